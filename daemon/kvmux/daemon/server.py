"""The ZeroMQ ROUTER socket: decode each request, call the service, answer with its id.

Replies and events are handed to libzmq in the order they are made, on the
loop's thread (held in order behind a client's backlog when its pipe is
full), so a request's reply always leaves before the events the scheduler
produces after it. Errors are translated here, in one place: a typed error
keeps its code and details; anything else is logged with its traceback and
answered ``internal``.

The socket is shared by people who do not trust each other, so nothing a
client sends may end, stall or bloat the daemon:

- any failure handling one frame becomes a typed ``bad_request`` (or a drop);
- the receive loop yields after every message, so a flood cannot starve the
  scheduler, the replies or the heartbeats;
- each sender has a budget of malformed frames (replied, then dropped, then
  its connection is shut);
- valid requests cost what they take to answer, against a budget per
  connection and per owner (:mod:`.budget`); past it they are answered
  ``overloaded`` before anything is built for them, and nothing is built for
  a client whose replies are not being read;
- every message sent is at most ``MAX_REPLY_BYTES`` (:mod:`.framing`); libzmq
  buffers at most ``_RECV_HWM`` messages from and ``_SEND_HWM`` messages to
  each connection, and the daemon itself at most
  ``server.max_client_buffer_bytes`` for a client that does not read, so such
  a client pins at most :func:`client_bound_bytes`;
- the daemon stops accepting connections before it runs out of file
  descriptors (libzmq aborts on EMFILE), and half-open connections are
  closed after ``server.handshake_timeout``;
- every job belongs to its owner (see :mod:`.access`): others get
  ``not_found`` for it and never see it in status or in the log stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import resource
import socket
import struct
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

import anyio
import anyio.abc
import msgspec
import structlog
import zmq
import zmq.asyncio
import zmq.auth
from zmq.auth.asyncio import AsyncioAuthenticator

from kvmux.client import protocol as p
from kvmux.client.endpoint import ipc_path
from kvmux.client.errors import (
    BadRequest,
    Internal,
    KvmuxError,
    Overloaded,
    Unauthorized,
    VersionMismatch,
)

from .access import ANONYMOUS, Caller, curve_caller, ipc_caller
from .budget import Bucket
from .config import ConfigError, ServerConfig
from .errors import error_info
from .framing import event_messages, log_messages
from .logs import LogSubscription, hub
from .service import Service

log = structlog.get_logger("kvmux.server")

# libzmq's per-connection pipes, in messages. Inbound: a connection the loop
# has not caught up with holds at most this many (each <= max_message_bytes),
# then libzmq stops reading it. Outbound: past this, a client's messages wait
# in the daemon's own byte-bounded backlog. Each is at most MAX_REPLY_BYTES.
_RECV_HWM = 4
_SEND_HWM = 32
_FD_CHECK_SECONDS = 0.02
# Answered ``overloaded`` while the connection's or the owner's budget is spent;
# the rest only release things (or keep the connection alive) and always pass.
_METERED = p.Submit | p.AddItems | p.Attach | p.Results | p.ListJobs | p.Status | p.SubscribeLogs
# Requests that build a reply of some size: not built for a client not reading.
_BUILDS_REPLY = p.Attach | p.Results | p.ListJobs | p.Status
# How long a client whose replies pile up is told to wait before asking again.
_NOT_READING_RETRY = 1.0


def client_bound_bytes(cfg: ServerConfig) -> int:
    """The most bytes of replies one client that never reads can pin in the daemon."""
    return _SEND_HWM * p.MAX_REPLY_BYTES + cfg.max_client_buffer_bytes


def raise_fd_limit() -> tuple[int, int]:
    """Raise the soft limit on open files to the hard one; returns (soft, hard) after.

    systemd's default soft limit (1024) is far below what a socket shared by
    many clients needs, and running out makes libzmq abort."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


class EndpointInUse(RuntimeError):
    """Another process already answers on this ipc socket or HTTP port."""


def prepare_ipc(path: Path) -> None:
    """Create the socket's directory; refuse a live socket, clear a stale one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.exists():
        return
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(1.0)
        probe.connect(str(path))
    except OSError:
        path.unlink(missing_ok=True)  # nobody listens: a crashed daemon's leftover
        return
    finally:
        probe.close()
    raise EndpointInUse(f"another process already listens on {path}; stop it or pick another")


@dataclass(eq=False)
class Peer:
    """What the server knows of one connection (a ROUTER identity); the sink its
    jobs' events go to."""

    server: Server
    ident: bytes
    caller: Caller
    seen: float
    fd: int | None
    bucket: Bucket  # its request budget (see .budget)
    # Malformed-frame budget: a token bucket, and frames dropped since it was last full.
    allowance: float
    allowance_at: float
    drops: int = 0
    rejected: int = 0
    # Replies libzmq would not take yet (its pipe to this client is full).
    backlog: deque[bytes] = field(default_factory=deque)
    backlog_bytes: int = 0
    lost: int = 0

    def deliver(self, events: list[p.Event]) -> None:
        """A scheduler turn's events for this client: one message (more only when they
        would not fit one)."""
        for data in event_messages(events):
            self.server._queue(self.ident, data)


class Server:
    """Owns the ROUTER socket, client liveness and log subscriptions."""

    def __init__(
        self,
        endpoint: str,
        cfg: ServerConfig,
        service: Service,
    ) -> None:
        self.endpoint = endpoint
        self.cfg = cfg
        self.service = service
        self.budget = service.budget
        self._instance = service.hello().instance  # heartbeat acks name it
        # An asyncio context for the CURVE authenticator's ZAP socket; the ROUTER
        # itself is a plain socket driven from the loop (see _receive_loop).
        self._ctx = zmq.asyncio.Context()
        self._sock: zmq.Socket[bytes] | None = None
        self._bound: str | None = None  # what sock.bind() resolved the endpoint to
        # Set when the socket may have something to read: its descriptor became
        # readable, or a send may have taken the edge that would have said so.
        self._readable = asyncio.Event()
        self._peers: dict[bytes, Peer] = {}
        self._backlogged: set[bytes] = set()  # peers with replies held back
        # What _backlog_loop sleeps on while nothing is held back.
        self._held: anyio.Event | None = None
        self._banned: dict[bytes, float] = {}  # identities shut for garbage, until when
        self._log_subs: dict[bytes, tuple[LogSubscription, anyio.CancelScope]] = {}
        self._tg: anyio.abc.TaskGroup | None = None
        self._auth: AsyncioAuthenticator | None = None
        self._authorized: frozenset[str] = frozenset()
        self._operator_keys = frozenset(cfg.operator_keys)
        self._transport = endpoint.split("://", 1)[0]
        self._fd_limit = raise_fd_limit()[0]
        self.listening = True
        self.requests = 0
        self.rejected = 0
        self.dropped_frames = 0
        self.disconnected = 0
        self.lost_replies = 0
        self.bytes_queued = 0  # every byte sent or held, for request costs

    # -- lifecycle -------------------------------------------------------------
    def bind(self) -> None:
        sock: zmq.Socket[bytes] = zmq.Socket(self._ctx, zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, self.cfg.max_message_bytes)
        sock.setsockopt(zmq.RCVHWM, _RECV_HWM)
        sock.setsockopt(zmq.SNDHWM, _SEND_HWM)
        # A full pipe raises EAGAIN instead of silently dropping, so the
        # daemon knows which client is not reading and holds its replies in
        # a byte-bounded backlog; a gone identity raises EHOSTUNREACH.
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        sock.setsockopt(zmq.HANDSHAKE_IVL, int(self.cfg.handshake_timeout * 1000))
        if self.cfg.curve_secret_key:
            self._enable_curve(sock)
        path = ipc_path(self.endpoint)
        if path is not None:
            prepare_ipc(path)
        sock.bind(self.endpoint)
        self._bound = sock.getsockopt_string(zmq.LAST_ENDPOINT) or self.endpoint
        if path is not None:
            os.chmod(path, 0o660)
        self._sock = sock

    def _enable_curve(self, sock: zmq.Socket[bytes]) -> None:
        """Encrypt, and admit only clients whose public key is in the authorized folder."""
        cfg = self.cfg
        if not zmq.has("curve"):
            raise ConfigError("this libzmq has no CURVE support", key="server.curve_secret_key")
        try:
            public, secret = zmq.auth.load_certificate(cfg.curve_secret_key)
        except (OSError, ValueError) as exc:
            raise ConfigError(f"cannot load: {exc}", key="server.curve_secret_key") from exc
        if secret is None:
            raise ConfigError(
                f"{cfg.curve_secret_key} holds no secret key: use the server's *.key_secret file",
                key="server.curve_secret_key",
            )
        keys = Path(cfg.curve_authorized_keys)
        if not keys.is_dir():
            raise ConfigError(f"{keys} is not a folder", key="server.curve_authorized_keys")
        # ZAP: libzmq asks this handler about every CURVE handshake on the context.
        self._auth = AsyncioAuthenticator(self._ctx)
        self._auth.start()
        self.reload_keys()
        sock.curve_secretkey = secret
        sock.curve_publickey = public
        sock.curve_server = True

    def reload_keys(self) -> None:
        """Re-read the authorized CURVE keys (SIGHUP): a removed key stops working at once,
        on new connections (ZAP) and on open ones (checked on every message)."""
        if self._auth is None:
            return
        location = self.cfg.curve_authorized_keys
        keys = zmq.auth.load_certificates(location)
        self._auth.configure_curve(domain="*", location=location)
        self._authorized = frozenset(
            k.decode("ascii") if isinstance(k, bytes) else str(k) for k in keys
        )
        log.info("curve_keys_loaded", folder=location, keys=len(self._authorized))

    async def serve(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        if self._sock is None:
            self.bind()
        assert self._sock is not None
        loop = asyncio.get_running_loop()
        fd = cast(int, self._sock.getsockopt(zmq.FD))
        loop.add_reader(fd, self._readable.set)
        try:
            async with anyio.create_task_group() as tg:
                self._tg = tg
                tg.start_soon(self._backlog_loop)
                tg.start_soon(self._reap_loop)
                tg.start_soon(self._fd_guard)
                task_status.started()
                await self._receive_loop()
        finally:
            loop.remove_reader(fd)
            self.close()

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None
            path = ipc_path(self.endpoint)
            if path is not None:
                path.unlink(missing_ok=True)
        for sub, _ in self._log_subs.values():
            hub.unsubscribe(sub)
        self._log_subs.clear()
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
        self._ctx.term()

    async def flush(self, timeout: float = 2.0) -> None:
        """Wait until every held message was handed to ZeroMQ (used at shutdown)."""
        with anyio.move_on_after(timeout):
            while self._backlogged:
                await anyio.sleep(0.01)

    @property
    def clients(self) -> int:
        return len(self._peers)

    def alive(self, ident: bytes) -> bool:
        """Whether ``ident`` is a client the server still knows (not gone, not reaped)."""
        return ident in self._peers

    # -- sending -----------------------------------------------------------------
    def send(self, ident: bytes, msg: p.Reply) -> None:
        data = p.encode(msg)
        if len(data) > p.MAX_REPLY_BYTES:
            # Every builder bounds its reply; one that did not is a bug, and the
            # bound on what a client can pin must hold regardless.
            log.error("reply_too_large", kind=type(msg).__name__, bytes=len(data))
            rid = getattr(msg, "id", None)
            error = Internal(f"kvmuxd built a {type(msg).__name__} reply over its size bound")
            data = p.encode(p.ErrorReply(id=rid, error=error.to_info()))
        self._queue(ident, data)

    def _queue(self, ident: bytes, data: bytes) -> None:
        """Hand ``data`` to libzmq now, or hold it behind what already waits for that
        client: sent in call order, so a request's reply leaves before the events
        that follow it."""
        self.bytes_queued += len(data)
        peer = self._peers.get(ident)
        if peer is not None and peer.backlog:
            self._hold(ident, peer, data)  # keep the order: behind what already waits
            return
        if self._try_send(ident, data) is False and peer is not None:
            self._hold(ident, peer, data)

    def _try_send(self, ident: bytes, data: bytes) -> bool | None:
        """True: sent; False: the client's pipe is full; None: the client is gone."""
        if self._sock is None:  # after a forced stop nothing can be delivered any more
            return None
        try:
            self._sock.send_multipart([ident, data], flags=zmq.NOBLOCK)
        except zmq.Again:
            return False
        except zmq.ZMQError:  # EHOSTUNREACH: that connection is gone
            return None
        finally:
            # A send lets libzmq process its mailbox, which may take the edge that
            # would have woken the receiver for a message that came in meanwhile.
            self._readable.set()
        return True

    def _hold(self, ident: bytes, peer: Peer, data: bytes) -> None:
        if peer.backlog_bytes + len(data) > self.cfg.max_client_buffer_bytes:
            peer.lost += 1
            self.lost_replies += 1
            if math.log2(peer.lost).is_integer():
                log.warning(
                    "client_not_reading",
                    owner=peer.caller.owner,
                    held_bytes=peer.backlog_bytes,
                    dropped_messages=peer.lost,
                )
            return
        peer.backlog.append(data)
        peer.backlog_bytes += len(data)
        self._backlogged.add(ident)
        if self._held is not None:
            self._held.set()

    async def _backlog_loop(self) -> None:
        """While replies are held back, try every 5 ms to hand them to libzmq; asleep
        otherwise (an idle daemon does not wake for it)."""
        while True:
            if not self._backlogged:
                self._held = anyio.Event()
                await self._held.wait()
            await anyio.sleep(0.005)
            for ident in list(self._backlogged):
                peer = self._peers.get(ident)
                while peer is not None and peer.backlog:
                    if self._try_send(ident, peer.backlog[0]) is False:
                        break
                    data = peer.backlog.popleft()
                    peer.backlog_bytes -= len(data)
                if peer is None or not peer.backlog:
                    self._backlogged.discard(ident)

    # -- receiving -----------------------------------------------------------------
    async def _receive_loop(self) -> None:
        """Read messages while there are any, then sleep until the socket's descriptor
        (or a send) says there may be more. A plain socket read without a future per
        message: a flood costs the loop as little as a message can."""
        sock = self._sock
        assert sock is not None
        while True:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                self._readable.clear()
                # libzmq signals edges: ask before sleeping whether one was missed.
                if not cast(int, sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
                    await self._readable.wait()
                continue
            try:
                await self._on_message(frames)
            except Exception:
                log.exception("frame_handling_failed")
            # Yield after every message, so a flood cannot starve the scheduler,
            # the backlogs or the heartbeats.
            await asyncio.sleep(0)

    async def _on_message(self, frames: list[zmq.Frame]) -> None:
        ident = frames[0].bytes
        self.requests += 1
        if ident in self._banned:
            self.dropped_frames += 1
            return
        caller = self._caller(frames[0])
        if caller is None:
            self._refuse_key(ident, frames)
            return
        if len(frames) != 2:
            self._bad_frame(
                ident, frames[0], caller, None, f"expected one message frame, got {len(frames) - 1}"
            )
            return
        data = frames[1].bytes
        # The loop thread's own CPU time: waiting for the GIL while the model thread
        # holds it is not this request's doing.
        started, queued = time.thread_time(), self.bytes_queued
        try:
            req = p.decode_request(data)
        except Exception as exc:  # noqa: BLE001 - DecodeError, and RecursionError on deep nesting
            why = (
                f"malformed request: {exc}"
                if isinstance(exc, msgspec.DecodeError)
                else (f"malformed request: {type(exc).__name__}")
            )
            self._bad_frame(ident, frames[0], caller, _salvage_id(data), why)
            return
        peer = self._touch(ident, frames[0], caller)
        try:
            if isinstance(req, _METERED):
                try:
                    self.budget.check(peer.bucket, caller.owner)
                except Overloaded as exc:
                    # Refused, not charged: charging the cheapest answer too would keep
                    # a client that waits as told refused for ever.
                    self.send(ident, p.ErrorReply(id=req.id, error=exc.to_info()))
                    return
            if peer.backlog and isinstance(req, _BUILDS_REPLY):
                # Its replies pile up unread: whatever were built now would wait
                # behind them, or be dropped.
                raise Overloaded(
                    "your replies are not being read: read them before asking for more",
                    {"retry_after": _NOT_READING_RETRY, "budget": "not_reading"},
                )
            await self._dispatch(peer, req)
        except Exception as exc:  # noqa: BLE001 - translated; nothing escapes a request
            self.send(ident, p.ErrorReply(id=req.id, error=error_info(exc, op=type(req).__name__)))
        self.budget.charge(
            peer.bucket,
            caller.owner,
            time.thread_time() - started,
            self.bytes_queued - queued,
        )

    def _caller(self, frame: zmq.Frame) -> Caller | None:
        """Who sent ``frame``; None for a CURVE key that is no longer authorized."""
        if self._auth is not None:
            caller = curve_caller(_property(frame, "User-Id"), self._operator_keys)
            return caller if caller.owner.removeprefix("key:") in self._authorized else None
        if self._transport == "ipc":
            return ipc_caller(_property(frame, "Peer-Address"))
        return Caller(ANONYMOUS)

    def _touch(self, ident: bytes, frame: zmq.Frame, caller: Caller) -> Peer:
        now = time.monotonic()
        peer = self._peers.get(ident)
        if peer is None:
            fd: int | None
            try:
                fd = frame.get(zmq.SRCFD)
            except zmq.ZMQError:
                fd = None
            burst = float(self.cfg.bad_frame_burst)
            peer = self._peers[ident] = Peer(
                self, ident, caller, now, fd, self.budget.connection(), burst, now
            )
        peer.seen = now
        return peer

    async def _dispatch(self, peer: Peer, req: p.Request) -> None:
        """Translate one request into a call of the service, and its answer into a reply."""
        ident, caller, service = peer.ident, peer.caller, self.service
        match req:
            case p.Hello(version=version):
                if version != p.PROTOCOL_VERSION:
                    raise VersionMismatch(
                        f"client speaks protocol {version}, this daemon {p.PROTOCOL_VERSION}; "
                        "install matching kvmux versions",
                        {"client": version, "daemon": p.PROTOCOL_VERSION},
                    )
                self.send(ident, msgspec.structs.replace(service.hello(), id=req.id))
            case p.Submit() | p.AddItems():
                service.scheduler  # noqa: B018 - not_ready now, not from the task
                # Validation tokenizes off the event loop: do not hold up others.
                assert self._tg is not None
                self._tg.start_soon(self._submit, peer, req)
            case p.Cancel(job_id=job_id):
                service.cancel(job_id, caller=caller)
                self.send(ident, p.Ack(id=req.id))
            case p.Attach(job_id=job_id, stream=stream):
                job = service.attach(peer, job_id, caller=caller, stream=stream)
                self.send(
                    ident,
                    p.Attached(
                        id=req.id,
                        job_id=job.job_id,
                        total=len(job.items),
                        done=job.done,
                        ok=job.ok,
                        failed=job.failed,
                        format=job.format,
                    ),
                )
            case p.Results(job_id=job_id, start=start, offset=offset):
                page = service.results_page(job_id, start, offset, caller=caller, request_id=req.id)
                self.send(ident, page)
            case p.ListJobs(start=start):
                jobs, after = service.list_jobs(caller=caller, start=start)
                self.send(ident, p.JobList(id=req.id, jobs=jobs, next=after))
            case p.Detach(job_id=job_id):
                service.detach(job_id, caller=caller)
                self.send(ident, p.Ack(id=req.id))
            case p.Status():
                self.send(ident, p.StatusReply(id=req.id, status=service.status(caller)))
            case p.SubscribeLogs(level=level, job_id=job_id):
                self._subscribe_logs(ident, caller, level, job_id)
                self.send(ident, p.Ack(id=req.id))
            case p.UnsubscribeLogs():
                self._unsubscribe_logs(ident)
                self.send(ident, p.Ack(id=req.id))
            case p.Heartbeat():
                self.send(ident, p.Ack(id=req.id, instance=self._instance))
            case p.Bye():
                self.send(ident, p.Ack(id=req.id))
                self._forget(ident, "its client closed the connection", "client_closed")

    async def _submit(self, peer: Peer, req: p.Submit | p.AddItems) -> None:
        """A submit or an addition, checked off the receive loop; its answer, or its error."""
        ident, caller = peer.ident, peer.caller
        reply: p.Reply
        try:
            if isinstance(req, p.Submit):
                # The job starts only if its client is still there once its items
                # are checked: nobody could ever learn the id of one that is not.
                job = await self.service.submit(
                    peer,
                    req.items,
                    caller=caller,
                    rejected=req.rejected,
                    detach=req.detach,
                    name=req.name,
                    format=req.format,
                    more=req.more,
                    stream=req.stream,
                    still_wanted=lambda: self.alive(ident),
                )
                if job is None:
                    return
                reply = p.Accepted(id=req.id, job_id=job.job_id, total=len(job.items))
            else:
                job = await self.service.add_items(
                    peer,
                    req.job_id,
                    req.items,
                    caller=caller,
                    rejected=req.rejected,
                    last=req.last,
                )
                reply = p.Added(id=req.id, job_id=job.job_id, total=len(job.items))
        except Exception as exc:  # noqa: BLE001 - translated; nothing escapes a request
            self.send(ident, p.ErrorReply(id=req.id, error=error_info(exc, op=type(req).__name__)))
            return
        # No await since the job took the items: this reply leaves before their events.
        self.send(ident, reply)

    # -- hostile input ---------------------------------------------------------------
    def _bad_frame(
        self,
        ident: bytes,
        frame: zmq.Frame,
        caller: Caller,
        rid: int | None,
        why: str,
        error: KvmuxError | None = None,
    ) -> None:
        """Reply (``bad_request``, or ``error``) while the sender's budget lasts, then
        drop, then disconnect."""
        self.rejected += 1
        peer = self._touch(ident, frame, caller)
        peer.rejected += 1
        now = time.monotonic()
        cfg = self.cfg
        peer.allowance = min(
            float(cfg.bad_frame_burst),
            peer.allowance + (now - peer.allowance_at) * cfg.bad_frames_per_second,
        )
        peer.allowance_at = now
        if math.log10(peer.rejected).is_integer():  # 1st, 10th, 100th ...: a flood stays readable
            log.warning(
                "request_rejected", owner=caller.owner, reason=why[:300], count=peer.rejected
            )
        if peer.allowance >= cfg.bad_frame_burst:
            peer.drops = 0  # calm for long enough to have earned its whole budget back
        if peer.allowance >= 1.0:
            peer.allowance -= 1.0
            self.send(ident, p.ErrorReply(id=rid, error=(error or BadRequest(why)).to_info()))
            return
        peer.drops += 1
        self.dropped_frames += 1
        if peer.drops > cfg.bad_frame_burst:
            self._disconnect(ident, peer, "bad_frames")

    def _refuse_key(self, ident: bytes, frames: list[zmq.Frame]) -> None:
        """A CURVE key removed from the authorized folder: forget what it had (its jobs
        not detached are cancelled), and answer each message ``unauthorized`` within
        the same budget as garbage."""
        if ident in self._peers:
            self._forget(ident, "its key was removed from the authorized keys", "key_revoked")
        rid = _salvage_id(frames[1].bytes) if len(frames) == 2 else None
        refusal = Unauthorized(
            "this client's key is no longer authorized on this daemon "
            "(removed from server.curve_authorized_keys)"
        )
        self._bad_frame(ident, frames[0], Caller("revoked"), rid, str(refusal), refusal)

    def _disconnect(self, ident: bytes, peer: Peer, reason: str) -> None:
        """Forget a client and shut its connection (ROUTER has no call for that: the
        descriptor the message came from is shut down, if it still is that peer's)."""
        self.disconnected += 1
        self._banned[ident] = time.monotonic()
        self._forget(ident, f"its connection was shut ({reason})", reason)
        if peer.fd is not None:
            _shut_if_same_peer(peer.fd, peer.caller)
        log.warning("client_disconnected", owner=peer.caller.owner, reason=reason)

    async def _fd_guard(self) -> None:
        """Stop listening before descriptors run out; listen again once they are back."""
        # Half the limit: libzmq keeps accepting between two checks, and a tight
        # loop of connects gets hundreds in that time.
        high = min(self.cfg.max_connections, self._fd_limit // 2)
        low = high * 3 // 4
        assert self._sock is not None
        # libzmq tells of each connection it accepts: a flood of connects is checked
        # as fast as the loop turns, not every _FD_CHECK_SECONDS. Polled alone, ~500
        # connects (a tight loop's 20 ms) came in between two checks, past the limit,
        # where libzmq's ipc accept aborts the process.
        accepted = cast(zmq.asyncio.Socket, self._sock.get_monitor_socket(zmq.EVENT_ACCEPTED))
        try:
            while True:
                with anyio.move_on_after(_FD_CHECK_SECONDS):
                    await accepted.recv_multipart()
                    with contextlib.suppress(zmq.Again):
                        while True:  # the rest of a burst: one check for all of it
                            await accepted.recv_multipart(zmq.NOBLOCK)
                self._check_fds(high, low)
        finally:
            if self._sock is not None:
                self._sock.disable_monitor()
            accepted.close(linger=0)

    def _check_fds(self, high: int, low: int) -> None:
        if self._sock is None or self._bound is None:
            return
        n = open_fds()
        if self.listening and n >= high:
            self._sock.unbind(self._bound)
            self.listening = False
            log.warning("listening_paused", open_fds=n, limit=high, fd_limit=self._fd_limit)
        elif not self.listening and n < low:
            path = ipc_path(self.endpoint)
            try:
                if path is not None:
                    prepare_ipc(path)
                self._sock.bind(self._bound)
            except (OSError, zmq.ZMQError, EndpointInUse) as exc:
                log.error("listening_resume_failed", error=str(exc))
                return
            if path is not None:
                os.chmod(path, 0o660)
            self.listening = True
            log.warning("listening_resumed", open_fds=n)

    # -- liveness and log subscriptions ----------------------------------------------
    async def _reap_loop(self) -> None:
        while True:
            await anyio.sleep(self.cfg.heartbeat_interval)
            now = time.monotonic()
            for ident, peer in list(self._peers.items()):
                silent = now - peer.seen
                if silent <= self.cfg.client_timeout:
                    continue
                self._forget(
                    ident, f"its client stopped heartbeating ({silent:.1f} s silent)", "client_gone"
                )
            # A shut connection's identity is not reused; forget it after a while.
            for ident in [i for i, t in self._banned.items() if now - t > 60.0]:
                del self._banned[ident]

    def _forget(self, ident: bytes, why: str, reason: str) -> None:
        peer = self._peers.pop(ident, None)
        self._backlogged.discard(ident)
        self._unsubscribe_logs(ident)
        if peer is None:
            return
        cancelled = self.service.sink_gone(peer, why, reason)
        log.info(reason, client=ident.hex(), why=why, cancelled_jobs=cancelled)

    def _subscribe_logs(self, ident: bytes, caller: Caller, level: str, job_id: str | None) -> None:
        visible = self.service.log_filter(caller, job_id)
        self._unsubscribe_logs(ident)
        sub = hub.subscribe(min_level=level, job_id=job_id, visible=visible)
        scope = anyio.CancelScope()
        self._log_subs[ident] = (sub, scope)
        assert self._tg is not None
        self._tg.start_soon(self._pump_logs, ident, sub, scope)

    def _unsubscribe_logs(self, ident: bytes) -> None:
        entry = self._log_subs.pop(ident, None)
        if entry is not None:
            sub, scope = entry
            hub.unsubscribe(sub)
            scope.cancel()

    async def _pump_logs(
        self, ident: bytes, sub: LogSubscription, scope: anyio.CancelScope
    ) -> None:
        with scope:
            while True:
                await sub.wait()
                records = sub.drain()
                if records:
                    for data in log_messages(records, sub.dropped):
                        self._queue(ident, data)


def _property(frame: zmq.Frame, name: str) -> str | None:
    """A connection property of a received message (None where libzmq has none)."""
    try:
        return str(frame.get(name))
    except zmq.ZMQError:
        return None


def _shut_if_same_peer(fd: int, caller: Caller) -> None:
    """Shut connection ``fd`` down if it still is one of ``caller``'s (libzmq may have
    closed it and reused the number since); libzmq then drops it as gone."""
    try:
        dup = socket.socket(fileno=os.dup(fd))
    except OSError:
        return
    try:
        if dup.family == socket.AF_UNIX:
            creds = dup.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
            _pid, uid, _gid = struct.unpack("3i", creds)
            if caller.owner not in (f"uid:{uid}", ANONYMOUS):
                return
        else:
            dup.getpeername()  # a connected socket; CURVE/anonymous carry no finer identity
        dup.shutdown(socket.SHUT_RDWR)
    except OSError:
        return
    finally:
        dup.close()


def _salvage_id(data: bytes) -> int | None:
    """The ``id`` of a request that failed validation, if one can be read, to echo it."""
    try:
        obj = msgspec.msgpack.decode(data)
    except Exception:  # noqa: BLE001 - DecodeError, RecursionError: there is no id to echo
        return None
    rid = obj.get("id") if isinstance(obj, dict) else None
    if isinstance(rid, int) and not isinstance(rid, bool) and 0 <= rid < 2**63:
        return rid
    return None
