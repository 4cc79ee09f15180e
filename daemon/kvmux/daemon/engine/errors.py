"""Engine errors: typed, with wire codes, never a raw onnxruntime RuntimeError."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar


class EngineError(Exception):
    """Root of decode-engine errors; ``code`` is stable on the wire."""

    code: ClassVar[str] = "engine_error"

    def __init__(self, message: str, details: Mapping[str, Any] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.details: dict[str, Any] = dict(details or {})


class RuntimeUnavailable(EngineError):
    """No usable onnxruntime build is installed; names the extra to install."""

    code = "runtime_unavailable"


class BadPrompt(EngineError):
    """A prompt or its parameters are invalid (empty, token ids outside the vocabulary, ...)."""

    code = "bad_request"


class RunFailed(EngineError):
    """A model run failed; the session was rolled back to before the step and stays usable."""

    code = "run_failed"
