"""A model written by onnxruntime-genai's own builder decodes in kvmux to the Generator's tokens.

Runs where the [genai] extra is installed (CI installs it); elsewhere the
fixture skips with the missing package named.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvmux.daemon.engine import Engine, EngineOptions, SamplingParams
from kvmux.daemon.model import load_model

from .genai_fixture import EOS_ID, generator_greedy

pytestmark = [pytest.mark.genai, pytest.mark.slow]


def test_builder_export_loads_with_its_declared_shape(genai_model_dir: Path) -> None:
    spec = load_model(genai_model_dir)
    assert spec.position_ids_name is None  # genai's GQA takes positions from seqlens_k
    assert spec.context_length == 1024
    assert spec.eos_token_ids == (EOS_ID,)
    assert spec.search.past_present_share_buffer


@pytest.mark.parametrize("min_bucket", [4, 256])
# Two prompts that run the full 60 tokens, one that stops on eos after 22.
@pytest.mark.parametrize(
    "prompt",
    [[1, 286, 230, 123, 140, 22, 37, 11, 81, 365, 292], [1, 179, 384], [1, 217, 191, 183, 16]],
)
def test_kvmux_tokens_equal_the_generator(
    genai_model_dir: Path, min_bucket: int, prompt: list[int]
) -> None:
    n_new = 60
    expected = generator_greedy(genai_model_dir, prompt, n_new)
    engine = Engine(genai_model_dir, EngineOptions(min_bucket=min_bucket, intra_op_threads=1))
    c = engine.generate(prompt, SamplingParams(max_new_tokens=n_new, temperature=0.0))
    # The Generator keeps the eos token it stopped on; kvmux reports it as
    # finish_reason "stop" and leaves it out of the completion.
    got = c.token_ids + ([EOS_ID] if c.finish_reason == "stop" else [])
    assert got == expected
    assert len(expected) >= 10, "the comparison must cover real decode steps"


def test_kvmux_chunked_prefill_equals_the_generator(genai_model_dir: Path) -> None:
    prompt = [1, *range(10, 90)]
    expected = generator_greedy(genai_model_dir, prompt, 30)
    engine = Engine(genai_model_dir, EngineOptions(min_bucket=4, prefill_chunk=16))
    c = engine.generate(prompt, SamplingParams(max_new_tokens=30, temperature=0.0))
    assert c.token_ids + ([EOS_ID] if c.finish_reason == "stop" else []) == expected
