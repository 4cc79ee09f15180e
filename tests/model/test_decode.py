"""The tiny model decoded with one shared past/present KV buffer per tensor (IOBinding)."""

from __future__ import annotations

from typing import Any

import numpy as np
import onnxruntime as ort
import pytest

from kvmux.daemon.model import ModelSpec

PROMPT = [int(t) for t in np.random.default_rng(7).integers(0, 256, 40)]
STEPS = 40


def test_capacity_does_not_change_logits(
    tiny_spec: ModelSpec, tiny_session: ort.InferenceSession, decode: Any
) -> None:
    small = decode.shared(tiny_spec, tiny_session, PROMPT, STEPS, capacity=256)
    big = decode.shared(tiny_spec, tiny_session, PROMPT, STEPS, capacity=1024)
    np.testing.assert_array_equal(small, big)


def test_shared_buffer_matches_plain_concat_reference(
    tiny_spec: ModelSpec, tiny_session: ort.InferenceSession, decode: Any
) -> None:
    shared = decode.shared(tiny_spec, tiny_session, PROMPT, STEPS, capacity=256)
    reference = decode.reference(tiny_spec, tiny_session, PROMPT, STEPS)
    # Measured bit-identical on ORT 1.32 CPU; exact equality is the claim.
    np.testing.assert_array_equal(shared, reference)


def test_chunked_prefill_matches_one_shot(
    tiny_spec: ModelSpec, tiny_session: ort.InferenceSession, decode: Any
) -> None:
    one_shot = decode.shared(tiny_spec, tiny_session, PROMPT, STEPS, capacity=256)
    chunked = decode.shared(tiny_spec, tiny_session, PROMPT, STEPS, capacity=256, chunk=16)
    # 40 tokens as 16 + 16 + 8, each chunk attending to the past: bit-identical
    # last-token logits on ORT 1.32 CPU, and the decode that follows too.
    np.testing.assert_array_equal(chunked[0], one_shot[0])
    np.testing.assert_array_equal(chunked, one_shot)


def test_logits_are_varied_and_depend_on_the_past(
    tiny_spec: ModelSpec, tiny_session: ort.InferenceSession, shared_kv: Any
) -> None:
    kv = shared_kv(tiny_spec, tiny_session, 64)
    kv.step(PROMPT[:20])
    probe = kv.step([PROMPT[20]])
    # Far from uniform: the top token holds a real share of the mass.
    p = np.exp(probe - probe.max())
    p /= p.sum()
    assert p.max() > 10.0 / tiny_spec.vocab_size
    assert probe.std() > 1.0

    # Same 21 tokens, then one past row disturbed: the next logits differ.
    def run(corrupt: bool) -> np.ndarray[Any, Any]:
        kv = shared_kv(tiny_spec, tiny_session, 64)
        kv.step(PROMPT[:20])
        if corrupt:
            kv.keys[0][0, :, 5, :] += 0.5
        return kv.step([PROMPT[20]])  # type: ignore[no-any-return]

    clean, corrupted = run(False), run(True)
    np.testing.assert_array_equal(clean, probe)
    assert np.abs(clean - corrupted).max() > 1e-3


def test_rows_past_the_valid_length_are_not_read(
    tiny_spec: ModelSpec, tiny_session: ort.InferenceSession, shared_kv: Any
) -> None:
    clean = shared_kv(tiny_spec, tiny_session, 64)
    dirty = shared_kv(tiny_spec, tiny_session, 64)
    for buf in (*dirty.keys, *dirty.values):
        buf[:] = np.nan
    a = clean.step(PROMPT[:10])
    b = dirty.step(PROMPT[:10])
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(clean.step([3]), dirty.step([3]))


def test_capacity_beyond_context_length_is_refused_by_gqa(
    tiny_spec: ModelSpec, tiny_session: ort.InferenceSession, shared_kv: Any
) -> None:
    # The mask is as wide as the capacity, so total_sequence_length = capacity, and
    # GQA needs a rotary cache row for each: capacity must stay <= context_length.
    assert tiny_spec.context_length == 2048
    shared_kv(tiny_spec, tiny_session, 2048).step(PROMPT)
    with pytest.raises(Exception, match="cos_cache dimension 0"):
        shared_kv(tiny_spec, tiny_session, 4096).step(PROMPT)
