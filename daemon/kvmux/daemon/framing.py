"""Every message the daemon sends stays within ``MAX_REPLY_BYTES``.

A step's events and a batch of log records are packed into as many messages
as they need; an item's result too large for one message travels as
:class:`~kvmux.client.protocol.ItemFinishedPart` events, one message each,
that the client joins back into the very bytes of the result. So a client
that never reads pins at most its pipe's messages times that size, whatever
it asked for. The common case (everything fits) costs one encode, as before.
"""

from __future__ import annotations

from typing import Any

import msgspec

from kvmux.client import protocol as p

_encode = msgspec.msgpack.Encoder().encode
# A message's own map around its list: kind, the list's key and header, dropped.
_ENVELOPE = 64


class _RawEvents(msgspec.Struct, tag="events", tag_field="kind"):
    """:class:`~kvmux.client.protocol.Events` on the wire, from events encoded already."""

    events: list[msgspec.Raw]


class _RawLogs(msgspec.Struct, tag="logs", tag_field="kind"):
    """:class:`~kvmux.client.protocol.LogEvents` on the wire, from records encoded already."""

    records: list[msgspec.Raw]
    dropped: int = 0


def result_parts(job_id: str, result: p.ItemResult) -> list[p.ItemFinishedPart]:
    """``result``'s encoding as the parts of one finished event."""
    data = _encode(result)
    size = len(data)
    return [
        p.ItemFinishedPart(
            job_id=job_id,
            index=result.index,
            offset=at,
            size=size,
            data=data[at : at + p.PART_BYTES],
        )
        for at in range(0, size, p.PART_BYTES)
    ]


def event_messages(events: list[p.Event]) -> list[bytes]:
    """``events`` as encoded ``events`` messages of at most ``MAX_REPLY_BYTES`` each, in order."""
    limit = p.MAX_REPLY_BYTES
    whole = p.encode(p.Events(events=events))
    if len(whole) <= limit:
        return [whole]
    encoded: list[bytes] = []
    for event in events:
        one = _encode(event)
        if len(one) + _ENVELOPE > limit and isinstance(event, p.ItemFinished):
            encoded.extend(_encode(part) for part in result_parts(event.job_id, event.result))
        else:
            encoded.append(one)
    return [_encode(_RawEvents([msgspec.Raw(e) for e in batch])) for batch in _pack(encoded, limit)]


def log_messages(records: list[dict[str, Any]], dropped: int) -> list[bytes]:
    """Log records as ``logs`` messages of at most ``MAX_REPLY_BYTES``; a record too large
    for one message on its own is cut to what names it (event, level, time, job)."""
    limit = p.MAX_REPLY_BYTES
    whole = p.encode(p.LogEvents(records=records, dropped=dropped))
    if len(whole) <= limit:
        return [whole]
    encoded = []
    for record in records:
        one = _encode(record)
        if len(one) + _ENVELOPE > limit:
            kept = {k: record[k] for k in ("event", "level", "timestamp", "job_id") if k in record}
            one = _encode({**kept, "truncated_bytes": len(one)})
        encoded.append(one)
    return [
        _encode(_RawLogs([msgspec.Raw(r) for r in batch], dropped))
        for batch in _pack(encoded, limit)
    ]


def _pack(encoded: list[bytes], limit: int) -> list[list[bytes]]:
    """Consecutive runs of ``encoded`` that fit one message each."""
    batches: list[list[bytes]] = []
    batch: list[bytes] = []
    size = _ENVELOPE
    for one in encoded:
        if batch and size + len(one) > limit:
            batches.append(batch)
            batch, size = [], _ENVELOPE
        batch.append(one)
        size += len(one)
    if batch:
        batches.append(batch)
    return batches
