"""Cohorts on device-like storage: charged per cohort, rows doubling, refusals translated.

The pool and RowKvCache are the ones CUDA uses; the storage is
:class:`~tests.kv.fake_device.FakeDeviceStorage`, which has CudaStorage's
semantics over NumPy and refuses on demand.
"""

from __future__ import annotations

import gc
import itertools

import numpy as np
import pytest

from kvmux.kv import (
    CohortPool,
    GrowthFailed,
    KvSpec,
    MemoryBudget,
    RowKvCache,
    carve,
    ensure_capacity,
    resolve_hard_max,
)

from .fake_device import FakeDeviceStorage, FakeOutOfMemory
from .test_cohort import _assert_intact, _write

SPEC = KvSpec(num_layers=2, kv_heads=2, head_dim=8, dtype="float32")
HARD = resolve_hard_max(None, 4096)
BPT = SPEC.bytes_per_token


def _pool(
    storage: FakeDeviceStorage, budget: MemoryBudget | None = None, rows: int = 8
) -> CohortPool:
    return CohortPool(SPEC, storage=storage, rows_per_cohort=rows, min_bucket=4, budget=budget)


def _opened(pool: CohortPool, n: int, tokens: int = 4) -> list[RowKvCache]:
    caches = [pool.new_cache(HARD) for _ in range(n)]
    for c in caches:
        ensure_capacity(c, tokens)
    return caches


def test_the_layout_carves_aligned_buffers_that_do_not_overlap() -> None:
    layout = carve(SPEC, 12, 3)
    ends = []
    for offset, shape, dtype in layout.buffers:
        assert offset % 256 == 0
        ends.append((offset, offset + int(np.prod(shape)) * dtype.itemsize))
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in itertools.pairwise(ends))
    assert ends[-1][1] <= layout.nbytes
    # Every buffer written with its own value reads back intact: no two share bytes.
    pool = _pool(FakeDeviceStorage())
    (cache,) = _opened(pool, 1)
    p = cache.placement()
    for i, buf in enumerate([*p.keys, *p.values]):
        buf[...] = i + 1
    p.mask[...] = 7
    for i, buf in enumerate([*p.keys, *p.values]):
        assert (buf == i + 1).all()
    assert (p.mask == 7).all()


def test_cohorts_double_their_rows_and_the_budget_charges_whole_cohorts() -> None:
    storage = FakeDeviceStorage()
    pool = _pool(storage)
    caches = _opened(pool, 7)
    assert storage.allocated_rows == [(4, 1), (4, 1), (4, 2), (4, 4)]
    row = 4 * BPT
    assert pool.budget.used == pool.allocated_bytes() == 8 * row
    assert pool.used_bytes() == 7 * row
    # The largest cohort fills first: its rows batch together.
    assert [c.placement().rows for c in caches] == [1, 1, 2, 2, 4, 4, 4]
    again = _opened(pool, 1)[0]
    assert again.placement().rows == 4 and pool.budget.used == 8 * row
    for c in [*caches, again]:
        c.release()
    assert pool.budget.used == 0 and pool.cohorts() == []
    del caches, again, c
    gc.collect()
    assert storage.held == 0  # dropped cohorts freed their device memory


def test_a_new_cohort_takes_no_more_rows_than_the_budget_has_free() -> None:
    row = 4 * BPT
    budget = MemoryBudget(5 * row)
    pool = _pool(FakeDeviceStorage(), budget)
    caches = _opened(pool, 4)  # cohorts of 1, 1, 2 rows
    fifth = _opened(pool, 1)[0]  # would be 4 rows; 1 row is free
    assert fifth.placement().rows == 1 and budget.used == 5 * row
    sixth = pool.new_cache(HARD)
    with pytest.raises(GrowthFailed) as info:
        ensure_capacity(sixth, 4)
    assert info.value.details["cause"] == "budget"
    assert sixth.capacity == 0 and budget.used == 5 * row
    caches[0].release()  # its cohort of one row is dropped, its charge freed
    ensure_capacity(sixth, 4)
    assert budget.used == 5 * row


def test_a_refused_cohort_is_retried_with_half_the_rows() -> None:
    row = 4 * BPT
    storage = FakeDeviceStorage(total=carve(SPEC, 4, 1).nbytes * 2 + carve(SPEC, 4, 2).nbytes)
    pool = _pool(storage)
    _opened(pool, 4)  # 1, 1, then 2 rows fill the fake device
    storage.total += carve(SPEC, 4, 2).nbytes  # room for 2 rows, not the 4 a doubling wants
    caches = _opened(pool, 1)
    assert storage.allocated_rows[-1] == (4, 2)
    assert caches[0].placement().rows == 2 and pool.budget.used == 6 * row


def test_a_device_refusal_fails_that_growth_alone_and_leaves_the_row_as_it_was() -> None:
    rng = np.random.default_rng(3)
    storage = FakeDeviceStorage(refuse_capacities={16})
    budget = MemoryBudget()
    pool = _pool(storage, budget)
    victim, other = pool.new_cache(HARD), pool.new_cache(HARD)
    refs: list[list[np.ndarray]] = [[], []]
    for step in range(8):
        for c, ref in zip((victim, other), refs, strict=True):
            if c is victim or step < 5:  # the other stays within bucket 8
                _write(c, rng, ref)
    before = (victim.placement(), victim.capacity, victim.valid_len, budget.used, storage.held)
    with pytest.raises(GrowthFailed) as info:
        ensure_capacity(victim, 9)
    d = info.value.details
    assert d["cause"] == "out_of_memory" and d["failed_step"] == "allocate"
    assert isinstance(info.value.__cause__, FakeOutOfMemory)
    assert (d["old_capacity"], d["new_capacity"]) == (8, 16)
    # One row was refused (a single-row cohort: nothing of 16 is held), so the
    # transient peak is the old row plus that one.
    assert d["new_alloc_bytes"] == 16 * BPT and d["transient_peak_bytes"] == (8 + 16) * BPT
    assert d["bytes_per_token"] == BPT
    assert d["memory_source"] == "fake device"
    assert d["device_total_bytes"] == storage.total
    assert d["device_free_bytes"] == storage.total - storage.held
    assert d["session_unchanged"] is True
    assert "Out of memory allocating" in d["cause_message"]
    assert (
        victim.placement(),
        victim.capacity,
        victim.valid_len,
        budget.used,
        storage.held,
    ) == before
    _assert_intact(victim, refs[0])
    # The other session goes on, its tokens intact; the victim can retry once memory frees.
    _write(other, rng, refs[1])
    _assert_intact(other, refs[1])
    storage.refuse_capacities.clear()
    _write(victim, rng, refs[0])
    assert victim.capacity == 16
    _assert_intact(victim, refs[0])


def test_growth_copies_on_the_device_and_synchronizes_before_commit() -> None:
    rng = np.random.default_rng(4)
    storage = FakeDeviceStorage()
    pool = _pool(storage)
    cache = pool.new_cache(HARD)
    ref: list[np.ndarray] = []
    for _ in range(6):
        _write(cache, rng, ref)
    assert cache.capacity == 8
    staged = cache.allocate(16)
    syncs = storage.syncs
    cache.copy_prefix(staged)
    assert storage.syncs == syncs + 1
    cache.build_mask(staged)
    assert storage.syncs == syncs + 2
    cache.invalidate_capture()
    cache.commit(staged)
    _assert_intact(cache, ref)
    for _ in range(40):
        _write(cache, rng, ref)
        _assert_intact(cache, ref)
    assert cache.capacity == 64


def test_a_freed_row_is_zeroed_on_the_device_before_it_is_handed_out() -> None:
    rng = np.random.default_rng(5)
    storage = FakeDeviceStorage()
    pool = _pool(storage, rows=2)
    # Cohorts of 1, 1 and 2 rows: first and its neighbour share the third.
    _keep, _other, first, neighbour = _opened(pool, 4)
    assert first.placement().group == neighbour.placement().group
    for _ in range(4):
        _write(first, rng, [])
    where = (first.placement().group, first.placement().row)
    syncs = storage.syncs
    first.release()
    assert storage.syncs == syncs + 1
    second = pool.new_cache(HARD)
    ensure_capacity(second, 1)
    p = second.placement()
    assert (p.group, p.row) == where
    assert not any(buf[p.row].any() for buf in [*p.keys, *p.values]) and not p.mask[p.row].any()


def test_compact_invalidates_the_capture_of_every_row_it_moves() -> None:
    storage = FakeDeviceStorage()
    pool = _pool(storage, rows=4)
    caches = _opened(pool, 7)  # rows 1, 1, 2 and 3 of a 4-row cohort
    big = [c for c in caches if c.placement().rows == 4]
    assert [c.placement().row for c in big] == [0, 1, 2]
    for c in caches:
        c.advance(2)
        c.capture_valid = True
    big[0].release()
    assert pool.compact(big[1:]) == 2 * SPEC.kv_bytes_per_token
    assert [c.placement().row for c in big[1:]] == [1, 0]
    assert [c.capture_valid for c in big[1:]] == [True, False]
    assert all(c.capture_valid for c in caches if c not in big)


def test_compact_moves_rows_out_of_small_cohorts_into_a_larger_ones_holes() -> None:
    rng = np.random.default_rng(6)
    storage = FakeDeviceStorage()
    pool = _pool(storage, rows=4)
    caches = _opened(pool, 8)  # cohorts of 1, 1, 2 and 4 rows
    refs: list[list[np.ndarray]] = [[] for _ in caches]
    for c, ref in zip(caches, refs, strict=True):
        _write(c, rng, ref)
    big = caches[4].placement().group
    for i in (4, 6):
        caches[i].release()
        refs[i] = []
    outsider = caches[3]  # growing, say: not handed to compact, so it must not move
    where = outsider.placement()
    used, held = pool.budget.used, storage.held
    for c in caches:
        c.capture_valid = True
    pool.compact([caches[i] for i in (0, 1, 2, 5, 7)])
    # The one-row cohorts' rows filled the big cohort's holes: its four rows run together.
    assert {caches[i].placement().row: i for i in (0, 1, 5, 7)} == {0: 1, 1: 5, 2: 0, 3: 7}
    assert all(caches[i].placement().group == big for i in (0, 1, 5, 7))
    # No hole comes before the 2-row cohort's row: it stays, beside the outsider.
    assert caches[2].placement().row == 0 and outsider.placement() == where
    # Only the rows that moved lost their capture.
    assert [caches[i].capture_valid for i in (0, 1, 2, 3, 5, 7)] == [False, False] + [True] * 4
    # The emptied one-row cohorts were dropped: their charge and memory are back.
    assert pool.budget.used == used - 2 * 4 * BPT
    gc.collect()
    assert storage.held == held - 2 * carve(SPEC, 4, 1).nbytes
    for c, ref in zip(caches, refs, strict=True):
        if c.capacity:
            _assert_intact(c, ref)
