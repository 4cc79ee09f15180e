"""KV memory accounting: every live buffer charged, an optional hard total enforced."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Protocol

from ._errors import BudgetExceeded, KvConfigError


@dataclass(frozen=True, slots=True)
class MemoryInfo:
    """Device memory at one moment: free and total bytes, and what measured them."""

    free: int
    total: int
    source: str


class Reclaimer(Protocol):
    """Memory charged to a budget that its holder gives back on demand (the prefix
    cache's rows): what a session needs comes before what is merely kept."""

    def reclaimable(self) -> int:
        """Bytes it could give back now."""
        ...

    def reclaim(self, nbytes: int) -> int:
        """Give back at least ``nbytes`` if it can; return the bytes given back (0: none
        left to give). Called without any budget or pool lock held."""
        ...


class MemoryBudget:
    """Accounts KV bytes across sessions; with ``total_bytes`` set, refuses past it.

    The total is an operator's explicit cap (``kv.memory_budget``), not a guess
    derived from free memory. ``None`` accounts without refusing, so the daemon
    can report KV bytes in use either way. Thread-safe: sessions may grow from a
    worker thread while the event loop reads ``used``.
    """

    def __init__(self, total_bytes: int | None = None) -> None:
        if total_bytes is not None and (
            isinstance(total_bytes, bool) or not isinstance(total_bytes, int) or total_bytes <= 0
        ):
            raise KvConfigError(
                f"kv.memory_budget must be a positive byte count, got {total_bytes!r}"
            )
        self.total = total_bytes
        self._used = 0
        self._peak = 0
        self._lock = threading.Lock()
        self.reclaimer: Reclaimer | None = None

    @property
    def used(self) -> int:
        return self._used

    @property
    def peak(self) -> int:
        return self._peak

    @property
    def free(self) -> int | None:
        return None if self.total is None else self.total - self._used

    @property
    def reclaimable(self) -> int:
        """Bytes charged that the reclaimer would give back on demand."""
        return 0 if self.reclaimer is None else self.reclaimer.reclaimable()

    @property
    def committed(self) -> int:
        """Bytes charged that nobody gives back on demand: what sessions hold."""
        return self._used - self.reclaimable

    def reclaim(self, nbytes: int) -> int:
        """Ask the reclaimer for ``nbytes`` (an allocation was refused); bytes given back."""
        return 0 if self.reclaimer is None else self.reclaimer.reclaim(nbytes)

    def reserve(self, nbytes: int) -> None:
        """Charge ``nbytes`` or raise :class:`BudgetExceeded` and charge nothing."""
        if nbytes < 0:
            raise ValueError(f"cannot reserve a negative byte count ({nbytes})")
        with self._lock:
            if self.total is not None and self._used + nbytes > self.total:
                raise BudgetExceeded(nbytes, self._used, self.total)
            self._used += nbytes
            self._peak = max(self._peak, self._used)

    def release(self, nbytes: int) -> None:
        """Give back ``nbytes`` charged earlier. Never raises (commit relies on it)."""
        with self._lock:
            self._used = max(self._used - nbytes, 0)

    def memory(self) -> MemoryInfo | None:
        if self.total is None:
            return None
        return MemoryInfo(free=self.total - self._used, total=self.total, source="kv.memory_budget")


def host_memory() -> MemoryInfo | None:
    """Host free/total now: MemAvailable from /proc/meminfo, else sysconf."""
    try:
        fields: dict[str, int] = {}
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in ("MemTotal", "MemAvailable"):
                    fields[key] = int(rest.split()[0]) * 1024
        return MemoryInfo(fields["MemAvailable"], fields["MemTotal"], "host /proc/meminfo")
    except (OSError, KeyError, ValueError, IndexError):
        pass
    try:
        import os

        page = os.sysconf("SC_PAGE_SIZE")
        return MemoryInfo(
            os.sysconf("SC_AVPHYS_PAGES") * page, os.sysconf("SC_PHYS_PAGES") * page, "host sysconf"
        )
    except (OSError, ValueError, AttributeError):
        return None
