from __future__ import annotations

import numpy as np
import pytest

from kvmux.kv import (
    GrowthFailed,
    HostKvCache,
    KvSpec,
    MemoryBudget,
    ensure_capacity,
    resolve_hard_max,
)

SPEC = KvSpec(num_layers=2, kv_heads=2, head_dim=8, dtype="float32")


def _cache(
    spec: KvSpec = SPEC, *, budget: MemoryBudget | None = None, cap: int | None = None
) -> HostKvCache:
    return HostKvCache(spec, resolve_hard_max(cap, 4096), min_bucket=4, budget=budget)


def _write_token(cache: HostKvCache, rng: np.random.Generator, ref: list[np.ndarray]) -> None:
    """Append one token's rows the way a model run would, and remember them."""
    pos = cache.valid_len
    ensure_capacity(cache, pos + 1)
    spec = cache.spec
    rows = rng.integers(0, 1 << 16, size=(2 * spec.num_layers, spec.kv_heads, spec.head_dim))
    rows = (
        rows.astype(np.uint16).view(spec.storage_dtype)
        if spec.dtype != "float32"
        else (
            rng.standard_normal((2 * spec.num_layers, spec.kv_heads, spec.head_dim)).astype(
                np.float32
            )
        )
    )
    for i, buf in enumerate(cache.keys + cache.values):
        buf[0, :, pos, :] = rows[i]
    cache.advance(1)
    ref.append(rows)


def _assert_rows_intact(cache: HostKvCache, ref: list[np.ndarray]) -> None:
    n = cache.valid_len
    assert n == len(ref)
    expected = np.stack(ref, axis=2)  # [2L, H, n, D]
    for i, buf in enumerate(cache.keys + cache.values):
        assert buf.shape == (1, cache.spec.kv_heads, cache.capacity, cache.spec.head_dim)
        # Compare bytes, not values: NaN payloads and -0.0 must survive too.
        assert buf[0, :, :n, :].tobytes() == expected[i].tobytes()
        assert not buf[0, :, n:, :].view(np.uint8).any() or cache.capacity == n
    assert cache.mask.dtype == np.int64 and cache.mask.shape == (1, cache.capacity)
    assert cache.mask[0, :n].tolist() == [1] * n and not cache.mask[0, n:].any()


def test_first_allocation_is_the_prompt_bucket() -> None:
    cache = _cache()
    assert cache.capacity == 0 and cache.nbytes == 0
    result = ensure_capacity(cache, 13)
    assert result.grew and (result.old_capacity, result.new_capacity) == (0, 16)
    assert cache.capacity == 16 and cache.nbytes == 16 * SPEC.bytes_per_token


def test_grows_4_to_1024_keeping_every_row() -> None:
    cache = _cache()
    rng = np.random.default_rng(0)
    ref: list[np.ndarray] = []
    seen = []
    for _ in range(1024):
        before = cache.capacity
        _write_token(cache, rng, ref)
        if cache.capacity != before:
            seen.append(cache.capacity)
            _assert_rows_intact(cache, ref)
    assert seen == [4, 8, 16, 32, 64, 128, 256, 512, 1024]
    _assert_rows_intact(cache, ref)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_bit_patterns_preserved(dtype: str) -> None:
    spec = KvSpec(num_layers=3, kv_heads=2, head_dim=4, dtype=dtype)
    cache = _cache(spec)
    rng = np.random.default_rng(1)
    ref: list[np.ndarray] = []
    for _ in range(70):  # random bit patterns include NaNs with payloads and infinities
        _write_token(cache, rng, ref)
    assert cache.capacity == 128
    assert cache.keys[0].dtype == spec.storage_dtype
    _assert_rows_intact(cache, ref)


def test_budget_refuses_transient_peak_and_leaves_cache_untouched() -> None:
    bpt = SPEC.bytes_per_token
    # Holds old (16) + new (32) tokens minus one byte: the growth must fail
    # although the budget is far from full before it starts.
    budget = MemoryBudget((16 + 32) * bpt - 1)
    cache = _cache(budget=budget)
    rng = np.random.default_rng(2)
    ref: list[np.ndarray] = []
    for _ in range(16):
        _write_token(cache, rng, ref)
    keys_before = [id(k) for k in cache.keys]
    mask_before = cache.mask.copy()
    used_before = budget.used
    assert used_before == 16 * bpt and budget.free is not None and budget.free > 16 * bpt

    with pytest.raises(GrowthFailed) as info:
        ensure_capacity(cache, 17)
    d = info.value.details
    assert d["cause"] == "budget" and d["failed_step"] == "allocate"
    assert d["transient_peak_bytes"] == (16 + 32) * bpt
    assert d["new_alloc_bytes"] == 32 * bpt
    assert d["bytes_per_token"] == bpt
    assert budget.total is not None
    assert d["device_total_bytes"] == budget.total
    assert d["device_free_bytes"] == budget.total - used_before
    assert d["memory_source"] == "kv.memory_budget"
    assert "transient peak" in str(info.value)

    assert cache.capacity == 16 and cache.valid_len == 16
    assert [id(k) for k in cache.keys] == keys_before
    assert np.array_equal(cache.mask, mask_before)
    assert budget.used == used_before
    _assert_rows_intact(cache, ref)


def test_budget_that_holds_the_peak_allows_growth_and_releases_old() -> None:
    bpt = SPEC.bytes_per_token
    budget = MemoryBudget((16 + 32) * bpt)
    cache = _cache(budget=budget)
    ensure_capacity(cache, 16)
    ensure_capacity(cache, 17)
    assert cache.capacity == 32
    assert budget.used == 32 * bpt
    assert budget.peak == (16 + 32) * bpt
    cache.release()
    assert budget.used == 0 and cache.capacity == 0


def test_advance_and_truncate_keep_mask_in_step() -> None:
    cache = _cache()
    ensure_capacity(cache, 5)
    cache.advance(5)
    with pytest.raises(ValueError, match="advance"):
        cache.advance(cache.capacity)
    cache.truncate(2)
    assert cache.valid_len == 2 and cache.mask[0].tolist() == [1, 1, 0, 0, 0, 0, 0, 0]
    with pytest.raises(ValueError, match="truncate"):
        cache.truncate(3)


def test_host_memory_is_reported_without_budget() -> None:
    mem = _cache().memory()
    assert mem is not None and 0 < mem.free <= mem.total
    assert mem.source.startswith("host")


def test_growth_bumps_capture_generation() -> None:
    cache = _cache()
    ensure_capacity(cache, 4)
    cache.capture_valid = True
    gen = cache.capture_generation
    ensure_capacity(cache, 5)
    assert not cache.capture_valid and cache.capture_generation == gen + 1


def test_pointers_address_live_buffers() -> None:
    cache = _cache()
    ensure_capacity(cache, 4)
    assert cache.key_ptr(1) == cache.keys[1].ctypes.data
    old = cache.value_ptr(0)
    ensure_capacity(cache, 5)
    assert cache.value_ptr(0) == cache.values[0].ctypes.data != old
