"""A batch file as a Ray Dataset of prepared rows, parsed once by the driver as ``kvmux submit``
parses it."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import ray
import ray.data

from kvmux.client import protocol as p

from ._formats import BatchReader, LineError
from ._rows import prepared_row

PREPARED_SCHEMA = pa.schema(
    [
        ("line", pa.int64()),
        ("custom_id", pa.string()),
        ("index", pa.int64()),
        ("items", pa.binary()),
        ("refused", pa.string()),
    ]
)


@dataclass
class BatchFile:
    """A batch file read into a dataset: one prepared row per line to run.

    ``openai`` says whether its lines are OpenAI batch lines (its first line
    that decodes decides, as for ``kvmux submit``); ``rows`` the lines in the
    dataset, ``items`` the results they will give (one per choice),
    ``refused`` the lines that do not parse (each a row that becomes its
    error result), ``skipped`` the lines ``skip`` held."""

    dataset: ray.data.Dataset
    openai: bool | None
    rows: int
    items: int
    refused: int
    skipped: int


def read_batch(
    source: str,
    *,
    skip: frozenset[str] | set[str] = frozenset(),
    rows_per_block: int = 64,
) -> BatchFile:
    """Read a JSONL batch file (a local path, or any URI Ray Data reads: ``s3://``,
    ``gs://``, ...) into prepared rows, a block of ``rows_per_block`` at a time.

    Lines are parsed here, once, by the CLI's own reader: a ``custom_id`` used
    twice is refused on the later line, lines whose ``custom_id`` is in
    ``skip`` (``--resume``) are left out, and each row keeps its line number.
    Blocks go to the object store as they fill, so the driver holds one at a
    time; the number of blocks is the grain Ray Data balances replicas by.
    """
    reader = BatchReader(_lines(source), skip)
    blocks: list[ray.ObjectRef[Any]] = []
    rows: list[dict[str, Any]] = []
    count = index = 0
    for line, custom_id, items, refused in _by_line(reader):
        rows.append(prepared_row(line, custom_id, items, refused, index))
        index += len(items)
        if len(rows) >= rows_per_block:
            blocks.append(ray.put(pa.Table.from_pylist(rows, schema=PREPARED_SCHEMA)))
            count += len(rows)
            rows = []
    if rows or not blocks:
        blocks.append(ray.put(pa.Table.from_pylist(rows, schema=PREPARED_SCHEMA)))
        count += len(rows)
    return BatchFile(
        dataset=ray.data.from_arrow_refs(blocks),
        openai=reader.openai,
        rows=count,
        items=reader.items,
        refused=reader.errors,
        skipped=reader.skipped,
    )


def _by_line(
    entries: Iterable[p.Item | LineError],
) -> Iterator[tuple[int, str, list[p.Item], LineError | None]]:
    """Entries grouped into lines: a line's items (its choices) come one after another."""
    current: list[p.Item] = []
    for e in entries:
        if current and (isinstance(e, LineError) or e.line != current[0].line):
            yield current[0].line or 0, current[0].custom_id, current, None
            current = []
        if isinstance(e, LineError):
            yield e.line, e.custom_id, [], e
        else:
            current.append(e)
    if current:
        yield current[0].line or 0, current[0].custom_id, current, None


def _lines(source: str) -> Iterator[bytes]:
    if "://" not in source:
        # A local file is read as kvmux submit reads it: bytes, a line at a time.
        with Path(source).open("rb") as f:
            yield from f
        return
    ds = ray.data.read_text(source, drop_empty_lines=False)
    # Line numbers are positions in the file: the rows must come in file order.
    ds.context.execution_options.preserve_order = True
    for row in ds.iter_rows():
        yield row["text"].encode()
