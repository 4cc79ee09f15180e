"""Which rows share a run, and how a failed run is split until only the failing row fails."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

from .runner import RowInput

T = TypeVar("T")


def plan(rows: Sequence[RowInput], max_rows: int, *, batch_prompts: bool = True) -> list[list[int]]:
    """Indices of ``rows`` grouped into runs of adjacent rows of one group (at most
    ``max_rows`` a run): decode rows together, first prompts together when
    ``batch_prompts``, and every other prompt chunk alone (onnxruntime runs no prompt
    with past in a batch; its CUDA GroupQueryAttention takes no batch of prompts at
    all: "batch_size must be 1 when sequence_length > 1 and past context is given")."""
    if len(rows) == 1:
        return [[0]]
    decode: list[tuple[int, int, int]] = []
    first: list[tuple[int, int, int]] = []
    runs: list[list[int]] = []
    for i, r in enumerate(rows):
        if len(r.tokens) == 1 or (batch_prompts and r.cache.valid_len == 0):
            p = r.placement()
            (decode if len(r.tokens) == 1 else first).append((p.group, p.row, i))
        else:
            runs.append([i])
    runs.extend(_spans(first, max_rows))
    runs.extend(_spans(decode, max_rows))
    return runs


def _spans(rows: list[tuple[int, int, int]], max_rows: int) -> list[list[int]]:
    rows.sort()
    spans: list[list[int]] = []
    span: list[int] = []
    last: tuple[int, int] | None = None
    for group, row, i in rows:
        adjacent = last is not None and last == (group, row - 1)
        if span and (not adjacent or len(span) >= max_rows):
            spans.append(span)
            span = []
        span.append(i)
        last = (group, row)
    if span:
        spans.append(span)
    return spans


def run_isolated(
    rows: Sequence[RowInput], run: Callable[[Sequence[RowInput]], Sequence[T]]
) -> list[T | Exception]:
    """``run(rows)``, and when it fails, each half again, down to the row that fails alone.

    A run that fails has rolled its rows back, so a half re-runs from the same
    state: the rows that do not fail get exactly the results they would have
    had. One failing row among ``n`` costs about ``2 log2 n`` extra runs.
    """
    try:
        return list(run(rows))
    except Exception as exc:  # noqa: BLE001 - it becomes that row's entry, or is split
        return split_failed(rows, run, exc)


def split_failed(
    rows: Sequence[RowInput], run: Callable[[Sequence[RowInput]], Sequence[T]], exc: Exception
) -> list[T | Exception]:
    """What :func:`run_isolated` gives once ``run(rows)`` has failed with ``exc``."""
    if len(rows) == 1:
        return [exc]
    mid = len(rows) // 2
    return [*run_isolated(rows[:mid], run), *run_isolated(rows[mid:], run)]
