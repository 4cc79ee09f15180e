"""The scheduler: every item of every job becomes a decode session; sessions take turns.

One loop owns all session state. Each turn it settles what happened since the
last one (cancellations, failed growths), admits queued items up to
``scheduler.max_active_sessions`` (round-robin across jobs, so one big job
cannot starve a small one), sends every session that needs more KV to the
growth coordinator, and steps every other ready session — prefill in chunks
of ``prefill_chunk`` tokens, decode one token, or a few decode tokens while
nothing can change the ready set — in a single call to the engine's worker
thread. A turn is a function of the *set* of ready sessions, so batching them
into one model run is a change to the engine.

Sessions are only ever released by the loop, between turns, when no step is
in flight. A failure inside one session ends that item alone.
"""

from __future__ import annotations

import math
import secrets
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import anyio
import anyio.abc
import structlog

from kvmux.client.errors import BadRequest, Cancelled, NotFound, Overloaded, ShuttingDown
from kvmux.client.protocol import (
    ErrorInfo,
    Event,
    Item,
    ItemFinished,
    ItemResult,
    ItemStarted,
    JobFinished,
    SessionInfo,
    Submit,
    TokenDelta,
    Usage,
)
from kvmux.kv import GrowthFailed, GrowthResult

from .config import JobsConfig, SchedulerConfig
from .coordinator import GrowthCoordinator
from .engine import Admission, DecodeSession, Engine, SamplingParams, StepOutput
from .errors import error_info
from .metrics import Metrics
from .worker import EngineWorker

log = structlog.get_logger("kvmux.scheduler")

# One worker call runs decode steps until about this much model time (at most
# _MAX_STEPS_PER_CALL steps): the two thread handoffs around it then cost a few %.
_MIN_CALL_SECONDS = 0.010
_MAX_STEPS_PER_CALL = 16

Phase = Literal["queued", "opening", "active", "growing", "parked", "failing", "done"]
Deliver = Callable[[bytes, list[Event]], None]


@dataclass(eq=False)
class ItemState:
    """One item's life: queued, then a session (active/growing/parked), then a result."""

    job: JobState
    index: int
    custom_id: str
    admission: Admission | None = None
    session: DecodeSession | None = None
    phase: Phase = "queued"
    result: ItemResult | None = None
    retries: int = 0
    # Set by anyone; acted on by the loop between turns.
    cancel_with: Exception | None = None
    failure: Exception | None = None
    admitted_seq: int = 0
    first_token_at: float | None = None

    @property
    def session_id(self) -> str:
        return f"{self.job.job_id}/{self.index}"


@dataclass(eq=False)
class JobState:
    """A submitted batch: its items, who owns it, and its tally."""

    job_id: str
    # The clients its events go to: the submitter, then whoever attached. A job
    # not detached is cancelled when the last of them is gone.
    clients: list[bytes]
    detached: bool
    name: str
    items: list[ItemState] = field(default_factory=list)
    created: float = field(default_factory=time.monotonic)
    finished_at: float | None = None
    ok: int = 0
    failed: int = 0
    tokens: int = 0  # generated tokens its results hold

    @property
    def done(self) -> bool:
        return self.ok + self.failed == len(self.items)

    def results(self) -> list[ItemResult]:
        return [it.result for it in self.items if it.result is not None]


class Scheduler:
    """Owns jobs, the bounded queue, the active set and the loop that runs them."""

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
        self.cfg = cfg
        self.jobs_cfg = jobs_cfg
        self._deliver = deliver
        self._queue: OrderedDict[str, deque[ItemState]] = OrderedDict()
        self._queued = 0
        self._reserved = 0  # queue slots held by submits still being validated
        self._active: list[ItemState] = []
        self._jobs: dict[str, JobState] = {}
        self._retained: OrderedDict[str, JobState] = OrderedDict()
        self._retained_tokens = 0
        self._outbox: dict[bytes, list[Event]] = {}
        self._wake = anyio.Event()
        self._tg: anyio.abc.TaskGroup | None = None
        self._seq = 0
        self.draining = False
        self._step_seconds = 0.0  # a session step's recent duration, handoffs included
        self.tokens_generated = 0
        self.finished_by_code: Counter[str] = Counter()  # "ok" or the error code
        self.metrics: Metrics | None = None

    # -- what the server calls --------------------------------------------------
    async def submit(self, owner: bytes, msg: Submit) -> JobState:
        """Validate and enqueue a job. Whole-job refusals raise; a bad item fails alone."""
        if self.draining:
            raise ShuttingDown("kvmuxd is shutting down and admits no new jobs")
        n = len(msg.items)
        if n > self.cfg.max_job_items:
            raise BadRequest(
                f"job has {n} items; this daemon takes at most {self.cfg.max_job_items} per job "
                "(scheduler.max_job_items): split it",
                {"items": n, "max_job_items": self.cfg.max_job_items},
            )
        free = self.cfg.max_queued_items - self._queued - self._reserved
        if n > free:
            raise Overloaded(
                f"queue full: {self._queued} items queued of {self.cfg.max_queued_items} "
                f"(scheduler.max_queued_items); the job's {n} items do not fit. Retry later.",
                {"items": n, "queued": self._queued, "max_queued_items": self.cfg.max_queued_items},
            )
        self._reserved += n
        try:
            checks = await self.worker.run(self._admit_all, msg.items)
        finally:
            self._reserved -= n
        if self.draining:  # the stop began while the items were being checked
            raise ShuttingDown("kvmuxd is shutting down and admits no new jobs")
        job = JobState(
            job_id=secrets.token_hex(6), clients=[owner], detached=msg.detach, name=msg.name
        )
        self._jobs[job.job_id] = job
        queue: deque[ItemState] = deque()
        for index, (item, check) in enumerate(zip(msg.items, checks, strict=True)):
            state = ItemState(job, index, item.custom_id)
            job.items.append(state)
            if isinstance(check, Admission):
                state.admission = check
                queue.append(state)
            else:
                state.failure = check
        log.info(
            "job_accepted",
            job_id=job.job_id,
            items=n,
            queued=len(queue),
            rejected=n - len(queue),
            detached=job.detached,
        )
        if queue:
            self._queue[job.job_id] = queue
            self._queued += len(queue)
        for state in job.items:
            if state.failure is not None:
                self._finish(state, error=state.failure)
        self.poke()
        return job

    def _admit_all(self, items: list[Item]) -> list[Admission | Exception]:
        # On the worker thread: tokenizing is the engine's work too.
        return [self._admit(item) for item in items]

    def _admit(self, item: Item) -> Admission | Exception:
        try:
            if (item.prompt is None) == (item.prompt_tokens is None):
                raise BadRequest("exactly one of `prompt` and `prompt_tokens` must be given")
            limit = self.cfg.max_new_tokens
            if item.max_new_tokens is not None and item.max_new_tokens > limit:
                raise BadRequest(
                    f"max_new_tokens {item.max_new_tokens} is over this daemon's limit {limit} "
                    "(scheduler.max_new_tokens)",
                    {"max_new_tokens": item.max_new_tokens, "limit": limit},
                )
            params = SamplingParams(
                max_new_tokens=item.max_new_tokens,
                temperature=item.temperature,
                top_k=item.top_k,
                top_p=item.top_p,
                seed=item.seed,
                stop=tuple(item.stop),
                ignore_eos=item.ignore_eos,
            )
            prompt = item.prompt if item.prompt is not None else list(item.prompt_tokens or [])
            admission = self.engine.admit(prompt, params, max_context=item.max_context)
            cap = self.cfg.max_prompt_tokens
            if cap and len(admission.prompt_ids) > cap:
                raise BadRequest(
                    f"prompt has {len(admission.prompt_ids)} tokens; this daemon takes at most "
                    f"{cap} (scheduler.max_prompt_tokens)",
                    {"prompt_tokens": len(admission.prompt_ids), "max_prompt_tokens": cap},
                )
            return admission
        except Exception as exc:  # noqa: BLE001 - the item fails alone, typed
            return exc

    def find(self, job_id: str) -> JobState:
        job = self._jobs.get(job_id) or self._retained.get(job_id)
        if job is None:
            raise NotFound(
                f"no job {job_id!r}: it never existed here, or its results were dropped after "
                f"jobs.retention ({self.jobs_cfg.retention:g} s), jobs.max_retained "
                f"({self.jobs_cfg.max_retained}) or jobs.max_retained_tokens "
                f"({self.jobs_cfg.max_retained_tokens})",
                {"job_id": job_id},
            )
        return job

    def attach(self, client: bytes, job_id: str) -> JobState:
        """Add ``client`` to the job's audience (the others keep theirs)."""
        job = self.find(job_id)
        if client not in job.clients:
            job.clients.append(client)
        return job

    def detach(self, job_id: str) -> None:
        self.find(job_id).detached = True

    def cancel(self, job_id: str, reason: Exception | None = None) -> JobState:
        job = self.find(job_id)
        self._cancel_job(job, reason or Cancelled("cancelled by request", {"job_id": job_id}))
        return job

    def client_gone(self, client: bytes, why: str, reason: str) -> list[str]:
        """Forget a client that left or stopped heartbeating; cancel the jobs (not
        detached) that nobody else is attached to."""
        gone = []
        for job in self._jobs.values():
            if client in job.clients:
                job.clients.remove(client)
                if not job.clients and not job.detached:
                    gone.append(job)
        for job in gone:
            self._cancel_job(
                job,
                Cancelled(
                    f"cancelled: {why} and the job was not detached",
                    {"job_id": job.job_id, "reason": reason},
                ),
            )
        return [j.job_id for j in gone]

    def _cancel_job(self, job: JobState, reason: Exception) -> None:
        queue = self._queue.pop(job.job_id, None)
        if queue:
            self._queued -= len(queue)
            for state in queue:
                self._finish(state, error=reason)
        for state in job.items:
            if state.phase not in ("done", "queued"):
                state.cancel_with = reason
        self.poke()

    # -- the loop ------------------------------------------------------------------
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
                self._flush()
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
        started = time.perf_counter()
        outputs = await self.worker.run(self.engine.step_many, sessions, steps)
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
        if self._queued or self.draining or not self._step_seconds:
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
        parked = [s for s in self._active if s.phase == "parked"]
        if parked and not any(s.phase in ("active", "growing") for s in self._active):
            # Nobody left who could free memory: waiting would never end. Fail
            # the newest parked session so the older ones can proceed.
            victim = max(parked, key=lambda s: s.admitted_seq)
            self._finish(victim, error=victim.failure or _stuck(victim))

    async def _admit_queued(self) -> None:
        if any(s.phase == "parked" for s in self._active):
            return  # memory is short: what a finished session frees goes to the parked
        slots = self.cfg.max_active_sessions - len(self._active)
        batch: list[ItemState] = []
        while slots > 0 and self._queue:
            job_id, queue = next(iter(self._queue.items()))
            state = queue.popleft()
            self._queued -= 1
            if queue:
                self._queue.move_to_end(job_id)
            else:
                del self._queue[job_id]
            state.phase = "opening"
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
            state.admission = None
            log.info(
                "session_started",
                job_id=state.job.job_id,
                session_id=session.session_id,
                index=state.index,
                prompt_tokens=len(session.prompt_ids),
                hard_max=session.hard_max.value,
            )
            self._emit(
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
                self.coordinator.record_failure(grown)
                refused.append((state, grown))
            elif isinstance(grown, Exception):
                state.phase = "failing"
                state.failure = grown
            elif grown is not None:
                self.coordinator.record(grown)
                self._log_growth(state, grown, waited)
        # After the whole batch is active, so the policy sees who could free memory.
        for state, exc in refused:
            with structlog.contextvars.bound_contextvars(
                job_id=state.job.job_id, session_id=state.session_id
            ):
                self._growth_failed(state, exc)

    def _open_all(
        self, batch: list[ItemState]
    ) -> list[tuple[DecodeSession | None, GrowthResult | Exception | None]]:
        """Open each session and allocate its first bucket; failures are per item."""
        out: list[tuple[DecodeSession | None, GrowthResult | Exception | None]] = []
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

    async def _grow(self, state: ItemState) -> None:
        session = state.session
        assert session is not None
        with structlog.contextvars.bound_contextvars(
            job_id=state.job.job_id, session_id=session.session_id
        ):
            try:
                result, waited = await self.coordinator.grow(session)
            except GrowthFailed as exc:
                self._growth_failed(state, exc)
            except Exception as exc:  # noqa: BLE001 - that item fails alone
                state.failure = exc
                state.phase = "failing"
            else:
                state.phase = "active"
                self._log_growth(state, result, waited)
            finally:
                self.poke()

    def _log_growth(self, state: ItemState, result: GrowthResult, waited: float) -> None:
        if not result.grew:
            return
        with structlog.contextvars.bound_contextvars(
            job_id=state.job.job_id, session_id=state.session_id
        ):
            log.info(
                "kv_grew",
                old=result.old_capacity,
                new=result.new_capacity,
                valid_len=result.valid_len,
                bytes_copied=result.bytes_copied,
                seconds=round(result.seconds, 6),
                lock_wait_seconds=round(waited, 6),
            )

    def _growth_failed(self, state: ItemState, exc: GrowthFailed) -> None:
        log.warning("kv_growth_failed", retries=state.retries, **exc.details)
        others_can_free = any(
            s is not state and s.phase in ("active", "growing") for s in self._active
        )
        if (
            self.cfg.on_growth_failure == "wait"
            and state.retries < self.cfg.growth_retries
            and others_can_free
        ):
            state.retries += 1
            state.phase = "parked"
            state.failure = exc  # what it will fail with if waiting does not help
            log.info("session_parked", retry=state.retries, of=self.cfg.growth_retries)
            return
        state.failure = exc
        state.phase = "failing"

    def _after_step(self, state: ItemState, out: StepOutput | Exception) -> None:
        if isinstance(out, Exception):
            self._finish(state, error=out)
            return
        if out.token_ids and state.first_token_at is None:
            state.first_token_at = time.monotonic()
            if self.metrics is not None:
                self.metrics.ttft.observe(state.first_token_at - state.job.created)
        if out.token_ids or out.text:
            self.tokens_generated += len(out.token_ids)
            self._emit(
                state.job,
                TokenDelta(
                    job_id=state.job.job_id,
                    index=state.index,
                    token_ids=out.token_ids,
                    text=out.text,
                ),
            )
        if out.finished:
            assert state.session is not None
            done = state.session.completion()
            self._finish(
                state,
                result=ItemResult(
                    index=state.index,
                    custom_id=state.custom_id,
                    status="ok",
                    text=done.text,
                    token_ids=done.token_ids,
                    finish_reason=done.finish_reason,
                    usage=Usage(
                        done.prompt_tokens,
                        done.completion_tokens,
                        done.prompt_tokens + done.completion_tokens,
                    ),
                    seed=done.seed,
                ),
            )

    # -- endings -------------------------------------------------------------------
    def _finish(
        self, state: ItemState, *, result: ItemResult | None = None, error: Exception | None = None
    ) -> None:
        """End an item: release its session, record and announce its result."""
        job = state.job
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
        if result is None:
            assert error is not None
            info: ErrorInfo = error_info(error, job_id=job.job_id, session_id=state.session_id)
            result = ItemResult(
                index=state.index, custom_id=state.custom_id, status="error", error=info
            )
        state.result = result
        state.phase = "done"
        state.admission = None
        job.tokens += len(result.token_ids)
        if result.status == "ok":
            job.ok += 1
            n = len(result.token_ids)
            if self.metrics is not None and state.first_token_at is not None and n > 1:
                self.metrics.tpot.observe((time.monotonic() - state.first_token_at) / (n - 1))
        else:
            job.failed += 1
        self.finished_by_code["ok" if result.error is None else result.error.code] += 1
        log.info(
            "session_finished",
            job_id=job.job_id,
            session_id=state.session_id,
            status=result.status,
            finish_reason=result.finish_reason,
            error=None if result.error is None else result.error.code,
            completion_tokens=len(result.token_ids),
            capacity=capacity,
        )
        self._emit(job, ItemFinished(job_id=job.job_id, result=result))
        if job.done:
            self._job_done(job)
        if freed:
            self._unpark()

    def _unpark(self) -> None:
        for state in self._active:
            if state.phase == "parked":
                state.phase = "active"
                self.coordinator.parked_retries += 1
        self.poke()

    def _job_done(self, job: JobState) -> None:
        job.finished_at = time.monotonic()
        self._jobs.pop(job.job_id, None)
        self._retained[job.job_id] = job
        self._retained_tokens += job.tokens
        self._emit(
            job,
            JobFinished(job_id=job.job_id, total=len(job.items), ok=job.ok, failed=job.failed),
        )
        log.info(
            "job_finished", job_id=job.job_id, items=len(job.items), ok=job.ok, failed=job.failed
        )
        self.prune_retained()

    def prune_retained(self) -> None:
        """Drop the oldest finished jobs past ``jobs.retention`` seconds, beyond
        ``jobs.max_retained`` jobs or ``jobs.max_retained_tokens`` tokens (the newest stays)."""
        cfg = self.jobs_cfg
        cutoff = time.monotonic() - cfg.retention
        while self._retained:
            oldest = next(iter(self._retained.values()))
            expired = oldest.finished_at is not None and oldest.finished_at < cutoff
            too_many = len(self._retained) > cfg.max_retained
            too_big = self._retained_tokens > cfg.max_retained_tokens and len(self._retained) > 1
            if not (expired or too_many or too_big):
                break
            self._retained.popitem(last=False)
            self._retained_tokens -= oldest.tokens

    # -- events ----------------------------------------------------------------------
    def _emit(self, job: JobState, event: Event) -> None:
        for client in job.clients:
            self._outbox.setdefault(client, []).append(event)

    def _flush(self) -> None:
        """One message per client for everything this turn produced."""
        if not self._outbox:
            return
        outbox, self._outbox = self._outbox, {}
        for client, events in outbox.items():
            self._deliver(client, events)

    # -- shutdown ------------------------------------------------------------------
    def cancel_all(self, reason: Exception) -> None:
        for job in list(self._jobs.values()):
            self._cancel_job(job, reason)

    @property
    def idle(self) -> bool:
        return not self._jobs

    # -- status ----------------------------------------------------------------------
    def counts(self) -> dict[str, int]:
        parked = sum(1 for s in self._active if s.phase == "parked")
        return {
            "jobs_active": len(self._jobs),
            "jobs_retained": len(self._retained),
            "sessions_active": len(self._active) - parked,
            "sessions_queued": self._queued,
            "sessions_parked": parked,
        }

    def sessions(self) -> list[SessionInfo]:
        out = []
        for state in self._active:
            session = state.session
            if session is None:
                continue
            out.append(
                SessionInfo(
                    session_id=session.session_id,
                    job_id=state.job.job_id,
                    index=state.index,
                    state=state.phase,
                    capacity=session.capacity,
                    valid_len=session.valid_len,
                    kv_bytes=session.kv_bytes,
                )
            )
        return out


def _stuck(state: ItemState) -> Exception:
    return GrowthFailed(
        "KV growth could not proceed: every session is waiting for memory and none can free any",
        {"session_id": state.session_id, "session_unchanged": True},
    )
