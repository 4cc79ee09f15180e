"""The turn loop. One loop owns all session state: sessions are only ever
released by it, between turns, when no step is in flight, so nothing needs a
lock but growth. A turn is a function of the *set* of ready sessions, so
batching them into one model run is a change to the engine, not to the loop."""

from __future__ import annotations

import math
import time
from collections import Counter

import anyio
import anyio.abc
import structlog

from kvmux.client.protocol import ItemFinished, ItemResult, ItemStarted, JobFinished, TokenDelta
from kvmux.kv import GrowthFailed, GrowthResult

from ..config import JobsConfig, SchedulerConfig
from ..coordinator import Fail, Grew, GrowthCoordinator, Park, Preempt, Verdict
from ..engine import DecodeSession, Engine, StepOutput
from ..journal import Journal
from ..metrics import Metrics
from ..worker import EngineWorker
from ._jobs import ItemState, JobState, JobTable
from ._outbox import Deliver, Outbox, completed_result, error_result
from ._queue import FairQueue

log = structlog.get_logger("kvmux.scheduler")

# One worker call runs decode steps until about this much model time (at most
# _MAX_STEPS_PER_CALL steps): the two thread handoffs around it then cost a few %.
_MIN_CALL_SECONDS = 0.010
_MAX_STEPS_PER_CALL = 16

_FAILURE_CODES = frozenset(
    {"kv_capacity_exceeded", "kv_growth_failed", "run_failed", "internal", "shutdown"}
)


class TurnLoop:
    """The active set and the loop that runs it, turn after turn."""

    def __init__(
        self,
        engine: Engine,
        worker: EngineWorker,
        coordinator: GrowthCoordinator,
        cfg: SchedulerConfig,
        jobs_cfg: JobsConfig,
        deliver: Deliver,
    ) -> None:
        self.engine = engine
        self.worker = worker
        self.coordinator = coordinator
        coordinator.adopt(engine, cfg)
        self.cfg = cfg
        self.jobs = JobTable(jobs_cfg)
        self.queue = FairQueue()
        self.outbox = Outbox(deliver)
        self._active: list[ItemState] = []
        self._wake = anyio.Event()
        self._tg: anyio.abc.TaskGroup | None = None
        self._seq = 0
        self.draining = False
        self._step_seconds = 0.0  # a session step's recent duration, handoffs included
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

    def poke(self) -> None:
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
        self._settle()
        await self._admit_queued()
        self._settle()
        ready: list[ItemState] = []
        for state in self._active:
            if state.phase != "active":
                continue
            session = state.session
            assert session is not None
            if session.needs_growth():
                state.phase = "growing"
                assert self._tg is not None
                self._tg.start_soon(self._grow, state)
            else:
                ready.append(state)
        if not ready:
            return False
        sessions = [state.session for state in ready if state.session is not None]
        steps = self._steps_per_call(ready)
        # Only decode calls are timed: a prompt chunk costs many decode steps, and
        # counted as one it made the calls after every admission run a step or two
        # (on `tiny`, 16 sessions took 8 calls for 40 tokens instead of 4).
        decoding = not any(s.prefilling for s in sessions)
        started = time.perf_counter()
        outputs = await self.worker.run(self.engine.step_many, sessions, steps)
        if decoding:
            per_step = (time.perf_counter() - started) / (steps * len(sessions))
            if self._step_seconds:
                per_step = 0.8 * self._step_seconds + 0.2 * per_step
            self._step_seconds = per_step
        for state, out in zip(ready, outputs, strict=True):
            self._after_step(state, out)
        return True

    def _steps_per_call(self, ready: list[ItemState]) -> int:
        """Decode steps per worker call: several while the ready set cannot change.

        Every call costs two thread handoffs (to the worker and back), each
        ~0.1-0.3 ms on a VM; a call of one short step pays them per token. So
        a call runs steps until it has ~_MIN_CALL_SECONDS of model time, but
        only while nothing waits to be admitted, nobody is being cancelled,
        and every session is past its prefill with room in its bucket for all
        of them (growth stays with the coordinator, between calls).
        """
        if self.queue.queued or self.draining or not self._step_seconds:
            return 1
        steps = min(
            _MAX_STEPS_PER_CALL,
            math.ceil(_MIN_CALL_SECONDS / (len(ready) * self._step_seconds)),
        )
        for state in ready:
            session = state.session
            assert session is not None
            if session.prefilling or state.cancel_with is not None:
                return 1
            steps = min(steps, session.room())
        return max(1, steps)

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
        slots = self.cfg.max_active_sessions - len(self._active)
        batch: list[ItemState] = []
        active_by = Counter(s.job.owner for s in self._active)
        while slots > 0 and self.queue:
            state = self.queue.head(active_by)
            assert state.admission is not None
            if not gate.admits(state.admission):
                break
            self.queue.take(state)
            active_by[state.job.owner] += 1
            state.phase = "opening"
            if not state.admitted_seq:  # a preempted item keeps its place among the old
                self._seq += 1
                state.admitted_seq = self._seq
            batch.append(state)
            slots -= 1
        if not batch:
            return
        self._active.extend(batch)
        # First allocations are growths from nothing: made under the growth lock,
        # all in the call that opens the sessions, so a burst of new sessions
        # starts prefilling in this very turn instead of queueing for the lock.
        async with self.coordinator.held() as waited:
            opened = await self.worker.run(self._open_all, batch)
        refused: list[tuple[ItemState, GrowthFailed]] = []
        for state, (session, grown) in zip(batch, opened, strict=True):
            if session is None:
                assert isinstance(grown, Exception)
                state.phase = "failing"
                state.failure = grown
                continue
            state.session = session
            state.phase = "active"
            state.seen_tokens = state.seen_text = 0
            log.info(
                "session_started",
                job_id=state.job.job_id,
                session_id=session.session_id,
                index=state.index,
                prompt_tokens=len(session.prompt_ids),
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
            if isinstance(grown, GrowthFailed):
                refused.append((state, grown))
            else:
                self._judge(state, grown, waited)
        # After the whole batch is active, so the policy sees who could free memory.
        for state, exc in refused:
            self._judge(state, exc, waited)

    def _open_all(
        self, batch: list[ItemState]
    ) -> list[tuple[DecodeSession | None, GrowthResult | Exception]]:
        """Open each session and allocate its first bucket; failures are per item."""
        out: list[tuple[DecodeSession | None, GrowthResult | Exception]] = []
        for state in batch:
            try:
                assert state.admission is not None
                session = self.engine.open_session(state.admission, state.session_id)
            except Exception as exc:  # noqa: BLE001 - that item fails alone
                out.append((None, exc))
                continue
            try:
                out.append((session, session.ensure_capacity()))
            except Exception as exc:  # noqa: BLE001 - GrowthFailed left it empty and usable
                out.append((session, exc))
        return out

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

    def _after_step(self, state: ItemState, out: StepOutput | Exception) -> None:
        if isinstance(out, Exception):
            self._finish(state, error=out)
            return
        if out.token_ids and state.first_token_at is None:
            state.first_token_at = time.monotonic()
            if self.metrics is not None:
                self.metrics.ttft.observe(state.first_token_at - state.job.created)
        # After a preemption the item replays from its start: only what goes
        # beyond what its clients were already sent is new to them.
        skip_tokens = max(0, state.sent_tokens - state.seen_tokens)
        skip_text = max(0, state.sent_text - state.seen_text)
        state.seen_tokens += len(out.token_ids)
        state.seen_text += len(out.text)
        state.sent_tokens = max(state.sent_tokens, state.seen_tokens)
        state.sent_text = max(state.sent_text, state.seen_text)
        token_ids, text = out.token_ids[skip_tokens:], out.text[skip_text:]
        if token_ids or text:
            self.tokens_generated += len(token_ids)
            self.outbox.emit(
                state.job,
                TokenDelta(
                    job_id=state.job.job_id,
                    index=state.index,
                    token_ids=token_ids,
                    text=text,
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
            session.release()
            state.session = None
        if state in self._active:
            self._active.remove(state)
        state.result = result
        state.phase = "done"
        state.admission = None
        job.tokens += len(result.token_ids)
        if self.jobs.journal is not None:
            self.jobs.charge(job, self.jobs.journal.add_result(job.job_id, result))
        if result.status == "ok":
            job.ok += 1
            n = len(result.token_ids)
            if self.metrics is not None and state.first_token_at is not None and n > 1:
                self.metrics.tpot.observe((time.monotonic() - state.first_token_at) / (n - 1))
        else:
            job.failed += 1
        code = None if result.error is None else result.error.code
        self.finished_by_code[code or "ok"] += 1
        # What went wrong in the daemon (not a client's bad item or cancel) is a
        # warning, so `kvmux logs --level warning` shows every failure.
        emit = log.warning if code in _FAILURE_CODES else log.info
        emit(
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
        if job.done:
            self._job_done(job)
        if freed:
            self._unpark()

    def _preempt(self, state: ItemState) -> None:
        """Release ``state``'s KV and put it back at the head of its job's queue; it
        decodes again from the start when memory allows (same seed, same tokens)."""
        session = state.session
        assert session is not None and state.admission is not None
        session.release()
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

    def _job_done(self, job: JobState) -> None:
        self.jobs.retire(job)
        self.outbox.emit(
            job,
            JobFinished(job_id=job.job_id, total=len(job.items), ok=job.ok, failed=job.failed),
        )
        log.info(
            "job_finished", job_id=job.job_id, items=len(job.items), ok=job.ok, failed=job.failed
        )

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
