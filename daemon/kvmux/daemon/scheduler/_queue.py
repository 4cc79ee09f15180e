"""The queue of items waiting for a session, kept per owner and then per job so
that both levels can take turns: neither a big job nor a big user starves anyone."""

from __future__ import annotations

from collections import Counter, OrderedDict, deque
from collections.abc import Mapping

from ._jobs import ItemState, JobState


class FairQueue:
    """Queued items by owner, then by job, in arrival order within a job."""

    def __init__(self) -> None:
        # owner -> job id -> that job's queued items; both levels round-robin.
        self._owners: OrderedDict[str, OrderedDict[str, deque[ItemState]]] = OrderedDict()
        self.queued = 0
        self.by_owner: Counter[str] = Counter()  # per owner, submits being checked included
        self.reserved = 0  # slots held by submits still being validated

    def __bool__(self) -> bool:
        return bool(self._owners)

    def extend(self, job: JobState, states: deque[ItemState]) -> None:
        """Queue ``states`` behind what ``job`` already has queued."""
        jobs = self._owners.setdefault(job.owner, OrderedDict())
        if job.job_id in jobs:
            jobs[job.job_id].extend(states)
        else:
            jobs[job.job_id] = states
        self._queued(job.owner, len(states))

    def push_front(self, state: ItemState) -> None:
        """Queue ``state`` before everything: its owner and job go first next time."""
        job = state.job
        jobs = self._owners.setdefault(job.owner, OrderedDict())
        jobs.setdefault(job.job_id, deque()).appendleft(state)
        jobs.move_to_end(job.job_id, last=False)
        self._owners.move_to_end(job.owner, last=False)
        self._queued(job.owner, 1)

    def drop(self, job: JobState) -> deque[ItemState]:
        """Take all of ``job``'s queued items out of the queue."""
        jobs = self._owners.get(job.owner)
        queue = jobs.pop(job.job_id, None) if jobs is not None else None
        if jobs is not None and not jobs:
            del self._owners[job.owner]
        if not queue:
            return deque()
        self._unqueued(job.owner, len(queue))
        return queue

    def head(self, active_by: Mapping[str, int]) -> ItemState:
        """The next item: the owner with the fewest active sessions goes first; among
        equals, the order rotates. Within an owner, its jobs take turns."""
        owner = min(self._owners, key=lambda o: active_by.get(o, 0))
        return next(iter(self._owners[owner].values()))[0]

    def take(self, state: ItemState) -> None:
        """Remove the :meth:`head` ``state``; its job and owner go to the back."""
        owner, job_id = state.job.owner, state.job.job_id
        jobs = self._owners[owner]
        queue = jobs[job_id]
        queue.popleft()
        if queue:
            jobs.move_to_end(job_id)
        else:
            del jobs[job_id]
        if jobs:
            self._owners.move_to_end(owner)
        else:
            del self._owners[owner]
        self._unqueued(owner, 1)

    def reserve(self, owner: str, n: int) -> None:
        """Hold ``n`` slots for items still being checked."""
        self.reserved += n
        self.by_owner[owner] += n

    def unreserve(self, owner: str, n: int) -> None:
        self.reserved -= n
        self.by_owner[owner] -= n

    def _queued(self, owner: str, n: int) -> None:
        self.queued += n
        self.by_owner[owner] += n

    def _unqueued(self, owner: str, n: int) -> None:
        self.queued -= n
        self.by_owner[owner] -= n
        if not self.by_owner[owner]:
            del self.by_owner[owner]
