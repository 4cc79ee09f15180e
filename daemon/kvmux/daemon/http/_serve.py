"""uvicorn, driven from the daemon's own event loop on a socket the daemon bound.

uvicorn's ``serve()`` would install its own signal handlers; the daemon has
its own (drain, reload, stop), so this runs uvicorn's ``startup``, its tick
loop and its ``shutdown`` directly. Its HTTP protocol gets one addition: a
connection that has not sent a request's headers within ``http.header_timeout``
(a half-open or slowloris connection) is closed; uvicorn only times out idle
keep-alive connections.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from typing import Any

import anyio
import anyio.abc
import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from ..config import HttpConfig


class TimedProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol, closing connections slow to send headers."""

    header_timeout = 10.0
    _header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def on_headers_complete(self) -> None:
        self._disarm()
        super().on_headers_complete()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm()  # the next request's headers, on a kept-alive connection

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._disarm()
        self._header_timer = self.loop.call_later(self.header_timeout, self._late)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _late(self) -> None:
        self._header_timer = None
        if not self.transport.is_closing():
            self.transport.close()


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (port 0: any free one)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP by name: asyncio turns Nagle off (TCP_NODELAY) only on sockets that
    # say so, and connections inherit it from this one. With Nagle, a stream's
    # second small write waited for the reader's delayed ACK: 40 ms a chunk.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(2048)
    except OSError:
        sock.close()
        raise
    sock.setblocking(False)
    return sock


def make_server(app: Any, cfg: HttpConfig) -> uvicorn.Server:
    protocol = type("KvmuxHttpProtocol", (TimedProtocol,), {"header_timeout": cfg.header_timeout})
    config = uvicorn.Config(
        app,
        http=protocol,
        lifespan="off",
        loop="none",
        log_config=None,
        access_log=False,
        server_header=False,
        limit_concurrency=cfg.max_connections,
        timeout_keep_alive=cfg.keep_alive_timeout,  # type: ignore[arg-type]
        ssl_certfile=cfg.tls_certfile or None,
        ssl_keyfile=cfg.tls_keyfile or None,
    )
    config.load()
    # uvicorn's own log lines (a 503 past limit_concurrency, a bad request line) are
    # warnings on stderr; the daemon logs its requests itself.
    logging.getLogger("uvicorn.error").setLevel(logging.WARNING)
    return uvicorn.Server(config)


async def serve(
    server: uvicorn.Server,
    sock: socket.socket,
    grace: float,
    *,
    task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Serve on ``sock`` until cancelled; then stop taking connections and give the
    open ones ``grace`` seconds to finish."""
    server.config.timeout_graceful_shutdown = max(1, int(grace))
    server.lifespan = server.config.lifespan_class(server.config)  # what serve() would set
    await server.startup(sockets=[sock])
    task_status.started()
    try:
        await server.main_loop()
    finally:
        with anyio.CancelScope(shield=True):
            server.force_exit = False
            await server.shutdown(sockets=[sock])
