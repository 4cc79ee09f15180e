"""The outbox: what a turn produces for clients is gathered here and sent as one
message per client per turn, not one per token; and an item's result is built
here, in the one shape every ending shares (what it echoes, what a stopped
item had already produced)."""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from kvmux.client.errors import Cancelled, ShuttingDown
from kvmux.client.protocol import (
    Event,
    ItemResult,
    TokenLogprob,
    TopLogprob,
    Usage,
)

from ..engine import Completion, TokenLogprobs
from ..errors import error_info
from ._jobs import ItemState, JobState, Sink


class Outbox:
    """Events of this turn, per client, until :meth:`flush` hands them on."""

    def __init__(self) -> None:
        self._events: dict[Sink, list[Event]] = {}

    def emit(self, job: JobState, event: Event) -> None:
        for client in job.clients:
            self._events.setdefault(client, []).append(event)

    def emit_tokens(self, job: JobState, event: Event) -> None:
        """A token update, to the clients that take them."""
        for client in job.streams:
            self._events.setdefault(client, []).append(event)

    def flush(self) -> None:
        """One message per client for everything this turn produced."""
        if not self._events:
            return
        events, self._events = self._events, {}
        for client, batch in events.items():
            client.deliver(batch)


def make_result(state: ItemState, status: Literal["ok", "error"], **fields: Any) -> ItemResult:
    """An item's result, carrying what the item asked to have echoed."""
    return ItemResult(
        index=state.index,
        custom_id=state.custom_id,
        status=status,
        line=state.line,
        choice=state.choice,
        choices=state.choices,
        n=state.n,
        chat=state.chat,
        tool_mode=state.tool_mode,
        **fields,
    )


def completed_result(state: ItemState, done: Completion) -> ItemResult:
    """The result of an item its session decoded to the end."""
    return make_result(
        state,
        "ok",
        text=done.text,
        token_ids=done.token_ids,
        finish_reason=done.finish_reason,
        usage=Usage(
            done.prompt_tokens,
            done.completion_tokens,
            done.prompt_tokens + done.completion_tokens,
            done.cached_tokens,
        ),
        seed=done.seed,
        logprobs=_wire_logprobs(done.logprobs),
    )


def error_result(state: ItemState, error: Exception) -> ItemResult:
    """The result of an item that ``error`` ended; taken before its session is
    released, so an item stopped mid-decode (cancelled, shut down) keeps the text
    and tokens it had produced, marked ``partial``."""
    info = error_info(error, job_id=state.job.job_id, session_id=state.session_id)
    result = make_result(state, "error", error=info)
    session = state.session
    if session is None or not isinstance(error, Cancelled | ShuttingDown) or not session.generated:
        return result
    if session.defers_text:
        session.drain_text()  # what no client took as an update (``stream`` false)
    session.stream.finish()  # what the decoder held back (a partial character) too
    details = {**info.details, "partial": True}
    return msgspec.structs.replace(
        result,
        text=session.stream.text,
        token_ids=list(session.generated),
        error=msgspec.structs.replace(info, details=details),
    )


def _wire_logprobs(logprobs: list[TokenLogprobs] | None) -> list[TokenLogprob] | None:
    if logprobs is None:
        return None
    return [
        TokenLogprob(e.token_id, e.token, e.logprob, [TopLogprob(*t) for t in e.top])
        for e in logprobs
    ]
