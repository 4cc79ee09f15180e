"""``POST /v1/chat/completions`` and ``POST /v1/completions``: one request, one
transient job of kvmux items, its results as OpenAI's body or as Server-Sent Events.

The body goes through the same translation as a batch line
(:func:`kvmux.client.openai.body_items`); the job is transient (neither
journaled nor retained: nobody can come back for it once the connection is
gone). A client that leaves before its answer, or in the middle of its stream,
is a sink gone: its job is cancelled and its KV freed at the scheduler's next
turn. A stream whose reader does not take a chunk within ``http.send_timeout``
is dropped the same way; until then, tokens it has not taken yet are merged,
so what it holds is bounded by its own completion.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import anyio
import msgspec
import structlog
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from kvmux.client import protocol as p
from kvmux.client.errors import error_from_info
from kvmux.client.openai import (
    CHAT_URL,
    COMPLETIONS_URL,
    RequestError,
    body_items,
    chat_chunk,
    completion_body,
    completion_chunk,
    completion_id,
    info_body,
    tool_finish,
    usage_chunk,
)
from kvmux.client.tools import CallStream

from ..service import Service
from ._common import caller_of, front_of, json_response, read_json

log = structlog.get_logger("kvmux.http")


class _StreamOptions(msgspec.Struct):
    include_usage: bool = False


class _Envelope(msgspec.Struct):
    """What the front reads of a completion request besides its items."""

    model: str | None = None
    stream: bool = False
    stream_options: _StreamOptions | None = None


class Collector:
    """One request's sink: its job's events until the request takes them. Token
    updates of an item not taken yet are merged; only a stream's job sends them (an
    answer wants only the results, and its job is submitted with ``stream`` false)."""

    def __init__(self) -> None:
        self.pending: list[p.Event] = []
        self._delta_at: dict[int, int] = {}
        self._wake = asyncio.Event()
        self.results: dict[int, p.ItemResult] = {}
        self.started = False
        self.finished = False

    def deliver(self, events: list[p.Event]) -> None:
        for event in events:
            match event:
                case p.TokenDelta(index=index):
                    at = self._delta_at.get(index)
                    if at is not None:
                        before = self.pending[at]
                        assert isinstance(before, p.TokenDelta)
                        self.pending[at] = msgspec.structs.replace(
                            before,
                            token_ids=before.token_ids + event.token_ids,
                            text=before.text + event.text,
                        )
                        continue
                    self._delta_at[index] = len(self.pending)
                case p.ItemStarted():
                    self.started = True
                case p.ItemFinished(result=result):
                    self.results[result.index] = result
                    self._delta_at.pop(result.index, None)  # its tokens go before its end
                case p.JobFinished():
                    self.finished = True
            self.pending.append(event)
        self._wake.set()

    def take(self) -> list[p.Event]:
        events, self.pending = self.pending, []
        self._delta_at.clear()
        return events

    async def wait(self) -> None:
        await self._wake.wait()
        self._wake.clear()


async def chat_completions(request: Request) -> Response:
    return await _complete(request, CHAT_URL)


async def completions(request: Request) -> Response:
    return await _complete(request, COMPLETIONS_URL)


def _within_limit(limit: int | None, items: list[p.Item], body: dict[str, Any]) -> None:
    """scheduler.max_new_tokens, refused here under the name the request used (the
    scheduler's own refusal names the item's field, max_new_tokens)."""
    asked = max((i.max_new_tokens or 0 for i in items), default=0)
    if limit is not None and asked > limit:
        field = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
        raise RequestError(
            f"`{field}` {asked} is over this daemon's limit {limit} (scheduler.max_new_tokens)",
            field,
        )


async def _complete(request: Request, url: str) -> Response:
    front = front_of(request)
    body = await read_json(request)
    envelope = msgspec.convert(body, _Envelope)
    model = front.served_model(envelope.model)
    items = body_items(url, body)
    _within_limit(front.max_new_tokens, items, body)
    collector = Collector()
    job = await front.service.submit(
        collector, items, caller=caller_of(request), transient=True, stream=envelope.stream
    )
    assert job is not None  # no still_wanted: always a job
    service = front.service
    if not envelope.stream:
        if await _until(request, collector, lambda: collector.finished):
            return _gone(service, collector)
        failed = next((r for r in collector.results.values() if r.status != "ok"), None)
        if failed is not None and failed.error is not None:
            raise error_from_info(failed.error)
        results = [collector.results[i] for i in sorted(collector.results)]
        return json_response(completion_body(results, model))
    if await _until(request, collector, lambda: collector.started or collector.finished):
        return _gone(service, collector)
    if not collector.started:
        # Every choice failed before it began (a prompt over its maximum, say): an
        # error status, not a stream.
        failed = next(r for r in collector.results.values() if r.status != "ok")
        assert failed.error is not None
        raise error_from_info(failed.error)
    include_usage = envelope.stream_options is not None and envelope.stream_options.include_usage
    chunks = _chunks(service, collector, items, model, url == CHAT_URL, include_usage)
    return EventStream(chunks, front.cfg.send_timeout)


def _gone(service: Service, collector: Collector) -> Response:
    service.sink_gone(collector, "its HTTP client left before the answer", "client_gone")
    return Response(status_code=499)  # nobody is there to read it


async def _until(request: Request, collector: Collector, done: Any) -> bool:
    """Wait until ``done()``; True if the client disconnected first."""
    gone = False
    async with anyio.create_task_group() as tg:

        async def watch() -> None:
            nonlocal gone
            while (await request.receive())["type"] != "http.disconnect":
                pass
            gone = True
            tg.cancel_scope.cancel()

        tg.start_soon(watch)
        while not done():
            await collector.wait()
        tg.cancel_scope.cancel()
    return gone


def _sse(obj: Any) -> bytes:
    return b"data: " + msgspec.json.encode(obj) + b"\n\n"


async def _chunks(
    service: Service,
    collector: Collector,
    items: list[p.Item],
    model: str,
    chat: bool,
    include_usage: bool,
) -> AsyncIterator[bytes]:
    """The stream's Server-Sent Events: every turn's events in one write."""
    cid, created = completion_id(chat), int(time.time())
    choice = [item.choice for item in items]  # the job's item index -> OpenAI's choice
    # Choices asked for tool calls: their text is read for calls as it comes.
    calls = {k: CallStream() for k, item in enumerate(items) if chat and item.tool_mode}

    def piece(
        index: int,
        text: str | None = None,
        *,
        role: str | None = None,
        finish: str | None = None,
        logprobs: list[p.TokenLogprob] | None = None,
        tool_calls: list[dict[str, Any]] | None = None,
    ) -> bytes:
        if chat:
            obj = chat_chunk(
                cid,
                created,
                model,
                index,
                content=text,
                role=role,
                finish=finish,
                logprobs=logprobs,
                tool_calls=tool_calls,
            )
        else:
            obj = completion_chunk(
                cid, created, model, index, text=text or "", finish=finish, logprobs=logprobs
            )
        return _sse(obj)

    done = False
    try:
        while True:
            out = bytearray()
            failed = False
            for event in collector.take():
                match event:
                    case p.ItemStarted(index=index) if chat:
                        out += piece(choice[index], "", role="assistant")
                    case p.TokenDelta(index=index, text=text) if text and index in calls:
                        for delta in calls[index].feed(text):
                            out += piece(
                                choice[index],
                                delta.get("content"),
                                tool_calls=delta.get("tool_calls"),
                            )
                    case p.TokenDelta(index=index, text=text) if text:
                        out += piece(choice[index], text)
                    case p.ItemFinished(result=result) if result.status == "ok":
                        finish = result.finish_reason
                        stream = calls.get(result.index)
                        if stream is not None:
                            for delta in stream.flush():
                                out += piece(
                                    result.choice,
                                    delta.get("content"),
                                    tool_calls=delta.get("tool_calls"),
                                )
                            finish = tool_finish(finish, result.tool_mode, stream.called)
                        out += piece(result.choice, finish=finish, logprobs=result.logprobs)
                    case p.ItemFinished(result=result):
                        # The SDK raises on an error event: the stream ends here.
                        assert result.error is not None
                        out += _sse(info_body(result.error))
                        failed = True
                        break
                    case p.JobFinished():
                        done = True
            if failed:
                yield bytes(out) + b"data: [DONE]\n\n"
                return
            if done:
                if include_usage:
                    results = [collector.results[i] for i in sorted(collector.results)]
                    out += _sse(usage_chunk(cid, created, model, results, chat))
                yield bytes(out) + b"data: [DONE]\n\n"
                return
            if out:
                yield bytes(out)
            await collector.wait()
    finally:
        if not done:
            service.sink_gone(collector, "its HTTP stream ended before the job", "client_gone")


class EventStream(Response):
    """A ``text/event-stream`` response: a piece not taken within ``send_timeout`` drops
    the stream (one watch for the whole stream, not a timer per piece); a client gone
    ends it at once."""

    media_type = "text/event-stream"

    def __init__(self, chunks: AsyncIterator[bytes], send_timeout: float) -> None:
        self.chunks = chunks
        self.send_timeout = send_timeout
        self.status_code = 200
        self.background = None
        self.init_headers({"cache-control": "no-cache", "x-accel-buffering": "no"})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
        sending_since: float | None = None
        try:
            async with anyio.create_task_group() as tg:

                async def watch_client() -> None:
                    while (await receive())["type"] != "http.disconnect":
                        pass
                    tg.cancel_scope.cancel()

                async def watch_reader() -> None:
                    while True:
                        await anyio.sleep(min(1.0, self.send_timeout))
                        since = sending_since
                        if since is not None and time.monotonic() - since > self.send_timeout:
                            log.warning(
                                "http_stream_dropped",
                                reason="its reader took nothing",
                                seconds=self.send_timeout,
                            )
                            tg.cancel_scope.cancel()

                tg.start_soon(watch_client)
                tg.start_soon(watch_reader)
                async for data in self.chunks:
                    sending_since = time.monotonic()
                    await send({"type": "http.response.body", "body": data, "more_body": True})
                    sending_since = None
                # Watched too: uvicorn waits for the buffered pieces to drain before it
                # writes the next, so a stream whose last pieces were merged into one
                # (the items ended while its reader took nothing) blocks here, not above.
                sending_since = time.monotonic()
                await send({"type": "http.response.body", "body": b"", "more_body": False})
                sending_since = None
                tg.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                aclose = getattr(self.chunks, "aclose", None)
                if aclose is not None:
                    await aclose()
