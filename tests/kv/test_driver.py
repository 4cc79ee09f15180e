from __future__ import annotations

import pytest

from kvmux.kv import CapacityExceeded, GrowthFailed, ensure_capacity, failpoints

from .recording import Boom, RecordingBackend

FALLIBLE = ["allocate", "copy_prefix", "build_mask", "invalidate_capture"]


def test_order_of_primitives() -> None:
    b = RecordingBackend(capacity=4, valid_len=3)
    result = ensure_capacity(b, 5)
    assert b.calls == ["allocate", "copy_prefix", "build_mask", "invalidate_capture", "commit"]
    assert result.grew and (result.old_capacity, result.new_capacity) == (4, 8)
    assert result.valid_len == 3 and result.bytes_copied == 180
    assert b.capacity == 8
    assert b.rows[:3] == [100, 101, 102]
    assert b.mask == [1, 1, 1, 0, 0, 0, 0, 0]
    assert not b.capture_valid


def test_fits_is_a_noop() -> None:
    b = RecordingBackend(capacity=8, valid_len=3)
    result = ensure_capacity(b, 8)
    assert not result.grew and result.new_capacity == 8
    assert b.calls == []


def test_capacity_exceeded_touches_nothing() -> None:
    b = RecordingBackend(capacity=4, valid_len=3, hard_max=16)
    before = b.snapshot()
    with pytest.raises(CapacityExceeded) as info:
        ensure_capacity(b, 17)
    assert b.calls == []
    assert b.snapshot() == before
    d = info.value.details
    assert d["requested_tokens"] == 17
    assert d["hard_max"] == 16
    assert d["hard_max_source"] == "explicit cap 16"
    assert d["model_max"] == 2048
    assert d["bytes_per_token"] == 64
    assert (d["device_free_bytes"], d["device_total_bytes"]) == (1000, 4000)
    assert d["levers"]
    assert "explicit cap 16" in str(info.value) and "17 tokens" in str(info.value)


@pytest.mark.parametrize("step", FALLIBLE)
def test_each_fallible_step_failing_leaves_state_unchanged(step: str) -> None:
    b = RecordingBackend(capacity=4, valid_len=3)
    before = b.snapshot()
    b.fail_at = {step}
    with pytest.raises(GrowthFailed) as info:
        ensure_capacity(b, 5)
    assert "commit" not in b.calls
    # Steps after the failing one never ran.
    assert b.calls[-2 if step != "allocate" else -1] == step
    if step != "allocate":
        assert b.calls[-1] == "discard" and len(b.discarded) == 1
    else:
        assert b.discarded == []
    after = b.snapshot()
    if step == "invalidate_capture":
        # The capture is gone only when invalidation itself was the failing step;
        # a capture can always be re-made, buffers and lengths cannot.
        assert after[:-1] == before[:-1]
    else:
        assert after == before
        assert b.capture_valid
    d = info.value.details
    assert d["failed_step"] == step
    assert (d["old_capacity"], d["new_capacity"]) == (4, 8)
    assert d["transient_peak_bytes"] == (4 + 8) * 64
    assert d["new_alloc_bytes"] == 8 * 64
    assert d["session_unchanged"] is True
    assert d["cause"] == "error" and "Boom" in d["cause_message"]
    assert isinstance(info.value.__cause__, Boom)

    # The same call succeeds once the fault is gone.
    b.fail_at = set()
    result = ensure_capacity(b, 5)
    assert result.grew and b.capacity == 8 and b.rows[:3] == [100, 101, 102]


@pytest.mark.parametrize("step", FALLIBLE)
def test_failpoints_inject_at_each_step(step: str) -> None:
    b = RecordingBackend(capacity=4, valid_len=3)
    before = b.snapshot()
    failpoints.arm(f"kv.{step}", 1)
    with pytest.raises(GrowthFailed) as info:
        ensure_capacity(b, 6)
    assert info.value.details["cause"] == "injected"
    assert info.value.details["failed_step"] == step
    assert "commit" not in b.calls
    # The failpoint fires before the primitive runs: even invalidation is untouched.
    assert b.snapshot() == before
    assert ensure_capacity(b, 6).grew  # armed for one hit only


def test_memory_error_is_classified_out_of_memory() -> None:
    class OomBackend(RecordingBackend):
        def allocate(self, new_capacity: int):  # type: ignore[no-untyped-def]
            raise MemoryError("cannot allocate 1 GiB")

    b = OomBackend()
    with pytest.raises(GrowthFailed) as info:
        ensure_capacity(b, 5)
    assert info.value.details["cause"] == "out_of_memory"


def test_onnxruntime_allocator_text_is_classified_out_of_memory() -> None:
    class OrtOomBackend(RecordingBackend):
        def copy_prefix(self, staged):  # type: ignore[no-untyped-def]
            raise RuntimeError("Failed to allocate memory for requested buffer of size 1048576")

    b = OrtOomBackend()
    with pytest.raises(GrowthFailed) as info:
        ensure_capacity(b, 5)
    assert info.value.details["cause"] == "out_of_memory"
    assert b.discarded, "staged buffers were not dropped"


def test_interrupt_is_not_swallowed_but_staging_is_dropped() -> None:
    class Interrupted(RecordingBackend):
        def build_mask(self, staged):  # type: ignore[no-untyped-def]
            raise KeyboardInterrupt

    b = Interrupted()
    before = b.snapshot()
    with pytest.raises(KeyboardInterrupt):
        ensure_capacity(b, 5)
    assert b.discarded and b.snapshot() == before


def test_growth_failed_message_is_actionable() -> None:
    b = RecordingBackend(capacity=4, valid_len=3)
    b.fail_at = {"allocate"}
    with pytest.raises(GrowthFailed) as info:
        ensure_capacity(b, 5)
    text = str(info.value)
    for needle in ("4 -> 8", "allocate", "transient peak", "per token", "free", "unchanged"):
        assert needle in text, needle
    assert info.value.code == "kv_growth_failed"


@pytest.mark.parametrize("bad", [-1, 2.0, True])
def test_invalid_required(bad: int) -> None:
    with pytest.raises(ValueError, match="required"):
        ensure_capacity(RecordingBackend(), bad)
