"""Rope scaling in a GGUF file, read as llama.cpp reads it: Llama 3.1's factor per
frequency (``rope_freqs.weight``, which llama.cpp's convert_hf_to_gguf.py computes from
the checkpoint's ``rope_scaling``) and linear scaling (``rope.scaling.type``/``factor``).

transformers' own GGUF loading reads neither for a ``llama`` file: it builds the model
with the plain rope (asserted below, and its logits are far from the file's). llama.cpp's
reading is what the file means, GGUF being its format, so the reference is transformers'
LlamaForCausalLM on the weights it loads from the file, with the rope the file states
given to it: the scaled frequencies then come from transformers' own llama3 / linear
rope code, not from the file's factors.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvmux.daemon.engine import Engine, EngineOptions, SamplingParams
from kvmux.daemon.model import GGUFImportError, import_gguf, load_model

from .gguf_fixture import (
    TinyShape,
    Vocab,
    llama3_rope_freqs,
    random_weights,
    train_vocab,
    with_metadata,
    write_gguf,
)

gguf = pytest.importorskip("gguf", reason="GGUF import needs the gguf package (cpu extra)")

# A long context over a short original one, as Llama 3.1 (131072 over 8192): with head
# 16 and base 10000, 2 of the 8 frequencies stay, 1 is smoothed and 5 are divided by 8.
SHAPE = TinyShape(context=2048)
LLAMA3 = {
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 128,
}
# Past the original 128 positions, well into the scaled range.
PROMPT_LENGTHS = (150, 200, 260)
STEPS = 64
EOS = 2


@pytest.fixture(scope="module")
def vocab() -> Vocab:
    return train_vocab()[1]


def _llama(path: Path, vocab: Vocab, shape: TinyShape = SHAPE, **kw: Any) -> Path:
    weights = random_weights(shape, len(vocab.tokens), qkv_bias=False, tied=False, seed=5)
    return write_gguf(path, "llama", shape, weights, vocab, **kw)


def _rope_freqs(values: np.ndarray[Any, Any]) -> dict[str, tuple[np.ndarray[Any, Any], Any]]:
    return {"rope_freqs.weight": (values, gguf.GGMLQuantizationType.F32)}


def _llama31(path: Path, vocab: Vocab) -> Path:
    freqs = llama3_rope_freqs(SHAPE.rope_theta, SHAPE.head, **LLAMA3)  # type: ignore[arg-type]
    return _llama(path, vocab, raw=_rope_freqs(freqs))


def _prompts(vocab_size: int) -> list[list[int]]:
    rng = np.random.default_rng(11)
    return [[int(t) for t in rng.integers(3, vocab_size, n)] for n in PROMPT_LENGTHS]


def _transformers(path: Path, rope: dict[str, Any] | None) -> Any:
    """transformers' GGUF loading of ``path``; with ``rope``, the model built with it."""
    pytest.importorskip("transformers", reason="the reference is transformers (genai extra)")
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    # What transformers reads from the file: the plain rope, the scaling left out.
    assert config.rope_parameters == {"rope_type": "default", "rope_theta": SHAPE.rope_theta}
    if rope is not None:
        config.rope_parameters = {"rope_theta": SHAPE.rope_theta, **rope}
    model = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, config=config, dtype=torch.float32
    )
    return model.eval()


def _teacher_forced(model: Any, prompt: list[int], tokens: list[int]) -> np.ndarray[Any, Any]:
    """The reference's logits after the prompt and after each of ``tokens``."""
    import torch

    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 :]
    return np.asarray(logits.double().numpy())


def _compare(path: Path, tmp_path: Path, vocab: Vocab, rope: dict[str, Any], decode: Any) -> None:
    folder = import_gguf(path, tmp_path / "kvmux")
    spec = load_model(folder)
    session = decode.session(spec)
    reference = _transformers(path, rope)
    plain = _transformers(path, None)
    engine = Engine(folder, EngineOptions(min_bucket=16, intra_op_threads=1))
    for prompt in _prompts(len(vocab.tokens)):
        ours = decode.shared(spec, session, prompt, STEPS, capacity=512)
        tokens = [int(np.argmax(row)) for row in ours[:-1]]
        theirs = _teacher_forced(reference, prompt, tokens)
        assert [int(np.argmax(row)) for row in theirs[:-1]] == tokens, len(prompt)
        np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-4)
        # The scaling matters at these lengths: the plain rope is far off.
        assert np.abs(_teacher_forced(plain, prompt, tokens) - ours).max() > 1.0
        # kvmux's own decode, its KV grown 256 -> 512 on the way, gives the same tokens.
        done = engine.generate(prompt, SamplingParams(max_new_tokens=STEPS, temperature=0.0))
        got = done.token_ids + ([EOS] if done.finish_reason == "stop" else [])
        assert got == tokens[: len(got)], len(prompt)
        assert len(got) == STEPS or done.finish_reason == "stop"


@pytest.mark.genai
def test_llama31_rope_freqs_decode_as_transformers_llama3_rope(
    vocab: Vocab, tmp_path: Path, decode: Any
) -> None:
    path = _llama31(tmp_path / "llama31.gguf", vocab)
    _compare(path, tmp_path, vocab, {"rope_type": "llama3", **LLAMA3}, decode)


@pytest.mark.genai
def test_linear_rope_scaling_decodes_as_transformers_linear_rope(
    vocab: Vocab, tmp_path: Path, decode: Any
) -> None:
    scaled = with_metadata(
        _llama(tmp_path / "plain.gguf", vocab),
        tmp_path / "linear.gguf",
        {"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 4.0},
    )
    _compare(scaled, tmp_path, vocab, {"rope_type": "linear", "factor": 4.0}, decode)


def test_yarn_is_refused_by_name(vocab: Vocab, tmp_path: Path) -> None:
    scaled = with_metadata(
        _llama(tmp_path / "plain.gguf", vocab),
        tmp_path / "yarn.gguf",
        {"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0},
    )
    with pytest.raises(GGUFImportError, match="rope scaling 'yarn' is not supported"):
        import_gguf(scaled, tmp_path / "out")


def test_rope_freqs_of_the_wrong_length_are_refused(vocab: Vocab, tmp_path: Path) -> None:
    path = _llama(tmp_path / "m.gguf", vocab, raw=_rope_freqs(np.ones(SHAPE.head, np.float32)))
    with pytest.raises(GGUFImportError, match=r"rope_freqs\.weight has 16 factors, expected 8"):
        import_gguf(path, tmp_path / "out")


def test_a_rope_factor_that_is_not_positive_is_refused(vocab: Vocab, tmp_path: Path) -> None:
    freqs = np.ones(SHAPE.head // 2, np.float32)
    freqs[3] = 0.0
    path = _llama(tmp_path / "m.gguf", vocab, raw=_rope_freqs(freqs))
    with pytest.raises(GGUFImportError, match="not a positive number"):
        import_gguf(path, tmp_path / "out")


def test_a_rope_attention_factor_is_refused(vocab: Vocab, tmp_path: Path) -> None:
    scaled = with_metadata(
        _llama(tmp_path / "plain.gguf", vocab),
        tmp_path / "attn.gguf",
        {"llama.rope.scaling.type": "linear", "llama.rope.scaling.attn_factor": 0.5},
    )
    with pytest.raises(GGUFImportError, match=r"attn_factor is 0\.5"):
        import_gguf(scaled, tmp_path / "out")


def test_rope_freqs_in_a_qwen2_file_are_refused_by_name(vocab: Vocab, tmp_path: Path) -> None:
    # llama.cpp loads rope_freqs into its llama graph; its qwen2 graph has no place for it.
    weights = random_weights(SHAPE, len(vocab.tokens), qkv_bias=True, tied=False, seed=5)
    freqs = _rope_freqs(np.ones(SHAPE.head // 2, np.float32))
    path = write_gguf(tmp_path / "q.gguf", "qwen2", SHAPE, weights, vocab, raw=freqs)
    with pytest.raises(GGUFImportError, match=r"'rope_freqs\.weight' has no place"):
        import_gguf(path, tmp_path / "out")
