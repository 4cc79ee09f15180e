"""Result lines: one JSON object per item, written (and flushed) the moment it finishes.

Every line has the same keys, so ``jq`` and dataframes need no special
cases::

    {"custom_id": "a", "line": 3, "index": 1, "status": "ok", "text": "...",
     "token_ids": [...], "finish_reason": "length", "usage": {...}, "seed": 7, "error": null}

``line`` is the input line (null when re-attached with ``kvmux results``,
which only the daemon's item ``index`` survives); ``index`` is the item's
position in the job (null for a line that never reached the daemon).
Results come in the order they finish; sort by ``line`` for input order.
``error`` is ``{"code", "message", "details"}`` with every diagnostic the
daemon sent.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import IO, Any

import msgspec

from .. import protocol as p
from .batch import LineError


def result_line(result: p.ItemResult, line: int | None) -> dict[str, Any]:
    """The output object for a result the daemon sent."""
    return {
        "custom_id": result.custom_id,
        "line": line,
        "index": result.index,
        "status": result.status,
        "text": result.text,
        "token_ids": result.token_ids,
        "finish_reason": result.finish_reason,
        "usage": None if result.usage is None else msgspec.to_builtins(result.usage),
        "seed": result.seed,
        "error": None if result.error is None else msgspec.to_builtins(result.error),
    }


def refused_line(err: LineError) -> dict[str, Any]:
    """The output object for a line that never became an item."""
    return {
        "custom_id": err.custom_id,
        "line": err.line,
        "index": None,
        "status": "error",
        "text": "",
        "token_ids": [],
        "finish_reason": None,
        "usage": None,
        "seed": None,
        "error": msgspec.to_builtins(err.to_info()),
    }


class ResultWriter:
    """Writes result objects as JSON lines, flushing each so an interrupted run keeps them."""

    def __init__(self, write: Callable[[str], object], flush: Callable[[], object]) -> None:
        self._write = write
        self._flush = flush
        self.written = 0

    @classmethod
    def to_stream(cls, stream: IO[str]) -> ResultWriter:
        return cls(stream.write, stream.flush)

    def write(self, obj: dict[str, Any]) -> None:
        self._write(msgspec.json.encode(obj).decode() + "\n")
        self._flush()
        self.written += 1
