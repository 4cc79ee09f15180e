"""The scheduler: every item of every job becomes a decode session; sessions take turns.

One loop owns all session state. Each turn it settles what happened since the
last one (cancellations, failed growths), admits queued items up to
``scheduler.max_active_sessions`` (to the owner with the fewest active
sessions first, round-robin across that owner's jobs, so neither a big job
nor a big user starves anyone), sends every session that needs more KV to the
growth coordinator, and steps every other ready session — prefill in chunks
of ``prefill_chunk`` tokens, decode one token, or a few decode tokens while
nothing can change the ready set — in a single call to the engine's worker
thread. A turn is a function of the *set* of ready sessions, so batching them
into one model run is a change to the engine.

Sessions are only ever released by the loop, between turns, when no step is
in flight. A failure inside one session ends that item alone.

Under ``on_growth_failure = "wait"`` with a ``kv.memory_budget``, an item
whose KV fits the budget on its own always finishes: new sessions start only
while the budget can carry the active ones through their next growth, a
refused growth parks its session until memory is freed, and when every
session is parked the newest is preempted — its KV released, the item put
back at the head of the queue and decoded again from the start later, its
already-sent tokens not sent twice (decoding is deterministic for a given
seed, so the replay produces the very same tokens).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import math
import secrets
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import anyio
import anyio.abc
import anyio.to_thread
import msgspec
import structlog

from kvmux.client.errors import (
    BadRequest,
    Cancelled,
    NotFound,
    Overloaded,
    ShuttingDown,
    StorageFull,
)
from kvmux.client.protocol import (
    AddItems,
    ErrorInfo,
    Event,
    Item,
    ItemFinished,
    ItemResult,
    ItemStarted,
    JobFinished,
    JobInfo,
    Rejected,
    SessionInfo,
    Submit,
    TokenDelta,
    TokenLogprob,
    TopLogprob,
    Usage,
)
from kvmux.kv import (
    GrowthFailed,
    GrowthResult,
    capacity_bucket,
    failpoints,
)

from .access import OPERATOR, Caller
from .config import JobsConfig, SchedulerConfig, owner_queue_share
from .coordinator import GrowthCoordinator
from .engine import (
    Admission,
    DecodeSession,
    Engine,
    SamplingParams,
    StepOutput,
    TokenLogprobs,
)
from .errors import error_info
from .journal import Journal, JournaledJob, JournalFull
from .metrics import Metrics
from .worker import EngineWorker

log = structlog.get_logger("kvmux.scheduler")
failpoints.register("scheduler.admit")

# One worker call runs decode steps until about this much model time (at most
# _MAX_STEPS_PER_CALL steps): the two thread handoffs around it then cost a few %.
_MIN_CALL_SECONDS = 0.010
_MAX_STEPS_PER_CALL = 16

Phase = Literal["queued", "opening", "active", "growing", "parked", "failing", "done"]
Deliver = Callable[[bytes, list[Event]], None]


@dataclass(eq=False, slots=True)
class ItemState:
    """One item's life: queued, then a session (active/growing/parked), then a result."""

    job: JobState
    index: int
    custom_id: str
    admission: Admission | None = None
    # Echoed into its result untouched (see Item): input line, choice, chat or not.
    line: int | None = None
    choice: int = 0
    choices: int = 1
    chat: bool = False
    session: DecodeSession | None = None
    phase: Phase = "queued"
    result: ItemResult | None = None
    retries: int = 0
    # Set by anyone; acted on by the loop between turns.
    cancel_with: Exception | None = None
    failure: Exception | None = None
    admitted_seq: int = 0
    first_token_at: float | None = None
    # A preempted item is decoded again from the start; what its client was
    # already sent (tokens, text characters) is not sent twice.
    sent_tokens: int = 0
    sent_text: int = 0
    seen_tokens: int = 0
    seen_text: int = 0
    preemptions: int = 0

    @property
    def session_id(self) -> str:
        return f"{self.job.job_id}/{self.index}"

    def make_result(self, status: Literal["ok", "error"], **fields: Any) -> ItemResult:
        """Its result, carrying what the item asked to have echoed."""
        return ItemResult(
            index=self.index,
            custom_id=self.custom_id,
            status=status,
            line=self.line,
            choice=self.choice,
            choices=self.choices,
            chat=self.chat,
            **fields,
        )


@dataclass(eq=False)
class JobState:
    """A submitted batch: its items, who owns it, and its tally."""

    job_id: str
    # The clients its events go to: the submitter, then whoever attached. A job
    # not detached is cancelled when the last of them is gone.
    clients: list[bytes]
    detached: bool
    name: str
    owner: str  # who may see and act on it (see kvmux.daemon.access)
    items: list[ItemState] = field(default_factory=list)
    # Takes more items (AddItems) until closed; it finishes only once closed.
    open: bool = False
    format: Literal["kvmux", "openai"] = "kvmux"
    created: float = field(default_factory=time.monotonic)
    touched: float = field(default_factory=time.monotonic)  # its last submit or addition
    # Additions are checked one at a time, so items are numbered in arrival order.
    adding: anyio.Lock = field(default_factory=anyio.Lock)
    finished_at: float | None = None
    ok: int = 0
    failed: int = 0
    tokens: int = 0  # generated tokens its results hold
    journal_bytes: int = 0  # what its items and results take in the journal (about)

    @property
    def done(self) -> bool:
        return not self.open and self.ok + self.failed == len(self.items)

    def results(self) -> list[ItemResult]:
        return [it.result for it in self.items if it.result is not None]

    def results_page(self, start: int, max_bytes: int) -> tuple[list[ItemResult], int | None]:
        """Finished results from item ``start`` on, up to about ``max_bytes`` encoded
        (at least one); and the index the next page starts at, None when none is left."""
        page: list[ItemResult] = []
        size = 0
        for state in itertools.islice(self.items, start, None):
            result = state.result
            if result is None:
                continue
            n = len(_ENCODER.encode(result))
            if page and size + n > max_bytes:
                return page, state.index
            page.append(result)
            size += n
        return page, None


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
        # owner -> job id -> that job's queued items; both levels round-robin.
        self._queue: OrderedDict[str, OrderedDict[str, deque[ItemState]]] = OrderedDict()
        self._queued = 0
        self._queued_by: Counter[str] = Counter()  # per owner, submits being checked included
        self._reserved = 0  # queue slots held by submits still being validated
        self._tokenizer = anyio.CapacityLimiter(1)
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
        self.journal: Journal | None = None
        self._journal_total = 0

    # -- what the server calls --------------------------------------------------
    async def submit(
        self,
        client: bytes,
        msg: Submit,
        *,
        caller: Caller = OPERATOR,
        still_wanted: Callable[[], bool] | None = None,
    ) -> JobState | None:
        """Validate and enqueue a job. Whole-job refusals raise; a bad item fails alone.

        With ``more`` the job stays open for :meth:`add_items`. None if
        ``still_wanted`` says, once the items are checked, that the client is gone:
        a job nobody can learn the id of is never started."""
        if self.draining:
            raise ShuttingDown("kvmuxd is shutting down and admits no new jobs")
        if not msg.items and not msg.rejected and not msg.more:
            raise BadRequest("a job needs at least one item (or `more` to add them later)")
        owner = caller.owner
        if msg.more:
            self._check_open_share(owner)
        self._check_message(len(msg.items), len(msg.rejected), 0)
        checks = await self._check_items(msg.items, owner)
        if still_wanted is not None and not still_wanted():
            log.info(
                "job_dropped",
                owner=owner,
                items=len(msg.items),
                reason="client gone before it started",
            )
            return None
        job = JobState(
            job_id=secrets.token_hex(6),
            clients=[client],
            detached=msg.detach,
            name=msg.name,
            owner=owner,
            open=msg.more,
            format=msg.format,
        )
        rejected = self._rejected_results(len(msg.items), msg.rejected)
        if self.journal is not None:
            # Written before it is acknowledged; sampled items with the seed the
            # daemon chose, so a replay after a crash draws the same tokens.
            wire = self._journaled(msg.items, checks, msg.rejected)
            await self._journal_write(
                job,
                wire,
                self.journal.add_job(
                    job.job_id,
                    owner,
                    msg.name,
                    msg.detach,
                    wire,
                    results=rejected,
                    format=msg.format,
                    open=msg.more,
                ),
            )
        self._jobs[job.job_id] = job
        self._append(job, msg.items, checks, rejected)
        log.info(
            "job_accepted",
            job_id=job.job_id,
            items=len(msg.items),
            queued=sum(1 for s in job.items if s.phase == "queued" and s.failure is None),
            refused=sum(1 for s in job.items if s.failure is not None) + len(rejected),
            detached=job.detached,
            open=job.open,
        )
        return job

    async def add_items(
        self, client: bytes, msg: AddItems, *, caller: Caller = OPERATOR
    ) -> JobState:
        """Append items (and rejected lines) to an open job; ``last`` closes it.

        Refused whole (``overloaded``) when the items do not fit the queue now:
        the caller sends the same message again later. Items are numbered in
        arrival order."""
        job = self.find(msg.job_id, caller)
        if job.adding.locked():
            # One addition at a time per job: a flood would otherwise pile up
            # messages (each up to max_message_bytes) waiting for their turn.
            raise Overloaded(
                f"an addition to job {job.job_id} is still being checked; send the next one "
                "after its answer",
                {"job_id": job.job_id, "retry_after": 0.05},
            )
        async with job.adding:
            if self.draining:
                raise ShuttingDown("kvmuxd is shutting down and admits no new items")
            self._check_open(job)
            self._check_message(len(msg.items), len(msg.rejected), len(job.items))
            checks = await self._check_items(msg.items, job.owner)
            self._check_open(job)  # cancelled, or closed for want of a client, meanwhile
            start = len(job.items)
            rejected = self._rejected_results(start + len(msg.items), msg.rejected)
            if self.journal is not None:
                wire = self._journaled(msg.items, checks, msg.rejected)
                await self._journal_write(
                    job,
                    wire,
                    self.journal.add_items(
                        job.job_id, start, wire, results=rejected, close=msg.last
                    ),
                )
                self._check_open(job)
            job.touched = time.monotonic()
            if msg.last:
                job.open = False
            self._append(job, msg.items, checks, rejected)
            log.info(
                "job_items_added",
                job_id=job.job_id,
                items=len(msg.items),
                rejected=len(msg.rejected),
                total=len(job.items),
                last=msg.last,
            )
            return job

    def _check_open_share(self, owner: str) -> None:
        cap = self.jobs_cfg.max_open_per_owner
        held = sum(1 for j in self._jobs.values() if j.open and j.owner == owner)
        if held >= cap:
            raise Overloaded(
                f"you hold {held} open jobs, the most one owner may (jobs.max_open_per_owner); "
                "close one (its last addition), cancel it, or wait until one finishes",
                {"open_jobs": held, "max_open_per_owner": cap},
            )

    def _check_open(self, job: JobState) -> None:
        if not job.open:
            raise BadRequest(
                f"job {job.job_id} takes no more items: it was closed (by a last addition, a "
                "cancel, or after jobs.open_timeout with nobody attached)",
                {"job_id": job.job_id},
            )

    def _check_message(self, items: int, rejected: int, total: int) -> None:
        """One message's bounds: ``scheduler.max_job_items`` per message,
        ``scheduler.max_job_total`` per job."""
        n = items + rejected
        cap = self.cfg.max_job_items
        if n > cap:
            raise BadRequest(
                f"this message carries {n} items and rejected lines; this daemon takes at most "
                f"{cap} per message (scheduler.max_job_items): send them in several (an open "
                "job takes more with each addition)",
                {"items": n, "max_job_items": cap},
            )
        if total + n > self.cfg.max_job_total:
            raise BadRequest(
                f"the job would hold {total + n} items; this daemon takes at most "
                f"{self.cfg.max_job_total} per job (scheduler.max_job_total)",
                {"items": total + n, "max_job_total": self.cfg.max_job_total},
            )

    async def _check_items(self, items: list[Item], owner: str) -> list[Admission | Exception]:
        """Admission checks of ``items`` off the loop, within the queue's bounds:
        ``overloaded`` (with a ``retry_after`` hint) when they do not fit now."""
        n = len(items)
        free = self.cfg.max_queued_items - self._queued - self._reserved
        # The queue drains about as fast as the active sessions finish items: a
        # hint, not a promise, for when to send the same request again.
        retry_after = round(min(2.0, max(0.05, 20 * self._step_seconds)), 3)
        if n > free:
            raise Overloaded(
                f"queue full: {self._queued} items queued of {self.cfg.max_queued_items} "
                f"(scheduler.max_queued_items); these {n} items do not fit. Retry later.",
                {
                    "items": n,
                    "queued": self._queued,
                    "max_queued_items": self.cfg.max_queued_items,
                    "retry_after": retry_after,
                },
            )
        share = owner_queue_share(self.cfg)
        mine = self._queued_by[owner]
        if mine + n > share:
            raise Overloaded(
                f"your queue share is full: {mine} of your items are queued and one owner may "
                f"queue {share} (scheduler.max_queued_per_owner); these {n} items do not "
                "fit. Retry when some have started.",
                {
                    "items": n,
                    "queued_by_you": mine,
                    "max_queued_per_owner": share,
                    "retry_after": retry_after,
                },
            )
        if not items:
            return []
        self._reserved += n
        self._queued_by[owner] += n
        try:
            # Tokenizing is neither the event loop's nor the model thread's work:
            # a long prompt on a side thread (the tokenizer lets go of the GIL)
            # holds up no step and no other client.
            checks = await anyio.to_thread.run_sync(self._admit_all, items, limiter=self._tokenizer)
        finally:
            self._reserved -= n
            self._queued_by[owner] -= n
        if self.draining:  # the stop began while the items were being checked
            raise ShuttingDown("kvmuxd is shutting down and admits no new items")
        return checks

    @staticmethod
    def _rejected_results(start: int, rejected: list[Rejected]) -> dict[int, ItemResult]:
        """Lines the client could not parse, as the job's error results from ``start`` on."""
        out = {}
        for index, r in enumerate(rejected, start):
            where = f"line {r.line}: " if r.line is not None else ""
            out[index] = ItemResult(
                index=index,
                custom_id=r.custom_id,
                status="error",
                error=ErrorInfo(
                    "bad_request", where + r.reason, {"line": r.line, "reason": r.reason}
                ),
                line=r.line,
            )
        return out

    @staticmethod
    def _journaled(
        items: list[Item],
        checks: list[Admission | Exception],
        rejected: list[Rejected],
    ) -> list[Item]:
        wire = [_with_seed(item, check) for item, check in zip(items, checks, strict=True)]
        # A rejected line has no item: its row keeps what identifies it.
        wire.extend(Item(custom_id=r.custom_id, line=r.line) for r in rejected)
        return wire

    async def _journal_write(
        self, job: JobState, wire: list[Item], pending: concurrent.futures.Future[None]
    ) -> None:
        """Wait for a submit's or an addition's commit (nothing is acknowledged before)."""
        assert self.journal is not None
        size = sum(len(_ENCODER.encode(item)) for item in wire)
        job.journal_bytes += size
        self._journal_total += size
        try:
            await asyncio.wrap_future(pending)
        except JournalFull as exc:
            raise StorageFull(
                f"kvmuxd cannot write its job journal ({exc}); running items go on, new items "
                "are refused until the disk has room",
                {"journal": str(self.journal.path)},
            ) from exc
        if self.draining:
            raise ShuttingDown("kvmuxd is shutting down and admits no new items")

    def _append(
        self,
        job: JobState,
        items: list[Item],
        checks: list[Admission | Exception],
        rejected: dict[int, ItemResult],
    ) -> None:
        """Give ``items`` and ``rejected`` their places in ``job``; queue the admitted."""
        start = len(job.items)
        self._enqueue(job, list(zip(items, checks, strict=True)))
        for state in job.items[start:]:
            if state.failure is not None:
                self._finish(state, error=state.failure)
        for index, result in rejected.items():
            state = ItemState(
                job, index, result.custom_id, line=result.line, phase="done", result=result
            )
            job.items.append(state)
            job.failed += 1
            if self.journal is not None:
                size = len(_ENCODER.encode(result))
                job.journal_bytes += size
                self._journal_total += size
            self.finished_by_code["bad_request"] += 1
            self._emit(job, ItemFinished(job_id=job.job_id, result=result))
        if job.done and job.job_id in self._jobs:
            self._job_done(job)
        self.poke()

    def _enqueue(
        self, job: JobState, items: list[tuple[Item, Admission | Exception | ItemResult]]
    ) -> int:
        """Register ``job`` with more items (after those it has): admitted ones queued in
        order, refused ones marked to fail, finished ones (from a journal) done. Returns
        how many queued."""
        self._jobs[job.job_id] = job
        queue: deque[ItemState] = deque()
        for index, (item, outcome) in enumerate(items, len(job.items)):
            state = ItemState(
                job,
                index,
                item.custom_id,
                line=item.line,
                choice=item.choice,
                choices=item.choices,
                chat=item.messages is not None,
            )
            job.items.append(state)
            if isinstance(outcome, Admission):
                state.admission = outcome
                queue.append(state)
            elif isinstance(outcome, ItemResult):
                state.result, state.phase = outcome, "done"
                job.tokens += len(outcome.token_ids)
                job.journal_bytes += len(_ENCODER.encode(outcome))
                if outcome.status == "ok":
                    job.ok += 1
                else:
                    job.failed += 1
            else:
                state.failure = outcome
        if queue:
            jobs = self._queue.setdefault(job.owner, OrderedDict())
            if job.job_id in jobs:
                jobs[job.job_id].extend(queue)
            else:
                jobs[job.job_id] = queue
            self._queued += len(queue)
            self._queued_by[job.owner] += len(queue)
        return len(queue)

    async def restore(self, journaled: list[JournaledJob]) -> int:
        """Take back the jobs of a journal (at start): finished results are served
        again, unfinished items queued in their original order and decoded from the
        start. Returns how many items were queued again."""
        replayed = 0
        now_wall, now_mono = time.time(), time.monotonic()
        for record in journaled:
            job = JobState(
                job_id=record.job_id,
                clients=[],
                detached=record.detached,
                name=record.name,
                owner=record.owner,
                # An open job comes back open: its client re-attaches and adds the rest.
                open=record.open,
                format="openai" if record.format == "openai" else "kvmux",
                created=now_mono - max(0.0, now_wall - record.created),
            )
            job.journal_bytes = sum(len(_ENCODER.encode(i)) for i in record.items)
            pending = [item for i, item in enumerate(record.items) if i not in record.results]
            checks = iter(
                await anyio.to_thread.run_sync(self._admit_all, pending, limiter=self._tokenizer)
            )
            outcomes: list[tuple[Item, Admission | Exception | ItemResult]] = [
                (item, record.results[i] if i in record.results else next(checks))
                for i, item in enumerate(record.items)
            ]
            replayed += self._enqueue(job, outcomes)
            for state in job.items:
                if state.failure is not None:
                    self._finish(state, error=state.failure)
            self._journal_total += job.journal_bytes
            if job.done and job.job_id in self._jobs:
                # Finished before the restart: retained for its results, not re-announced.
                del self._jobs[job.job_id]
                finished = record.finished if record.finished is not None else now_wall
                job.finished_at = now_mono - max(0.0, now_wall - finished)
                self._retained[job.job_id] = job
                self._retained_tokens += job.tokens
        log.info("journal_replayed", jobs=len(journaled), items_queued=replayed)
        self.prune_retained()
        self.poke()
        return replayed

    def _admit_all(self, items: list[Item]) -> list[Admission | Exception]:
        failpoints.hit("scheduler.admit")  # tests slow it to hold a submit's check open
        return [self._admit(item) for item in items]

    def _admit(self, item: Item) -> Admission | Exception:
        try:
            given = [x for x in (item.prompt, item.prompt_tokens, item.messages) if x is not None]
            if len(given) != 1:
                raise BadRequest(
                    "exactly one of `prompt`, `prompt_tokens` and `messages` must be given"
                )
            limit = self.cfg.max_new_tokens
            if item.max_new_tokens is not None and item.max_new_tokens > limit:
                raise BadRequest(
                    f"max_new_tokens {item.max_new_tokens} is over this daemon's limit {limit} "
                    "(scheduler.max_new_tokens)",
                    {"max_new_tokens": item.max_new_tokens, "limit": limit},
                )
            params = item_params(item)
            # Rendered here, on the tokenizer's side thread: the event loop never runs Jinja.
            prompt = item_prompt(self.engine, item)
            if isinstance(prompt, str):
                self._check_prompt_bytes(prompt, item.max_context)
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

    def _check_prompt_bytes(self, prompt: str, max_context: int | None) -> None:
        """Refuse a text prompt that cannot fit before spending time tokenizing it.

        A token stands for at most ``text_bytes_per_token`` bytes of text, so a
        prompt of B bytes has at least B / that many tokens: over the tightest of
        scheduler.max_prompt_tokens, the item's hard maximum and the protocol's
        bound, it is refused unread."""
        per_token = self.engine.tokenizer.text_bytes_per_token
        size = len(prompt.encode("utf-8", errors="surrogatepass"))
        at_least = -(-size // per_token)
        self.engine.refuse_over_hard_max(self.engine.hard_max_for(max_context), at_least)
        cap = self.cfg.max_prompt_tokens or (1 << 20)
        if at_least > cap:
            raise BadRequest(
                f"prompt is {size} bytes, so at least {at_least} tokens; this daemon takes at "
                f"most {cap} (scheduler.max_prompt_tokens). Shorten the prompt.",
                {
                    "prompt_bytes": size,
                    "prompt_tokens_at_least": at_least,
                    "max_prompt_tokens": cap,
                },
            )

    def list_jobs(self, caller: Caller = OPERATOR) -> list[JobInfo]:
        """The jobs ``caller`` may see, running then retained, oldest first."""
        now = time.monotonic()
        out = []
        for job in sorted(
            [*self._jobs.values(), *self._retained.values()], key=lambda j: j.created
        ):
            if caller.may_see(job.owner):
                out.append(
                    JobInfo(
                        job_id=job.job_id,
                        name=job.name,
                        owner=job.owner,
                        state="done" if job.done else "running",
                        total=len(job.items),
                        ok=job.ok,
                        failed=job.failed,
                        detached=job.detached,
                        age_seconds=round(now - job.created, 3),
                    )
                )
        return out

    def owner_of(self, job_id: str) -> str | None:
        """The owner of a job this daemon holds (running or retained); None if unknown."""
        job = self._jobs.get(job_id) or self._retained.get(job_id)
        return None if job is None else job.owner

    def find(self, job_id: str, caller: Caller = OPERATOR) -> JobState:
        """The job, if ``caller`` may see it; otherwise the same ``not_found`` an unknown
        id gets, so ids cannot be probed."""
        job = self._jobs.get(job_id) or self._retained.get(job_id)
        if job is not None and not caller.may_see(job.owner):
            job = None
        if job is None:
            raise NotFound(
                f"no job {job_id!r}: it never existed here, or its results were dropped after "
                f"jobs.retention ({self.jobs_cfg.retention:g} s), jobs.max_retained "
                f"({self.jobs_cfg.max_retained}) or jobs.max_retained_tokens "
                f"({self.jobs_cfg.max_retained_tokens})",
                {"job_id": job_id},
            )
        return job

    def attach(self, client: bytes, job_id: str, caller: Caller = OPERATOR) -> JobState:
        """Add ``client`` to the job's audience (the others keep theirs)."""
        job = self.find(job_id, caller)
        if client not in job.clients:
            job.clients.append(client)
        return job

    def detach(self, job_id: str, caller: Caller = OPERATOR) -> None:
        job = self.find(job_id, caller)
        job.detached = True
        if self.journal is not None:
            self.journal.set_detached(job_id)

    def cancel(
        self, job_id: str, reason: Exception | None = None, *, caller: Caller = OPERATOR
    ) -> JobState:
        job = self.find(job_id, caller)
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
        # A cancelled job takes no more items: it finishes once those it has end.
        self._close(job)
        jobs = self._queue.get(job.owner)
        queue = jobs.pop(job.job_id, None) if jobs is not None else None
        if jobs is not None and not jobs:
            del self._queue[job.owner]
        if queue:
            self._unqueued(job.owner, len(queue))
            for state in queue:
                self._finish(state, error=reason)
        for state in job.items:
            if state.phase not in ("done", "queued"):
                state.cancel_with = reason
        if job.done and job.job_id in self._jobs:
            self._job_done(job)  # nothing was left running
        self.poke()

    def _close(self, job: JobState) -> None:
        if job.open:
            job.open = False
            if self.journal is not None:
                self.journal.set_closed(job.job_id)

    def close_abandoned(self) -> list[str]:
        """Close the open jobs nobody is attached to that got nothing for
        ``jobs.open_timeout`` seconds (a client that died mid-file, or never came
        back after a restart): they finish with the items they have."""
        cutoff = time.monotonic() - self.jobs_cfg.open_timeout
        closed = []
        for job in list(self._jobs.values()):
            if job.open and not job.clients and job.touched < cutoff and not job.adding.locked():
                self._close(job)
                closed.append(job.job_id)
                log.warning(
                    "open_job_closed",
                    job_id=job.job_id,
                    items=len(job.items),
                    idle_seconds=self.jobs_cfg.open_timeout,
                    reason="nobody attached and nothing added",
                )
                if job.done:
                    self._job_done(job)
        if closed:
            self.poke()
        return closed

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
            # Nobody left who could free memory: waiting would never end. The
            # newest parked session makes room for the older ones: preempted
            # (decoded again later) when it can ever fit, else failed.
            victim = max(parked, key=lambda s: s.admitted_seq)
            if len(parked) > 1 and self._fits_alone(victim):
                self._preempt(victim)
                self._unpark()
            else:
                self._finish(victim, error=victim.failure or _stuck(victim))

    # -- memory arithmetic (only with an explicit kv.memory_budget) --------------------
    def _bucket_bytes(self, tokens: int, admission: Admission) -> int:
        bucket = capacity_bucket(max(tokens, 1), admission.hard_max.value, self.engine.min_bucket)
        return bucket * self.engine.kv_spec.bytes_per_token

    def _fits_alone(self, state: ItemState) -> bool:
        """Whether the item's whole decode fits the budget with no other session:
        its last bucket and the one before it (a growth holds both)."""
        total = self.engine.budget.total
        admission = state.admission
        if total is None or admission is None:
            return True
        prompt = len(admission.prompt_ids)
        first = self._bucket_bytes(prompt, admission)
        final = self._bucket_bytes(prompt + admission.sampling.max_new_tokens, admission)
        peak = final + max(first, final // 2) if final > first else final
        return peak <= total

    def _growth_reserve(self) -> int:
        """Bytes the active sessions need on top of what they hold to each make their
        next growth (growths are serialized: all the growths' net gains plus the
        largest transient old buffer)."""
        gains, largest = 0, 0
        for state in self._active:
            session = state.session
            if session is None or state.admission is None:
                continue
            now = session.kv_bytes
            gains += max(self._bucket_bytes(session.capacity + 1, state.admission) - now, 0)
            largest = max(largest, now)
        return gains + largest

    async def _admit_queued(self) -> None:
        if any(s.phase == "parked" for s in self._active):
            return  # memory is short: what a finished session frees goes to the parked
        slots = self.cfg.max_active_sessions - len(self._active)
        batch: list[ItemState] = []
        active_by = Counter(s.job.owner for s in self._active)
        budget = self.engine.budget
        metered = budget.total is not None and slots > 0 and bool(self._queue)
        need = self._growth_reserve() if metered else 0
        while slots > 0 and self._queue:
            # The owner with the fewest active sessions goes first; among equals,
            # the order rotates. Within an owner, its jobs take turns.
            owner = min(self._queue, key=lambda o: active_by[o])
            jobs = self._queue[owner]
            job_id, queue = next(iter(jobs.items()))
            state = queue[0]
            if budget.total is not None and (self._active or batch):
                admission = state.admission
                assert admission is not None
                prompt = len(admission.prompt_ids)
                first = self._bucket_bytes(prompt, admission)
                second = self._bucket_bytes(
                    capacity_bucket(prompt, None, self.engine.min_bucket) + 1, admission
                )
                if budget.used + need + first + max(second - first, 0) > budget.total:
                    break  # not enough to carry everyone to their next growth: it waits
                need += first + max(second - first, 0)
            queue.popleft()
            if queue:
                jobs.move_to_end(job_id)
            else:
                del jobs[job_id]
            if jobs:
                self._queue.move_to_end(owner)
            else:
                del self._queue[owner]
            self._unqueued(owner, 1)
            active_by[owner] += 1
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
        others_hold = [s for s in self._active if s is not state and s.session is not None]
        others_can_free = any(s.phase in ("active", "growing") for s in others_hold)
        waiting = self.cfg.on_growth_failure == "wait"
        budget_said_no = exc.details.get("cause") == "budget"
        if waiting and budget_said_no and others_hold and self._fits_alone(state):
            # The budget, not the device, said no, and others hold memory: an
            # item that fits alone is never failed for it (see the module doc).
            if others_can_free:
                state.phase = "parked"
                state.failure = exc
                log.info("session_parked", reason="budget")
            else:
                # Everyone else is parked too: the newest of all makes room.
                parked = [s for s in others_hold if s.phase == "parked"]
                self._preempt(max([*parked, state], key=lambda s: s.admitted_seq))
                if state.phase != "queued":
                    state.phase = "parked"
                    state.failure = exc
                self._unpark()
            return
        if waiting and state.retries < self.cfg.growth_retries and others_can_free:
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
            self._emit(
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
            done = state.session.completion()
            self._finish(
                state,
                result=state.make_result(
                    "ok",
                    text=done.text,
                    token_ids=done.token_ids,
                    finish_reason=done.finish_reason,
                    usage=Usage(
                        done.prompt_tokens,
                        done.completion_tokens,
                        done.prompt_tokens + done.completion_tokens,
                    ),
                    seed=done.seed,
                    logprobs=_wire_logprobs(done.logprobs),
                ),
            )

    # -- endings -------------------------------------------------------------------
    def _finish(
        self, state: ItemState, *, result: ItemResult | None = None, error: Exception | None = None
    ) -> None:
        """End an item: release its session, record and announce its result."""
        job = state.job
        freed = 0
        partial = _partial(state, error) if result is None else None
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
            result = state.make_result("error", error=info)
        state.result = result
        state.phase = "done"
        state.admission = None
        if partial is not None:
            state.result = result = partial(result)
        job.tokens += len(result.token_ids)
        if self.journal is not None:
            size = self.journal.add_result(job.job_id, result)
            job.journal_bytes += size
            self._journal_total += size
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
        self._emit(job, ItemFinished(job_id=job.job_id, result=result))
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
        job = state.job
        jobs = self._queue.setdefault(job.owner, OrderedDict())
        jobs.setdefault(job.job_id, deque()).appendleft(state)
        # Its owner and job go first next time: it is among the oldest.
        jobs.move_to_end(job.job_id, last=False)
        self._queue.move_to_end(job.owner, last=False)
        self._queued += 1
        self._queued_by[job.owner] += 1
        self.coordinator.preemptions += 1
        log.info(
            "session_preempted",
            job_id=job.job_id,
            session_id=state.session_id,
            sent_tokens=state.sent_tokens,
            preemptions=state.preemptions,
        )

    def _unqueued(self, owner: str, n: int) -> None:
        self._queued -= n
        self._queued_by[owner] -= n
        if not self._queued_by[owner]:
            del self._queued_by[owner]

    def _unpark(self) -> None:
        for state in self._active:
            if state.phase == "parked":
                state.phase = "active"
                self.coordinator.parked_retries += 1
        self.poke()

    def _job_done(self, job: JobState) -> None:
        job.finished_at = time.monotonic()
        if self.journal is not None:
            self.journal.set_finished(job.job_id, time.time())
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
        ``jobs.max_retained`` jobs, ``jobs.max_retained_tokens`` tokens or (journaled)
        ``jobs.max_journal_bytes`` (the newest stays), from memory and the journal."""
        cfg = self.jobs_cfg
        cutoff = time.monotonic() - cfg.retention
        dropped = []
        while self._retained:
            oldest = next(iter(self._retained.values()))
            expired = oldest.finished_at is not None and oldest.finished_at < cutoff
            too_many = len(self._retained) > cfg.max_retained
            several = len(self._retained) > 1
            too_big = self._retained_tokens > cfg.max_retained_tokens and several
            too_big = too_big or (self._journal_total > cfg.max_journal_bytes and several)
            if not (expired or too_many or too_big):
                break
            self._retained.popitem(last=False)
            self._retained_tokens -= oldest.tokens
            self._journal_total -= oldest.journal_bytes
            dropped.append(oldest.job_id)
        if dropped and self.journal is not None:
            self.journal.delete(dropped)

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

    def sessions(self, caller: Caller = OPERATOR) -> list[SessionInfo]:
        """The live sessions of the jobs ``caller`` may see."""
        out = []
        for state in self._active:
            session = state.session
            if session is None or not caller.may_see(state.job.owner):
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


_ENCODER = msgspec.msgpack.Encoder()
_FAILURE_CODES = frozenset(
    {"kv_capacity_exceeded", "kv_growth_failed", "run_failed", "internal", "shutdown"}
)


def item_params(item: Item) -> SamplingParams:
    """What a wire item asks the sampler for (``None``: the model's default)."""
    return SamplingParams(
        max_new_tokens=item.max_new_tokens,
        temperature=item.temperature,
        top_k=item.top_k,
        top_p=item.top_p,
        seed=item.seed,
        stop=tuple(item.stop),
        ignore_eos=item.ignore_eos,
        min_new_tokens=item.min_new_tokens,
        min_p=item.min_p,
        repetition_penalty=item.repetition_penalty,
        presence_penalty=item.presence_penalty,
        frequency_penalty=item.frequency_penalty,
        stop_token_ids=tuple(item.stop_token_ids),
        logprobs=item.logprobs,
        skip_special_tokens=item.skip_special_tokens,
    )


def item_prompt(engine: Engine, item: Item) -> str | list[int]:
    """A wire item's prompt for the engine: its text, its token ids, or its chat
    messages rendered with the model's template."""
    if item.messages is not None:
        return engine.render_chat([msgspec.structs.asdict(m) for m in item.messages])
    if item.prompt is not None:
        return item.prompt
    return list(item.prompt_tokens or [])


def _with_seed(item: Item, check: Admission | Exception) -> Item:
    """The item as journaled: a sampled item gets the seed the daemon chose for it."""
    if isinstance(check, Admission) and item.seed is None and not check.sampling.greedy:
        return msgspec.structs.replace(item, seed=check.sampling.seed)
    return item


def _partial(
    state: ItemState, error: Exception | None
) -> Callable[[ItemResult], ItemResult] | None:
    """For an item stopped mid-decode (cancelled, shut down): what puts the text and
    tokens it had produced into its error result, marked ``partial``."""
    session = state.session
    if session is None or not isinstance(error, Cancelled | ShuttingDown) or not session.generated:
        return None
    session.stream.finish()  # what the decoder held back (a partial character) too
    text, token_ids = session.stream.text, list(session.generated)

    def keep(result: ItemResult) -> ItemResult:
        error = result.error
        if error is not None:
            error = msgspec.structs.replace(error, details={**error.details, "partial": True})
        return msgspec.structs.replace(result, text=text, token_ids=token_ids, error=error)

    return keep


def _wire_logprobs(logprobs: list[TokenLogprobs] | None) -> list[TokenLogprob] | None:
    if logprobs is None:
        return None
    return [
        TokenLogprob(e.token_id, e.token, e.logprob, [TopLogprob(*t) for t in e.top])
        for e in logprobs
    ]


def _stuck(state: ItemState) -> Exception:
    return GrowthFailed(
        "KV growth could not proceed: every session is waiting for memory and none can free any",
        {"session_id": state.session_id, "session_unchanged": True},
    )
