"""The async Python client: connect, submit jobs, stream their events, cancel, status, logs."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import (
    AsyncGenerator,
    AsyncIterator,
    Callable,
    Iterable,
    Iterator,
)
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Literal, Protocol

import msgspec
import zmq
import zmq.asyncio

from . import protocol as p
from .curve import CurveKeys, curve_from_env
from .endpoint import client_default_endpoint, http_server_at, ipc_path
from .errors import BadRequest, DaemonUnreachable, KvmuxError, Overloaded, error_from_info

# A daemon silent for this many heartbeat intervals is taken as gone.
_SILENT_INTERVALS = 5
# What a message holds besides its items (op, id, job id, flags), with room to spare.
_ENVELOPE_BYTES = 1024
# Waiting for queue room: the first pause when the daemon gives no hint, the longest one.
_BACKOFF_FIRST = 0.05
_BACKOFF_MAX = 2.0
# How long one request waits out refusals for want of request budget, all told.
BUDGET_WAIT = 60.0
_decode_result = msgspec.msgpack.Decoder(p.ItemResult).decode

Format = Literal["kvmux", "openai"]


class Job:
    """A submitted (or re-attached) job: iterate its events, or wait for its results.

    Results are kept by item index as they finish (unless ``keep_results`` is
    False: then each lives only until its event is consumed, for a caller that
    streams them elsewhere). If the event stream ever misses one (the daemon
    dropped a message to a slow client), or the job was attached after some
    items finished, :meth:`results` fetches the rest from the daemon a page at
    a time, so no result is lost.

    An open job (submitted with ``more=True``) takes more items with
    :meth:`add` or :meth:`add_all` until one with ``last=True``; ``total``
    counts what it holds so far. ``format`` is how its results are meant to be
    written out, as its submitter said.
    """

    def __init__(
        self,
        client: Client,
        job_id: str,
        total: int,
        *,
        format: Format = "kvmux",
        keep_results: bool = True,
    ) -> None:
        self.client = client
        self.job_id = job_id
        self.total = total
        self.format: Format = format
        self.keep_results = keep_results
        self.results_by_index: dict[int, p.ItemResult] = {}
        self.finished = False
        self._queue: asyncio.Queue[p.Event | KvmuxError] = asyncio.Queue()
        # Results too large for one message, as their parts arrive (by item index).
        self._parts: dict[int, bytearray] = {}

    def _push(self, event: p.Event | KvmuxError) -> None:
        if isinstance(event, p.ItemFinishedPart):
            joined = _join(self._parts, event.index, event.offset, event.size, event.data)
            if joined is None:
                return
            event = p.ItemFinished(job_id=event.job_id, result=joined)
        if isinstance(event, p.ItemFinished) and self.keep_results:
            self.results_by_index[event.result.index] = event.result
        elif isinstance(event, p.JobFinished):
            self.total = event.total
        self._queue.put_nowait(event)

    async def add(
        self,
        items: Iterable[p.Item] = (),
        rejected: Iterable[p.Rejected] = (),
        *,
        last: bool = False,
    ) -> int:
        """Add items (and lines that could not be parsed) to this open job; ``last``
        closes it. Returns the job's total. :class:`Overloaded` when the daemon's
        queue has no room for them now: send them again later (:meth:`add_all`
        does)."""
        return await self._add(_checked(items), list(rejected), last)

    async def _add(self, items: list[p.Item], rejected: list[p.Rejected], last: bool) -> int:
        reply = await self.client._request(
            p.AddItems(id=0, job_id=self.job_id, items=items, rejected=rejected, last=last)
        )
        assert isinstance(reply, p.Added)
        self.total = reply.total
        return reply.total

    async def add_all(
        self,
        entries: Iterable[p.Item | Refusal],
        *,
        on_wait: Callable[[float], None] | None = None,
        on_added: Callable[[Chunk, int], None] | None = None,
    ) -> int:
        """Send every entry (items, and refused lines as :class:`Refusal`-likes) in
        messages within the daemon's limits, waiting out ``overloaded``, then close the
        job. Returns its total. See :class:`Feeder` for the callbacks."""
        feeder = Feeder(entries, self.client)
        await feeder.run(self, on_wait=on_wait, on_added=on_added)
        return self.total

    async def result_pages(self, start: int = 0) -> AsyncIterator[p.ItemResult]:
        """Every result the daemon holds for this job from item ``start`` on, a page at a
        time, without keeping them."""
        at: int | None = start
        offset = 0
        parts: dict[int, bytearray] = {}
        while at is not None:
            page = await self.client._results_page(self.job_id, at, offset)
            for r in page.results:
                yield r
            part = page.part
            if part is not None:
                joined = _join(parts, part.index, part.offset, part.size, part.data)
                if joined is not None:
                    yield joined
            at, offset = page.next, page.next_offset

    def _seed(self, done: bool) -> None:
        if done:
            self.finished = True

    async def fetch_results(self) -> list[p.ItemResult]:
        """Every result the daemon holds for this job now, fetched page by page."""
        async for r in self.result_pages():
            self.results_by_index[r.index] = r
        return [self.results_by_index[i] for i in sorted(self.results_by_index)]

    async def events(self) -> AsyncIterator[p.Event]:
        """Every event of this job as it happens, ending after :class:`JobFinished`."""
        if self.finished and self._queue.empty():
            return
        while True:
            ev = await self._queue.get()
            if isinstance(ev, KvmuxError):
                raise ev
            yield ev
            if isinstance(ev, p.JobFinished):
                self.finished = True
                return

    async def results(self) -> list[p.ItemResult]:
        """Wait for the job to finish; every item's result, in item order."""
        if not self.finished:
            async for _ in self.events():
                pass
        if len(self.results_by_index) < self.total:
            return await self.fetch_results()
        return [self.results_by_index[i] for i in sorted(self.results_by_index)]

    def close(self) -> None:
        """Stop routing this job's events here (the job itself keeps running)."""
        self.client._jobs.pop(self.job_id, None)


class Client:
    """A connection to kvmuxd over a ZeroMQ DEALER socket.

    Use as ``async with Client(endpoint) as c: job = await c.submit(items)``.
    ``curve`` (see :mod:`kvmux.client.curve`) authenticates to a CURVE endpoint;
    without it, ``$KVMUX_CURVE_SERVER_KEY``/``$KVMUX_CURVE_CLIENT_KEY`` apply.
    Replies are matched to requests by id; job events are routed to their
    :class:`Job`. While connected the client heartbeats, so the daemon keeps its
    jobs; a job submitted with ``detach=True`` survives the client's exit.
    """

    def __init__(
        self,
        endpoint: str | None = None,
        *,
        timeout: float = 10.0,
        name: str = "kvmux-python",
        curve: CurveKeys | None = None,
    ) -> None:
        self.endpoint = endpoint or client_default_endpoint()
        self.timeout = timeout
        self.name = name
        self.welcome: p.Welcome | None = None
        # CURVE from the environment lets every tool built on Client (the CLI
        # included) reach an authenticated endpoint without new flags.
        self._curve = curve if curve is not None else curve_from_env()
        self._ctx: zmq.asyncio.Context | None = None
        self._sock: zmq.asyncio.Socket | None = None
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[p.Reply]] = {}
        self._jobs: dict[str, Job] = {}  # jobs whose events are still to come
        self._handles: dict[int, Job] = {}  # request id -> the Job its reply made
        self._logs: asyncio.Queue[p.LogEvents] | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._last_recv = time.monotonic()
        self._lost: KvmuxError | None = None

    # -- lifecycle -----------------------------------------------------------
    async def __aenter__(self) -> Client:
        await self.connect()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def connect(self) -> p.Welcome:
        """Open the socket and say hello; :class:`DaemonUnreachable` if nobody answers."""
        path = ipc_path(self.endpoint)
        if path is not None and not path.exists():
            raise self._unreachable(f"no socket at {path}")
        self._ctx = zmq.asyncio.Context()
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        if self._curve is not None:
            server_public, public, secret = self._curve
            sock.curve_serverkey = server_public
            sock.curve_publickey = public
            sock.curve_secretkey = secret
        sock.connect(self.endpoint)
        self._sock = sock
        self._tasks.append(asyncio.create_task(self._receive_loop()))
        hello = asyncio.ensure_future(
            self._request(p.Hello(id=0, version=p.PROTOCOL_VERSION, client=self.name))
        )
        # kvmuxd's HTTP port given for its ZeroMQ endpoint would only time out: asked
        # once a daemon is slow to answer (none is probed that answers at once).
        probe = asyncio.ensure_future(_http_server_later(self.endpoint, 0.25))
        try:
            done, _ = await asyncio.wait({hello, probe}, return_when=asyncio.FIRST_COMPLETED)
            if hello not in done and probe.result():
                hello.cancel()
                await self.close()
                raise self._unreachable(
                    "an HTTP server answers there: kvmuxd's OpenAI API (http.listen) takes "
                    "HTTP clients such as the openai SDK or curl; the kvmux CLI and client "
                    "speak ZeroMQ to server.endpoint (by default an ipc socket: leave "
                    "--endpoint out)"
                )
            reply = await hello
        except TimeoutError:
            await self.close()
            raise self._unreachable(f"no answer within {self.timeout:g} s") from None
        except BaseException:
            await self.close()
            raise
        finally:
            probe.cancel()
        assert isinstance(reply, p.Welcome)
        self.welcome = reply
        self._tasks.append(asyncio.create_task(self._heartbeat_loop(reply.heartbeat_interval)))
        return reply

    async def close(self, *, goodbye: float | None = None) -> None:
        """Say goodbye (the daemon cancels this client's jobs that were not detached) and close.

        ``goodbye`` bounds the wait for the daemon's answer to it (default: the
        client's timeout, at most 1 s); a goodbye still unsent then is dropped."""
        wait = min(self.timeout, 1.0) if goodbye is None else goodbye
        tasks, self._tasks = self._tasks, []
        try:
            if self._sock is not None and self._lost is None and self.welcome is not None:
                # Best effort: a daemon that is gone cannot be told.
                with contextlib.suppress(KvmuxError, TimeoutError, zmq.ZMQError):
                    await asyncio.wait_for(self._request(p.Bye(id=0)), wait)
            for task in tasks:
                task.cancel()
            # gather, not a suppressed CancelledError per task: a cancellation of
            # the caller itself (Ctrl-C) while it waits here must not be swallowed.
            await asyncio.gather(*tasks, return_exceptions=True)
        finally:
            for task in tasks:
                task.cancel()
            if self._sock is not None:
                self._sock.close(linger=0)
                self._sock = None
            if self._ctx is not None:
                self._ctx.term()
                self._ctx = None
            self._fail_all(DaemonUnreachable(f"client for {self.endpoint} closed"))

    def _unreachable(self, why: str) -> DaemonUnreachable:
        return DaemonUnreachable(
            f"kvmuxd is not reachable at {self.endpoint} ({why}). Start it with "
            "`kvmuxd --config FILE` (or `systemctl start kvmuxd`), or point the client "
            "elsewhere with --endpoint / $KVMUX_ENDPOINT.",
            {"endpoint": self.endpoint, "reason": why},
        )

    # -- requests ------------------------------------------------------------
    async def submit(
        self,
        items: Iterable[p.Item],
        *,
        detach: bool = False,
        name: str = "",
        rejected: Iterable[p.Rejected] = (),
        more: bool = False,
        format: Format = "kvmux",
        keep_results: bool = True,
        stream: bool = True,
    ) -> Job:
        """Submit a job. Items are checked locally first (:class:`BadRequest` names the item).

        ``rejected`` lines become error results of the job (so whoever collects it
        sees them); ``more`` keeps it open for :meth:`Job.add`. ``stream`` false:
        its events carry no :class:`~kvmux.client.protocol.TokenDelta`, only starts
        and results (the daemon then does no per-token work for it). A file of any
        size: :meth:`submit_stream`."""
        checked = _checked(items)
        reply = await self._request(
            p.Submit(
                id=0,
                items=checked,
                detach=detach,
                name=name,
                format=format,
                rejected=list(rejected),
                more=more,
                stream=stream,
            )
        )
        assert isinstance(reply, p.Accepted)
        job = self._handles.pop(reply.id)
        job.format = format
        _keep(job, keep_results)
        return job

    async def submit_stream(
        self,
        entries: Iterable[p.Item | Refusal],
        *,
        detach: bool = False,
        name: str = "",
        format: Format = "kvmux",
        keep_results: bool = True,
        on_wait: Callable[[float], None] | None = None,
        on_added: Callable[[Chunk, int], None] | None = None,
        stream: bool = True,
    ) -> Job:
        """One job from any number of entries: items, and lines that could not be parsed
        (anything with ``line``, ``reason``, ``custom_id``), sent a bounded message at a
        time; returns once all were added (its events are queued meanwhile)."""
        job = await self.submit(
            [],
            detach=detach,
            name=name,
            more=True,
            format=format,
            keep_results=keep_results,
            stream=stream,
        )
        await job.add_all(entries, on_wait=on_wait, on_added=on_added)
        return job

    async def attach(self, job_id: str, *, keep_results: bool = True, stream: bool = True) -> Job:
        """Re-attach to a job (e.g. submitted with ``detach=True`` by an earlier client).

        Its live events follow (token updates only with ``stream``, as in
        :meth:`submit`); :meth:`Job.results` also fetches what finished before."""
        reply = await self._request(p.Attach(id=0, job_id=job_id, stream=stream))
        assert isinstance(reply, p.Attached)
        job = self._handles.pop(reply.id)
        _keep(job, keep_results)
        return job

    async def _results_page(self, job_id: str, start: int, offset: int = 0) -> p.ResultsPage:
        reply = await self._request(p.Results(id=0, job_id=job_id, start=start, offset=offset))
        assert isinstance(reply, p.ResultsPage)
        return reply

    async def jobs(self) -> list[p.JobInfo]:
        """This caller's jobs (every job for an operator), running and retained."""
        out: list[p.JobInfo] = []
        at: int | None = 0
        while at is not None:
            reply = await self._request(p.ListJobs(id=0, start=at))
            assert isinstance(reply, p.JobList)
            out.extend(reply.jobs)
            at = reply.next
        return out

    async def cancel(self, job_id: str) -> None:
        await self._request(p.Cancel(id=0, job_id=job_id))

    async def detach(self, job_id: str) -> None:
        await self._request(p.Detach(id=0, job_id=job_id))

    async def status(self) -> p.DaemonStatus:
        reply = await self._request(p.Status(id=0))
        assert isinstance(reply, p.StatusReply)
        return reply.status

    async def subscribe_logs(
        self, *, level: p.LogLevel = "info", job_id: str | None = None
    ) -> AsyncGenerator[dict[str, Any], None]:
        """Subscribe to the daemon's log events; returns once the daemon has
        acknowledged, so every event from then on is in the returned stream.

        Close the stream (``contextlib.aclosing``) to unsubscribe at once."""
        self._logs = asyncio.Queue()
        await self._request(p.SubscribeLogs(id=0, level=level, job_id=job_id))
        return self._log_stream()

    async def logs(
        self, *, level: p.LogLevel = "info", job_id: str | None = None
    ) -> AsyncGenerator[dict[str, Any], None]:
        """The daemon's log events as they happen, until the caller stops iterating."""
        stream = await self.subscribe_logs(level=level, job_id=job_id)
        async with contextlib.aclosing(stream):
            async for record in stream:
                yield record

    async def _log_stream(self) -> AsyncGenerator[dict[str, Any], None]:
        assert self._logs is not None
        try:
            while True:
                batch = await self._logs.get()
                for record in batch.records:
                    yield record
        finally:
            self._logs = None
            if self._sock is not None and self._lost is None:
                # Not waited for: requests are taken in order, so nothing sent after it
                # is answered as if still subscribed; a daemon that stopped answering
                # must not hold whoever stops reading.
                with contextlib.suppress(zmq.ZMQError):
                    await self._sock.send(p.encode(p.UnsubscribeLogs(id=next(self._ids))))

    async def _request(self, msg: p.Request) -> p.Reply:
        """Send ``msg`` and wait for its reply. A refusal for want of request budget
        (``overloaded`` naming a ``budget``: nothing was done) is waited out as its
        ``retry_after`` says, up to :data:`BUDGET_WAIT` seconds in all."""
        deadline: float | None = None
        while True:
            try:
                return await self._request_once(msg)
            except Overloaded as exc:
                retry = exc.details.get("retry_after")
                if "budget" not in exc.details or not isinstance(retry, int | float):
                    raise
                now = time.monotonic()
                deadline = deadline or now + max(BUDGET_WAIT, self.timeout)
                if now + retry > deadline:
                    raise
                await asyncio.sleep(retry)

    async def _request_once(self, msg: p.Request) -> p.Reply:
        if self._lost is not None:
            raise self._lost
        if self._sock is None:
            raise DaemonUnreachable(f"client for {self.endpoint} is not connected")
        rid = next(self._ids)
        msg = msgspec.structs.replace(msg, id=rid)
        fut: asyncio.Future[p.Reply] = asyncio.get_running_loop().create_future()
        self._pending[rid] = fut
        try:
            await self._sock.send(p.encode(msg))
            reply = await asyncio.wait_for(fut, self.timeout)
        finally:
            self._pending.pop(rid, None)
        if isinstance(reply, p.ErrorReply):
            raise error_from_info(reply.error)
        return reply

    # -- background ------------------------------------------------------------
    async def _receive_loop(self) -> None:
        assert self._sock is not None
        while True:
            data = await self._sock.recv()
            self._last_recv = time.monotonic()
            try:
                reply = p.decode_reply(data)
            except msgspec.DecodeError:
                continue  # a newer daemon's message this client cannot read
            self._route(reply)
            # pyzmq completes a recv at once while messages are queued, without a turn
            # of the event loop: a client slower than the daemon's stream would never
            # let its other tasks run (the command itself, every timeout, Ctrl-C).
            await asyncio.sleep(0)

    def _route(self, reply: p.Reply) -> None:
        match reply:
            case p.Events(events=events):
                for ev in events:
                    job = self._jobs.get(ev.job_id)
                    if job is not None:
                        job._push(ev)
                        if isinstance(ev, p.JobFinished):
                            # Nothing more will come: the caller's Job object
                            # holds the results; a long-lived client stays small.
                            del self._jobs[ev.job_id]
                return
            case p.Ack(instance=instance) if (
                instance and self.welcome is not None and instance != self.welcome.instance
            ):
                # ZeroMQ reconnected this socket to another run of the daemon: what
                # this connection was attached to is gone with the old one.
                self._lost = self._unreachable("it restarted: another run of kvmuxd answers now")
                self._fail_all(self._lost)
            case p.LogEvents():
                if self._logs is not None:
                    self._logs.put_nowait(reply)
                return
            case p.Accepted(id=rid, job_id=job_id, total=total):
                # Registered before the submitter wakes: the job's events (its
                # end included) may be in the very next message.
                self._handles[rid] = self._jobs.setdefault(job_id, Job(self, job_id, total))
            case p.Attached(id=rid, job_id=job_id, total=total, done=done, format=fmt):
                job = self._jobs.setdefault(job_id, Job(self, job_id, total))
                job.total, job.format = total, fmt
                job._seed(done)
                self._handles[rid] = job
                if done:
                    del self._jobs[job_id]  # finished: no events will follow
        reply_id: int | None = getattr(reply, "id", None)
        fut = self._pending.get(reply_id) if reply_id is not None else None
        if fut is not None and not fut.done():
            fut.set_result(reply)

    async def _heartbeat_loop(self, interval: float) -> None:
        assert self._sock is not None
        while True:
            await asyncio.sleep(interval)
            if time.monotonic() - self._last_recv > _SILENT_INTERVALS * interval:
                self._lost = self._unreachable(
                    f"silent for {_SILENT_INTERVALS * interval:g} s; it stopped or restarted"
                )
                self._fail_all(self._lost)
                return
            await self._sock.send(p.encode(p.Heartbeat(id=next(self._ids))))

    def _fail_all(self, exc: KvmuxError) -> None:
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(exc)
        for job in self._jobs.values():
            if not job.finished:
                job._push(exc)
        self._jobs.clear()


def _join(
    parts: dict[int, bytearray], index: int, offset: int, size: int, data: bytes
) -> p.ItemResult | None:
    """Add a part of result ``index``; the result once its last part is in. A part
    that does not follow the one before (a message was lost) drops what was joined:
    the result is still the daemon's to page through."""
    joined = parts.pop(index, None)
    if offset == 0:
        joined = bytearray()
    elif joined is None or len(joined) != offset:
        return None
    joined += data
    if len(joined) < size:
        parts[index] = joined
        return None
    return _decode_result(joined)


def _keep(job: Job, keep_results: bool) -> None:
    job.keep_results = keep_results
    if not keep_results:
        # Any that arrived before the caller got the job are still in its event queue.
        job.results_by_index.clear()


def _checked(items: Iterable[p.Item]) -> list[p.Item]:
    checked = []
    for i, item in enumerate(items):
        try:
            checked.append(p.check_item(item))
        except (msgspec.ValidationError, ValueError) as exc:
            raise BadRequest(
                f"item {i} ({item.custom_id!r}): {exc}", {"index": i, "reason": str(exc)}
            ) from exc
    return checked


def _refused(custom_id: str, reason: str, line: int | None) -> p.Rejected:
    # Cut to the protocol's bounds: one overlong field must not refuse the whole message.
    return p.Rejected(custom_id=custom_id[:512], reason=reason[:4096], line=line)


class Refusal(Protocol):
    """A line that could not become an item (the CLI's ``LineError`` is one)."""

    @property
    def line(self) -> int: ...

    @property
    def reason(self) -> str: ...

    @property
    def custom_id(self) -> str: ...


@dataclass
class Chunk:
    """One message's worth of entries: items, then refused lines (the daemon numbers
    them in that order after what the job already holds)."""

    items: list[p.Item] = field(default_factory=list)
    rejected: list[p.Rejected] = field(default_factory=list)
    last: bool = False

    def __len__(self) -> int:
        return len(self.items) + len(self.rejected)


def chunked(
    entries: Iterable[p.Item | Refusal], *, max_items: int, max_bytes: int
) -> Iterator[Chunk]:
    """``entries`` in messages of at most ``max_items`` entries and ``max_bytes`` encoded
    bytes; the final one marked ``last`` (an empty one when there are none). An item
    that is invalid, or too big for any message on its own, becomes a refused line."""
    budget = max(max_bytes - _ENVELOPE_BYTES, 1)
    chunk, size = Chunk(), 0
    for entry in entries:
        if isinstance(entry, p.Item):
            one: p.Item | p.Rejected = entry
            try:
                one = p.check_item(entry)
            except (msgspec.ValidationError, ValueError) as exc:
                one = _refused(entry.custom_id, str(exc), entry.line)
            n = len(p.encode(one))
            if isinstance(one, p.Item) and n > budget:
                one = _refused(
                    entry.custom_id,
                    f"this line is {n} bytes as an item; kvmuxd takes messages of at most "
                    f"{max_bytes} bytes (server.max_message_bytes)",
                    entry.line,
                )
        else:
            one = _refused(entry.custom_id, entry.reason, entry.line)
        n = len(p.encode(one))
        if len(chunk) and (len(chunk) >= max_items or size + n > budget):
            yield chunk
            chunk, size = Chunk(), 0
        if isinstance(one, p.Item):
            chunk.items.append(one)
        else:
            chunk.rejected.append(one)
        size += n
    chunk.last = True
    yield chunk


class Feeder:
    """Sends entries to an open job a bounded message at a time, and closes it.

    Sizes come from the daemon's welcome (``max_job_items``,
    ``max_message_bytes``). ``overloaded`` is waited out: the same message is sent
    again after the daemon's ``retry_after`` hint, backing off up to 2 s, and
    ``on_wait(seconds)`` hears how long this message has waited so far (then
    ``on_wait(0.0)`` once it went in); ``on_added(chunk, total)`` hears each
    message the daemon took and the job's total after it.

    If the connection is lost, :meth:`resume` with the total a re-attach reports
    tells the feeder whether the message in flight made it (the daemon commits a
    message whole), and :meth:`run` goes on from there on the new job handle.
    Reads its entries lazily, one message ahead at most.
    """

    def __init__(self, entries: Iterable[p.Item | Refusal], client: Client) -> None:
        welcome = client.welcome
        if welcome is None:
            raise DaemonUnreachable(f"client for {client.endpoint} is not connected")
        self._chunks = chunked(
            entries, max_items=welcome.max_job_items, max_bytes=welcome.max_message_bytes
        )
        self.pending: Chunk | None = None
        self.acked = 0  # entries the daemon has confirmed
        self.closed = False
        self.waited = 0.0  # seconds spent waiting for queue room, all messages together

    def resume(self, total: int) -> None:
        """Line up with the job's ``total`` after a re-attach."""
        pending = self.pending
        if pending is not None and total == self.acked + len(pending):
            # The message was committed before the connection went.
            self.acked = total
            self.closed = pending.last
            self.pending = None
        elif total != self.acked:
            raise BadRequest(
                f"the job holds {total} items but {self.acked} were confirmed sent, with "
                f"{0 if pending is None else len(pending)} in flight: it was changed by "
                "someone else",
                {"total": total, "acked": self.acked},
            )

    async def run(
        self,
        job: Job,
        *,
        on_wait: Callable[[float], None] | None = None,
        on_added: Callable[[Chunk, int], None] | None = None,
    ) -> None:
        while not self.closed:
            if self.pending is None:
                self.pending = next(self._chunks)
            chunk = self.pending
            total = await self._send(job, chunk, on_wait)
            self.acked = total
            self.pending = None
            self.closed = chunk.last
            if on_added is not None:
                on_added(chunk, total)

    async def _send(self, job: Job, chunk: Chunk, on_wait: Callable[[float], None] | None) -> int:
        backoff = _BACKOFF_FIRST
        started: float | None = None
        while True:
            try:
                total = await job._add(chunk.items, chunk.rejected, chunk.last)
            except Overloaded as exc:
                now = time.monotonic()
                started = now if started is None else started
                hint = exc.details.get("retry_after")
                pause = hint if isinstance(hint, int | float) and hint > 0 else backoff
                pause = min(max(pause, backoff), _BACKOFF_MAX)
                backoff = min(backoff * 1.5, _BACKOFF_MAX)
                if on_wait is not None:
                    on_wait(now - started + pause)
                await asyncio.sleep(pause)
                continue
            if started is not None:
                self.waited += time.monotonic() - started
                if on_wait is not None:
                    on_wait(0.0)
            return total


async def _http_server_later(endpoint: str, delay: float) -> bool:
    await asyncio.sleep(delay)
    return await http_server_at(endpoint)
