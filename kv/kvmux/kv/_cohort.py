"""Cohorts: sessions of one bucket capacity as rows of shared buffers, so one run decodes them.

A cohort is per-layer K and V buffers ``[rows, kv_heads, capacity, head_dim]``
plus a mask ``[rows, capacity]``. A session's KV is one row; growing it moves
it to a free row of the next bucket's cohort through the same transaction as
any growth (:func:`kvmux.kv.ensure_capacity`): claim a row, copy the valid
prefix, build the mask row, commit, free the old row. A freed row is zeroed
and the next claim takes the lowest free row of the largest cohort. Rows bound
for one bucket at one step move together (:func:`kvmux.kv.ensure_capacity_many`,
through the pool's ``*_many`` primitives): one claim of their rows, one indexed
copy per buffer, one mask write per target cohort, one wait, their old rows freed
together.

Rows move in two cases only, each by the one thread that owns the row at that
moment: a growth (to the next bucket's cohort), and :meth:`CohortPool.compact`,
which the model thread calls between runs to move rows of sessions it is about
to run into free rows of the same capacity that come first (a lower row, a
larger cohort), so that the rows one run binds are adjacent. Either move
invalidates the session's captured CUDA graph. A row held by anyone else is
never touched.

Where the buffers live is a :class:`CohortStorage`: host memory (here) or a
CUDA device (:class:`kvmux.kv.CudaStorage`). How the budget is charged follows
what the storage really holds:

- Host: buffers are anonymous mappings whose pages the kernel backs only where
  a row is written, and a freed row's pages are handed back
  (``MADV_DONTNEED``, which also makes them read as zeros). Memory follows the
  rows in use, so the budget charges each claimed row (its capacity times
  bytes per token), exactly what a session of its own would, and a growth's
  transient peak is one row: the old row plus the new one.
- Device: memory is held from allocation to free, so the budget charges each
  cohort allocated, whole. To keep what is held but unused small, a new
  cohort of a capacity has as many rows as that capacity already holds
  (1, 1, 2, 4, ... up to the row limit): the rows double, like a growing
  array, without moving anyone's row. Its row count is also kept within what
  the budget has free, and a cohort the device (or budget) refuses is retried
  at half the rows, down to one; so a growth fails only when a single row of
  the new bucket cannot be had, and then its transient peak is one row too.
  :meth:`CohortPool.allocated_bytes` and :meth:`CohortPool.used_bytes` report
  held against used.
"""

from __future__ import annotations

import mmap
import sys
import threading
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from . import failpoints
from ._bucket import resolve_min_bucket
from ._budget import MemoryBudget, MemoryInfo, host_memory
from ._buffers import KvState
from ._errors import BudgetExceeded
from ._hardmax import HardMax
from ._placement import Placement, new_group
from ._spec import KvSpec

_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000 if sys.platform == "linux" else 0)
_RESERVED = object()  # a row claimed by a growth that has not committed
_RETIRED = object()  # a freed row whose zeroing failed: never handed out again
# Address space on the host, memory on a device; kept well under what a kernel
# with strict overcommit (which ignores MAP_NORESERVE) may still grant.
_MAX_RESERVED = 16 << 30
# Offsets of the buffers carved from one device allocation: cudaMalloc aligns
# to 256 bytes, and so does every buffer carved from it.
_ALIGN = 256


class CohortBuffers(Protocol):
    """One cohort's buffers: per-layer K and V ``[rows, kv_heads, capacity, head_dim]``, a mask."""

    keys: list[Any]
    values: list[Any]
    mask: Any

    def clear_row(self, row: int) -> None:
        """Zero one row of every buffer (issued on the current stream on a device)."""
        ...


class CohortStorage(Protocol):
    """Where cohorts live: the allocation, device and stream primitives a pool needs.

    ``per_row`` says how memory is held: True when it follows the rows in use
    (the budget charges each claimed row), False when a cohort holds all its
    memory from allocation to free (the budget charges each cohort).
    ``allocate`` raises a ``MemoryError`` when the memory is refused (CuPy's
    ``OutOfMemoryError`` is one).
    """

    @property
    def xp(self) -> Any:
        """The array module of the buffers (NumPy, CuPy)."""
        ...

    @property
    def source(self) -> str:
        """What :meth:`memory` measures, as errors name it."""
        ...

    @property
    def per_row(self) -> bool: ...

    def allocate(self, spec: KvSpec, capacity: int, rows: int) -> CohortBuffers: ...

    def on_device(self) -> AbstractContextManager[Any]:
        """Make the storage's device (and stream) current on this thread: growths run on
        other threads than the model. Holds :meth:`exclusive`'s lock while inside."""
        ...

    def exclusive(self) -> AbstractContextManager[Any]:
        """Held by the model thread while a run may capture a CUDA graph: no other
        thread's device work (:meth:`on_device`, :meth:`memory`) runs meanwhile."""
        ...

    def synchronize(self) -> None:
        """Wait until the work issued inside :meth:`on_device` (copies, zeroing) has landed."""
        ...

    def memory(self) -> MemoryInfo | None:
        """Free/total of the memory the buffers live in."""
        ...

    def ptr(self, array: Any) -> int:
        """The address of one of this storage's arrays, to bind it by pointer."""
        ...


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
            # Rows are mostly whole pages: no empty slice assignments (~1 us each).
            if start < inner_start:
                self.bytes[start:inner_start] = 0
            if inner_end < end:
                self.bytes[inner_end:end] = 0
        else:
            self.bytes[start:end] = 0


class _HostBuffers:
    """A cohort's buffers as lazily backed host mappings."""

    def __init__(self, spec: KvSpec, capacity: int, rows: int) -> None:
        shape = (rows, spec.kv_heads, capacity, spec.head_dim)
        dtype = spec.storage_dtype
        self._maps = [_Lazy(shape, dtype) for _ in range(2 * spec.num_layers)]
        self._maps.append(_Lazy((rows, capacity), np.dtype(spec.mask_dtype or "int64")))
        arrays = [m.array for m in self._maps]
        self.keys = arrays[: spec.num_layers]
        self.values = arrays[spec.num_layers : 2 * spec.num_layers]
        self.mask = arrays[-1]

    def clear_row(self, row: int) -> None:
        for m in self._maps:
            m.clear_row(row)


class HostStorage:
    """Cohorts in host memory (onnxruntime's CPU provider binds them by pointer)."""

    xp = np
    source = "host"
    per_row = True

    def allocate(self, spec: KvSpec, capacity: int, rows: int) -> CohortBuffers:
        return _HostBuffers(spec, capacity, rows)

    def on_device(self) -> AbstractContextManager[Any]:
        return nullcontext()

    def exclusive(self) -> AbstractContextManager[Any]:
        return nullcontext()  # nothing is captured on the host

    def synchronize(self) -> None:
        pass  # host copies are complete when they return

    def memory(self) -> MemoryInfo | None:
        return host_memory()

    def ptr(self, array: Any) -> int:
        return int(array.ctypes.data)


class CarvedBuffers:
    """A cohort's buffers carved from one allocation (a device's; or a test's NumPy bytes).

    One allocation per cohort, so a cohort is had or refused whole. ``view``
    makes an array of ``shape`` and ``dtype`` at a byte offset of the
    allocation (CuPy: ``cupy.ndarray(shape, dtype, memptr=base + offset)``);
    ``keep`` holds the allocation alive as long as the buffers are.
    """

    def __init__(
        self,
        spec: KvSpec,
        capacity: int,
        rows: int,
        view: Callable[[int, tuple[int, ...], np.dtype[Any]], Any],
        keep: object,
    ) -> None:
        layout = carve(spec, capacity, rows)
        arrays = [view(offset, shape, dtype) for offset, shape, dtype in layout.buffers]
        self.keys = arrays[: spec.num_layers]
        self.values = arrays[spec.num_layers : 2 * spec.num_layers]
        self.mask = arrays[-1]
        self.keep = keep

    def clear_row(self, row: int) -> None:
        # Slicing assignment: a fill kernel on the current stream with CuPy.
        for buf in (*self.keys, *self.values, self.mask):
            buf[row] = 0


@dataclass(frozen=True, slots=True)
class Layout:
    """Byte offsets of a cohort's buffers within one allocation of ``nbytes``."""

    nbytes: int
    buffers: list[tuple[int, tuple[int, ...], np.dtype[Any]]]


def carve(spec: KvSpec, capacity: int, rows: int) -> Layout:
    """K of every layer, V of every layer, then the mask, each at a 256-byte boundary."""
    kv_shape = (rows, spec.kv_heads, capacity, spec.head_dim)
    mask_dtype = np.dtype(spec.mask_dtype or "int64")
    shapes: list[tuple[tuple[int, ...], np.dtype[Any]]] = [(kv_shape, spec.storage_dtype)] * (
        2 * spec.num_layers
    )
    shapes.append(((rows, capacity), mask_dtype))
    offset, out = 0, []
    for shape, dtype in shapes:
        out.append((offset, shape, dtype))
        size = int(np.prod(shape)) * dtype.itemsize
        offset += -(-size // _ALIGN) * _ALIGN
    return Layout(offset, out)


class Cohort:
    """``rows`` rows of one capacity: the buffers one batched run binds.

    ``charge`` is what the budget was charged for the cohort itself (device
    storage); host cohorts charge per row instead and carry 0.
    """

    def __init__(self, capacity: int, rows: int, buffers: CohortBuffers, charge: int = 0) -> None:
        self.capacity = capacity
        self.rows = rows
        self.group = new_group()
        self.buffers = buffers
        self.keys = buffers.keys
        self.values = buffers.values
        self.mask = buffers.mask
        self.charge = charge
        self.slots: list[object | None] = [None] * rows
        self.used = 0
        self.retired = 0  # rows whose zeroing failed (see CohortPool.free)

    def has_room(self) -> bool:
        return self.used + self.retired < self.rows

    def clear_row(self, row: int) -> None:
        self.buffers.clear_row(row)

    def __repr__(self) -> str:
        return f"Cohort(capacity={self.capacity}, rows={self.used}/{self.rows})"


class CohortPool:
    """Per bucket capacity, cohorts of up to ``rows_per_cohort`` rows; hands rows out and takes
    them back, and charges the budget for them (see the module's docstring).

    Thread-safe: growths claim rows on their own threads while the event loop
    releases finished sessions' rows.
    """

    def __init__(
        self,
        spec: KvSpec,
        *,
        storage: CohortStorage | None = None,
        rows_per_cohort: int = 64,
        min_bucket: int | None = None,
        budget: MemoryBudget | None = None,
    ) -> None:
        if rows_per_cohort < 1:
            raise ValueError(f"rows_per_cohort must be >= 1, got {rows_per_cohort}")
        self.spec = spec
        self.storage: CohortStorage = storage if storage is not None else HostStorage()
        self.xp = self.storage.xp
        self.rows_per_cohort = rows_per_cohort
        self.min_bucket = resolve_min_bucket(min_bucket)
        self.budget = budget if budget is not None else MemoryBudget()
        self._cohorts: dict[int, list[Cohort]] = {}
        # Host storage: the last cohort of a capacity to empty, kept for the next
        # claim of that capacity (its pages are back with the kernel: it costs address
        # space only; mapping a new one costs a job of one item ~5% of its loop time).
        self._spare: dict[int, Cohort] = {}
        self._lock = threading.Lock()
        self.moved_bytes = 0  # copied by compact(), for benchmarks

    def rows_for(self, capacity: int) -> int:
        """The most rows of a cohort of ``capacity``: fewer for long buckets, so that one
        cohort reserves at most ``_MAX_RESERVED`` bytes."""
        row = capacity * self.spec.bytes_per_token
        return max(1, min(self.rows_per_cohort, _MAX_RESERVED // row))

    def new_cache(self, hard_max: HardMax) -> RowKvCache:
        """An empty cache (capacity 0) whose first growth claims its first row."""
        return RowKvCache(self, hard_max)

    def cohorts(self) -> list[Cohort]:
        with self._lock:
            return [c for cs in self._cohorts.values() for c in cs]

    def allocated_bytes(self) -> int:
        """Bytes of every cohort's rows, used or not: device memory held on a device,
        address space reserved on the host."""
        bpt = self.spec.bytes_per_token
        return sum(c.rows * c.capacity * bpt for c in self.cohorts())

    def used_bytes(self) -> int:
        """Bytes of the rows sessions hold (claimed rows included)."""
        bpt = self.spec.bytes_per_token
        return sum(c.used * c.capacity * bpt for c in self.cohorts())

    def claim(self, capacity: int) -> tuple[Cohort, int]:
        """A free row of a cohort of ``capacity`` (a new cohort when all are full), charged.

        A refusal (by the budget or the storage) first asks the budget's
        reclaimer for memory (the prefix cache gives back what it keeps) and
        tries again while it gives some. Then raises what the budget or the
        storage raised (``BudgetExceeded``, a device's ``OutOfMemoryError``),
        having charged and claimed nothing.
        """
        while True:
            try:
                return self._claim(capacity)
            except MemoryError as exc:  # BudgetExceeded is one, as CuPy's OutOfMemoryError is
                if not self.budget.reclaim(_shortfall(exc, capacity * self.spec.bytes_per_token)):
                    raise

    def _claim(self, capacity: int) -> tuple[Cohort, int]:
        row_bytes = capacity * self.spec.bytes_per_token
        per_row = self.storage.per_row
        if per_row:
            self.budget.reserve(row_bytes)
        try:
            with self._lock:
                # The largest cohort first: the more rows share one, the more one run decodes.
                for cohort in self._ranked(capacity):
                    if cohort.has_room():
                        return cohort, self._take(cohort, cohort.slots.index(None))
                held = sum(c.rows for c in self._cohorts.get(capacity, []))
            # Allocated outside the lock; another claim may allocate one too, harmlessly.
            cohort = self._new_cohort(capacity, held)
            with self._lock:
                self._cohorts.setdefault(capacity, []).append(cohort)
                return cohort, self._take(cohort, 0)
        except BaseException:
            if per_row:
                self.budget.release(row_bytes)
            raise

    def claim_many(
        self, capacity: int, count: int
    ) -> tuple[list[tuple[Cohort, int]], MemoryError | None]:
        """Up to ``count`` free rows of cohorts of ``capacity``, charged: one claim for rows
        that move together (:func:`kvmux.kv.ensure_capacity_many`).

        Free rows of the capacity's cohorts go first; the rest come from one new cohort
        sized for them (on a device: as many rows as the capacity holds or as are
        wanted, whichever is more, within the row limit and the budget), and another
        only when one cannot hold them all. When the budget or the storage refuses,
        the reclaimer is asked as :meth:`claim` does; what it cannot make room for is
        left out: returns the rows had (in claim order, possibly none) and the refusal
        (None when all ``count`` were had). Any other exception releases every row this
        call claimed and propagates.
        """
        got: list[tuple[Cohort, int]] = []
        row_bytes = capacity * self.spec.bytes_per_token
        try:
            while len(got) < count:
                try:
                    got.extend(self._claim_some(capacity, count - len(got)))
                except MemoryError as exc:
                    if self.budget.reclaim(_shortfall(exc, row_bytes)):
                        continue
                    return got, exc
        except BaseException:
            for cohort, row in got:
                self.free(cohort, row)
            raise
        return got, None

    def _claim_some(self, capacity: int, want: int) -> list[tuple[Cohort, int]]:
        """At least one and at most ``want`` rows, charged: free rows when there are
        some, else those of one new cohort. Raises a ``MemoryError`` having claimed
        nothing when not even one row can be had."""
        row_bytes = capacity * self.spec.bytes_per_token
        per_row = self.storage.per_row
        charged = 0
        if per_row:
            free = self.budget.free
            if free is not None and want * row_bytes > free:
                # What fits now; none fitting raises BudgetExceeded below.
                want = max(1, free // row_bytes)
            self.budget.reserve(want * row_bytes)
            charged = want
        try:
            taken: list[tuple[Cohort, int]] = []
            with self._lock:
                # The order claim() hands rows out in: the largest cohort, the lowest row.
                for cohort in self._ranked(capacity):
                    for row, slot in enumerate(cohort.slots):
                        if len(taken) == want:
                            break
                        if slot is None:
                            taken.append((cohort, self._take(cohort, row)))
                held = sum(c.rows for c in self._cohorts.get(capacity, []))
            if not taken:
                cohort = self._new_cohort(capacity, held, want)
                with self._lock:
                    self._cohorts.setdefault(capacity, []).append(cohort)
                    taken = [(cohort, self._take(cohort, r)) for r in range(min(want, cohort.rows))]
        except BaseException:
            if charged:
                self.budget.release(charged * row_bytes)
            raise
        if charged > len(taken):
            self.budget.release((charged - len(taken)) * row_bytes)
        return taken

    @staticmethod
    def _take(cohort: Cohort, row: int) -> int:
        cohort.slots[row] = _RESERVED
        cohort.used += 1
        return row

    def _new_cohort(self, capacity: int, held: int, want: int = 1) -> Cohort:
        rows = self.rows_for(capacity)
        if self.storage.per_row:
            with self._lock:
                spare = self._spare.pop(capacity, None)
            if spare is not None:
                return spare
        row_bytes = capacity * self.spec.bytes_per_token
        if not self.storage.per_row:
            # Rows that move together are wanted at once: room for them, no more.
            rows = min(rows, max(held, want, 1))
            free = self.budget.free
            if free is not None:
                # What the prefix cache keeps is free to a session (given back below).
                free += self.budget.reclaimable
                rows = max(1, min(rows, free // row_bytes))
        while True:
            charge = 0 if self.storage.per_row else rows * row_bytes
            charged = False
            try:
                self.budget.reserve(charge)
                charged = True
                with self.storage.on_device():
                    buffers = self.storage.allocate(self.spec, capacity, rows)
            except BaseException as exc:
                if charged:
                    self.budget.release(charge)
                if not isinstance(exc, MemoryError):  # BudgetExceeded is one
                    raise
                # Refused (by the device, or the budget another growth just charged):
                # what the prefix cache keeps goes first, so a session's cohort is not
                # made narrower for it; then fewer rows may still fit. One row refused
                # is the answer (claim asks the reclaimer once more, in vain).
                if self.budget.reclaim(_shortfall(exc, rows * row_bytes)):
                    continue
                if rows == 1:
                    raise
                rows //= 2
                continue
            return Cohort(capacity, rows, buffers, charge)

    # -- rows that move together: the GroupGrowth seam of ensure_capacity_many --------
    def allocate_many(
        self, caches: Sequence[RowKvCache], new_capacity: int
    ) -> tuple[list[StagedRow], MemoryError | None]:
        """Claim rows of ``new_capacity`` for the first of ``caches`` that fit (see
        :meth:`claim_many`), staged to receive their valid prefixes."""
        claimed, refused = self.claim_many(new_capacity, len(caches))
        nbytes = new_capacity * self.spec.bytes_per_token
        staged = [
            StagedRow(new_capacity, cohort, row, nbytes, cache._valid_len, cache)
            for cache, (cohort, row) in zip(caches, claimed, strict=False)
        ]
        return staged, refused

    def copy_prefix_many(self, staged: Sequence[StagedRow]) -> list[int]:
        """Copy each staged row's valid prefix from its session's row: per K/V buffer, one
        indexed copy for the rows of one source cohort into one target cohort with the
        same valid length (sessions growing at one step have the same). Issued on the
        storage's device and stream; :meth:`build_mask_many` waits for it."""
        runs: dict[tuple[int, int, int], list[StagedRow]] = {}
        for s in staged:
            src = s.source
            if s.valid > src._valid_len:
                raise ValueError(f"cannot copy {s.valid} tokens from a row of {src._valid_len}")
            if s.valid and src._cohort is not None:
                runs.setdefault((id(src._cohort), id(s.cohort), s.valid), []).append(s)
        if runs:
            with self.storage.on_device():
                for members in runs.values():
                    old, new, n = members[0].source._cohort, members[0].cohort, members[0].valid
                    assert old is not None
                    src_rows = _rows([m.source._row for m in members])
                    dst_rows = _rows([m.row for m in members])
                    for a, b in zip(old.keys + old.values, new.keys + new.values, strict=True):
                        b[dst_rows, :, :n, :] = a[src_rows, :, :n, :]
        per_token = self.spec.kv_bytes_per_token
        for s in staged:
            s.bytes_copied = s.valid * per_token
        return [s.bytes_copied for s in staged]

    def build_mask_many(self, staged: Sequence[StagedRow]) -> None:
        """Every staged row's mask in one write per target cohort, then one wait for the
        copies and masks to land (a growth runs on another thread than the model)."""
        targets: dict[int, list[StagedRow]] = {}
        for s in staged:
            targets.setdefault(id(s.cohort), []).append(s)
        xp = self.xp
        with self.storage.on_device():
            for members in targets.values():
                cohort = members[0].cohort
                valid = xp.asarray([m.valid for m in members])[:, None]
                columns = xp.arange(cohort.capacity)[None, :]
                cohort.mask[_rows([m.row for m in members])] = (columns < valid).astype(
                    cohort.mask.dtype
                )
            self.storage.synchronize()

    def commit_many(self, caches: Sequence[RowKvCache], staged: Sequence[StagedRow]) -> None:
        """Each of ``caches`` takes its staged row; then their old rows are freed together
        (:meth:`free_many`). Does not raise."""
        old = [o for c, s in zip(caches, staged, strict=True) if (o := c._adopt(s)) is not None]
        self.free_many(old)

    def settle(self, cohort: Cohort, row: int, owner: object) -> None:
        with self._lock:
            cohort.slots[row] = owner

    def compact(self, caches: Sequence[RowKvCache]) -> int:
        """Move rows of ``caches`` into free rows that come before theirs; returns bytes moved.

        Rows of one capacity come in the order claims fill them: the largest
        cohort first (the oldest among equals), and within a cohort the lowest
        row. The caller guarantees that no run and no growth is using these
        caches (the model thread, between runs, over sessions that are not
        growing), so their rows can move; other rows are never touched.
        Afterwards the rows of ``caches`` of one capacity sit in as few cohorts,
        as low, and so as adjacent, as the rows held by others allow: one run
        binds them together. A cohort left empty is dropped, which on a device
        frees the small cohorts that a bucket's first sessions opened.
        """
        by_capacity: dict[int, list[RowKvCache]] = {}
        for c in caches:
            if c._cohort is not None:
                by_capacity.setdefault(c._cohort.capacity, []).append(c)
        moved = 0
        for capacity, members in by_capacity.items():
            with self._lock:
                rank = {id(c): i for i, c in enumerate(self._ranked(capacity))}

            def place(
                cohort: Cohort | None, row: int, rank: dict[int, int] = rank
            ) -> tuple[int, int]:
                # A cohort opened meanwhile (by a growth) ranks last.
                return rank.get(id(cohort), len(rank)), row

            # The worst placed first: once no free row beats it, none beats the rest.
            members.sort(key=lambda c: place(c._cohort, c._row), reverse=True)
            for cache in members:
                with self._lock:
                    hole = next((c for c in self._ranked(capacity) if c.has_room()), None)
                    if hole is None:
                        break
                    row = hole.slots.index(None)
                    if place(hole, row) >= place(cache._cohort, cache._row):
                        break
                    self._take(hole, row)
                moved += cache._move_to(hole, row)
        self.moved_bytes += moved
        return moved

    def _ranked(self, capacity: int) -> list[Cohort]:
        """Cohorts of ``capacity`` in the order rows are handed out (under the lock)."""
        # Stable: among cohorts of equal rows, the oldest first.
        return sorted(self._cohorts.get(capacity, []), key=lambda c: -c.rows)

    def free(self, cohort: Cohort, row: int, *, moved: bool = False) -> None:
        """Take a row back, zeroed; a cohort with no rows left is dropped (unmapped, or
        its device memory freed) and its charge released. ``moved``: the row's session
        moved to another row of the same capacity, which keeps the row's charge.

        It does not raise: it runs where a session ends, in error paths and in a
        growth's infallible commit. A row whose zeroing fails (a device error) is
        retired, never handed out again; its cohort is dropped, and its charge
        released, once its live rows are gone, as always."""
        with self._lock:
            last = cohort.used == 1
            if last:
                # Nobody can claim a row of it any more: no need to zero this one,
                # unless it is kept as its capacity's spare.
                self._drop(cohort, row)
        if last and self.storage.per_row and not cohort.retired:
            self._keep_spare(cohort, row)
        if not last:
            try:
                with self.storage.on_device():
                    failpoints.hit("kv.clear_row")
                    cohort.clear_row(row)
                    # The zeroing must land before the row is handed out: the next
                    # claim may write it from another thread's stream.
                    self.storage.synchronize()
                clean = True
            except Exception:  # noqa: BLE001 - retired below; the release itself goes on
                clean = False
            with self._lock:
                cohort.slots[row] = None if clean else _RETIRED
                cohort.used -= 1
                cohort.retired += not clean
                if cohort.used == 0:  # the other rows left meanwhile
                    self._drop(cohort, None)
                    last = True
        if self.storage.per_row and not moved:
            self.budget.release(cohort.capacity * self.spec.bytes_per_token)
        if last:
            self.budget.release(cohort.charge)

    def free_many(self, rows: Sequence[tuple[Cohort, int]]) -> None:
        """:meth:`free` for rows given back together (the old rows of a group's growth).

        On a device, the rows of cohorts that others still hold are zeroed together,
        one fill per buffer of a cohort, and waited for once; a cohort left with none
        of its rows held is dropped whole, unzeroed, as :meth:`free` drops a cohort's
        last row. A zeroing that fails retires those rows. Host rows are freed one by
        one: each gives its own pages back, and a host copy needs no wait. Does not
        raise."""
        if self.storage.per_row:
            for cohort, row in rows:
                self.free(cohort, row)
            return
        by_cohort: dict[int, tuple[Cohort, list[int]]] = {}
        for cohort, row in rows:
            by_cohort.setdefault(id(cohort), (cohort, []))[1].append(row)
        dropped: list[Cohort] = []
        zero: list[tuple[Cohort, list[int]]] = []
        with self._lock:
            for cohort, held in by_cohort.values():
                if cohort.used == len(held):
                    # Nobody else holds a row of it: gone before anyone can claim one.
                    for row in held:
                        cohort.slots[row] = None
                    cohort.used = 0
                    self._drop(cohort, None)
                    dropped.append(cohort)
                else:
                    zero.append((cohort, held))
        if zero:
            try:
                with self.storage.on_device():
                    failpoints.hit("kv.clear_row")
                    for cohort, held in zero:
                        index = _rows(sorted(held))
                        for buf in (*cohort.keys, *cohort.values, cohort.mask):
                            buf[index] = 0
                    # Landed before the rows are handed out (see free()).
                    self.storage.synchronize()
                clean = True
            except Exception:  # noqa: BLE001 - retired below; the release itself goes on
                clean = False
            with self._lock:
                for cohort, held in zero:
                    for row in held:
                        cohort.slots[row] = None if clean else _RETIRED
                    cohort.used -= len(held)
                    cohort.retired += 0 if clean else len(held)
                    if cohort.used == 0:  # the other rows left meanwhile
                        self._drop(cohort, None)
                        dropped.append(cohort)
        for cohort in dropped:
            self.budget.release(cohort.charge)

    def _keep_spare(self, cohort: Cohort, row: int) -> None:
        """Keep an emptied host cohort for the next claim of its capacity, zeroed."""
        try:
            cohort.clear_row(row)
        except Exception:  # noqa: BLE001 - then it is simply not kept
            return
        with self._lock:
            self._spare.setdefault(cohort.capacity, cohort)

    def _drop(self, cohort: Cohort, row: int | None) -> None:
        # Under the lock.
        if row is not None:
            cohort.slots[row] = None
            cohort.used -= 1
        siblings = self._cohorts.get(cohort.capacity, [])
        if cohort in siblings:
            siblings.remove(cohort)
        if not siblings:
            self._cohorts.pop(cohort.capacity, None)


@dataclass(slots=True)
class StagedRow:
    """A claimed row of the next bucket's cohort, not yet the session's.

    ``valid`` tokens are copied into it from ``source``'s row: the session's own
    valid prefix in a growth, another row's first tokens in a fork
    (:func:`kvmux.kv.fork_prefix`), which the row holds once committed.
    """

    capacity: int
    cohort: Cohort
    row: int
    nbytes: int
    valid: int
    source: RowKvCache
    bytes_copied: int = 0
    released: bool = field(default=False)


class RowKvCache(KvState):
    """One session's KV as a row of a :class:`Cohort`; a :class:`~kvmux.kv.GrowthBackend`.

    Same contract as :class:`~kvmux.kv.ArrayKvCache` (capacity, valid length,
    mask), so the driver, the runner and the scheduler need not know which
    layout they hold; the pool charges the budget. Copies run inside the
    storage's :meth:`~CohortStorage.on_device` (on a device: its device and
    stream) and are synchronized before the primitive returns: a growth runs
    on another thread than the model, and the next run must see the copied row.
    """

    def __init__(self, pool: CohortPool, hard_max: HardMax) -> None:
        self.pool = pool
        self.spec = pool.spec
        self.budget = pool.budget
        self.storage = pool.storage
        self.xp = pool.xp
        self._hard_max = hard_max
        self._min_bucket = pool.min_bucket
        self._cohort: Cohort | None = None
        self._row = 0
        self._capacity = 0
        self._valid_len = 0
        self._nbytes = 0
        self._place: Placement | None = None
        self._seed: tuple[RowKvCache, int] | None = None
        self.capture_generation = 0
        self.capture_valid = False

    @property
    def memory_source(self) -> str:
        return self.storage.source

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
            return self.xp.zeros((1, 0), dtype=self.spec.mask_dtype or "int64")
        return self._cohort.mask[self._row : self._row + 1]

    def placement(self) -> Placement:
        """Where the row is; the same object until the row moves, grows or is released,
        so a caller may compare placements by identity to learn that nothing moved."""
        place = self._place
        if place is None:
            c = self._cohort
            if c is None:
                raise RuntimeError("cache holds no row yet (capacity 0)")
            place = Placement(c.group, self._row, c.rows, c.capacity, c.keys, c.values, c.mask)
            self._place = place
        return place

    # -- the session's own bookkeeping ------------------------------------
    # advance/truncate run on the model thread; the runner synchronizes its
    # stream before each run, so their mask writes need no synchronize here.
    def advance(self, n: int) -> None:
        end = self._valid_len + n
        if n < 0 or end > self._capacity or self._cohort is None:
            raise ValueError(
                f"cannot advance {n} tokens: valid {self._valid_len}, capacity {self._capacity}"
            )
        if n == 1:  # a decode step, per row: an element costs a sixth of a slice
            self._cohort.mask[self._row, self._valid_len] = 1
        else:
            self._cohort.mask[self._row, self._valid_len : end] = 1
        self._valid_len = end

    def counted(self, n: int) -> None:
        """Count ``n`` tokens whose mask columns a runner has written itself (a batched
        decode writes every row's column in one scatter)."""
        end = self._valid_len + n
        if n < 0 or end > self._capacity:
            raise ValueError(
                f"cannot count {n} tokens: valid {self._valid_len}, capacity {self._capacity}"
            )
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
        self._cohort = self._place = None
        self._capacity = self._valid_len = self._nbytes = 0
        self.capture_valid = False
        self.capture_generation += 1

    # -- growth primitives -----------------------------------------------
    @property
    def grows_with(self) -> CohortPool | None:
        """Its pool, which grows it together with other rows of the pool growing into the
        same bucket (:func:`kvmux.kv.ensure_capacity_many`); None while seeded for a fork,
        which copies from another row and grows alone."""
        return self.pool if self._seed is None else None

    def seed(self, source: RowKvCache | None, tokens: int = 0) -> None:
        """Make the next growth copy ``source``'s first ``tokens`` positions instead of this
        cache's own prefix (None: its own again). Only :func:`kvmux.kv.fork_prefix` calls
        it, around one growth of an empty cache; it takes no memory."""
        self._seed = None if source is None else (source, tokens)

    def allocate(self, new_capacity: int) -> StagedRow:
        source, valid = self._seed or (self, self._valid_len)
        cohort, row = self.pool.claim(new_capacity)
        return StagedRow(
            new_capacity, cohort, row, new_capacity * self.spec.bytes_per_token, valid, source
        )

    def copy_prefix(self, staged: StagedRow) -> int:
        n, src = staged.valid, staged.source
        old = src._cohort
        if n > src._valid_len:
            raise ValueError(f"cannot copy {n} tokens from a row holding {src._valid_len}")
        if n and old is not None:
            with self.storage.on_device():
                for a, b in zip(
                    old.keys + old.values, staged.cohort.keys + staged.cohort.values, strict=True
                ):
                    b[staged.row, :, :n, :] = a[src._row, :, :n, :]
                self.storage.synchronize()
        staged.bytes_copied = n * self.spec.kv_bytes_per_token
        return staged.bytes_copied

    def build_mask(self, staged: StagedRow) -> None:
        with self.storage.on_device():
            staged.cohort.mask[staged.row, : staged.valid] = 1
            self.storage.synchronize()

    def invalidate_capture(self) -> None:
        self.capture_valid = False

    def commit(self, staged: StagedRow) -> None:
        old = self._adopt(staged)
        if old is not None:
            self.pool.free(*old)

    def _adopt(self, staged: StagedRow) -> tuple[Cohort, int] | None:
        """Take ``staged`` as this cache's row; returns the old row, for the caller to free."""
        old = None if self._cohort is None else (self._cohort, self._row)
        self.pool.settle(staged.cohort, staged.row, self)
        self._cohort, self._row, self._place = staged.cohort, staged.row, None
        self._capacity = staged.capacity
        self._valid_len = staged.valid
        self._nbytes = staged.nbytes
        self.capture_generation += 1
        staged.released = True
        return old

    def discard(self, staged: StagedRow) -> None:
        if not staged.released:
            staged.released = True
            self.pool.free(staged.cohort, staged.row)

    def memory(self) -> MemoryInfo | None:
        return self.budget.memory() or self.storage.memory()

    def _move_to(self, cohort: Cohort, row: int) -> int:
        """Move to ``row`` of ``cohort`` (of this capacity, claimed for it); returns bytes
        copied. Called by :meth:`CohortPool.compact` on the model thread."""
        old, old_row, n = self._cohort, self._row, self._valid_len
        assert old is not None and old.capacity == cohort.capacity
        with self.storage.on_device():
            for a, b in zip(old.keys + old.values, cohort.keys + cohort.values, strict=True):
                b[row, :, :n, :] = a[old_row, :, :n, :]
            cohort.mask[row, :n] = 1
            # Landed before the old row is zeroed or its cohort freed (and before
            # the next run, on onnxruntime's own stream).
            self.storage.synchronize()
        self.pool.settle(cohort, row, self)
        self._cohort, self._row, self._place = cohort, row, None
        # The runner keys a binding (and its graph) by group and rows: a row
        # that moved must be re-captured before a graph is replayed on it.
        self.capture_valid = False
        self.capture_generation += 1
        self.pool.free(old, old_row, moved=True)
        return n * self.spec.kv_bytes_per_token

    # -- addresses for binding by pointer ----------------------------------
    def ptr(self, array: Any) -> int:
        return self.storage.ptr(array)

    def __repr__(self) -> str:
        return (
            f"RowKvCache(capacity={self._capacity}, valid={self._valid_len}, "
            f"cohort={self._cohort!r}, row={self._row})"
        )


def _rows(rows: list[int]) -> slice | list[int]:
    """Rows to index with: a slice when they are adjacent and ascending (a plain strided
    copy, no gather), else the list (a gather)."""
    first = rows[0]
    if rows == list(range(first, first + len(rows))):
        return slice(first, first + len(rows))
    return rows


def _shortfall(exc: MemoryError, asked: int) -> int:
    """The bytes a refused allocation of ``asked`` bytes lacked: the budget says; a
    device's out-of-memory does not, so all of it."""
    if isinstance(exc, BudgetExceeded):
        return max(exc.used + exc.requested - exc.total, 1)
    return asked
