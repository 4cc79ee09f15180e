"""The job table. Jobs outlive their sessions: a finished job is retained for
its results, within ``jobs.retention``, ``jobs.max_retained``,
``jobs.max_retained_tokens`` and ``jobs.max_journal_bytes``. Every lookup
answers an unknown id and a job the caller may not see alike, so ids cannot
be probed."""

from __future__ import annotations

import itertools
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, NamedTuple, Protocol

import anyio
import msgspec
import structlog

from kvmux.client.errors import BadRequest, NotFound
from kvmux.client.protocol import (
    PART_BYTES,
    Event,
    ItemResult,
    JobInfo,
    ResultPart,
    ResultsPage,
    ToolMode,
)

from ..access import OPERATOR, Caller
from ..config import JobsConfig
from ..engine import Admission, DecodeSession
from ..journal import Journal

if TYPE_CHECKING:
    from ._prefix import ItemPrefix

log = structlog.get_logger("kvmux.scheduler")


class Sink(Protocol):
    """Where a job's events go: a connection, a stream (see :mod:`kvmux.daemon.service`)."""

    def deliver(self, events: list[Event]) -> None: ...


# "waiting": admitted, holding no KV yet, until another item's prefill of its
# prompt's prefix is done (then it starts on a copy of it).
Phase = Literal["queued", "opening", "waiting", "active", "growing", "parked", "failing", "done"]

_ENCODER = msgspec.msgpack.Encoder()


def encoded_size(message: msgspec.Struct) -> int:
    """About what ``message`` takes in the journal (its msgpack encoding)."""
    return len(_ENCODER.encode(message))


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
    n: int = 1
    chat: bool = False
    tool_mode: ToolMode | None = None
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
    # Its result's encoded size, once known (the journal measures it as it writes).
    result_bytes: int = 0
    # Its prompt as the prefix cache matches it, and its part in the cache while it runs.
    prefix: ItemPrefix | None = None

    def result_size(self) -> int:
        if not self.result_bytes and self.result is not None:
            self.result_bytes = encoded_size(self.result)
        return self.result_bytes

    @property
    def session_id(self) -> str:
        return f"{self.job.job_id}/{self.index}"


class Page(NamedTuple):
    """One bounded page of a job's results: whole results, or a part of one too large
    for a page; where the next page starts (``next`` None: nothing finished beyond)."""

    results: list[ItemResult]
    part: ResultPart | None
    next: int | None
    next_offset: int = 0


@dataclass(eq=False)
class JobState:
    """A submitted batch: its items, who owns it, and its tally."""

    job_id: str
    # The clients its events go to: the submitter, then whoever attached. A job
    # not detached is cancelled when the last of them is gone.
    clients: list[Sink]
    detached: bool
    name: str
    owner: str  # who may see and act on it (see kvmux.daemon.access)
    items: list[ItemState] = field(default_factory=list)
    # Those of its clients that take token updates (Submit/Attach ``stream``). While
    # there are none, no update is built and the items' text is decoded at their end.
    streams: list[Sink] = field(default_factory=list)
    # Takes more items (AddItems) until closed; it finishes only once closed.
    open: bool = False
    # One HTTP request's: neither journaled nor retained once done (nobody could
    # come back for it after the connection is gone).
    transient: bool = False
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
    # The encoding of the one result whose parts are being fetched: (index, bytes).
    _encoded: tuple[int, bytes] | None = None

    @property
    def done(self) -> bool:
        return not self.open and self.ok + self.failed == len(self.items)

    def results(self) -> list[ItemResult]:
        return [it.result for it in self.items if it.result is not None]

    def results_page(
        self, start: int, offset: int = 0, *, request_id: int = 0, max_bytes: int = PART_BYTES
    ) -> ResultsPage:
        """The reply to ``results``: finished results from item ``start`` on, at most
        ``max_bytes`` encoded.

        A result larger than that comes alone, in parts: ``offset`` is the byte of
        its encoding the part starts at, and the page says where the next part (or
        the next page) starts."""
        page = self._page(start, offset, max_bytes)
        return ResultsPage(
            id=request_id,
            job_id=self.job_id,
            total=len(self.items),
            done=self.done,
            results=page.results,
            next=page.next,
            part=page.part,
            next_offset=page.next_offset,
        )

    def _page(self, start: int, offset: int, max_bytes: int) -> Page:
        if offset:
            return self._part(start, offset, max_bytes)
        page: list[ItemResult] = []
        size = 0
        for state in itertools.islice(self.items, start, None):
            if state.result is None:
                continue
            n = state.result_size()
            if n > max_bytes:
                if page:
                    return Page(page, None, state.index)
                return self._part(state.index, 0, max_bytes)
            if size + n > max_bytes:
                return Page(page, None, state.index)
            page.append(state.result)
            size += n
        return Page(page, None, None)

    def _part(self, index: int, offset: int, max_bytes: int) -> Page:
        state = self.items[index] if 0 <= index < len(self.items) else None
        if state is None or state.result is None or offset >= state.result_size():
            raise BadRequest(
                f"no part at byte {offset} of result {index} of job {self.job_id}: ask for "
                "the `start` and `offset` the previous page named",
                {"job_id": self.job_id, "start": index, "offset": offset},
            )
        cached = self._encoded
        if cached is None or cached[0] != index:
            # Its parts are asked for one after another: encoded once for all of them.
            cached = self._encoded = (index, _ENCODER.encode(state.result))
        data = cached[1]
        chunk = data[offset : offset + max_bytes]
        end = offset + len(chunk)
        part = ResultPart(index=index, offset=offset, size=len(data), data=chunk)
        if end < len(data):
            return Page([], part, index, end)
        self._encoded = None
        rest = itertools.islice(self.items, index + 1, None)
        later = next((s.index for s in rest if s.result is not None), None)
        return Page([], part, later)


class JobTable:
    """The running jobs, the finished ones retained for their results, and what
    both take in the journal."""

    def __init__(self, cfg: JobsConfig) -> None:
        self.cfg = cfg
        self.live: dict[str, JobState] = {}
        self.retained: OrderedDict[str, JobState] = OrderedDict()
        self.retained_tokens = 0
        self.journal: Journal | None = None
        self.journal_total = 0
        # Jobs retention must not drop yet: a batch's, until its files are written.
        self.pinned: set[str] = set()

    def charge(self, job: JobState, size: int) -> None:
        """Count ``size`` journal bytes to ``job`` (and so to the retention bound)."""
        job.journal_bytes += size
        self.journal_total += size

    def list_jobs(
        self, caller: Caller = OPERATOR, start: int = 0, max_bytes: int = PART_BYTES
    ) -> tuple[list[JobInfo], int | None]:
        """The jobs ``caller`` may see, running then retained, oldest first: a page of at
        most ``max_bytes`` encoded from the ``start``-th on, and where the next starts."""
        now = time.monotonic()
        jobs = sorted([*self.live.values(), *self.retained.values()], key=lambda j: j.created)
        visible = [job for job in jobs if caller.may_see(job.owner)]
        out: list[JobInfo] = []
        size = 0
        for at, job in enumerate(visible[start:], start):
            info = JobInfo(
                job_id=job.job_id,
                name=job.name,
                owner=job.owner,
                state="done" if job.done else "running",
                total=len(job.items),
                ok=job.ok,
                failed=job.failed,
                detached=job.detached,
                age_seconds=round(now - job.created, 3),
                open=job.open,
            )
            size += encoded_size(info)
            if out and size > max_bytes:
                return out, at
            out.append(info)
        return out, None

    def owner_of(self, job_id: str) -> str | None:
        """The owner of a job this daemon holds (running or retained); None if unknown."""
        job = self.live.get(job_id) or self.retained.get(job_id)
        return None if job is None else job.owner

    def find(self, job_id: str, caller: Caller = OPERATOR) -> JobState:
        """The job, if ``caller`` may see it; otherwise the same ``not_found`` an unknown
        id gets, so ids cannot be probed."""
        job = self.live.get(job_id) or self.retained.get(job_id)
        if job is not None and not caller.may_see(job.owner):
            job = None
        if job is None:
            raise NotFound(
                f"no job {job_id!r}: it never existed here, or its results were dropped after "
                f"jobs.retention ({self.cfg.retention:g} s), jobs.max_retained "
                f"({self.cfg.max_retained}) or jobs.max_retained_tokens "
                f"({self.cfg.max_retained_tokens})",
                {"job_id": job_id},
            )
        return job

    def attach(
        self, client: Sink, job_id: str, caller: Caller = OPERATOR, *, stream: bool = True
    ) -> JobState:
        """Add ``client`` to the job's audience (the others keep theirs); ``stream``:
        whether it takes token updates (attaching again changes that)."""
        job = self.find(job_id, caller)
        if client not in job.clients:
            job.clients.append(client)
        if client in job.streams and not stream:
            job.streams.remove(client)
        elif stream and client not in job.streams:
            job.streams.append(client)
        return job

    def detach(self, job_id: str, caller: Caller = OPERATOR) -> None:
        job = self.find(job_id, caller)
        job.detached = True
        if self.journal is not None and not job.transient:
            self.journal.set_detached(job_id)

    def close(self, job: JobState) -> None:
        if job.open:
            job.open = False
            if self.journal is not None and not job.transient:
                self.journal.set_closed(job.job_id)

    def close_abandoned(self) -> list[JobState]:
        """Close the open jobs nobody is attached to that got nothing for
        ``jobs.open_timeout`` seconds (a client that died mid-file, or never came
        back after a restart): they finish with the items they have."""
        cutoff = time.monotonic() - self.cfg.open_timeout
        closed = []
        for job in list(self.live.values()):
            if job.open and not job.clients and job.touched < cutoff and not job.adding.locked():
                self.close(job)
                closed.append(job)
                log.warning(
                    "open_job_closed",
                    job_id=job.job_id,
                    items=len(job.items),
                    idle_seconds=self.cfg.open_timeout,
                    reason="nobody attached and nothing added",
                )
        return closed

    def retire(self, job: JobState) -> None:
        """Keep a job that just finished for its results (a transient one is dropped)."""
        if job.transient:
            self.live.pop(job.job_id, None)
            return
        if self.journal is not None:
            self.journal.set_finished(job.job_id, time.time())
        self.keep_finished(job, time.monotonic())
        self.prune_retained()

    def keep_finished(self, job: JobState, finished_at: float) -> None:
        """Move a finished job from the running to the retained (``finished_at``: monotonic)."""
        job.finished_at = finished_at
        self.live.pop(job.job_id, None)
        self.retained[job.job_id] = job
        self.retained_tokens += job.tokens

    def prune_retained(self) -> None:
        """Drop the oldest finished jobs past ``jobs.retention`` seconds, beyond
        ``jobs.max_retained`` jobs, ``jobs.max_retained_tokens`` tokens or (journaled)
        ``jobs.max_journal_bytes`` (the newest stays, and so do pinned jobs), from memory
        and the journal."""
        cfg = self.cfg
        cutoff = time.monotonic() - cfg.retention
        dropped = []
        while self.retained:
            oldest = next((j for j in self.retained.values() if j.job_id not in self.pinned), None)
            if oldest is None:
                break
            expired = oldest.finished_at is not None and oldest.finished_at < cutoff
            too_many = len(self.retained) > cfg.max_retained
            several = len(self.retained) > 1
            too_big = self.retained_tokens > cfg.max_retained_tokens and several
            too_big = too_big or (self.journal_total > cfg.max_journal_bytes and several)
            if not (expired or too_many or too_big):
                break
            del self.retained[oldest.job_id]
            self.retained_tokens -= oldest.tokens
            self.journal_total -= oldest.journal_bytes
            dropped.append(oldest.job_id)
        if dropped and self.journal is not None:
            self.journal.delete(dropped)
