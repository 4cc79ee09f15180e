"""The scheduler's front door: what the server (and a restart) ask of the loop.

Every request that changes what the loop runs — a submit, an addition, a
cancel, a client gone — lands here and touches no running session: it queues,
or marks what the loop acts on between turns. A job is acknowledged only once
the journal holds it, so a crash loses nothing a client was told was taken."""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import secrets
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Literal

import structlog

from kvmux.client.errors import BadRequest, Cancelled, Overloaded, ShuttingDown, StorageFull
from kvmux.client.protocol import Item, ItemFinished, ItemResult, Rejected, SessionInfo

from ..access import OPERATOR, Caller
from ..engine import Admission
from ..journal import JournaledJob, JournalFull
from ._admission import (
    Admitter,
    check_message,
    check_open,
    check_open_share,
    journaled,
    rejected_results,
)
from ._jobs import ItemState, JobState, Sink, encoded_size
from ._loop import TurnLoop

log = structlog.get_logger("kvmux.scheduler")


class Scheduler(TurnLoop):
    """Owns jobs, the bounded queue, the active set and the loop that runs them."""

    @functools.cached_property
    def admitter(self) -> Admitter:
        """The admission checks: only what comes in through this door needs them."""
        return Admitter(self.engine, self.cfg)

    async def submit(
        self,
        client: Sink,
        items: list[Item],
        *,
        caller: Caller = OPERATOR,
        rejected: Sequence[Rejected] = (),
        detach: bool = False,
        name: str = "",
        format: Literal["kvmux", "openai"] = "kvmux",
        more: bool = False,
        still_wanted: Callable[[], bool] | None = None,
        transient: bool = False,
        stream: bool = True,
    ) -> JobState | None:
        """Validate and enqueue a job. Whole-job refusals raise; a bad item fails alone.

        With ``more`` the job stays open for :meth:`add_items`. None if
        ``still_wanted`` says, once the items are checked, that the client is gone:
        a job nobody can learn the id of is never started. A ``transient`` job is
        neither journaled nor retained once done. ``stream``: whether ``client``
        takes token updates."""
        if self.draining:
            raise ShuttingDown("kvmuxd is shutting down and admits no new jobs")
        if not items and not rejected and not more:
            raise BadRequest("a job needs at least one item (or `more` to add them later)")
        owner = caller.owner
        if more:
            check_open_share(self.jobs, owner)
        check_message(self.cfg, len(items), len(rejected), 0)
        checks = await self._check_items(items, owner)
        if still_wanted is not None and not still_wanted():
            log.info(
                "job_dropped",
                owner=owner,
                items=len(items),
                reason="client gone before it started",
            )
            return None
        job = JobState(
            job_id=secrets.token_hex(6),
            clients=[client],
            streams=[client] if stream else [],
            detached=detach,
            name=name,
            owner=owner,
            open=more,
            format=format,
            transient=transient,
        )
        refused = rejected_results(len(items), rejected)
        if self.journal is not None and not transient:
            # Written before it is acknowledged; sampled items with the seed the
            # daemon chose, so a replay after a crash draws the same tokens.
            wire = journaled(items, checks, rejected)
            await self._journal_write(
                job,
                wire,
                self.journal.add_job(
                    job.job_id,
                    owner,
                    name,
                    detach,
                    wire,
                    results=refused,
                    format=format,
                    open=more,
                ),
            )
        self.jobs.live[job.job_id] = job
        self._append(job, items, checks, refused)
        log.info(
            "job_accepted",
            job_id=job.job_id,
            items=len(items),
            queued=sum(1 for s in job.items if s.phase == "queued" and s.failure is None),
            refused=sum(1 for s in job.items if s.failure is not None) + len(refused),
            detached=job.detached,
            open=job.open,
        )
        return job

    async def add_items(
        self,
        client: Sink,
        job_id: str,
        items: list[Item],
        *,
        caller: Caller = OPERATOR,
        rejected: Sequence[Rejected] = (),
        last: bool = False,
    ) -> JobState:
        """Append items (and rejected lines) to an open job; ``last`` closes it.

        Refused whole (``overloaded``) when the items do not fit the queue now:
        the caller sends the same message again later. Items are numbered in
        arrival order."""
        job = self.jobs.find(job_id, caller)
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
            check_open(job)
            check_message(self.cfg, len(items), len(rejected), len(job.items))
            checks = await self._check_items(items, job.owner)
            check_open(job)  # cancelled, or closed for want of a client, meanwhile
            start = len(job.items)
            refused = rejected_results(start + len(items), rejected)
            if self.journal is not None and not job.transient:
                wire = journaled(items, checks, rejected)
                await self._journal_write(
                    job,
                    wire,
                    self.journal.add_items(job.job_id, start, wire, results=refused, close=last),
                )
                check_open(job)
            job.touched = time.monotonic()
            if last:
                job.open = False
            self._append(job, items, checks, refused)
            log.info(
                "job_items_added",
                job_id=job.job_id,
                items=len(items),
                rejected=len(rejected),
                total=len(job.items),
                last=last,
            )
            return job

    async def _check_items(self, items: list[Item], owner: str) -> list[Admission | Exception]:
        # The queue drains about as fast as the active sessions finish items: a
        # hint, not a promise, for when to send the same request again.
        retry_after = round(min(2.0, max(0.05, 20 * self._step_seconds)), 3)
        checks = await self.admitter.check(items, owner, self.queue, retry_after)
        if items and self.draining:  # the stop began while the items were being checked
            raise ShuttingDown("kvmuxd is shutting down and admits no new items")
        return checks

    async def _journal_write(
        self, job: JobState, wire: list[Item], pending: concurrent.futures.Future[None]
    ) -> None:
        """Wait for a submit's or an addition's commit (nothing is acknowledged before)."""
        assert self.journal is not None
        self.jobs.charge(job, sum(encoded_size(item) for item in wire))
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
            if self.journal is not None and not job.transient:
                self.jobs.charge(job, encoded_size(result))
            self.finished_by_code["bad_request"] += 1
            self.outbox.emit(job, ItemFinished(job_id=job.job_id, result=result))
        if job.done and job.job_id in self.jobs.live:
            self._job_done(job)
        self.poke()

    def _enqueue(
        self, job: JobState, items: list[tuple[Item, Admission | Exception | ItemResult]]
    ) -> int:
        """Register ``job`` with more items (after those it has): admitted ones queued in
        order, refused ones marked to fail, finished ones (from a journal) done. Returns
        how many queued."""
        self.jobs.live[job.job_id] = job
        queue: deque[ItemState] = deque()
        for index, (item, outcome) in enumerate(items, len(job.items)):
            state = ItemState(
                job,
                index,
                item.custom_id,
                line=item.line,
                choice=item.choice,
                choices=item.choices,
                n=item.n,
                chat=item.messages is not None,
                tool_mode=item.tool_mode,
            )
            job.items.append(state)
            if isinstance(outcome, Admission):
                state.admission = outcome
                queue.append(state)
            elif isinstance(outcome, ItemResult):
                state.result, state.phase = outcome, "done"
                job.tokens += len(outcome.token_ids)
                state.result_bytes = encoded_size(outcome)
                job.journal_bytes += state.result_bytes
                if outcome.status == "ok":
                    job.ok += 1
                else:
                    job.failed += 1
            else:
                state.failure = outcome
        if queue:
            self.queue.extend(job, queue)
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
            job.journal_bytes = sum(encoded_size(i) for i in record.items)
            pending = [item for i, item in enumerate(record.items) if i not in record.results]
            checks = iter(await self.admitter.admit_items(pending))
            outcomes: list[tuple[Item, Admission | Exception | ItemResult]] = [
                (item, record.results[i] if i in record.results else next(checks))
                for i, item in enumerate(record.items)
            ]
            replayed += self._enqueue(job, outcomes)
            for state in job.items:
                if state.failure is not None:
                    self._finish(state, error=state.failure)
            self.jobs.journal_total += job.journal_bytes
            if job.done and job.job_id in self.jobs.live:
                # Finished before the restart: retained for its results, not re-announced.
                finished = record.finished if record.finished is not None else now_wall
                self.jobs.keep_finished(job, now_mono - max(0.0, now_wall - finished))
        log.info("journal_replayed", jobs=len(journaled), items_queued=replayed)
        self.jobs.prune_retained()
        self.poke()
        return replayed

    # -- the job table ------------------------------------------------------------
    def close_abandoned(self) -> list[str]:
        """Close the open jobs nobody attends (see :meth:`JobTable.close_abandoned`)."""
        closed = self.jobs.close_abandoned()
        for job in closed:
            if job.done:
                self._job_done(job)
        if closed:
            self.poke()
        return [job.job_id for job in closed]

    # -- cancelling ------------------------------------------------------------------
    def cancel(
        self, job_id: str, reason: Exception | None = None, *, caller: Caller = OPERATOR
    ) -> JobState:
        job = self.jobs.find(job_id, caller)
        self._cancel_job(job, reason or Cancelled("cancelled by request", {"job_id": job_id}))
        return job

    def client_gone(self, client: Sink, why: str, reason: str) -> list[str]:
        """Forget a client that left or stopped heartbeating; cancel the jobs (not
        detached) that nobody else is attached to."""
        gone = []
        for job in self.jobs.live.values():
            if client in job.streams:
                job.streams.remove(client)
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

    def cancel_all(self, reason: Exception, *, transient_only: bool = False) -> None:
        for job in list(self.jobs.live.values()):
            if job.transient or not transient_only:
                self._cancel_job(job, reason)

    def _cancel_job(self, job: JobState, reason: Exception) -> None:
        # A cancelled job takes no more items: it finishes once those it has end.
        self.jobs.close(job)
        for state in self.queue.drop(job):
            self._finish(state, error=reason)
        for state in job.items:
            if state.phase not in ("done", "queued"):
                state.cancel_with = reason
        if job.done and job.job_id in self.jobs.live:
            self._job_done(job)  # nothing was left running
        self.poke()

    # -- status ----------------------------------------------------------------------
    @property
    def idle(self) -> bool:
        return not self.jobs.live

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
