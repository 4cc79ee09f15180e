"""The errors a client sees: one class per wire ``code``, rebuilt from an ``ErrorInfo``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .protocol import ErrorInfo


class KvmuxError(Exception):
    """Root of every kvmux error a client can receive; ``code`` is stable on the wire."""

    code: str = "error"

    def __init__(self, message: str, details: Mapping[str, Any] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.details: dict[str, Any] = dict(details or {})

    def to_info(self) -> ErrorInfo:
        return ErrorInfo(self.code, self.message, self.details)


class BadRequest(KvmuxError):
    """The request or an item is malformed or invalid; nothing was run for it."""

    code = "bad_request"


class Overloaded(KvmuxError):
    """The daemon's queue is full; retry later."""

    code = "overloaded"


class ShuttingDown(KvmuxError):
    """The daemon is draining for shutdown and admits no new work."""

    code = "shutdown"


class NotReady(KvmuxError):
    """The daemon is still loading its model; retry shortly."""

    code = "not_ready"


class NotFound(KvmuxError):
    """No such job (never existed, or its retention ran out)."""

    code = "not_found"


class Cancelled(KvmuxError):
    """The item was cancelled (by request, or because its client went away)."""

    code = "cancelled"


class CapacityExceeded(KvmuxError):
    """The item needs more tokens than its hard maximum allows."""

    code = "kv_capacity_exceeded"


class GrowthFailed(KvmuxError):
    """The item's KV cache could not grow; ``details`` carries every diagnostic."""

    code = "kv_growth_failed"


class RunFailed(KvmuxError):
    """A model run failed for this item."""

    code = "run_failed"


class VersionMismatch(KvmuxError):
    """Client and daemon speak different protocol versions."""

    code = "version_mismatch"


class StorageFull(KvmuxError):
    """The daemon cannot write its job journal (disk full): new jobs are refused for now."""

    code = "storage_full"


class Unauthorized(KvmuxError):
    """The daemon no longer admits this client's key (removed from its authorized keys)."""

    code = "unauthorized"


class Internal(KvmuxError):
    """The daemon hit an unexpected error; its log has the traceback."""

    code = "internal"


class DaemonUnreachable(KvmuxError):
    """No daemon answered at the endpoint (raised by the client, never sent)."""

    code = "unreachable"


_BY_CODE: dict[str, type[KvmuxError]] = {
    cls.code: cls
    for cls in (
        BadRequest,
        Overloaded,
        ShuttingDown,
        NotReady,
        NotFound,
        Cancelled,
        CapacityExceeded,
        GrowthFailed,
        RunFailed,
        VersionMismatch,
        Unauthorized,
        StorageFull,
        Internal,
        DaemonUnreachable,
    )
}


def error_from_info(info: ErrorInfo) -> KvmuxError:
    """The exception for a wire error; an unknown code keeps its code on a plain KvmuxError."""
    cls = _BY_CODE.get(info.code)
    if cls is not None:
        return cls(info.message, info.details)
    exc = KvmuxError(info.message, info.details)
    exc.code = info.code
    return exc
