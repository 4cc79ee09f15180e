"""Cohorts: sessions' KV as rows of shared buffers, grown by the same transaction as any cache."""

from __future__ import annotations

import numpy as np
import pytest

from kvmux.kv import (
    BudgetExceeded,
    CohortPool,
    GrowthFailed,
    KvSpec,
    MemoryBudget,
    RowKvCache,
    ensure_capacity,
    failpoints,
    resolve_hard_max,
)

SPEC = KvSpec(num_layers=2, kv_heads=2, head_dim=8, dtype="float32")
HARD = resolve_hard_max(None, 4096)


def _pool(budget: MemoryBudget | None = None, rows: int = 4) -> CohortPool:
    return CohortPool(SPEC, rows_per_cohort=rows, min_bucket=4, budget=budget)


def _write(cache: RowKvCache, rng: np.random.Generator, ref: list[np.ndarray]) -> None:
    """Append one token the way a run would: at the row's next position, in every layer."""
    pos = cache.valid_len
    ensure_capacity(cache, pos + 1)
    p = cache.placement()
    rows = rng.standard_normal((2 * SPEC.num_layers, SPEC.kv_heads, SPEC.head_dim))
    for i, buf in enumerate([*p.keys, *p.values]):
        buf[p.row, :, pos, :] = rows[i]
    cache.advance(1)
    ref.append(rows.astype(np.float32))


def _assert_intact(cache: RowKvCache, ref: list[np.ndarray]) -> None:
    p, n = cache.placement(), cache.valid_len
    expected = np.stack(ref, axis=2)
    for i, buf in enumerate([*p.keys, *p.values]):
        assert buf[p.row, :, :n, :].tobytes() == expected[i].tobytes()
        assert not buf[p.row, :, n:, :].any()
    assert p.mask[p.row, :n].tolist() == [1] * n and not p.mask[p.row, n:].any()


def test_sessions_of_one_bucket_share_a_cohort_in_the_lowest_free_rows() -> None:
    pool = _pool()
    caches = [pool.new_cache(HARD) for _ in range(3)]
    for c in caches:
        ensure_capacity(c, 3)
    places = [c.placement() for c in caches]
    assert len({p.group for p in places}) == 1
    assert [p.row for p in places] == [0, 1, 2]
    caches[1].release()
    again = pool.new_cache(HARD)
    ensure_capacity(again, 2)
    assert again.placement().row == 1  # the hole is filled first
    assert again.placement().group == places[0].group


def test_growth_moves_the_row_keeping_every_token_and_freeing_the_old_row() -> None:
    rng = np.random.default_rng(0)
    pool = _pool()
    neighbour = pool.new_cache(HARD)
    ensure_capacity(neighbour, 4)
    cache = pool.new_cache(HARD)
    ref: list[np.ndarray] = []
    groups = []
    for _ in range(40):
        _write(cache, rng, ref)
        groups.append(cache.placement().group)
        _assert_intact(cache, ref)
    assert cache.capacity == 64 and len(set(groups)) == 5  # 4, 8, 16, 32, 64
    # The bucket-4 cohort still holds the neighbour; the others it left are unmapped.
    assert sorted(c.capacity for c in pool.cohorts()) == [4, 64]
    assert pool.budget.used == (4 + 64) * SPEC.bytes_per_token


def test_a_freed_row_reads_as_zeros_when_claimed_again() -> None:
    rng = np.random.default_rng(1)
    pool = _pool()
    keep = pool.new_cache(HARD)
    ensure_capacity(keep, 4)  # keeps the cohort mapped
    first = pool.new_cache(HARD)
    for _ in range(4):
        _write(first, rng, [])
    row = first.placement().row
    first.release()
    second = pool.new_cache(HARD)
    ensure_capacity(second, 1)
    p = second.placement()
    assert p.row == row
    for buf in [*p.keys, *p.values]:
        assert not buf[row].any()
    assert not p.mask[row].any()


@pytest.mark.parametrize(
    "failpoint", ["kv.allocate", "kv.copy_prefix", "kv.build_mask", "kv.invalidate_capture"]
)
def test_failed_growth_leaves_the_row_where_it_was(failpoint: str) -> None:
    rng = np.random.default_rng(2)
    pool = _pool()
    cache = pool.new_cache(HARD)
    ref: list[np.ndarray] = []
    for _ in range(4):
        _write(cache, rng, ref)
    before = (cache.placement(), cache.capacity, cache.valid_len, pool.budget.used)
    with failpoints.armed_for(failpoint, 1), pytest.raises(GrowthFailed):
        ensure_capacity(cache, 5)
    assert (cache.placement(), cache.capacity, cache.valid_len, pool.budget.used) == before
    _assert_intact(cache, ref)
    # The claimed row went back: the retry gets row 0 of a fresh bucket-8 cohort.
    _write(cache, rng, ref)
    assert cache.capacity == 8 and cache.placement().row == 0
    _assert_intact(cache, ref)


def test_budget_charges_a_row_and_the_peak_is_one_row_old_plus_new() -> None:
    bpt = SPEC.bytes_per_token
    budget = MemoryBudget((16 + 32) * bpt)
    pool = _pool(budget)
    cache = pool.new_cache(HARD)
    ensure_capacity(cache, 16)
    assert budget.used == 16 * bpt
    assert ensure_capacity(cache, 17).new_capacity == 32
    assert budget.used == 32 * bpt and budget.peak == (16 + 32) * bpt
    with pytest.raises(GrowthFailed) as info:
        ensure_capacity(cache, 33)  # 32 + 64 is over the budget
    assert info.value.details["cause"] == "budget"
    assert isinstance(info.value.__cause__, BudgetExceeded)
    assert cache.capacity == 32 and budget.used == 32 * bpt
    cache.release()
    assert budget.used == 0 and pool.cohorts() == []


def test_a_full_cohort_opens_another() -> None:
    pool = _pool(rows=2)
    caches = [pool.new_cache(HARD) for _ in range(3)]
    for c in caches:
        ensure_capacity(c, 4)
    groups = [c.placement().group for c in caches]
    assert groups[0] == groups[1] != groups[2]
    assert [c.placement().row for c in caches] == [0, 1, 0]


def _rss() -> int:
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_memory_follows_the_rows_in_use_not_the_cohort() -> None:
    """A 64-row cohort at 4096 tokens of a `small`-like spec reserves 4 GiB of address
    space; two written rows make ~128 MiB resident, and a freed row gives its 64 MiB back."""
    spec = KvSpec(num_layers=8, kv_heads=4, head_dim=64, dtype="float32")
    pool = CohortPool(spec, rows_per_cohort=64, min_bucket=4096)
    row_bytes = 4096 * spec.bytes_per_token
    base = _rss()
    caches = [pool.new_cache(HARD) for _ in range(2)]
    for c in caches:
        ensure_capacity(c, 4096)
        p = c.placement()
        for buf in [*p.keys, *p.values]:
            buf[p.row] = 1.0  # every page of the row written, as a full context would be
        c.advance(4096)
    grown = _rss() - base
    assert pool.budget.used == 2 * row_bytes
    assert 1.5 * row_bytes < grown < 3 * row_bytes, (grown, row_bytes)
    caches[0].release()
    freed = _rss() - base
    assert grown - freed > 0.8 * row_bytes, (grown, freed)
    caches[1].release()
    assert pool.cohorts() == []


def test_compact_moves_rows_down_into_holes_leaving_others_in_place() -> None:
    rng = np.random.default_rng(7)
    pool = _pool(rows=8)
    caches = [pool.new_cache(HARD) for _ in range(6)]
    refs: list[list[np.ndarray]] = [[] for _ in caches]
    for _ in range(3):
        for c, ref in zip(caches, refs, strict=True):
            _write(c, rng, ref)
    caches[1].release()
    caches[3].release()
    outsider = caches[4]  # growing, say: not handed to compact, so it must not move
    members = [caches[0], caches[2], caches[5]]
    used = pool.budget.used
    moved = pool.compact(members)
    assert pool.budget.used == used == 4 * 4 * SPEC.bytes_per_token  # a move keeps its charge
    assert [c.placement().row for c in members] == [0, 2, 1]
    assert outsider.placement().row == 4
    assert moved == 3 * SPEC.kv_bytes_per_token  # one row of 3 tokens
    for c, ref in ((caches[0], refs[0]), (caches[2], refs[2]), (caches[5], refs[5])):
        _assert_intact(c, ref)
    _assert_intact(outsider, refs[4])
    p = outsider.placement()
    assert not p.mask[5].any() and not p.keys[0][5].any()  # the old row was cleared
    assert pool.compact(members) == 0  # nothing left to fill below them


def test_long_buckets_get_fewer_rows_per_cohort() -> None:
    pool = _pool(rows=64)
    assert pool.rows_for(16) == 64
    long = 1 << 22  # a row of 1.1 GB: 64 of them would reserve 70 GB
    assert pool.rows_for(long) == (16 << 30) // (long * SPEC.bytes_per_token) == 15
    assert pool.rows_for(1 << 40) == 1


def test_a_placement_is_the_same_object_until_its_row_moves_grows_or_is_released() -> None:
    """The engine reuses a step's plan while its rows' placements are the very same
    objects: a new one must come with every move, growth and release."""
    pool = _pool(rows=8)
    a, b = pool.new_cache(HARD), pool.new_cache(HARD)
    for c in (a, b):
        ensure_capacity(c, 3)
        c.advance(3)
    first = b.placement()
    assert b.placement() is first
    b.advance(1)  # a token more is not a move
    assert b.placement() is first
    a.release()
    pool.compact([b])  # b moves down into a's old row
    moved = b.placement()
    assert moved is not first and (moved.row, first.row) == (0, 1)
    ensure_capacity(b, 5)  # the next bucket: a row of another cohort
    grown = b.placement()
    assert grown is not moved and grown.capacity == 8 and grown.group != moved.group
    b.release()
    with pytest.raises(RuntimeError):
        b.placement()
    ensure_capacity(b, 2)
    assert b.placement() is not grown
