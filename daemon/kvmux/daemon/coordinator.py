"""The growth coordinator: every KV growth of every session under one async lock,
and every decision about what a growth's outcome means for its session.

Under ``on_growth_failure = "wait"`` with a ``kv.memory_budget``, an item
whose KV fits the budget on its own always finishes: new sessions start only
while the budget can carry the active ones through their next growth, a
refused growth parks its session until memory is freed, and when every
session is parked the newest is preempted — its KV released, the item put
back at the head of the queue and decoded again from the start later, its
already-sent tokens not sent twice (decoding is deterministic for a given
seed, so the replay produces the very same tokens).

The scheduler runs the allocations and carries out the verdicts; the policy
and its counters (growths, failures by cause, parked retries, preemptions) are
the coordinator's alone. A session's first allocation and every later growth
go through the same :meth:`GrowthCoordinator.decide`, so both are judged and
counted alike.
"""

from __future__ import annotations

import contextlib
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

import anyio
import anyio.to_thread
import structlog

from kvmux.client.protocol import GrowthStats
from kvmux.kv import GrowthFailed, GrowthResult, capacity_bucket

from .config import SchedulerConfig
from .engine import Admission, DecodeSession, Engine, grow_together

log = structlog.get_logger("kvmux.coordinator")


class Contender(Protocol):
    """What the coordinator reads of an item holding (or about to hold) a session."""

    @property
    def phase(self) -> str: ...
    @property
    def admitted_seq(self) -> int: ...
    @property
    def retries(self) -> int: ...
    @property
    def failure(self) -> Exception | None: ...
    @property
    def session(self) -> DecodeSession | None: ...
    @property
    def admission(self) -> Admission | None: ...
    @property
    def session_id(self) -> str: ...


C = TypeVar("C", bound=Contender)


@dataclass(frozen=True, slots=True)
class Grew:
    """The allocation committed (or there was nothing to grow): the session steps on."""


@dataclass(frozen=True, slots=True)
class Park:
    """The session waits until memory is freed, then tries again; ``error`` is what it
    fails with if waiting does not help. ``retry`` is which of
    ``scheduler.growth_retries`` this wait spends (0: the budget's wait spends none)."""

    error: GrowthFailed
    retry: int = 0


@dataclass(frozen=True, slots=True)
class Preempt(Generic[C]):
    """``victim`` gives its KV back and is queued again, then every parked session
    tries again; the refused session, unless it is the victim, waits with ``error``
    (None when no growth was refused: everyone was parked)."""

    victim: C
    error: GrowthFailed | None = None


@dataclass(frozen=True, slots=True)
class Fail(Generic[C]):
    """``victim``'s item ends with ``error``."""

    victim: C
    error: Exception


Verdict = Grew | Park | Preempt[C] | Fail[C]


class GrowthCoordinator:
    """Serializes growth transactions so no two transient peaks overlap, and
    decides what a refused one means: wait, retry, make room, or fail.

    A growth holds a session's old and new buffers at once. Growths run on
    their own threads, off the model's thread, so one session's long copy does
    not stall every other session's decode step; the lock is what keeps two of
    them from holding their peaks at the same time. It is held only around
    :func:`kvmux.kv.ensure_capacity` (or :func:`kvmux.kv.ensure_capacity_many` for
    sessions crossing into one bucket at one turn: one hold for all of them, whose
    peak is the sum of theirs), whose commit has released the old buffers before the
    lock is let go.

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
        self._engine: Engine | None = None
        self._wait = False
        self._retries = 0
        self.growths = 0
        self.lock_holds = 0  # a group growing together holds the lock once
        self.bytes_copied = 0
        self.lock_wait_total = 0.0
        self.lock_wait_max = 0.0
        self.failures: Counter[str] = Counter()
        self.parked_retries = 0
        self.preemptions = 0

    def adopt(self, engine: Engine, cfg: SchedulerConfig) -> None:
        """Take the policy (``on_growth_failure``, ``growth_retries``) and the memory
        it is about (the engine's budget and KV shape)."""
        self._engine = engine
        self._wait = cfg.on_growth_failure == "wait"
        self._retries = cfg.growth_retries

    # -- the lock ----------------------------------------------------------------
    def _guard(self) -> AbstractAsyncContextManager[object]:
        return self._lock if self.serialize else contextlib.nullcontext()

    @contextlib.asynccontextmanager
    async def held(self) -> AsyncIterator[float]:
        """Hold the growth lock (when serializing); yields how long getting it took (s)."""
        asked = time.perf_counter()
        async with self._guard():
            waited = time.perf_counter() - asked
            self.lock_holds += 1
            self._record_wait(waited)
            yield waited

    def _record_wait(self, waited: float) -> None:
        self.lock_wait_total += waited
        self.lock_wait_max = max(self.lock_wait_max, waited)
        if self._on_wait is not None:
            self._on_wait(waited)

    # -- growths and what they mean ------------------------------------------------
    async def grow(self, contender: C, contenders: Sequence[C]) -> Verdict[C]:
        """Grow ``contender``'s session to fit its next step, on a thread of its own;
        ``contenders`` are all the sessions (the policy weighs who could free memory)."""
        session = contender.session
        assert session is not None
        outcome: GrowthResult | Exception
        async with self.held() as waited:
            try:
                outcome = await anyio.to_thread.run_sync(
                    session.ensure_capacity, limiter=self._limiter
                )
            except Exception as exc:  # noqa: BLE001 - judged below; that item fails alone
                outcome = exc
        return self.decide(contender, outcome, waited, contenders)

    async def grow_many(
        self, contenders: Sequence[C]
    ) -> tuple[list[GrowthResult | Exception], float]:
        """Grow the sessions of ``contenders`` (bound for one bucket) to fit their next
        steps, together, under ONE hold of the lock and on one thread: one claim of
        their rows, batched copies (:func:`kvmux.kv.ensure_capacity_many`). Returns each
        one's outcome, in order, and the lock wait; the caller hands each to
        :meth:`decide` (and acts on its verdict before the next is decided, as after
        single growths). A group's transient peak is the sum of its members'; the lock
        keeps it apart from every other growth's, as it does a single one's.
        """
        sessions: list[DecodeSession] = []
        for contender in contenders:
            assert contender.session is not None
            sessions.append(contender.session)
        outcomes: list[GrowthResult | Exception]
        async with self.held() as waited:
            try:
                grown = await anyio.to_thread.run_sync(
                    grow_together, sessions, limiter=self._limiter
                )
                outcomes = list(grown)
            except Exception as exc:  # noqa: BLE001 - a bug's, not a growth's: each item fails
                outcomes = [exc] * len(sessions)
        return outcomes, waited

    def decide(
        self,
        contender: C,
        outcome: GrowthResult | Exception,
        waited: float,
        contenders: Sequence[C],
    ) -> Verdict[C]:
        """What an allocation's ``outcome`` means for ``contender`` — its session's
        first allocation or a later growth, made under :meth:`held` (``waited``: the
        lock wait). Counted here: growths, and refusals by cause."""
        if isinstance(outcome, GrowthResult):
            if outcome.grew:
                self.growths += 1
                self.bytes_copied += outcome.bytes_copied
                log.info(
                    "kv_grew",
                    old=outcome.old_capacity,
                    new=outcome.new_capacity,
                    valid_len=outcome.valid_len,
                    bytes_copied=outcome.bytes_copied,
                    seconds=round(outcome.seconds, 6),
                    lock_wait_seconds=round(waited, 6),
                )
            return Grew()
        if not isinstance(outcome, GrowthFailed):
            return Fail(contender, outcome)
        self.failures[str(outcome.details.get("cause", "error"))] += 1
        return self._refused(contender, outcome, contenders)

    def _refused(self, contender: C, exc: GrowthFailed, contenders: Sequence[C]) -> Verdict[C]:
        log.warning("kv_growth_failed", retries=contender.retries, **exc.details)
        others_hold = [s for s in contenders if s is not contender and s.session is not None]
        others_can_free = any(s.phase in ("active", "growing") for s in others_hold)
        budget_said_no = exc.details.get("cause") == "budget"
        if self._wait and budget_said_no and others_hold and self._fits_alone(contender):
            # The budget, not the device, said no, and others hold memory: an
            # item that fits alone is never failed for it (see the module doc).
            if others_can_free:
                log.info("session_parked", reason="budget")
                return Park(exc)
            # Everyone else is parked too: the newest of all makes room.
            parked = [s for s in others_hold if s.phase == "parked"]
            return self._preempt(max([*parked, contender], key=lambda s: s.admitted_seq), exc)
        if self._wait and contender.retries < self._retries and others_can_free:
            retry = contender.retries + 1
            log.info("session_parked", retry=retry, of=self._retries)
            return Park(exc, retry)
        return Fail(contender, exc)

    def stalled(self, contenders: Sequence[C]) -> Preempt[C] | Fail[C] | None:
        """When sessions are parked and none is left who could free memory, waiting
        would never end: the newest parked session makes room for the older ones —
        preempted (decoded again later) when it can ever fit, else failed."""
        parked = [s for s in contenders if s.phase == "parked"]
        if not parked or any(s.phase in ("active", "growing") for s in contenders):
            return None
        victim = max(parked, key=lambda s: s.admitted_seq)
        if len(parked) > 1 and self._fits_alone(victim):
            return self._preempt(victim, None)
        return Fail(victim, victim.failure or _stuck(victim))

    def _preempt(self, victim: C, error: GrowthFailed | None) -> Preempt[C]:
        self.preemptions += 1
        return Preempt(victim, error)

    def resume(self, contenders: Sequence[C]) -> list[C]:
        """The parked sessions, to try their growth again now that memory was freed."""
        parked = [s for s in contenders if s.phase == "parked"]
        self.parked_retries += len(parked)
        return parked

    # -- memory arithmetic (only with an explicit kv.memory_budget) --------------------
    def starts(self, active: Sequence[C]) -> StartGate | None:
        """Whether new sessions may start beside ``active``: never while one is parked
        (what a finished session frees goes to the parked), else as the gate says."""
        if any(s.phase == "parked" for s in active):
            return None
        return StartGate(self, active)

    def _bucket_bytes(self, tokens: int, admission: Admission) -> int:
        engine = self._adopted()
        bucket = capacity_bucket(max(tokens, 1), admission.hard_max.value, engine.min_bucket)
        return bucket * engine.kv_spec.bytes_per_token

    def _fits_alone(self, contender: Contender) -> bool:
        """Whether the item's whole decode fits the budget with no other session:
        its last bucket and the one before it (a growth holds both)."""
        total = self._adopted().budget.total
        admission = contender.admission
        if total is None or admission is None:
            return True
        prompt = len(admission.prompt_ids)
        first = self._bucket_bytes(prompt, admission)
        final = self._bucket_bytes(prompt + admission.sampling.max_new_tokens, admission)
        peak = final + max(first, final // 2) if final > first else final
        return peak <= total

    def _growth_reserve(self, active: Sequence[Contender]) -> int:
        """Bytes the active sessions need on top of what they hold to each make their
        next growth (growths are serialized: all the growths' net gains plus the
        largest transient old buffer)."""
        gains, largest = 0, 0
        for state in active:
            session = state.session
            if session is None or state.admission is None:
                continue
            now = session.kv_bytes
            gains += max(self._bucket_bytes(session.capacity + 1, state.admission) - now, 0)
            largest = max(largest, now)
        return gains + largest

    def _start_cost(self, admission: Admission) -> int:
        """What a new session adds to the reserve: its first bucket, and its first
        growth's net gain."""
        prompt = len(admission.prompt_ids)
        first = self._bucket_bytes(prompt, admission)
        second = self._bucket_bytes(
            capacity_bucket(prompt, None, self._adopted().min_bucket) + 1, admission
        )
        return first + max(second - first, 0)

    def _adopted(self) -> Engine:
        assert self._engine is not None, "the scheduler adopts its policy into the coordinator"
        return self._engine

    def stats(self) -> GrowthStats:
        return GrowthStats(
            growths=self.growths,
            lock_holds=self.lock_holds,
            bytes_copied=self.bytes_copied,
            lock_wait_seconds_total=self.lock_wait_total,
            lock_wait_seconds_max=self.lock_wait_max,
            failures=dict(self.failures),
            parked_retries=self.parked_retries,
            preemptions=self.preemptions,
        )


class StartGate:
    """Admits new sessions, one at a time, while the budget can carry every session
    — the active and those admitted so far — through its next growth. With nothing
    active the first always starts: an item that fits alone must get its turn."""

    def __init__(self, coordinator: GrowthCoordinator, active: Sequence[Contender]) -> None:
        self._coordinator = coordinator
        self._active = active
        self._anyone = bool(active)
        self._need: int | None = None
        # Nothing is allocated while one gate decides (sessions open after it): what the
        # budget holds is read once (it sums the prefix cache's kept rows).
        self._committed: int | None = None

    def admits(self, admission: Admission) -> bool:
        coordinator = self._coordinator
        budget = coordinator._adopted().budget
        if budget.total is None:
            return True
        if not self._anyone:
            self._anyone = True
            return True
        if self._need is None:
            self._need = coordinator._growth_reserve(self._active)
            self._committed = budget.committed
        assert self._committed is not None
        cost = coordinator._start_cost(admission)
        # What the prefix cache keeps is given back on demand: it stands in no one's way.
        if self._committed + self._need + cost > budget.total:
            return False  # not enough to carry everyone to their next growth: it waits
        self._need += cost
        return True


def _stuck(contender: Contender) -> Exception:
    return GrowthFailed(
        "KV growth could not proceed: every session is waiting for memory and none can free any",
        {"session_id": contender.session_id, "session_unchanged": True},
    )
