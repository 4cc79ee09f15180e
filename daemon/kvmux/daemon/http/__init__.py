"""kvmuxd's HTTP front: OpenAI's API (completions, models, files, batches) beside the
ZeroMQ socket, in the same process and event loop, over the same service.

Starlette on uvicorn (with httptools), the pair vLLM's server stands on: the
fastest HTTP/1.1 parsing among the well-kept ASGI servers, which matters for a
stream of small chunks per token; driven from the daemon's own anyio/asyncio
loop (see :mod:`._serve`). Routes only translate (:mod:`._completions`,
:mod:`._routes`); errors become OpenAI's error object in one place
(:mod:`._common`).
"""

from __future__ import annotations

import errno
import socket
import time
from collections.abc import Callable
from typing import Any

import anyio
import anyio.abc
import structlog
import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvmux.client.errors import NotFound

from ..access import ANONYMOUS, Caller
from ..batches import Batches, FileStore
from ..budget import Bucket, forget_full
from ..config import HttpConfig, split_listen
from ..metrics import Metrics
from ..model import ModelSpec
from ..server import EndpointInUse
from ..service import Service
from . import _completions as completions
from . import _routes as routes
from ._common import BodyTimeout, BodyTooLarge, error_response, guarded, json_error, unauthorized
from ._serve import bind, make_server, serve
from .keys import ApiKeys

__all__ = ["HttpFront"]

log = structlog.get_logger("kvmux.http")


class HttpFront:
    """The HTTP listener, its keys, and what its routes reach: the service, the files,
    the batches, the served model's names."""

    def __init__(
        self,
        cfg: HttpConfig,
        service: Service,
        files: FileStore,
        batches: Batches,
        *,
        names: list[str],
        state: Callable[[], str],
        grace: float,
        metrics: Metrics | None = None,
    ) -> None:
        self.cfg = cfg
        self.service = service
        self.budget = service.budget
        self.files = files
        self.batches = batches
        self.names = names
        # Known once the model is loaded (see loaded()).
        self.max_model_len: int | None = None
        self.model_folder = ""
        self.model_precision = ""
        self.max_new_tokens: int | None = None
        self.state = state
        self.grace = grace
        self.metrics = metrics
        self.keys = ApiKeys(cfg.api_keys)
        self.keys.load()
        self.created = int(time.time())
        self._buckets: dict[Any, Bucket] = {}
        self._sock: socket.socket | None = None
        self.server: uvicorn.Server | None = None
        self.url = ""

    # -- who is asking ------------------------------------------------------------------
    def authenticate(self, header: str | None) -> Caller:
        """The caller an ``Authorization`` header names: an API key's owner, or with no
        keys configured (loopback only) ``anonymous``; ``unauthorized`` otherwise."""
        if not self.keys.enabled:
            return Caller(ANONYMOUS)
        scheme, _, key = (header or "").partition(" ")
        caller = self.keys.caller(key.strip()) if scheme.lower() == "bearer" else None
        if caller is None:
            raise unauthorized()
        return caller

    def reload_keys(self) -> None:
        """SIGHUP: a key removed from the file is refused from now on."""
        count = self.keys.load()
        log.info("api_keys_loaded", file=self.cfg.api_keys, keys=count)

    def connection_bucket(self, client: Any) -> Bucket:
        """The request budget of the connection ``client`` (host, port) names."""
        key = tuple(client) if client else None
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = self._buckets[key] = self.budget.connection()
        return bucket

    def housekeeping(self) -> None:
        """Forget the buckets of connections that spent nothing lately."""
        forget_full(self._buckets)

    # -- the model ----------------------------------------------------------------------
    def loaded(self, spec: ModelSpec, max_new_tokens: int) -> None:
        """What the loaded model and the scheduler tell requests and /v1/models."""
        self.max_model_len = spec.context_length
        self.model_folder = str(spec.folder)
        self.model_precision = spec.features.precision
        self.max_new_tokens = max_new_tokens

    def served_model(self, name: str | None) -> str:
        """The name a request gave the model; none at all is the served model, as vLLM
        serves its one model to a request without ``model``."""
        if name is None:
            return self.names[0]
        if name not in self.names:
            error = NotFound(
                f"The model `{name}` does not exist: this kvmuxd serves "
                f"{', '.join(repr(n) for n in self.names)} (http.served_model_names)",
                {"param": "model"},
            )
            error.code = "model_not_found"
            raise error
        return name

    def model_object(self, name: str) -> dict[str, Any]:
        return {
            "id": name,
            "object": "model",
            "created": self.created,
            "owned_by": "kvmux",
            # vLLM's root is the model's path; so is kvmux's (a built-in's folder in
            # the model cache), with the precision its graph's weights have.
            "root": self.model_folder or name,
            "parent": None,
            "max_model_len": self.max_model_len,
            "precision": self.model_precision or None,
        }

    # -- serving ------------------------------------------------------------------------
    def bind(self) -> str:
        """Bind ``http.listen`` now (before the model loads: a port in use fails the
        start, and /health answers 503 meanwhile); the URL it serves."""
        host, port = split_listen(self.cfg.listen)
        try:
            self._sock = bind(host, port)
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE:
                raise
            # The same words as a socket in use: the address, and the key that sets it.
            raise EndpointInUse(
                f"http.listen {self.cfg.listen}: address already in use (another process "
                f"listens on port {port}); stop it, or set http.listen (kvmuxd --http "
                "HOST:PORT) to a free port"
            ) from None
        bound = self._sock.getsockname()
        scheme = "https" if self.cfg.tls_certfile else "http"
        shown = f"[{bound[0]}]" if ":" in bound[0] else bound[0]
        self.url = f"{scheme}://{shown}:{bound[1]}"
        return self.url

    async def serve(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        if self._sock is None:
            self.bind()
        assert self._sock is not None
        server = self.server = make_server(build_app(self), self.cfg)
        log.info("http_listening", url=self.url, api_keys=self.keys.enabled)
        await serve(server, self._sock, self.grace, task_status=task_status)


def build_app(front: HttpFront) -> ASGIApp:
    """The Starlette app: its routes, OpenAI-shaped refusals, bounded bodies."""
    metered: list[tuple[str, Any, list[str]]] = [
        ("/v1/models", routes.list_models, ["GET"]),
        ("/v1/models/{model:path}", routes.get_model, ["GET"]),
        ("/v1/chat/completions", completions.chat_completions, ["POST"]),
        ("/v1/completions", completions.completions, ["POST"]),
        ("/v1/files", routes.create_file, ["POST"]),
        ("/v1/files", routes.list_files, ["GET"]),
        ("/v1/files/{file_id}", routes.get_file, ["GET"]),
        ("/v1/files/{file_id}/content", routes.file_content, ["GET"]),
        ("/v1/batches", routes.create_batch, ["POST"]),
        ("/v1/batches", routes.list_batches, ["GET"]),
        ("/v1/batches/{batch_id}", routes.get_batch, ["GET"]),
        # Where vLLM serves them: scrapers reach one port, with its API keys.
        ("/metrics", routes.metrics, ["GET"]),
    ]
    # What only releases things is never refused for want of budget (as on the socket).
    releasing: list[tuple[str, Any, list[str]]] = [
        ("/v1/files/{file_id}", routes.delete_file, ["DELETE"]),
        ("/v1/batches/{batch_id}/cancel", routes.cancel_batch, ["POST"]),
    ]
    table = [Route("/health", guarded(routes.health, auth=False), methods=["GET"])]
    table += [Route(path, guarded(fn), methods=m) for path, fn, m in metered]
    table += [Route(path, guarded(fn, metered=False), methods=m) for path, fn, m in releasing]
    app = Starlette(routes=table, exception_handlers={HTTPException: json_error})
    app.state.front = front
    return Limits(app, front.cfg)


class Limits:
    """Every request body bounded: past its limit (``http.max_file_bytes`` for an
    upload, ``http.max_body_bytes`` else) it is refused 413, and it must arrive
    within ``http.body_timeout`` (408)."""

    def __init__(self, app: ASGIApp, cfg: HttpConfig) -> None:
        self.app = app
        self.cfg = cfg

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        upload = scope["path"] == "/v1/files" and scope["method"] == "POST"
        limit = self.cfg.max_file_bytes + (1 << 20) if upload else self.cfg.max_body_bytes
        for name, value in scope["headers"]:
            if name == b"content-length" and value.isdigit() and int(value) > limit:
                await error_response(BodyTooLarge(limit))(scope, receive, send)
                return
        deadline = time.monotonic() + self.cfg.body_timeout
        size = 0
        done = False

        async def limited() -> Message:
            nonlocal size, done
            if done:
                return await receive()
            with anyio.move_on_after(max(0.0, deadline - time.monotonic())):
                message = await receive()
                if message["type"] == "http.request":
                    size += len(message.get("body", b""))
                    if size > limit:
                        raise BodyTooLarge(limit)
                    done = not message.get("more_body", False)
                else:
                    done = True
                return message
            raise BodyTimeout(
                f"the request body did not arrive within {self.cfg.body_timeout:g} s "
                "(http.body_timeout)"
            )

        await self.app(scope, limited, send)
