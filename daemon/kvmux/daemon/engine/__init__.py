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
from .session import Completion, DecodeSession, StepOutput, TokenLogprobs, still_going
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
    "import_onnxruntime",
    "resolve_sampling",
    "step_logprobs",
    "still_going",
]
