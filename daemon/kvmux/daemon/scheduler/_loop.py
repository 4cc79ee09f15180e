"""The turn loop. One loop owns all session state: sessions are only ever
released by it, between turns, when no step is in flight, so nothing needs a
lock but growth. A turn is a function of the *set* of ready sessions, so
batching them into one model run is a change to the engine, not to the loop."""

from __future__ import annotations

import asyncio
import functools
import math
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import anyio
import anyio.abc
import structlog

from kvmux.client.protocol import ItemFinished, ItemResult, ItemStarted, JobFinished, TokenDelta
from kvmux.kv import GrowthFailed, GrowthResult, failpoints

from ..config import JobsConfig, SchedulerConfig
from ..coordinator import Fail, Grew, GrowthCoordinator, Park, Preempt, Verdict
from ..engine import DecodeSession, Engine, StepOutput, still_going
from ..journal import Journal
from ..metrics import Metrics
from ..worker import EngineWorker
from ._jobs import ItemState, JobState, JobTable
from ._outbox import Outbox, completed_result, error_result
from ._prefix import PrefixPlanner, Start
from ._queue import FairQueue

log = structlog.get_logger("kvmux.scheduler")

# A streamed decode run hands its tokens to the loop in chunks of about this much
# model time (at most _MAX_CHUNK_STEPS steps): each hand-over wakes the loop,
# so a chunk of one short step would pay a wake-up per token.
_MIN_CHUNK_SECONDS = 0.010
# A call into the engine also pays once per session (reading its state, handing over
# its tokens: ~6 us a session on this 2-core VM, against O(1) a step inside the call),
# so a chunk lasts long enough that this stays about _CALL_SHARE of it: 10 ms up to
# ~80 sessions, 31 ms at 256.
_CALL_SECONDS_PER_SESSION = 6e-6
_CALL_SHARE = 0.05
# A run nobody streams hands over no chunk on its own (see _QUIET_OUTPUTS), so its
# chunks are longer: fewer calls into the engine (5% of the time at 256 sessions in
# 31 ms chunks). What chunks were also for is done within the call: a poke (an
# arrival, a cancel) returns it after the step under way; and while something waits
# for a slot (queued, parked, growing), so does a session that ends once the call
# has run a while (see _endings_seconds).
_QUIET_CHUNK_SECONDS = 0.100
# What the loop's turn between two runs costs the model, roughly, on this 2-core VM
# (a wake-up and the next run's start; per session the results, releases and
# admissions a turn may do, as they were measured at 16 and 256 sessions).
_TURN_SECONDS = 3e-4
_TURN_SECONDS_PER_SESSION = 2e-5
_MAX_CHUNK_STEPS = 64
# While no client takes a run's token updates, its chunks wait for the run's end
# until they hold this many sessions' outputs: below, the loop's wake-up costs
# more than its work on them (~2-4 us each) would overlap the model's run.
_QUIET_OUTPUTS = 64
# However long the sessions could go on, a run returns to the loop after this
# long: a safety net, since everything that changes the ready set stops it.
_MAX_RUN_SECONDS = 1.0
_MAX_RUN_STEPS = 1 << 30  # what fits before any bucket's room bounds it
# Sessions of one admission the loop opens itself on the host (see _opens_inline).
_INLINE_OPENS = 32
# The most KV bytes those may copy from cached prefixes: about what the hop to the
# model thread costs (1 MiB copies in ~0.1-0.3 ms; a 1,024-token prefix of
# `small` is 16 MiB, milliseconds the event loop would be stuck).
_INLINE_COPY_BYTES = 1 << 20

_FAILURE_CODES = frozenset(
    {"kv_capacity_exceeded", "kv_growth_failed", "run_failed", "internal", "shutdown"}
)


class _Chunk(NamedTuple):
    """Some steps of a decode run: each session's merged output, and their time."""

    outputs: list[StepOutput | Exception]
    steps: int
    seconds: float
    decoding: bool  # no session was prefilling: ``seconds`` is decode steps' time
    at: float  # time.monotonic() when its steps were done (a first token's time)


def _chunk_seconds(sessions: int) -> float:
    """A streamed chunk's length: ~_MIN_CHUNK_SECONDS, or more (see _CALL_SHARE)."""
    return max(_MIN_CHUNK_SECONDS, sessions * _CALL_SECONDS_PER_SESSION / _CALL_SHARE)


def _endings_seconds(sessions: int, lifetime: float) -> float:
    """How long a quiet call runs before a session's end returns it, while its slot is
    wanted. Returning at once would pay a turn per ending; waiting w leaves an ended
    slot idle w / 2 on average. Per second: turn / w + w / (2 * lifetime) (an item
    ends every lifetime / sessions), least at w = sqrt(2 * lifetime * turn). No one
    w fits all: a job of mixed lengths took 3.7% longer at 16 sessions with 20 ms
    than with 10 ms, and 4% longer at 64 sessions with 10 ms than with 20 ms.
    ``lifetime``: a recent item's decode time (0: none yet)."""
    if not lifetime:
        return _chunk_seconds(sessions)
    turn = _TURN_SECONDS + sessions * _TURN_SECONDS_PER_SESSION
    return min(_QUIET_CHUNK_SECONDS, max(0.001, math.sqrt(2 * lifetime * turn)))


def _chunk_steps(per_step: float, sessions: int, *, quiet: bool = False) -> int:
    """Steps for a chunk (of _QUIET_CHUNK_SECONDS or more while nobody streams), given
    a session's share of a step."""
    seconds = _chunk_seconds(sessions)
    if quiet:
        seconds = max(seconds, _QUIET_CHUNK_SECONDS)
    return max(1, min(_MAX_CHUNK_STEPS, math.ceil(seconds / (sessions * per_step))))


def _steps_that_fit(sessions: list[DecodeSession]) -> int:
    """Steps every session can take without growing: 0 if one must grow first; one
    while one is prefilling (a prompt chunk takes many tokens)."""
    fit = _MAX_RUN_STEPS
    for session in sessions:
        if session.needs_growth():
            return 0
        # A session at its hard max has no room and no growth: its next step ends it.
        fit = min(fit, 1 if session.prefilling else max(1, session.room()))
    return fit


@dataclass(slots=True)
class _Ending:
    """Items ended in one pass over a run's outputs: whether a session was parked
    when the first ended (None: not looked yet), and what the pass leaves to do
    once their results are sent (see TurnLoop._took)."""

    parked: bool | None = None
    freed: bool = False
    # Releases and log lines of the items ended, each a call.
    after: list[Callable[[], None]] = field(default_factory=list)


class TurnLoop:
    """The active set and the loop that runs it, turn after turn."""

    def __init__(
        self,
        engine: Engine,
        worker: EngineWorker,
        coordinator: GrowthCoordinator,
        cfg: SchedulerConfig,
        jobs_cfg: JobsConfig,
    ) -> None:
        self.engine = engine
        self.worker = worker
        self.coordinator = coordinator
        coordinator.adopt(engine, cfg)
        self.cfg = cfg
        self.jobs = JobTable(jobs_cfg)
        self.queue = FairQueue()
        self.outbox = Outbox()
        self.prefix = PrefixPlanner(engine.prefix)
        self._active: list[ItemState] = []
        self._wake = anyio.Event()
        # Set whenever the loop is wanted (what poke() is for): a decode run on the
        # model thread ends at its next chunk, so the loop can change the ready set.
        self._stop = threading.Event()
        self._tg: anyio.abc.TaskGroup | None = None
        self._seq = 0
        self._draining = False
        self._step_seconds = 0.0  # a session's share of a recent decode step
        self._lifetime = 0.0  # a recent item's time from its first token to its end
        # Sessions opened this turn whose first allocation went through: announced
        # (logs, ItemStarted, the growth counted) while their first run goes on.
        self._opened: list[tuple[ItemState, DecodeSession, GrowthResult, float]] = []
        self._ending: _Ending | None = None  # set while _took goes over outputs
        self.tokens_generated = 0
        self.finished_by_code: Counter[str] = Counter()  # "ok" or the error code
        self.metrics: Metrics | None = None

    @property
    def journal(self) -> Journal | None:
        """The job journal, given after construction when the daemon keeps one; the
        job table writes to it and counts its bytes against retention."""
        return self.jobs.journal

    @journal.setter
    def journal(self, journal: Journal | None) -> None:
        self.jobs.journal = journal

    @property
    def draining(self) -> bool:
        return self._draining

    @draining.setter
    def draining(self, value: bool) -> None:
        self._draining = value
        self.poke()

    def poke(self) -> None:
        self._stop.set()
        self._wake.set()

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        async with anyio.create_task_group() as tg:
            self._tg = tg
            task_status.started()
            while True:
                try:
                    busy = await self._turn()
                except Exception:  # nothing escapes the loop; the item-level paths catch their own
                    log.exception("scheduler_turn_failed")
                    busy = False
                self.outbox.flush()
                if not busy:
                    await self._wake.wait()
                    self._wake = anyio.Event()

    async def _turn(self) -> bool:
        self._stop.clear()  # what asks for the loop from here on ends this turn's run
        self._settle()
        await self._admit_queued()
        self._settle()
        ready: list[ItemState] = []
        growing: dict[int, list[ItemState]] = {}
        for state in self._active:
            if state.phase != "active":
                continue
            session = state.session
            assert session is not None
            if session.needs_growth():
                state.phase = "growing"
                growing.setdefault(session.growth_bucket(), []).append(state)
            else:
                ready.append(state)
        # Sessions bound for one bucket grow together: one lock hold, one claim of their
        # rows (256 sessions crossing a bucket at one step queued 256 times for the lock).
        # Without the lock (a test proving its purpose) there is no wait to save.
        together = self.coordinator.serialize
        for group in growing.values():
            assert self._tg is not None
            if len(group) == 1 or not together:
                for state in group:
                    self._tg.start_soon(self._grow, state)
            else:
                # The oldest first: when memory takes only some, they are the ones grown.
                group.sort(key=lambda s: s.admitted_seq)
                self._tg.start_soon(self._grow_many, group)
        if not ready:
            self._announce_opened()
            return False
        sessions = [state.session for state in ready if state.session is not None]
        jobs = list({id(state.job): state.job for state in ready}.values())
        loop = asyncio.get_running_loop()

        def post(chunks: list[_Chunk]) -> None:
            loop.call_soon_threadsafe(self._took_chunks, ready, chunks)

        first = self._first_chunk(sessions, quiet=not any(job.streams for job in jobs))
        beside = self._announce_opened if self._opened else None
        # Every chunk, the last included, reaches the loop through post(), before the
        # call's own completion does (both are call_soon_threadsafe from the model
        # thread, in that order): the last one's results go out a wake-up sooner
        # than through the awaited future (~0.35 -> ~0.05 ms on this VM).
        await self.worker.run_beside(beside, self._run, sessions, first, post, jobs)
        return True

    def _run(
        self,
        sessions: list[DecodeSession],
        steps: int,
        post: Callable[[list[_Chunk]], None],
        jobs: list[JobState],
    ) -> None:
        """A run, on the model thread: chunks of steps back to back, the first of
        ``steps``, while the ready set stays what it was.

        Each chunk is posted to the loop, which streams its tokens while the next
        one runs: the model does not wait for the loop between chunks (on short
        steps that wait was a third of the daemon's time). The run ends, after
        posting its last chunk, when a session finishes or fails (its release is
        the loop's, when no step is in flight), when the next step does not fit a
        session's bucket (growth is the coordinator's, between runs), when the loop
        is wanted (poke: an arrival, a cancel, a growth done), when a prefill that
        items wait for has got there (they start on a copy of it between runs) or
        after _MAX_RUN_SECONDS.

        While no client of the run's jobs takes token updates, a few sessions'
        chunks wait and go to the loop together (see _QUIET_OUTPUTS): each hand-over
        wakes the loop and passes the GIL back and forth while the model runs, for
        nothing a client would see.
        """
        started = time.perf_counter()
        prefix = self.prefix
        pending: list[_Chunk] = []

        def post_pending() -> None:
            nonlocal pending
            if pending:
                post(pending)
                pending = []

        while True:
            decoding = not any(s.prefilling for s in sessions)
            # Read each chunk: a client may attach to take a quiet job's updates.
            streamed = any(job.streams for job in jobs)
            hand_over = streamed or len(pending) * len(sessions) >= _QUIET_OUTPUTS
            t = time.perf_counter()
            ends_after = None
            if not streamed and (self.queue.queued or len(self._active) > len(sessions)):
                ends_after = t + _endings_seconds(len(sessions), self._lifetime)
            try:
                # The chunks before go to the loop as this one's first run starts: the
                # loop's Python for them (~4 us a session) then overlaps the run, not
                # the Python that prepares it, which would wait for the GIL meanwhile.
                outputs = self.engine.step_many(
                    sessions,
                    steps,
                    launching=post_pending if hand_over else None,
                    halt=self._stop,
                    ends_after=ends_after,
                )
            except BaseException:
                post_pending()  # what the sessions did before is theirs to keep
                raise
            if hand_over:
                post_pending()
            seconds = time.perf_counter() - t
            halted = self._stop.is_set()
            going = all(map(still_going, outputs))
            if decoding and (halted or not going):  # it may have taken fewer steps
                steps = max(
                    (len(o.token_ids) for o in outputs if isinstance(o, StepOutput)), default=0
                )
            chunk = _Chunk(outputs, steps, seconds, decoding, time.monotonic())
            ends = (
                halted
                or not going
                or time.perf_counter() - started > _MAX_RUN_SECONDS
                # Checked here, not by the loop: on short steps the next chunk would
                # decode the donor to its end before a poke from the loop landed.
                or (prefix.waiting and prefix.any_waiter_ready())
            )
            # Decided before the chunk is posted: once it is, the loop may end and
            # release its sessions while this thread is still here.
            fit = 0 if ends else _steps_that_fit(sessions)
            pending.append(chunk)
            if not fit:
                post_pending()
                return
            # A prompt chunk costs many decode steps: the next chunk is sized by
            # the loop's estimate then (one step until there is one).
            per_step = (
                chunk.seconds / (chunk.steps * len(sessions)) if decoding else self._step_seconds
            )
            if per_step:
                steps = min(fit, _chunk_steps(per_step, len(sessions), quiet=not streamed))
            else:
                steps = 1

    def _first_chunk(self, sessions: list[DecodeSession], *, quiet: bool) -> int:
        """A run's first chunk, in steps: one while a session is prefilling (its
        first token goes out as soon as it is drawn) or before a step was timed."""
        if not self._step_seconds:
            return 1
        fit = _steps_that_fit(sessions)
        return max(1, min(fit, _chunk_steps(self._step_seconds, len(sessions), quiet=quiet)))

    def _took_chunks(self, ready: list[ItemState], chunks: list[_Chunk]) -> None:
        """Chunks posted by a run, in order: stream their tokens, end what they ended."""
        try:
            for chunk in chunks:
                self._took(ready, chunk)
        except Exception:  # a callback's exception would only reach asyncio's handler
            log.exception("scheduler_chunk_failed")
        self.outbox.flush()

    def _took(self, ready: list[ItemState], chunk: _Chunk) -> None:
        # A prompt chunk costs many decode steps: not a step's time (nor one halted
        # before any session took a token).
        if chunk.decoding and chunk.steps:
            per_step = chunk.seconds / (chunk.steps * len(ready))
            if self._step_seconds:
                per_step = 0.8 * self._step_seconds + 0.2 * per_step
            self._step_seconds = per_step
        # Whether a session is parked is looked at once for every item this pass ends,
        # and the parked are resumed once after it: not once an item (256 at a time).
        ending = self._ending = _Ending()
        try:
            for state, out in zip(ready, chunk.outputs, strict=True):
                self._after_step(state, out, chunk.at)
        finally:
            self._ending = None
            # The results go out before the sessions' releases and log lines (~0.1 ms
            # an item: 1.7 ms when 16 end together). No other task runs in between, so
            # whatever a client asks next (status, a new job) finds them released.
            if ending.after:
                self.outbox.flush()
                for call in ending.after:
                    try:
                        call()
                    except Exception:  # one failed release must not keep the others
                        log.exception("item_ending_failed")
        if ending.freed:
            self._unpark()
        elif ending.after and self.prefix.waiting:  # see _finish
            self.poke()

    def _settle(self) -> None:
        """Act on cancellations and failures that arrived while the loop was away."""
        for state in list(self._active):
            if state.phase == "growing":
                continue  # its growth task hands it back first
            if state.cancel_with is not None:
                self._finish(state, error=state.cancel_with)
            elif state.phase == "failing":
                assert state.failure is not None
                self._finish(state, error=state.failure)
        match self.coordinator.stalled(self._active):
            case Preempt(victim=victim):
                self._preempt(victim)
                self._unpark()
            case Fail(victim=victim, error=error):
                self._finish(victim, error=error)
            case None:
                pass

    async def _admit_queued(self) -> None:
        gate = self.coordinator.starts(self._active)
        if gate is None:
            return
        batch: list[ItemState] = []
        # Items that waited for another's prefill of their prefix were admitted first:
        # while one of them cannot start, no younger item does.
        held_back = False
        for state in self.prefix.ready_waiters():
            assert state.admission is not None
            if not gate.admits(state.admission):
                held_back = True
                break
            self.prefix.opening(state)
            state.phase = "opening"
            batch.append(state)
        slots = self.cfg.max_active_sessions - len(self._active)
        active_by = Counter(s.job.owner for s in self._active)
        while slots > 0 and self.queue and not held_back:
            state = self.queue.head(active_by)
            assert state.admission is not None
            if not gate.admits(state.admission):
                break
            self.queue.take(state)
            active_by[state.job.owner] += 1
            if not state.admitted_seq:  # a preempted item keeps its place among the old
                self._seq += 1
                state.admitted_seq = self._seq
            slots -= 1
            self._active.append(state)
            if self.prefix.waits(state):
                state.phase = "waiting"  # no memory yet: it opens on a copy once that is ready
                continue
            self.prefix.opening(state)
            state.phase = "opening"
            batch.append(state)
        settle = self.engine.prefix is not None and self.engine.prefix.unsettled
        if not batch and not settle:
            return
        # First allocations are growths from nothing: made under the growth lock,
        # all in the call that opens the sessions, so a burst of new sessions
        # starts prefilling in this very turn instead of queueing for the lock.
        # Rows the prefix cache keeps move to its own pool there too.
        async with self.coordinator.held() as waited:
            # A kept row's move copies a whole prompt's KV: not on the event loop.
            if not settle and self._opens_inline(batch):
                opened = self._open_all(batch)
            else:
                opened = await self.worker.run(self._open_all, batch)
        refused: list[tuple[ItemState, GrowthFailed]] = []
        for state, (session, grown) in zip(batch, opened, strict=True):
            self.prefix.opened(state, session)
            if session is None:
                assert isinstance(grown, Exception)
                state.phase = "failing"
                state.failure = grown
                continue
            state.session = session
            state.phase = "active"
            state.seen_tokens = state.seen_text = 0
            if isinstance(grown, GrowthResult):
                self._opened.append((state, session, grown, waited))
                continue
            self._started(state, session)
            if isinstance(grown, GrowthFailed):
                refused.append((state, grown))
            else:
                self._judge(state, grown, waited)
        # After the whole batch is active, so the policy sees who could free memory.
        for state, exc in refused:
            self._judge(state, exc, waited)

    def _announce_opened(self) -> None:
        """Log and announce the sessions this turn opened (their first run is already
        under way: at 256 sessions a start costs the loop ~15 ms the model need not
        wait for). Before any of their tokens: those are the loop's to stream after."""
        opened, self._opened = self._opened, []
        for state, session, grown, waited in opened:
            self._started(state, session)
            self._judge(state, grown, waited)

    def _started(self, state: ItemState, session: DecodeSession) -> None:
        log.info(
            "session_started",
            job_id=state.job.job_id,
            session_id=session.session_id,
            index=state.index,
            prompt_tokens=len(session.prompt_ids),
            cached_tokens=session.cached_tokens,
            hard_max=session.hard_max.value,
        )
        self.outbox.emit(
            state.job,
            ItemStarted(
                job_id=state.job.job_id,
                index=state.index,
                custom_id=state.custom_id,
                session_id=session.session_id,
                prompt_tokens=len(session.prompt_ids),
            ),
        )

    def _opens_inline(self, batch: list[ItemState]) -> bool:
        """Whether the loop opens ``batch`` itself: a few sessions whose first rows are
        host memory (~17 us each with `tiny`, against 0.8 ms measured for the hop to
        the model thread and back on this 2-core VM) and copy little from cached
        prefixes, while no failpoint can make an allocation sleep."""
        return (
            len(batch) <= _INLINE_OPENS
            and not self.engine.on_cuda
            and not failpoints.any_active()
            and self.prefix.copy_tokens(batch) * self.engine.kv_spec.kv_bytes_per_token
            <= _INLINE_COPY_BYTES
        )

    def _open_all(
        self, batch: list[ItemState]
    ) -> list[tuple[DecodeSession | None, GrowthResult | Exception]]:
        """Open each session and allocate its first bucket, on a copy of a cached prefix
        of its prompt when there is one (a copy that fails leaves it to prefill the
        whole prompt); failures are per item. Then the rows the prefix cache keeps move
        to its own pool (under the same growth lock)."""
        out: list[tuple[DecodeSession | None, GrowthResult | Exception]] = []
        for state in batch:
            try:
                assert state.admission is not None
                session = self.engine.open_session(state.admission, state.session_id)
            except Exception as exc:  # noqa: BLE001 - that item fails alone
                out.append((None, exc))
                continue
            start = self.prefix.start(state)
            if start is not None and self._start_from(state, session, start, out):
                continue
            try:
                out.append((session, session.ensure_capacity()))
            except Exception as exc:  # noqa: BLE001 - GrowthFailed left it empty and usable
                out.append((session, exc))
        if self.engine.prefix is not None and self.engine.prefix.unsettled:
            self.engine.prefix.settle()
        return out

    def _start_from(
        self,
        state: ItemState,
        session: DecodeSession,
        start: Start,
        out: list[tuple[DecodeSession | None, GrowthResult | Exception]],
    ) -> bool:
        """Allocate ``session``'s first bucket on a copy of the prefix ``start`` names;
        False (the session as it was) when there is nothing worth copying or the copy
        fails: the cache never fails an item."""
        assert self.engine.prefix is not None
        tokens = session.fork_tokens(start.tokens)
        if tokens < 1:
            return False
        try:
            grown = session.start_from(self.engine.prefix, start.holder, start.key, tokens)
        except Exception as exc:  # noqa: BLE001 - falls back to prefilling the whole prompt
            log.warning(
                "prefix_fork_failed",
                job_id=state.job.job_id,
                session_id=state.session_id,
                tokens=tokens,
                error=f"{type(exc).__name__}: {exc}"[:500],
            )
            return False
        out.append((session, grown))
        return True

    def _judge(self, state: ItemState, outcome: GrowthResult | Exception, waited: float) -> None:
        with structlog.contextvars.bound_contextvars(
            job_id=state.job.job_id, session_id=state.session_id
        ):
            self._act(state, self.coordinator.decide(state, outcome, waited, self._active))

    async def _grow(self, state: ItemState) -> None:
        session = state.session
        assert session is not None
        with structlog.contextvars.bound_contextvars(
            job_id=state.job.job_id, session_id=session.session_id
        ):
            try:
                self._act(state, await self.coordinator.grow(state, self._active))
            finally:
                self.poke()

    async def _grow_many(self, group: list[ItemState]) -> None:
        try:
            outcomes, waited = await self.coordinator.grow_many(group)
            # One at a time, each acted on before the next is judged: as the verdicts of
            # single growths, each sees what the ones before it made of the others.
            for state, outcome in zip(group, outcomes, strict=True):
                self._judge(state, outcome, waited)
        finally:
            self.poke()

    def _act(self, state: ItemState, verdict: Verdict[ItemState]) -> None:
        """Carry out the coordinator's verdict on ``state``'s allocation."""
        match verdict:
            case Grew():
                state.phase = "active"
            case Park(error=error, retry=retry):
                state.phase = "parked"
                state.failure = error
                if retry:
                    state.retries = retry
            case Preempt(victim=victim, error=error):
                self._preempt(victim)
                if error is not None and victim is not state:
                    state.phase = "parked"
                    state.failure = error
                self._unpark()
            case Fail(victim=victim, error=error):
                victim.failure = error
                victim.phase = "failing"

    def _after_step(self, state: ItemState, out: StepOutput | Exception, at: float) -> None:
        if isinstance(out, Exception):
            self._finish(state, error=out)
            return
        if out.token_ids and state.first_token_at is None:
            state.first_token_at = at  # when it was drawn, not when the loop got to it
            if self.metrics is not None:
                self.metrics.ttft.observe(state.first_token_at - state.job.created)
        # After a preemption the item replays from its start: only what goes
        # beyond what its clients were already sent is new to them.
        skip_tokens = max(0, state.sent_tokens - state.seen_tokens)
        state.seen_tokens += len(out.token_ids)
        state.sent_tokens = max(state.sent_tokens, state.seen_tokens)
        token_ids = out.token_ids[skip_tokens:]
        self.tokens_generated += len(token_ids)
        job = state.job
        if job.streams:
            # Read only for a client that takes it: unread, the text waits in the
            # session, decoded once at the item's end or with the next update.
            skip_text = max(0, state.sent_text - state.seen_text)
            state.seen_text += len(out.text)
            state.sent_text = max(state.sent_text, state.seen_text)
            text = out.text[skip_text:]
            if token_ids or text:
                self.outbox.emit_tokens(
                    job,
                    TokenDelta(
                        job_id=job.job_id, index=state.index, token_ids=token_ids, text=text
                    ),
                )
        if out.finished:
            assert state.session is not None
            self._finish(state, result=completed_result(state, state.session.completion()))

    # -- endings -------------------------------------------------------------------
    def _finish(
        self, state: ItemState, *, result: ItemResult | None = None, error: Exception | None = None
    ) -> None:
        """End an item: release its session, record and announce its result."""
        if self._opened:  # its start is told before its end, whatever ended it
            self._announce_opened()
        job = state.job
        if result is None:
            assert error is not None
            result = error_result(state, error)
        freed = 0
        session = state.session
        capacity = 0
        if session is not None:
            freed = session.kv_bytes
            capacity = session.capacity
            state.session = None
        # What it prefilled may stay for later prompts that begin alike, unless
        # memory is wanted right now (a parked session waits for it).
        ending = self._ending
        if ending is None:
            parked = any(s.phase == "parked" for s in self._active)
        else:
            if ending.parked is None:
                ending.parked = any(s.phase == "parked" for s in self._active)
            parked = ending.parked
        keep = result.status == "ok" and not parked
        if ending is None:
            self.prefix.leave(state, session, keep=keep)
        else:
            ending.after.append(functools.partial(self.prefix.leave, state, session, keep=keep))
        if state in self._active:
            self._active.remove(state)
        state.result = result
        state.phase = "done"
        state.admission = None
        job.tokens += len(result.token_ids)
        if self.jobs.journal is not None and not job.transient:
            state.result_bytes = self.jobs.journal.add_result(job.job_id, result)
            self.jobs.charge(job, state.result_bytes)
        if result.status == "ok":
            job.ok += 1
            n = len(result.token_ids)
            if state.first_token_at is not None:
                life = time.monotonic() - state.first_token_at
                self._lifetime = 0.9 * self._lifetime + 0.1 * life if self._lifetime else life
            if self.metrics is not None and state.first_token_at is not None and n > 1:
                self.metrics.tpot.observe((time.monotonic() - state.first_token_at) / (n - 1))
        else:
            job.failed += 1
        code = None if result.error is None else result.error.code
        self.finished_by_code[code or "ok"] += 1
        # What went wrong in the daemon (not a client's bad item or cancel) is a
        # warning, so `kvmux logs --level warning` shows every failure.
        emit = log.warning if code in _FAILURE_CODES else log.info
        line = functools.partial(
            emit,
            "session_finished",
            job_id=job.job_id,
            session_id=state.session_id,
            status=result.status,
            finish_reason=result.finish_reason,
            error=code,
            message=None if result.error is None else result.error.message[:500],
            completion_tokens=len(result.token_ids),
            capacity=capacity,
        )
        self.outbox.emit(job, ItemFinished(job_id=job.job_id, result=result))
        if ending is not None:  # _took acts once for every item it ends
            ending.after.append(line)
            ending.freed = ending.freed or freed > 0
            if job.done:
                self._job_done(job, ending)
            return
        line()
        if job.done:
            self._job_done(job)
        if freed:
            self._unpark()
        elif self.prefix.waiting:
            # Items may wait for its prefill: with nothing freed (it failed before its
            # first row) no one else wakes the loop to let them open.
            self.poke()

    def _preempt(self, state: ItemState) -> None:
        """Release ``state``'s KV and put it back at the head of its job's queue; it
        decodes again from the start when memory allows (same seed, same tokens)."""
        session = state.session
        assert session is not None and state.admission is not None
        self.prefix.leave(state, session, keep=False)
        state.session = None
        state.preemptions += 1
        state.phase = "queued"
        state.failure = None
        self._active.remove(state)
        self.queue.push_front(state)  # it is among the oldest
        log.info(
            "session_preempted",
            job_id=state.job.job_id,
            session_id=state.session_id,
            sent_tokens=state.sent_tokens,
            preemptions=state.preemptions,
        )

    def _unpark(self) -> None:
        for state in self.coordinator.resume(self._active):
            state.phase = "active"
        self.poke()

    def _job_done(self, job: JobState, ending: _Ending | None = None) -> None:
        self.jobs.retire(job)
        self.outbox.emit(
            job,
            JobFinished(job_id=job.job_id, total=len(job.items), ok=job.ok, failed=job.failed),
        )
        line = functools.partial(
            log.info,
            "job_finished",
            job_id=job.job_id,
            items=len(job.items),
            ok=job.ok,
            failed=job.failed,
        )
        if ending is None:
            line()
        else:  # after its items' lines
            ending.after.append(line)

    # -- status ----------------------------------------------------------------------
    def counts(self) -> dict[str, int]:
        parked = sum(1 for s in self._active if s.phase == "parked")
        return {
            "jobs_active": len(self.jobs.live),
            "jobs_retained": len(self.jobs.retained),
            "sessions_active": len(self._active) - parked,
            "sessions_queued": self.queue.queued,
            "sessions_parked": parked,
        }
