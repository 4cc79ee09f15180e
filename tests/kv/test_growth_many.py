"""Rows growing into one bucket move together: one claim, batched copies, all or nothing.

The pool, its rows and the driver are the real ones; the storages are the host
storage with its allocations counted, and the device-like fake (one allocation
per cohort, refusing on demand), both through :class:`kvmux.kv.CohortStorage`.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from kvmux.kv import (
    CohortBuffers,
    CohortPool,
    CohortStorage,
    GrowthFailed,
    GrowthResult,
    HostStorage,
    KvSpec,
    MemoryBudget,
    RowKvCache,
    ensure_capacity,
    ensure_capacity_many,
    failpoints,
    resolve_hard_max,
)

from .fake_device import FakeDeviceStorage
from .test_cohort import _assert_intact, _write

SPEC = KvSpec(num_layers=2, kv_heads=2, head_dim=8, dtype="float32")
HARD = resolve_hard_max(None, 4096)
BPT = SPEC.bytes_per_token
FAILPOINTS = ["kv.allocate", "kv.copy_prefix", "kv.build_mask", "kv.invalidate_capture"]


class CountingHostStorage(HostStorage):
    """The host storage, its allocations recorded as (capacity, rows)."""

    def __init__(self) -> None:
        self.allocated_rows: list[tuple[int, int]] = []

    def allocate(self, spec: KvSpec, capacity: int, rows: int) -> CohortBuffers:
        self.allocated_rows.append((capacity, rows))
        return super().allocate(spec, capacity, rows)


def _storage(kind: str) -> CountingHostStorage | FakeDeviceStorage:
    return CountingHostStorage() if kind == "host" else FakeDeviceStorage()


def _pool(storage: CohortStorage, budget: MemoryBudget | None = None) -> CohortPool:
    return CohortPool(SPEC, storage=storage, rows_per_cohort=8, min_bucket=4, budget=budget)


def _opened(
    pool: CohortPool, lengths: list[int], seed: int = 0
) -> tuple[list[RowKvCache], list[list[np.ndarray]]]:
    """Caches holding ``lengths`` random tokens each, opened one by one (on the device
    fake the bucket-4 rows land in cohorts of 1, 1, 2, 4 rows: sources in several)."""
    rng = np.random.default_rng(seed)
    caches: list[RowKvCache] = []
    refs: list[list[np.ndarray]] = []
    for n in lengths:
        cache, ref = pool.new_cache(HARD), list[np.ndarray]()
        for _ in range(n):
            _write(cache, rng, ref)
        caches.append(cache)
        refs.append(ref)
    return caches, refs


def _state(cache: RowKvCache) -> tuple[Any, ...]:
    """Everything a growth may touch of one cache, by value and by identity."""
    p = cache.placement()
    rows = tuple(buf[p.row].tobytes() for buf in [*p.keys, *p.values])
    return (
        p,
        cache.capacity,
        cache.valid_len,
        cache.capture_valid,
        cache.capture_generation,
        p.mask[p.row].tobytes(),
        rows,
    )


def _allocations(storage: CountingHostStorage | FakeDeviceStorage, capacity: int) -> list[int]:
    return [rows for cap, rows in storage.allocated_rows if cap == capacity]


@pytest.mark.parametrize("kind", ["host", "device"])
def test_a_group_moves_in_one_allocation_keeping_every_token(kind: str) -> None:
    storage = _storage(kind)
    pool = _pool(storage)
    # Four at the end of bucket 4 (a decode step) and two mid-prompt (a chunk of
    # several): all six need bucket 8.
    lengths = [4, 4, 4, 4, 2, 3]
    required = [5, 5, 5, 5, 6, 8]
    caches, refs = _opened(pool, lengths)
    # A neighbour that stays in bucket 4: the old rows beside it are zeroed, not dropped.
    [stay], [stay_ref] = _opened(pool, [3], seed=1)
    for c in caches:
        c.capture_valid = True
    sources = {c.placement().group for c in caches}
    if kind == "device":
        assert len(sources) == 4  # rows 1 + 1 + 2 + 2 of 4
    syncs = storage.syncs if isinstance(storage, FakeDeviceStorage) else 0
    results = ensure_capacity_many(caches, required)
    if isinstance(storage, FakeDeviceStorage):
        # One wait for the copies and masks, one for zeroing the old rows that stay.
        assert storage.syncs - syncs == 2
    assert all(isinstance(r, GrowthResult) and r.grew for r in results)
    assert [(r.old_capacity, r.new_capacity, r.valid_len) for r in results] == [  # type: ignore[union-attr]
        (4, 8, n) for n in lengths
    ]
    assert [r.bytes_copied for r in results] == [  # type: ignore[union-attr]
        n * SPEC.kv_bytes_per_token for n in lengths
    ]
    # One allocation for the six rows, all in one cohort, rows 0..5.
    assert len(_allocations(storage, 8)) == 1
    assert len({c.placement().group for c in caches}) == 1
    assert sorted(c.placement().row for c in caches) == list(range(6))
    assert not any(c.capture_valid for c in caches)
    for c, ref in zip(caches, refs, strict=True):
        _assert_intact(c, ref)
    # The old rows went back: zeroed beside the neighbour, their cohorts dropped else.
    assert sorted(c.capacity for c in pool.cohorts()) == [4, 8]
    _assert_intact(stay, stay_ref)
    (old,) = [c for c in pool.cohorts() if c.capacity == 4]
    free_rows = [r for r, owner in enumerate(old.slots) if owner is None]
    assert free_rows and old.used == 1
    for buf in (*old.keys, *old.values, old.mask):
        assert not buf[free_rows].any()
    # They decode on: each keeps appending tokens and holds exactly them.
    rng = np.random.default_rng(9)
    for _ in range(3):
        for c, ref in zip(caches, refs, strict=True):
            _write(c, rng, ref)
    for c, ref in zip(caches, refs, strict=True):
        _assert_intact(c, ref)


def test_growing_one_by_one_takes_a_claim_each_and_lands_the_same_bytes() -> None:
    """The group and the one-by-one path write the very same rows' contents."""
    lengths, required = [4, 4, 3, 4], [5, 5, 7, 5]
    one_storage, many_storage = FakeDeviceStorage(), FakeDeviceStorage()
    one, _ = _opened(_pool(one_storage), lengths)
    many, _ = _opened(_pool(many_storage), lengths)
    for c, need in zip(one, required, strict=True):
        ensure_capacity(c, need)
    ensure_capacity_many(many, required)
    assert len(_allocations(one_storage, 8)) > 1 and len(_allocations(many_storage, 8)) == 1
    for a, b in zip(one, many, strict=True):
        pa, pb = a.placement(), b.placement()
        for x, y in zip([*pa.keys, *pa.values], [*pb.keys, *pb.values], strict=True):
            assert x[pa.row].tobytes() == y[pb.row].tobytes()
        assert pa.mask[pa.row].tobytes() == pb.mask[pb.row].tobytes()


@pytest.mark.parametrize("failpoint", FAILPOINTS)
@pytest.mark.parametrize("kind", ["host", "device"])
def test_a_failure_before_commit_leaves_every_session_as_it_was(failpoint: str, kind: str) -> None:
    storage = _storage(kind)
    pool = _pool(storage)
    lengths = [4, 4, 4, 2]
    caches, refs = _opened(pool, lengths)
    for c in caches:
        c.capture_valid = True
    before = [_state(c) for c in caches]
    used, cohorts = pool.budget.used, [(c.capacity, c.used) for c in pool.cohorts()]
    # Armed for two hits: the group hits it once, so one is left.
    with failpoints.armed_for(failpoint, 2):
        results = ensure_capacity_many(caches, [5, 5, 5, 6])
        assert failpoints.armed() == {failpoint: 1}
    step = failpoint.removeprefix("kv.")
    for r, c in zip(results, caches, strict=True):
        assert isinstance(r, GrowthFailed)
        d = r.details
        assert d["failed_step"] == step and d["cause"] == "injected"
        assert (d["old_capacity"], d["new_capacity"]) == (4, 8)
        assert d["valid_len"] == c.valid_len and d["session_unchanged"] is True
        assert d["transient_peak_bytes"] == (4 + 8) * BPT
        assert d["group_size"] == 4 and d["group_transient_peak_bytes"] == 4 * (4 + 8) * BPT
        assert "KV growth 4 -> 8 tokens failed" in str(r) and "transient peak" in str(r)
    assert [_state(c) for c in caches] == before
    assert pool.budget.used == used
    assert [(c.capacity, c.used) for c in pool.cohorts()] == cohorts
    for c, ref in zip(caches, refs, strict=True):
        _assert_intact(c, ref)
    # The same call again succeeds, every token where it was.
    again = ensure_capacity_many(caches, [5, 5, 5, 6])
    assert all(isinstance(r, GrowthResult) and r.grew for r in again)
    for c, ref in zip(caches, refs, strict=True):
        _assert_intact(c, ref)


def test_the_budget_takes_some_of_a_group_and_refuses_the_rest_each() -> None:
    """Six rows of bucket 4 held, room for 16 tokens more: rows of 8 for the first two,
    whose old rows then free room for a third; the last three are refused."""
    budget = MemoryBudget((6 * 4 + 16) * BPT)
    storage = CountingHostStorage()
    pool = _pool(storage, budget)
    caches, refs = _opened(pool, [4] * 6)
    before = [_state(c) for c in caches]
    results = ensure_capacity_many(caches, [5] * 6)
    grown, refused = results[:3], results[3:]
    assert all(isinstance(r, GrowthResult) and r.new_capacity == 8 for r in grown)
    assert budget.peak <= budget.total  # type: ignore[operator]
    for r, c, state in zip(refused, caches[3:], before[3:], strict=True):
        assert isinstance(r, GrowthFailed)
        d = r.details
        assert d["cause"] == "budget" and d["failed_step"] == "allocate"
        assert (d["old_capacity"], d["new_capacity"]) == (4, 8)
        assert d["new_alloc_bytes"] == 8 * BPT and d["transient_peak_bytes"] == 12 * BPT
        assert d["memory_source"] == "kv.memory_budget"
        assert d["levers"] and d["session_unchanged"] is True
        assert _state(c) == state
        # The same refusal, word for word, as growing it alone now.
        with pytest.raises(GrowthFailed) as alone:
            ensure_capacity(c, 5)
        same = {k: v for k, v in d.items() if not k.startswith("group_")}
        assert alone.value.details == same
    # Growing one by one, in this order, grows the same three.
    twin_budget = MemoryBudget((6 * 4 + 16) * BPT)
    twin, _ = _opened(_pool(CountingHostStorage(), twin_budget), [4] * 6)
    alone_grew = []
    for c in twin:
        try:
            alone_grew.append(ensure_capacity(c, 5).grew)
        except GrowthFailed:
            alone_grew.append(False)
    assert alone_grew == [True] * 3 + [False] * 3
    # The grown decode on, the refused hold what they held.
    rng = np.random.default_rng(5)
    for _ in range(3):
        for c, ref in zip(caches[:3], refs[:3], strict=True):
            _write(c, rng, ref)
    for c, ref in zip(caches, refs, strict=True):
        _assert_intact(c, ref)


def test_a_device_refusal_fails_the_group_and_leaves_it_as_it_was() -> None:
    storage = FakeDeviceStorage(refuse_capacities={8})
    pool = _pool(storage)
    caches, refs = _opened(pool, [4, 4, 4])
    before = [_state(c) for c in caches]
    results = ensure_capacity_many(caches, [5, 5, 5])
    for r in results:
        assert isinstance(r, GrowthFailed) and r.details["cause"] == "out_of_memory"
        assert r.details["device_total_bytes"] == storage.total
    assert [_state(c) for c in caches] == before
    for c, ref in zip(caches, refs, strict=True):
        _assert_intact(c, ref)


def test_each_cache_gets_its_own_outcome() -> None:
    """Caches that need nothing, that are past their hard maximum, and that grow into
    different buckets: each its outcome, the groups by bucket."""
    storage = CountingHostStorage()
    pool = _pool(storage)
    capped = resolve_hard_max(8, 4096)
    caches, refs = _opened(pool, [4, 4, 2, 4, 4])
    tight = pool.new_cache(capped)
    ensure_capacity(tight, 8)
    results = ensure_capacity_many([*caches, tight], [5, 9, 3, 5, 17, 9])
    kinds = [type(r).__name__ for r in results]
    assert kinds == ["GrowthResult"] * 5 + ["CapacityExceeded"]
    assert [r.new_capacity for r in results[:5]] == [8, 16, 4, 8, 32]  # type: ignore[union-attr]
    assert results[2].grew is False  # type: ignore[union-attr]
    assert _allocations(storage, 8) == [8] and len(_allocations(storage, 16)) == 1
    for c, ref in zip(caches, refs, strict=True):
        _assert_intact(c, ref)
    with pytest.raises(ValueError):
        ensure_capacity_many([caches[0], caches[0]], [9, 9])
    with pytest.raises(ValueError):
        ensure_capacity_many(caches[:1], [-1])


def test_old_rows_whose_zeroing_fails_are_retired_and_the_growth_stands() -> None:
    storage = FakeDeviceStorage()
    pool = _pool(storage)
    # Four rows in cohorts of 1, 1 and 2 rows, which they leave empty (dropped); the
    # fifth beside a session that stays, in a cohort of 4 rows: zeroed, and that fails.
    caches, refs = _opened(pool, [4, 4, 4, 4])
    [stay], _ = _opened(pool, [2], seed=3)
    [mover], [mover_ref] = _opened(pool, [4], seed=4)
    assert mover.placement().group == stay.placement().group
    together = [*caches, mover]
    with failpoints.armed_for("kv.clear_row", 1):
        results = ensure_capacity_many(together, [5] * 5)
    assert all(isinstance(r, GrowthResult) and r.grew for r in results)
    for c, r in zip(together, [*refs, mover_ref], strict=True):
        _assert_intact(c, r)
    (old,) = [c for c in pool.cohorts() if c.capacity == 4]
    assert old.retired == 1 and old.used == 1 and old.has_room()
    stay.release()
    for c in together:
        c.release()
    assert pool.cohorts() == [] and pool.budget.used == 0
