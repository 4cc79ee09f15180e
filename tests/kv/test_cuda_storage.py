"""CudaStorage: cohorts in device memory, same pool and rows. Real-device tests are marked gpu."""

from __future__ import annotations

import numpy as np
import pytest

from kvmux.kv import (
    CohortPool,
    CudaStorage,
    GrowthFailed,
    KvConfigError,
    KvSpec,
    MemoryBudget,
    cuda_unavailable_reason,
    ensure_capacity,
    resolve_hard_max,
)

SPEC = KvSpec(num_layers=2, kv_heads=2, head_dim=8, dtype="float16")
HARD = resolve_hard_max(None, None)


def _pool(budget: MemoryBudget | None = None) -> CohortPool:
    return CohortPool(SPEC, storage=CudaStorage(0), min_bucket=4, budget=budget)


def test_unavailability_is_explained_not_crashed() -> None:
    reason = cuda_unavailable_reason()
    if reason is None:
        assert CudaStorage(0).per_row is False
    else:
        assert reason  # a sentence, not an empty string
        with pytest.raises(KvConfigError, match="CUDA KV storage is unavailable"):
            CudaStorage(0)


@pytest.mark.gpu
def test_device_growth_moves_the_row_keeping_bits() -> None:
    import cupy

    pool = _pool()
    neighbour = pool.new_cache(HARD)
    ensure_capacity(neighbour, 4)
    cache = pool.new_cache(HARD)
    rng = np.random.default_rng(0)
    ref = []
    for _ in range(100):
        pos = cache.valid_len
        ensure_capacity(cache, pos + 1)
        p = cache.placement()
        rows = rng.integers(0, 1 << 16, size=(4, 2, 8), dtype=np.uint16)
        for i, buf in enumerate([*p.keys, *p.values]):
            buf.view(cupy.uint16)[p.row, :, pos, :] = cupy.asarray(rows[i])
        cache.advance(1)
        ref.append(rows)
    assert cache.capacity == 128
    p = cache.placement()
    expected = np.stack(ref, axis=2)
    for i, buf in enumerate([*p.keys, *p.values]):
        got = cupy.asnumpy(buf.view(cupy.uint16)[p.row])
        assert np.array_equal(got[:, :100, :], expected[i])
        assert not got[:, 100:, :].any()
    mask = cupy.asnumpy(p.mask[p.row])
    assert mask[:100].tolist() == [1] * 100 and not mask[100:].any()
    # Bound by pointer: the row's address is the cohort buffer's plus whole rows.
    row_bytes = p.keys[0][0].nbytes
    assert cache.ptr(p.keys[0]) + p.row * row_bytes == p.keys[0][p.row].data.ptr
    mem = cache.memory()
    assert mem is not None and mem.source.startswith("cudaMemGetInfo")
    neighbour.release()
    cache.release()
    assert pool.budget.used == 0 and pool.cohorts() == []


@pytest.mark.gpu
def test_a_real_device_refusal_fails_one_growth_and_the_others_go_on() -> None:
    pool = _pool()
    victim, other = pool.new_cache(HARD), pool.new_cache(HARD)
    ensure_capacity(victim, 8)
    ensure_capacity(other, 8)
    before = (victim.placement(), victim.capacity, pool.budget.used)
    # 2**40 tokens of this spec is petabytes: a real device refusal, for one row.
    with pytest.raises(GrowthFailed) as info:
        ensure_capacity(victim, 1 << 40)
    d = info.value.details
    assert d["cause"] == "out_of_memory" and d["failed_step"] == "allocate"
    assert d["memory_source"].startswith("cudaMemGetInfo")
    assert d["device_total_bytes"] > 0 and d["device_free_bytes"] is not None
    assert d["transient_peak_bytes"] == (8 + (1 << 40)) * SPEC.bytes_per_token
    assert (victim.placement(), victim.capacity, pool.budget.used) == before
    assert ensure_capacity(other, 9).grew
    assert ensure_capacity(victim, 9).grew


@pytest.mark.gpu
def test_device_budget_charges_cohorts_and_refuses_past_it() -> None:
    row = 8 * SPEC.bytes_per_token
    budget = MemoryBudget(2 * row)
    pool = _pool(budget)
    a, b = pool.new_cache(HARD), pool.new_cache(HARD)
    ensure_capacity(a, 8)
    ensure_capacity(b, 8)
    assert budget.used == pool.allocated_bytes() == 2 * row
    with pytest.raises(GrowthFailed) as info:
        ensure_capacity(a, 9)
    assert info.value.details["cause"] == "budget"
    assert a.capacity == 8 and budget.used == 2 * row
