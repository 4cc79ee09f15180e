"""The rows a kvmux stage takes and gives.

In, one row per batch-file line, in one of three shapes:

- a *prepared* row, as :func:`kvmux.ray.read_batch` makes them: ``line``,
  ``custom_id``, ``index`` (its first item's position among the file's
  items, refused lines not counted: the ``index`` ``kvmux submit``'s job
  gives it when the file fits one message),
  ``items`` (the line's items, msgpack) and ``refused`` (why the line is
  not an item, else empty). The file was parsed once, by the driver.
- ``line`` and ``text``: the line's JSON, as ``ray.data.read_text`` gives it;
- ``line`` and the line's own fields as columns (``ray.data.read_json``,
  ``from_items``): an OpenAI batch line or a kvmux item.

``line`` (from 1) is required: kvmux's results carry it, and a line
without a ``custom_id`` is named after it. Out, one row per result line
``kvmux submit`` would write (one per choice in kvmux's format, one per
line in OpenAI's): ``custom_id``, ``line``, ``choice``, ``ok``, ``tokens``
(completion tokens), ``output`` (the result line's JSON, exactly as
``kvmux submit`` writes it), ``node`` (the Ray node that ran it) and
``replica`` (which actor there: node and process id).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

from kvmux.client import protocol as p

from ._formats import LineError, parse_line

OUTPUT_COLUMNS = ("custom_id", "line", "choice", "ok", "tokens", "output", "node", "replica")

_items = msgspec.msgpack.Encoder()
_decode_items = msgspec.msgpack.Decoder(list[p.Item])


@dataclass
class Entry:
    """One input line: its items, or why it is not one."""

    line: int
    custom_id: str
    items: list[p.Item]
    refused: LineError | None = None
    index: int | None = None  # its first item's position among the file's items, when known


def prepared_row(
    line: int, custom_id: str, items: list[p.Item], refused: LineError | None, index: int
) -> dict[str, Any]:
    """The row :func:`entry` reads back as the same :class:`Entry`."""
    return {
        "line": line,
        "custom_id": custom_id,
        "index": index,
        "items": _items.encode(items) if items else b"",
        "refused": "" if refused is None else refused.reason,
    }


def entry(row: dict[str, Any]) -> Entry:
    """The :class:`Entry` a row of any of the three shapes stands for."""
    line = row.get("line")
    if not isinstance(line, int) or isinstance(line, bool) or line < 1:
        raise ValueError(
            "a kvmux stage needs a `line` column (the batch-file line, from 1) in every row; "
            f"got {line!r}. kvmux.ray.read_batch(path) reads a file into such rows"
        )
    if "items" in row:
        custom_id = str(row["custom_id"])
        if row.get("refused"):
            return Entry(line, custom_id, [], LineError(line, str(row["refused"]), custom_id))
        return Entry(line, custom_id, _decode_items.decode(row["items"]), index=row.get("index"))
    text = row.get("text")
    raw = text if isinstance(text, str) else _fields(row)
    try:
        items = parse_line(raw, line)
    except LineError as exc:
        return Entry(line, exc.custom_id, [], exc)
    return Entry(line, items[0].custom_id, items)


def _fields(row: dict[str, Any]) -> bytes:
    # Columns a reader filled for other lines' keys hold null, which both line
    # formats read as "not given".
    return msgspec.json.encode({k: v for k, v in row.items() if k != "line"})
