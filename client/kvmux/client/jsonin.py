"""JSON from outside (a request body, a batch line, a file someone wrote), decoded with one
nesting limit checked before any recursive work.

msgspec (like the standard library's ``json``) decodes nested arrays and
objects recursively: a line ``[[[[...]]]]`` a thousand deep raises
``RecursionError``, and where it does depends on how deep the caller's own
stack already is. So the depth is measured first, by an iterative scan, and
:data:`MAX_DEPTH` is the same for the daemon's HTTP front, its Batch API, the
``kvmux`` CLI and the operator's files. Refusals are :class:`TooDeep`, a
``msgspec.DecodeError``: every place that already answers invalid JSON answers
this the same way.

This module imports nothing of the daemon: the client and kvmuxd share it.
"""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np

# Levels of arrays and objects one JSON value may nest. serde_json's default;
# an OpenAI request nests four or five (messages -> content parts -> object), a
# JSON schema in ``response_format`` a few dozen at the most.
MAX_DEPTH = 128

# Each byte's step in depth: +1 opening a bracket, -1 closing one, 0 otherwise.
_STEP = np.zeros(256, np.int8)
_STEP[[ord("["), ord("{")]] = 1
_STEP[[ord("]"), ord("}")]] = -1
_QUOTE = ord('"')


class TooDeep(msgspec.DecodeError):
    """JSON nested deeper than :data:`MAX_DEPTH` levels."""

    def __init__(self, limit: int = MAX_DEPTH) -> None:
        super().__init__(f"JSON nested deeper than {limit} levels (kvmux's limit on nesting)")
        self.limit = limit


def depth(data: bytes | str) -> int:
    """How deep arrays and objects nest in ``data`` (0 for a scalar), in linear time and
    without recursion. Brackets inside strings do not count; for text that is not
    JSON the figure is only an estimate, and the decoder refuses such text anyway."""
    if isinstance(data, str):
        data = data.encode("utf-8", "surrogatepass")
    if not (b"[" in data or b"{" in data):
        return 0
    if b"\\" in data:
        # Escaped backslashes out first, then escaped quotes: every quote left opens or
        # closes a string (an unterminated one runs to the end).
        data = data.replace(b"\\\\", b"").replace(b'\\"', b"")
    text = np.frombuffer(data, np.uint8)
    steps = _STEP[text]
    if b'"' in data:
        in_string = np.logical_xor.accumulate(text == _QUOTE)
        steps[in_string] = 0
    return max(0, int(steps.cumsum(dtype=np.int32).max()))


def check_depth(data: bytes | str, limit: int = MAX_DEPTH) -> None:
    """Raise :class:`TooDeep` if ``data`` nests deeper than ``limit``."""
    if isinstance(data, str):
        data = data.encode("utf-8", "surrogatepass")
    # A text with no more opening brackets than the limit cannot nest deeper: most
    # bodies and lines stop here, after two scans in C.
    if data.count(b"[") + data.count(b"{") <= limit:
        return
    if depth(data) > limit:
        raise TooDeep(limit)


def decode(data: bytes | str, limit: int = MAX_DEPTH) -> Any:
    """``data`` as Python values, or ``msgspec.DecodeError`` (:class:`TooDeep` for
    nesting over ``limit``)."""
    check_depth(data, limit)
    try:
        return msgspec.json.decode(data)
    except RecursionError:
        # Within the limit but the caller's stack was already deep: still a refusal.
        raise TooDeep(limit) from None
