"""CudaKvCache: same primitives on device memory. Real-device tests are marked gpu."""

from __future__ import annotations

import numpy as np
import pytest

from kvmux.kv import (
    CudaKvCache,
    GrowthFailed,
    KvConfigError,
    KvSpec,
    MemoryBudget,
    cuda_unavailable_reason,
    ensure_capacity,
    resolve_hard_max,
)

SPEC = KvSpec(num_layers=2, kv_heads=2, head_dim=8, dtype="float16")


def test_unavailability_is_explained_not_crashed() -> None:
    reason = cuda_unavailable_reason()
    if reason is None:
        cache = CudaKvCache(SPEC, resolve_hard_max(None, None), min_bucket=4)
        assert cache.capacity == 0
    else:
        assert reason  # a sentence, not an empty string
        with pytest.raises(KvConfigError, match="CudaKvCache is unavailable"):
            CudaKvCache(SPEC, resolve_hard_max(None, None), min_bucket=4)


@pytest.mark.gpu
def test_device_growth_keeps_bits() -> None:
    import cupy

    cache = CudaKvCache(SPEC, resolve_hard_max(None, None), min_bucket=4)
    rng = np.random.default_rng(0)
    ref = []
    for _ in range(100):
        pos = cache.valid_len
        ensure_capacity(cache, pos + 1)
        rows = rng.integers(0, 1 << 16, size=(4, 2, 8), dtype=np.uint16)
        for i, buf in enumerate(cache.keys + cache.values):
            buf.view(cupy.uint16)[0, :, pos, :] = cupy.asarray(rows[i])
        cache.advance(1)
        ref.append(rows)
    assert cache.capacity == 128
    expected = np.stack(ref, axis=2)
    for i, buf in enumerate(cache.keys + cache.values):
        assert np.array_equal(cupy.asnumpy(buf.view(cupy.uint16))[0, :, :100, :], expected[i])
    assert cache.key_ptr(0) == cache.keys[0].data.ptr
    mem = cache.memory()
    assert mem is not None and mem.source.startswith("cudaMemGetInfo")


@pytest.mark.gpu
def test_device_refusal_becomes_growth_failed() -> None:
    cache = CudaKvCache(SPEC, resolve_hard_max(None, None), min_bucket=4)
    ensure_capacity(cache, 8)
    before = (cache.capacity, [k.data.ptr for k in cache.keys])
    # 2**40 tokens of this spec is petabytes: a real device refusal.
    with pytest.raises(GrowthFailed) as info:
        ensure_capacity(cache, 1 << 40)
    assert info.value.details["cause"] == "out_of_memory"
    assert info.value.details["memory_source"].startswith("cudaMemGetInfo")
    assert (cache.capacity, [k.data.ptr for k in cache.keys]) == before
    assert ensure_capacity(cache, 9).grew


@pytest.mark.gpu
def test_device_budget_refusal() -> None:
    budget = MemoryBudget(12 * SPEC.bytes_per_token)
    cache = CudaKvCache(SPEC, resolve_hard_max(None, None), min_bucket=4, budget=budget)
    ensure_capacity(cache, 4)
    ensure_capacity(cache, 8)
    with pytest.raises(GrowthFailed):
        ensure_capacity(cache, 9)
    assert cache.capacity == 8 and budget.used == 8 * SPEC.bytes_per_token
