"""The one place an exception becomes a wire error."""

from __future__ import annotations

import structlog

from kvmux.client.errors import Internal, KvmuxError
from kvmux.client.protocol import ErrorInfo
from kvmux.kv import KvError

from .engine import EngineError

log = structlog.get_logger("kvmux.daemon")


def error_info(exc: BaseException, **context: object) -> ErrorInfo:
    """Typed errors keep their code and details; anything else is logged with its
    traceback and answered ``internal``, without the traceback."""
    if isinstance(exc, KvmuxError):
        return exc.to_info()
    if isinstance(exc, KvError | EngineError):
        return ErrorInfo(exc.code, exc.message, exc.details)
    log.error("internal_error", exc_info=exc, **context)
    return Internal(
        f"internal error in kvmuxd ({type(exc).__name__}); the daemon's log has the traceback"
    ).to_info()
