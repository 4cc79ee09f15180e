"""The growth coordinator: every KV growth of every session under one async lock."""

from __future__ import annotations

import contextlib
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager

import anyio
import anyio.to_thread

from kvmux.client.protocol import GrowthStats
from kvmux.kv import GrowthFailed, GrowthResult

from .engine import DecodeSession


class GrowthCoordinator:
    """Serializes growth transactions so no two transient peaks overlap.

    A growth holds a session's old and new buffers at once. Growths run on
    their own threads, off the model's thread, so one session's long copy does
    not stall every other session's decode step; the lock is what keeps two of
    them from holding their peaks at the same time. It is held only around
    :func:`kvmux.kv.ensure_capacity`, whose commit has released the old buffers
    before the lock is let go.

    ``serialize=False`` exists for the test that proves the lock's purpose:
    without it, concurrent growths overlap and a budget sized for one peak
    refuses some of them.
    """

    def __init__(
        self,
        *,
        serialize: bool = True,
        threads: int = 4,
        on_wait: Callable[[float], None] | None = None,
    ) -> None:
        self.serialize = serialize
        self._on_wait = on_wait
        self._lock = anyio.Lock()
        self._limiter = anyio.CapacityLimiter(threads)
        self.growths = 0
        self.bytes_copied = 0
        self.lock_wait_total = 0.0
        self.lock_wait_max = 0.0
        self.failures: Counter[str] = Counter()
        self.parked_retries = 0
        self.preemptions = 0

    def _guard(self) -> AbstractAsyncContextManager[object]:
        return self._lock if self.serialize else contextlib.nullcontext()

    @contextlib.asynccontextmanager
    async def held(self) -> AsyncIterator[float]:
        """Hold the growth lock (when serializing); yields how long getting it took (s)."""
        asked = time.perf_counter()
        async with self._guard():
            waited = time.perf_counter() - asked
            self._record_wait(waited)
            yield waited

    def record(self, result: GrowthResult) -> None:
        if result.grew:
            self.growths += 1
            self.bytes_copied += result.bytes_copied

    def record_failure(self, exc: GrowthFailed) -> None:
        self.failures[str(exc.details.get("cause", "error"))] += 1

    async def grow(self, session: DecodeSession) -> tuple[GrowthResult, float]:
        """Grow ``session`` to fit its next step; returns the result and the lock wait (s).

        Raises :class:`~kvmux.kv.GrowthFailed` (session unchanged), counted by cause.
        """
        async with self.held() as waited:
            try:
                result = await anyio.to_thread.run_sync(
                    session.ensure_capacity, limiter=self._limiter
                )
            except GrowthFailed as exc:
                self.record_failure(exc)
                raise
        self.record(result)
        return result, waited

    def _record_wait(self, waited: float) -> None:
        self.lock_wait_total += waited
        self.lock_wait_max = max(self.lock_wait_max, waited)
        if self._on_wait is not None:
            self._on_wait(waited)

    def stats(self) -> GrowthStats:
        return GrowthStats(
            growths=self.growths,
            bytes_copied=self.bytes_copied,
            lock_wait_seconds_total=self.lock_wait_total,
            lock_wait_seconds_max=self.lock_wait_max,
            failures=dict(self.failures),
            parked_retries=self.parked_retries,
            preemptions=self.preemptions,
        )
