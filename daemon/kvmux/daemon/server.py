"""The ZeroMQ ROUTER socket: decode each request, dispatch it, answer with its id.

Every reply is queued to one sender task, so a request's reply always leaves
before the events the scheduler produces after it. Errors are translated
here, in one place: a typed error keeps its code and details; anything else
is logged with its traceback and answered ``internal``.
"""

from __future__ import annotations

import contextlib
import math
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path

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
from kvmux.client.errors import BadRequest, NotReady, VersionMismatch

from .config import ConfigError, ServerConfig
from .errors import error_info
from .logs import LogSubscription, hub
from .scheduler import Scheduler

log = structlog.get_logger("kvmux.server")


class EndpointInUse(RuntimeError):
    """Another daemon already answers on this ipc socket."""


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


class Server:
    """Owns the ROUTER socket, client liveness and log subscriptions."""

    def __init__(
        self,
        endpoint: str,
        cfg: ServerConfig,
        *,
        hello: Callable[[], p.Welcome],
        status: Callable[[], p.DaemonStatus],
    ) -> None:
        self.endpoint = endpoint
        self.cfg = cfg
        self.scheduler: Scheduler | None = None
        self._hello = hello
        self._status = status
        self._ctx = zmq.asyncio.Context()
        self._sock: zmq.asyncio.Socket | None = None
        self._out, self._out_rx = anyio.create_memory_object_stream[tuple[bytes, bytes]](math.inf)
        self._clients: dict[bytes, float] = {}
        self._log_subs: dict[bytes, tuple[LogSubscription, anyio.CancelScope]] = {}
        self._rejects: dict[bytes, int] = {}
        self._tg: anyio.abc.TaskGroup | None = None
        self._auth: AsyncioAuthenticator | None = None
        self.requests = 0
        self.rejected = 0

    # -- lifecycle -------------------------------------------------------------
    def bind(self) -> None:
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, self.cfg.max_message_bytes)
        # A slow client's backlog is bounded by what it submitted; results are
        # also kept on the job, so a dropped event is recoverable by re-attach.
        sock.setsockopt(zmq.SNDHWM, 100_000)
        if self.cfg.curve_secret_key:
            self._enable_curve(sock)
        path = ipc_path(self.endpoint)
        if path is not None:
            prepare_ipc(path)
        sock.bind(self.endpoint)
        if path is not None:
            os.chmod(path, 0o660)
        self._sock = sock

    def _enable_curve(self, sock: zmq.asyncio.Socket) -> None:
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
        self._auth.configure_curve(domain="*", location=str(keys))
        sock.curve_secretkey = secret
        sock.curve_publickey = public
        sock.curve_server = True

    async def serve(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        if self._sock is None:
            self.bind()
        try:
            async with anyio.create_task_group() as tg:
                self._tg = tg
                tg.start_soon(self._send_loop)
                tg.start_soon(self._reap_loop)
                task_status.started()
                await self._receive_loop()
        finally:
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
        self._out.close()
        self._out_rx.close()
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
        self._ctx.term()

    async def flush(self, timeout: float = 2.0) -> None:
        """Wait until every queued message was handed to ZeroMQ (used at shutdown)."""
        with anyio.move_on_after(timeout):
            while self._out_rx.statistics().current_buffer_used:
                await anyio.sleep(0.01)

    @property
    def clients(self) -> int:
        return len(self._clients)

    # -- sending -----------------------------------------------------------------
    def send(self, ident: bytes, msg: p.Reply) -> None:
        # After a forced stop closed the stream nothing can be delivered any more.
        with contextlib.suppress(anyio.ClosedResourceError):
            self._out.send_nowait((ident, p.encode(msg)))

    def deliver(self, owner: bytes, events: list[p.Event]) -> None:
        """The scheduler's outlet: one message per client per step."""
        self.send(owner, p.Events(events=events))

    async def _send_loop(self) -> None:
        async for ident, data in self._out_rx:
            if self._sock is None:
                return
            # ROUTER drops messages for identities that are gone; never blocks.
            await self._sock.send_multipart([ident, data])

    # -- receiving -----------------------------------------------------------------
    async def _receive_loop(self) -> None:
        assert self._sock is not None
        while True:
            frames = await self._sock.recv_multipart()
            ident = frames[0]
            if len(frames) != 2:
                self._reject(ident, None, f"expected one message frame, got {len(frames) - 1}")
                continue
            await self._handle(ident, frames[1])

    async def _handle(self, ident: bytes, data: bytes) -> None:
        self.requests += 1
        try:
            req = p.decode_request(data)
        except msgspec.DecodeError as exc:
            self._reject(ident, _salvage_id(data), f"malformed request: {exc}")
            return
        self._clients[ident] = time.monotonic()
        try:
            await self._dispatch(ident, req)
        except Exception as exc:  # noqa: BLE001 - translated; nothing escapes a request
            self.send(ident, p.ErrorReply(id=req.id, error=error_info(exc, op=type(req).__name__)))

    async def _dispatch(self, ident: bytes, req: p.Request) -> None:
        sched = self.scheduler
        if sched is None and isinstance(req, p.Submit | p.Cancel | p.Attach | p.Detach):
            raise NotReady(
                "kvmuxd is still loading its model; retry shortly (`kvmux status --wait` "
                "waits until it is ready)"
            )
        match req:
            case p.Hello(version=version):
                if version != p.PROTOCOL_VERSION:
                    raise VersionMismatch(
                        f"client speaks protocol {version}, this daemon {p.PROTOCOL_VERSION}; "
                        "install matching kvmux versions",
                        {"client": version, "daemon": p.PROTOCOL_VERSION},
                    )
                self.send(ident, msgspec.structs.replace(self._hello(), id=req.id))
            case p.Submit():
                # Validation tokenizes on the worker thread: do not hold up others.
                assert self._tg is not None
                self._tg.start_soon(self._submit, ident, req)
            case p.Cancel(job_id=job_id):
                assert sched is not None
                sched.cancel(job_id)
                self.send(ident, p.Ack(id=req.id))
            case p.Attach(job_id=job_id):
                assert sched is not None
                job = sched.attach(ident, job_id)
                self.send(
                    ident,
                    p.Attached(
                        id=req.id,
                        job_id=job.job_id,
                        total=len(job.items),
                        done=job.done,
                        results=job.results(),
                    ),
                )
            case p.Detach(job_id=job_id):
                assert sched is not None
                sched.detach(job_id)
                self.send(ident, p.Ack(id=req.id))
            case p.Status():
                self.send(ident, p.StatusReply(id=req.id, status=self._status()))
            case p.SubscribeLogs(level=level, job_id=job_id):
                self._subscribe_logs(ident, level, job_id)
                self.send(ident, p.Ack(id=req.id))
            case p.UnsubscribeLogs():
                self._unsubscribe_logs(ident)
                self.send(ident, p.Ack(id=req.id))
            case p.Heartbeat():
                self.send(ident, p.Ack(id=req.id))
            case p.Bye():
                self.send(ident, p.Ack(id=req.id))
                self._forget(ident, "its client closed the connection", "client_closed")

    async def _submit(self, ident: bytes, req: p.Submit) -> None:
        try:
            assert self.scheduler is not None  # _dispatch answered not_ready without one
            job = await self.scheduler.submit(ident, req)
        except Exception as exc:  # noqa: BLE001 - translated; nothing escapes a request
            self.send(ident, p.ErrorReply(id=req.id, error=error_info(exc, op="Submit")))
            return
        # No await between admission and this reply: it leaves before any event.
        self.send(ident, p.Accepted(id=req.id, job_id=job.job_id, total=len(job.items)))

    def _reject(self, ident: bytes, rid: int | None, why: str) -> None:
        self.rejected += 1
        count = self._rejects.get(ident, 0) + 1
        self._rejects[ident] = count
        if math.log10(count).is_integer():  # 1st, 10th, 100th ...: a flood stays readable
            log.warning("request_rejected", client=ident.hex(), reason=why[:300], count=count)
        self.send(ident, p.ErrorReply(id=rid, error=BadRequest(why).to_info()))

    # -- liveness and log subscriptions ----------------------------------------------
    async def _reap_loop(self) -> None:
        while True:
            await anyio.sleep(self.cfg.heartbeat_interval)
            now = time.monotonic()
            for ident, seen in list(self._clients.items()):
                silent = now - seen
                if silent <= self.cfg.client_timeout:
                    continue
                self._forget(
                    ident, f"its client stopped heartbeating ({silent:.1f} s silent)", "client_gone"
                )
            # Rejection tallies only rate-limit logging; forget senders that are gone.
            for ident in [i for i in self._rejects if i not in self._clients]:
                del self._rejects[ident]
            if self.scheduler is not None:
                self.scheduler.prune_retained()

    def _forget(self, ident: bytes, why: str, reason: str) -> None:
        self._clients.pop(ident, None)
        self._rejects.pop(ident, None)
        self._unsubscribe_logs(ident)
        if self.scheduler is None:  # still loading: no jobs yet
            return
        cancelled = self.scheduler.client_gone(ident, why, reason)
        log.info(reason, client=ident.hex(), why=why, cancelled_jobs=cancelled)

    def _subscribe_logs(self, ident: bytes, level: str, job_id: str | None) -> None:
        self._unsubscribe_logs(ident)
        sub = hub.subscribe(min_level=level, job_id=job_id)
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
                    self.send(ident, p.LogEvents(records=records, dropped=sub.dropped))


def _salvage_id(data: bytes) -> int | None:
    """The ``id`` of a request that failed validation, if one can be read, to echo it."""
    try:
        obj = msgspec.msgpack.decode(data)
    except msgspec.DecodeError:
        return None
    rid = obj.get("id") if isinstance(obj, dict) else None
    if isinstance(rid, int) and not isinstance(rid, bool) and 0 <= rid < 2**63:
        return rid
    return None
