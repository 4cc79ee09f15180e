"""Cohorts: sessions of one bucket capacity as rows of shared buffers, so one run decodes them.

A cohort is per-layer K and V buffers ``[rows, kv_heads, capacity, head_dim]``
plus a mask ``[rows, capacity]``. A session's KV is one row; growing it moves
it to a free row of the next bucket's cohort through the same transaction as
any growth (:func:`kvmux.kv.ensure_capacity`): claim a row, copy the valid
prefix, build the mask row, commit, free the old row.

Rows never move while they hold a session: a freed row is left free and the
next claim takes the lowest free row. Moving the last row into a hole (to keep
active rows contiguous) would rewrite another session's row while a growth or
a run may be using it; a runner instead decodes each contiguous span of ready
rows in one run.

Memory follows the rows in use, not the cohort's row count: the buffers are
reserved as anonymous mappings, whose pages the kernel backs only when a row
is written, and a freed row's pages are handed back (``MADV_DONTNEED``, which
also makes them read as zeros). So the budget charges exactly what a session
of its own would (its capacity times bytes per token), and a growth's
transient peak is one row: the old row plus the new one.
"""

from __future__ import annotations

import mmap
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ._bucket import resolve_min_bucket
from ._budget import MemoryBudget, MemoryInfo, host_memory
from ._buffers import KvState
from ._hardmax import HardMax
from ._placement import Placement, new_group
from ._spec import KvSpec

_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000 if sys.platform == "linux" else 0)
_RESERVED = object()  # a row claimed by a growth that has not committed
# Address space, not memory; kept well under what a kernel with strict
# overcommit (which ignores MAP_NORESERVE) may still grant.
_MAX_RESERVED = 16 << 30


class _Lazy:
    """An array over an anonymous mapping: zero, and backed by memory only where written."""

    def __init__(self, shape: tuple[int, ...], dtype: np.dtype[Any]) -> None:
        count = int(np.prod(shape))
        nbytes = max(count * dtype.itemsize, 1)
        self.map = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _NORESERVE)
        self.array: np.ndarray[Any, Any] = np.frombuffer(self.map, dtype, count).reshape(shape)
        self.bytes = np.frombuffer(self.map, np.uint8, count * dtype.itemsize)
        self.row_bytes = count * dtype.itemsize // shape[0]

    def clear_row(self, row: int) -> None:
        """Zero one row, giving its whole pages back to the kernel."""
        start, end = row * self.row_bytes, (row + 1) * self.row_bytes
        page = mmap.PAGESIZE
        inner_start = -(-start // page) * page
        inner_end = end // page * page
        if inner_end > inner_start:
            try:
                self.map.madvise(mmap.MADV_DONTNEED, inner_start, inner_end - inner_start)
            except (OSError, ValueError, AttributeError):
                self.bytes[inner_start:inner_end] = 0  # still correct, only resident
            self.bytes[start:inner_start] = 0
            self.bytes[inner_end:end] = 0
        else:
            self.bytes[start:end] = 0


class Cohort:
    """``rows`` rows of one capacity: the buffers one batched run binds."""

    def __init__(self, spec: KvSpec, capacity: int, rows: int) -> None:
        self.capacity = capacity
        self.rows = rows
        self.group = new_group()
        shape = (rows, spec.kv_heads, capacity, spec.head_dim)
        dtype = spec.storage_dtype
        self._k = [_Lazy(shape, dtype) for _ in range(spec.num_layers)]
        self._v = [_Lazy(shape, dtype) for _ in range(spec.num_layers)]
        self._mask = _Lazy((rows, capacity), np.dtype(spec.mask_dtype or "int64"))
        self.keys = [b.array for b in self._k]
        self.values = [b.array for b in self._v]
        self.mask = self._mask.array
        self.slots: list[object | None] = [None] * rows
        self.used = 0

    def clear_row(self, row: int) -> None:
        for buf in (*self._k, *self._v, self._mask):
            buf.clear_row(row)

    def __repr__(self) -> str:
        return f"Cohort(capacity={self.capacity}, rows={self.used}/{self.rows})"


class CohortPool:
    """Per bucket capacity, cohorts of ``rows_per_cohort`` rows; hands rows out and takes them back.

    Thread-safe: growths claim rows on their own threads while the event loop
    releases finished sessions' rows.
    """

    def __init__(
        self,
        spec: KvSpec,
        *,
        rows_per_cohort: int = 64,
        min_bucket: int | None = None,
        budget: MemoryBudget | None = None,
    ) -> None:
        if rows_per_cohort < 1:
            raise ValueError(f"rows_per_cohort must be >= 1, got {rows_per_cohort}")
        self.spec = spec
        self.rows_per_cohort = rows_per_cohort
        self.min_bucket = resolve_min_bucket(min_bucket)
        self.budget = budget if budget is not None else MemoryBudget()
        self._cohorts: dict[int, list[Cohort]] = {}
        self._lock = threading.Lock()
        self.moved_bytes = 0  # copied by compact(), for benchmarks

    def rows_for(self, capacity: int) -> int:
        """Rows of a new cohort of ``capacity``: fewer for long buckets, so that one
        cohort reserves at most ``_MAX_RESERVED`` bytes of address space."""
        row = capacity * self.spec.bytes_per_token
        return max(1, min(self.rows_per_cohort, _MAX_RESERVED // row))

    def new_cache(self, hard_max: HardMax) -> RowKvCache:
        """An empty cache (capacity 0) whose first growth claims its first row."""
        return RowKvCache(self, hard_max)

    def cohorts(self) -> list[Cohort]:
        with self._lock:
            return [c for cs in self._cohorts.values() for c in cs]

    def claim(self, capacity: int) -> tuple[Cohort, int]:
        """The lowest free row of a cohort of ``capacity`` (a new cohort when all are full)."""
        with self._lock:
            for cohort in self._cohorts.get(capacity, []):
                if cohort.used < cohort.rows:
                    row = cohort.slots.index(None)
                    cohort.slots[row] = _RESERVED
                    cohort.used += 1
                    return cohort, row
        # Mapping is outside the lock; another claim may map one too, harmlessly.
        cohort = Cohort(self.spec, capacity, self.rows_for(capacity))
        with self._lock:
            cohort.slots[0] = _RESERVED
            cohort.used = 1
            self._cohorts.setdefault(capacity, []).append(cohort)
        return cohort, 0

    def settle(self, cohort: Cohort, row: int, owner: object) -> None:
        with self._lock:
            cohort.slots[row] = owner

    def compact(self, caches: Sequence[RowKvCache]) -> int:
        """Move rows of ``caches`` down into free rows below them; returns bytes moved.

        The caller guarantees that no run and no growth is using these caches
        (the model thread, between runs, over sessions that are not growing), so
        their rows can move; other rows are never touched. Afterwards the rows
        of ``caches`` that share a cohort sit as low, and so as adjacent, as the
        rows held by others allow: one run binds them together.
        """
        by_cohort: dict[int, list[RowKvCache]] = {}
        for c in caches:
            if c._cohort is not None:
                by_cohort.setdefault(id(c._cohort), []).append(c)
        moved = 0
        for members in by_cohort.values():
            members.sort(key=lambda c: c._row, reverse=True)
            cohort = members[0]._cohort
            assert cohort is not None
            for cache in members:
                with self._lock:
                    if None not in cohort.slots[: cache._row]:
                        break
                    hole = cohort.slots.index(None)
                    cohort.slots[hole] = _RESERVED
                    cohort.used += 1
                moved += cache._move_to(hole)
        self.moved_bytes += moved
        return moved

    def free(self, cohort: Cohort, row: int) -> None:
        """Zero a row and take it back; a cohort with no rows left is unmapped."""
        cohort.clear_row(row)
        with self._lock:
            cohort.slots[row] = None
            cohort.used -= 1
            if cohort.used == 0:
                siblings = self._cohorts.get(cohort.capacity, [])
                if cohort in siblings:
                    siblings.remove(cohort)
                if not siblings:
                    self._cohorts.pop(cohort.capacity, None)


@dataclass(slots=True)
class StagedRow:
    """A claimed row of the next bucket's cohort, not yet the session's."""

    capacity: int
    cohort: Cohort
    row: int
    nbytes: int
    bytes_copied: int = 0
    released: bool = field(default=False)


class RowKvCache(KvState):
    """One session's KV as a row of a :class:`Cohort`; a :class:`~kvmux.kv.GrowthBackend`.

    Same contract as :class:`~kvmux.kv.ArrayKvCache` (capacity, valid length,
    mask, budget charge of capacity times bytes per token), so the driver, the
    runner and the scheduler need not know which layout they hold.
    """

    memory_source = "host"
    xp = np

    def __init__(self, pool: CohortPool, hard_max: HardMax) -> None:
        self.pool = pool
        self.spec = pool.spec
        self.budget = pool.budget
        self._hard_max = hard_max
        self._min_bucket = pool.min_bucket
        self._cohort: Cohort | None = None
        self._row = 0
        self._capacity = 0
        self._valid_len = 0
        self._nbytes = 0
        self.capture_generation = 0
        self.capture_valid = False

    @property
    def keys(self) -> list[Any]:
        return [] if self._cohort is None else self._cohort.keys

    @property
    def values(self) -> list[Any]:
        return [] if self._cohort is None else self._cohort.values

    @property
    def mask(self) -> Any:
        """This row's mask, ``[1, capacity]``."""
        if self._cohort is None:
            return np.zeros((1, 0), dtype=self.spec.mask_dtype or "int64")
        return self._cohort.mask[self._row : self._row + 1]

    def placement(self) -> Placement:
        c = self._cohort
        if c is None:
            raise RuntimeError("cache holds no row yet (capacity 0)")
        return Placement(c.group, self._row, c.rows, c.capacity, c.keys, c.values, c.mask)

    # -- the session's own bookkeeping ------------------------------------
    def advance(self, n: int) -> None:
        end = self._valid_len + n
        if n < 0 or end > self._capacity or self._cohort is None:
            raise ValueError(
                f"cannot advance {n} tokens: valid {self._valid_len}, capacity {self._capacity}"
            )
        self._cohort.mask[self._row, self._valid_len : end] = 1
        self._valid_len = end

    def truncate(self, length: int) -> None:
        if not 0 <= length <= self._valid_len:
            raise ValueError(f"cannot truncate to {length}: valid {self._valid_len}")
        if self._cohort is not None:
            self._cohort.mask[self._row, length : self._valid_len] = 0
        self._valid_len = length

    def release(self) -> None:
        if self._cohort is not None:
            self.pool.free(self._cohort, self._row)
        self.budget.release(self._nbytes)
        self._cohort = None
        self._capacity = self._valid_len = self._nbytes = 0
        self.capture_valid = False
        self.capture_generation += 1

    # -- growth primitives -----------------------------------------------
    def allocate(self, new_capacity: int) -> StagedRow:
        nbytes = new_capacity * self.spec.bytes_per_token
        self.budget.reserve(nbytes)
        try:
            cohort, row = self.pool.claim(new_capacity)
        except BaseException:
            self.budget.release(nbytes)
            raise
        return StagedRow(new_capacity, cohort, row, nbytes)

    def copy_prefix(self, staged: StagedRow) -> int:
        n = self._valid_len
        old = self._cohort
        if n and old is not None:
            src, dst = self._row, staged.row
            for a, b in zip(
                old.keys + old.values, staged.cohort.keys + staged.cohort.values, strict=True
            ):
                b[dst, :, :n, :] = a[src, :, :n, :]
        staged.bytes_copied = n * self.spec.kv_bytes_per_token
        return staged.bytes_copied

    def build_mask(self, staged: StagedRow) -> None:
        staged.cohort.mask[staged.row, : self._valid_len] = 1

    def invalidate_capture(self) -> None:
        self.capture_valid = False

    def commit(self, staged: StagedRow) -> None:
        old, old_row, old_nbytes = self._cohort, self._row, self._nbytes
        self.pool.settle(staged.cohort, staged.row, self)
        self._cohort, self._row = staged.cohort, staged.row
        self._capacity = staged.capacity
        self._nbytes = staged.nbytes
        self.capture_generation += 1
        staged.released = True
        if old is not None:
            self.pool.free(old, old_row)
        self.budget.release(old_nbytes)

    def discard(self, staged: StagedRow) -> None:
        if not staged.released:
            staged.released = True
            self.pool.free(staged.cohort, staged.row)
            self.budget.release(staged.nbytes)

    def memory(self) -> MemoryInfo | None:
        return self.budget.memory() or host_memory()

    def _move_to(self, row: int) -> int:
        """Move to ``row`` (claimed for it) of the same cohort; returns bytes copied."""
        cohort, old, n = self._cohort, self._row, self._valid_len
        assert cohort is not None
        for buf in cohort.keys + cohort.values:
            buf[row, :, :n, :] = buf[old, :, :n, :]
        cohort.mask[row, :n] = 1
        self.pool.settle(cohort, row, self)
        self._row = row
        self.capture_valid = False
        self.capture_generation += 1
        self.pool.free(cohort, old)
        return n * self.spec.kv_bytes_per_token

    # -- addresses for binding by pointer ----------------------------------
    def ptr(self, array: Any) -> int:
        return int(array.ctypes.data)

    def __repr__(self) -> str:
        return (
            f"RowKvCache(capacity={self._capacity}, valid={self._valid_len}, "
            f"cohort={self._cohort!r}, row={self._row})"
        )
