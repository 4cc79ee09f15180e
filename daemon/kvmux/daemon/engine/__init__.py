"""The decode engine: onnxruntime sessions over growing, shared KV buffers."""

from .engine import Admission, Engine, EngineOptions
from .errors import BadPrompt, EngineError, RunFailed, RuntimeUnavailable
from .runtime import create_session, import_onnxruntime
from .sampling import (
    ResolvedSampling,
    Sampler,
    SamplingParams,
    StepLogprobs,
    resolve_sampling,
    step_logprobs,
)
from .session import (
    Completion,
    DecodeSession,
    StepOutput,
    TokenLogprobs,
    grow_together,
    still_going,
)
from .text import TextStream

__all__ = [
    "Admission",
    "BadPrompt",
    "Completion",
    "DecodeSession",
    "Engine",
    "EngineError",
    "EngineOptions",
    "ResolvedSampling",
    "RunFailed",
    "RuntimeUnavailable",
    "Sampler",
    "SamplingParams",
    "StepLogprobs",
    "StepOutput",
    "TextStream",
    "TokenLogprobs",
    "create_session",
    "grow_together",
    "import_onnxruntime",
    "resolve_sampling",
    "step_logprobs",
    "still_going",
]
