"""The service both fronts call: submit, add items, attach an event sink, page results,
cancel, detach, list, status. It knows nothing of ZeroMQ or HTTP.

A front turns what its clients send into these calls and what they return (or
raise: always a typed :class:`~kvmux.client.errors.KvmuxError`) into its own
replies. Job events reach a front through the :class:`Sink` it passed in: a
ZeroMQ connection, an HTTP stream, the batch runner. Every call names the
:class:`~kvmux.daemon.access.Caller`, so ownership is checked here, once, for
every front alike; an id the caller may not see is ``not_found``, exactly as
one that never existed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Literal

from kvmux.client import protocol as p
from kvmux.client.errors import NotReady

from .access import Caller
from .budget import RequestBudget
from .scheduler import JobState, Scheduler, Sink

Format = Literal["kvmux", "openai"]
__all__ = ["Format", "Service", "Sink"]


class Service:
    """The daemon's work, as the fronts may ask for it."""

    def __init__(
        self,
        *,
        budget: RequestBudget,
        hello: Callable[[], p.Welcome],
        status: Callable[[Caller], p.DaemonStatus],
    ) -> None:
        self.budget = budget
        self._hello = hello
        self._status = status
        self._scheduler: Scheduler | None = None

    def ready(self, scheduler: Scheduler) -> None:
        """The model is loaded and the journal replayed: jobs may come."""
        self._scheduler = scheduler

    @property
    def scheduler(self) -> Scheduler:
        """The scheduler; ``not_ready`` while the model loads."""
        if self._scheduler is None:
            raise NotReady(
                "kvmuxd is still loading its model; retry shortly (`kvmux status --wait` "
                "waits until it is ready)"
            )
        return self._scheduler

    # -- jobs ------------------------------------------------------------------------
    async def submit(
        self,
        sink: Sink,
        items: list[p.Item],
        *,
        caller: Caller,
        rejected: Iterable[p.Rejected] = (),
        detach: bool = False,
        name: str = "",
        format: Format = "kvmux",
        more: bool = False,
        still_wanted: Callable[[], bool] | None = None,
        transient: bool = False,
        stream: bool = True,
    ) -> JobState | None:
        """A new job owned by ``caller``, its events to ``sink``. Whole-job refusals
        raise; an invalid item fails alone. ``more`` keeps it open for
        :meth:`add_items`. None if ``still_wanted`` says, once the items are checked,
        that the client is gone. A ``transient`` job (one HTTP request's) is neither
        journaled nor retained once done: nobody could come back for it. ``stream``:
        whether ``sink`` takes token updates."""
        return await self.scheduler.submit(
            sink,
            items,
            caller=caller,
            rejected=list(rejected),
            detach=detach,
            name=name,
            format=format,
            more=more,
            still_wanted=still_wanted,
            transient=transient,
            stream=stream,
        )

    async def add_items(
        self,
        sink: Sink,
        job_id: str,
        items: list[p.Item],
        *,
        caller: Caller,
        rejected: Iterable[p.Rejected] = (),
        last: bool = False,
    ) -> JobState:
        """More items for an open job (``overloaded`` when they do not fit the queue now:
        the same call may be made again later); ``last`` closes it."""
        return await self.scheduler.add_items(
            sink, job_id, items, caller=caller, rejected=list(rejected), last=last
        )

    def attach(self, sink: Sink, job_id: str, *, caller: Caller, stream: bool = True) -> JobState:
        """Add ``sink`` to the job's audience: its events from now on (token updates
        only with ``stream``)."""
        return self.scheduler.jobs.attach(sink, job_id, caller, stream=stream)

    def find(self, job_id: str, *, caller: Caller) -> JobState:
        return self.scheduler.jobs.find(job_id, caller)

    def results_page(
        self, job_id: str, start: int, offset: int = 0, *, caller: Caller, request_id: int = 0
    ) -> p.ResultsPage:
        """One bounded page of the job's finished results from item ``start`` on."""
        job = self.find(job_id, caller=caller)
        return job.results_page(start, offset, request_id=request_id)

    def cancel(self, job_id: str, *, caller: Caller, reason: Exception | None = None) -> JobState:
        return self.scheduler.cancel(job_id, reason, caller=caller)

    def detach(self, job_id: str, *, caller: Caller) -> None:
        self.scheduler.jobs.detach(job_id, caller)

    def list_jobs(self, *, caller: Caller, start: int = 0) -> tuple[list[p.JobInfo], int | None]:
        return self.scheduler.jobs.list_jobs(caller, start)

    def sink_gone(self, sink: Sink, why: str, reason: str) -> list[str]:
        """A client (connection, stream) is gone: the jobs it alone attended, not
        detached, are cancelled. Returns their ids."""
        if self._scheduler is None:  # still loading: no jobs yet
            return []
        return self._scheduler.client_gone(sink, why, reason)

    def owner_of(self, job_id: str) -> str | None:
        return None if self._scheduler is None else self._scheduler.jobs.owner_of(job_id)

    def log_filter(
        self, caller: Caller, job_id: str | None
    ) -> Callable[[dict[str, Any]], bool] | None:
        """Which log events ``caller`` may see (None: all): only those of its own jobs,
        the rest names other people's jobs, clients and prompts' sizes. ``job_id``, if
        given, must be one of the caller's (``not_found`` otherwise: following it would
        wait forever for events that never come)."""
        if job_id is not None:
            self.find(job_id, caller=caller)
        if caller.operator:
            return None
        owner = caller.owner

        def visible(event: dict[str, Any]) -> bool:
            job = event.get("job_id")
            return isinstance(job, str) and self.owner_of(job) == owner

        return visible

    # -- the daemon ---------------------------------------------------------------
    def hello(self) -> p.Welcome:
        return self._hello()

    def status(self, caller: Caller) -> p.DaemonStatus:
        return self._status(caller)

    def housekeeping(self) -> None:
        """What runs about once a second: open jobs nobody attends are closed, finished
        jobs past their retention dropped, idle owners' budgets forgotten."""
        self.budget.prune()
        if self._scheduler is not None:
            self._scheduler.close_abandoned()
            self._scheduler.jobs.prune_retained()
