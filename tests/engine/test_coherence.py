"""Coherence is the assertion: a grown session decodes exactly as one big buffer does."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from kvmux.daemon.engine import Engine
from kvmux.kv import HostKvCache, StagedBuffers

from .helpers import decode, greedy, prompt_ids


def _reference_concat_kv(
    engine: Engine, prompt: list[int], n_new: int
) -> list[np.ndarray[Any, Any]]:
    """Greedy decode with plain session.run: past KV of exact length, concatenated by the model."""
    spec = engine.spec
    sess = engine.ort.session
    shape = (1, spec.num_kv_heads, 0, spec.head_size)
    past = {
        name: np.zeros(shape, spec.kv_dtype) for name in spec.past_key_names + spec.past_value_names
    }
    out_names = [spec.logits_name, *spec.present_key_names, *spec.present_value_names]
    tokens = list(prompt)
    feed_ids = list(prompt)
    logits_seen = []
    for _ in range(n_new):
        total = len(tokens)
        feeds: dict[str, Any] = {
            spec.input_ids_name: np.asarray([feed_ids], dtype=np.int64),
            spec.attention_mask_name: np.ones((1, total), dtype=np.int64),
            **past,
        }
        outs = sess.run(out_names, feeds)
        last = outs[0][0, -1].astype(np.float32)
        logits_seen.append(last)
        presents = outs[1:]
        names = spec.past_key_names + spec.past_value_names
        past = dict(zip(names, presents, strict=True))
        nxt = int(np.argmax(last))
        tokens.append(nxt)
        feed_ids = [nxt]
    return logits_seen


def test_grown_session_equals_one_big_buffer_bit_for_bit(
    engine: Engine, big_buffer_engine: Engine
) -> None:
    prompt = prompt_ids(engine, 3)
    grown_tokens, grown_logits, capacities = decode(engine, engine.new_session(prompt, greedy(200)))
    big = big_buffer_engine
    big_tokens, big_logits, big_caps = decode(big, big.new_session(prompt, greedy(200)))

    assert capacities == [4, 8, 16, 32, 64, 128, 256]
    assert big_caps == [256]
    assert len(grown_logits) == len(big_logits) == 200
    assert grown_tokens == big_tokens
    for step, (a, b) in enumerate(zip(grown_logits, big_logits, strict=True)):
        assert a.tobytes() == b.tobytes(), f"logits differ at step {step}"


def test_shared_buffer_equals_concat_kv_reference(engine: Engine) -> None:
    prompt = prompt_ids(engine, 5, seed=1)
    tokens, logits, _ = decode(engine, engine.new_session(prompt, greedy(60)))
    ref_logits = _reference_concat_kv(engine, prompt, 60)
    assert tokens == [int(np.argmax(x)) for x in ref_logits]
    for step, (a, b) in enumerate(zip(logits, ref_logits, strict=True)):
        np.testing.assert_array_equal(a, b, err_msg=f"step {step}")


class _OffByOneCopy(HostKvCache):
    """A prefix copy that shifts every row by one: the bug coherence must catch."""

    def copy_prefix(self, staged: StagedBuffers) -> int:
        copied = super().copy_prefix(staged)
        n = self.valid_len
        if n > 1:
            for buf in staged.keys + staged.values:
                buf[:, :, 1:n, :] = buf[:, :, 0 : n - 1, :].copy()
        return copied


def test_a_corrupted_prefix_copy_is_detected(
    engine: Engine, big_buffer_engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    prompt = prompt_ids(engine, 3, seed=2)
    _, good_logits, _ = decode(big_buffer_engine, big_buffer_engine.new_session(prompt, greedy(40)))

    def corrupted_cache(hard_max: Any) -> HostKvCache:
        return _OffByOneCopy(engine.kv_spec, hard_max, min_bucket=4, budget=engine.budget)

    monkeypatch.setattr(engine, "new_cache", corrupted_cache)
    _, bad_logits, caps = decode(engine, engine.new_session(prompt, greedy(40)))
    assert len(caps) > 1, "the session never grew, so the corruption was never exercised"
    first_bad = next(
        (
            i
            for i, (a, b) in enumerate(zip(good_logits, bad_logits, strict=True))
            if not np.array_equal(a, b)
        ),
        None,
    )
    # Steps before the first growth are identical; the first step after it is not.
    assert first_bad is not None and first_bad == 4 - len(prompt) + 1


def test_chunked_prefill_matches_one_shot(tiny_model: Any) -> None:
    from kvmux.daemon.engine import EngineOptions

    chunked = Engine(tiny_model, EngineOptions(min_bucket=4, prefill_chunk=16, intra_op_threads=1))
    one_shot = Engine(
        tiny_model, EngineOptions(min_bucket=4, prefill_chunk=4096, intra_op_threads=1)
    )
    prompt = prompt_ids(chunked, 40, seed=3)
    s = chunked.new_session(prompt, greedy(20))
    steps_before_first_token = 0
    while not s.generated:
        chunked.step(s)
        steps_before_first_token += 1
    assert steps_before_first_token == 3  # 16 + 16 + 8
    s.release()
    a_tokens, a_logits, _ = decode(chunked, chunked.new_session(prompt, greedy(20)))
    b_tokens, b_logits, _ = decode(one_shot, one_shot.new_session(prompt, greedy(20)))
    assert a_tokens == b_tokens
    for a, b in zip(a_logits, b_logits, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
