"""The prefix cache on onnxruntime-genai builder exports: where the model matrix finds
kvmux's chunked prefill bit-equal to the Generator (its dense families), a session started
on a cached prefix computes every logit bit for bit as one prefilling its whole prompt."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from kvmux.daemon.engine import DecodeSession, Engine, EngineOptions, SamplingParams

from . import genai_fixture as gf
from . import matrix as m

pytestmark = [pytest.mark.genai, pytest.mark.slow]

#: Identical in the matrix, no rotary switch: the families whose forks must be exact.
DENSE = [("llama", "int4"), ("gemma2-fullkv", "fp32"), ("gemma2-fullkv", "int4")]
BLOCK = 8
SHARED = [gf.BOS_ID, *range(40, 77)]  # 38 tokens: 4 whole blocks and 6 more
N_NEW = 80


def _decode(engine: Engine, session: DecodeSession) -> tuple[list[int], list[np.ndarray[Any, Any]]]:
    """Greedy to the end, every pick through a recording sampler."""
    logits: list[np.ndarray[Any, Any]] = []
    pick = session.sampler

    def keep(row: np.ndarray[Any, Any]) -> int:
        logits.append(row.copy())
        return pick(row)

    session.sampler = keep  # type: ignore[assignment]
    session.picks_argmax = False
    try:
        while not session.finished:
            engine.step(session)
        return list(session.generated), logits
    finally:
        session.release()


def _greedy() -> SamplingParams:
    return SamplingParams(max_new_tokens=N_NEW, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize(("family", "precision"), DENSE)
def test_a_forked_session_is_bit_equal_to_a_whole_prefill(
    matrix_exports: dict[tuple[str, str], m.Export], family: str, precision: str
) -> None:
    folder = matrix_exports[(family, precision)].folder
    engine = Engine(
        folder,
        EngineOptions(
            min_bucket=m.MIN_BUCKET,
            prefill_chunk=m.PREFILL_CHUNK,
            intra_op_threads=1,
            prefix_block=BLOCK,
        ),
    )
    cache = engine.prefix
    assert cache is not None
    donor_prompt = [*SHARED, *range(100, 110)]
    key = cache.key(donor_prompt)
    copied = []
    for prompt in ([*SHARED, *range(120, 133)], donor_prompt):  # another tail; the same prompt
        want_tokens, want_logits = _decode(engine, engine.new_session(prompt, _greedy()))
        assert len(set(want_tokens)) >= m.MIN_DISTINCT  # a decode that can tell copies apart
        # A live donor that has prefilled its prompt, registered as the scheduler does.
        cache.lookup(key)
        holder = cache.register(key)
        assert holder is not None
        donor = engine.new_session(donor_prompt, SamplingParams(max_new_tokens=1))
        cache.attach(holder, donor.cache, donor.exact_prefix())  # type: ignore[arg-type]
        while donor.prefilling:
            engine.step(donor)
        mine = cache.key(prompt)
        session = engine.new_session(prompt, _greedy())
        tokens = session.fork_tokens(min(cache.lookup(mine).tokens, holder.exact))
        session.start_from(cache, holder, mine, tokens)
        copied.append(tokens)
        assert cache.leave(holder, keep=False)
        donor.release()  # the copy is the session's own
        got_tokens, got_logits = _decode(engine, session)
        assert got_tokens == want_tokens
        pairs = zip(got_logits, want_logits, strict=True)
        assert max(float(np.abs(a - b).max()) for a, b in pairs) == 0.0
    assert copied == [32, 46]  # 4 whole blocks; all the same prompt's blocks but its last 2


def test_a_longrope_export_keeps_no_prefix_cache(
    matrix_exports: dict[tuple[str, str], m.Export],
) -> None:
    """Its rotary factors follow the width of the run that computed a token: another
    prompt's KV for the same tokens is not the KV this prompt would compute."""
    engine = Engine(
        matrix_exports[("phi3-longrope", "fp32")].folder,
        EngineOptions(min_bucket=m.MIN_BUCKET, prefill_chunk=m.PREFILL_CHUNK, intra_op_threads=1),
    )
    assert engine.prefix is None
