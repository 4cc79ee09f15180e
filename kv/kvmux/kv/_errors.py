"""The kv error tree: every failure carries wire-ready diagnostics."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

# Values in ``details`` are plain JSON/msgpack scalars or lists of them, so a
# daemon can put the mapping on the wire as it is.
Details = Mapping[str, Any]


class KvError(Exception):
    """Root of kvmux's KV-cache errors; ``code`` is stable on the wire."""

    code: ClassVar[str] = "kv_error"

    def __init__(self, message: str, details: Details | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.details: dict[str, Any] = dict(details or {})


class KvConfigError(KvError, ValueError):
    """A KV setting (min bucket, cap, failpoint spec) is invalid."""

    code = "kv_config"


class CapacityExceeded(KvError):
    """A session asked for more tokens than its hard maximum allows."""

    code = "kv_capacity_exceeded"


class GrowthFailed(KvError):
    """A KV growth step failed; the session was left exactly as it was."""

    code = "kv_growth_failed"


class BudgetExceeded(MemoryError):
    """An allocation would take the KV memory budget past its total."""

    def __init__(self, requested: int, used: int, total: int) -> None:
        super().__init__(
            f"KV memory budget refused {requested} bytes: {used} of {total} bytes in use"
        )
        self.requested = requested
        self.used = used
        self.total = total


class InjectedFault(RuntimeError):
    """Raised by an armed failpoint (tests and KVMUX_FAILPOINTS)."""

    def __init__(self, name: str) -> None:
        super().__init__(f"injected failure at failpoint {name}")
        self.name = name


def format_bytes(n: int | None) -> str:
    """Human-readable binary size; ``None`` reads as unavailable."""
    if n is None:
        return "unavailable"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")
