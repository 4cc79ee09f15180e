"""A GGUF file written by ggml's gguf library, imported by kvmux, decodes to the tokens
onnxruntime-genai's Generator gives on its own builder's export of the same weights.

The weights start as a random Hugging Face checkpoint (Llama: separate lm_head, its
matrices stored Q8_0 in the file; Qwen2: q/k/v biases, tied embeddings). The GGUF
gets them the way llama.cpp's converter writes them (a llama file's q/k rows
permuted for its rotary); the checkpoint the builder exports holds the values the
file stands for (Q8_0 dequantized). Equal tokens over 60 steps show the import
undid the permutation, kept the biases and the tying, and read the quantized
blocks right. The import is ``dequantize``'s, float32 like the builder's export; the
quantized import is held to it in tests/model/test_gguf_quantized.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvmux.daemon.engine import Engine, EngineOptions, SamplingParams
from kvmux.daemon.model import import_gguf, load_model

from ..model.gguf_fixture import (
    TinyShape,
    quantize_q8_0,
    random_weights,
    train_vocab,
    write_gguf,
)
from .conftest import require_genai_stack

pytestmark = [pytest.mark.genai, pytest.mark.slow]

SHAPE = TinyShape()
EOS = 2
PROMPTS = [[17, 200, 45, 300, 9], [1, 50, 60], [250, 251, 252, 253, 254, 255, 100, 101]]


def _hf_checkpoint(
    out: Path, arch: str, weights: dict[str, np.ndarray[Any, Any]], tokenizer: Any
) -> Path:
    import torch
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        PreTrainedTokenizerFast,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    common: dict[str, Any] = dict(
        vocab_size=weights["model.embed_tokens.weight"].shape[0],
        hidden_size=SHAPE.hidden,
        intermediate_size=SHAPE.inter,
        num_hidden_layers=SHAPE.layers,
        num_attention_heads=SHAPE.heads,
        num_key_value_heads=SHAPE.kv_heads,
        max_position_embeddings=SHAPE.context,
        rms_norm_eps=SHAPE.eps,
        rope_theta=SHAPE.rope_theta,
        tie_word_embeddings="lm_head.weight" not in weights,
        bos_token_id=1,
        eos_token_id=EOS,
        pad_token_id=0,
    )
    if arch == "llama":
        config: Any = LlamaConfig(head_dim=SHAPE.head, **common)
        model: Any = LlamaForCausalLM(config)
    else:
        config = Qwen2Config(use_sliding_window=False, **common)
        model = Qwen2ForCausalLM(config)
    state = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in weights.items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    model.to(torch.float32).eval().save_pretrained(out, safe_serialization=True)
    PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<|im_start|>", eos_token="<|im_end|>"
    ).save_pretrained(out)
    return out


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_an_imported_gguf_decodes_to_the_generators_tokens(arch: str, tmp_path: Path) -> None:
    require_genai_stack()
    from .genai_fixture import export_with_genai_builder, generator_greedy

    tokenizer, vocab = train_vocab()
    qwen = arch == "qwen2"
    weights = random_weights(SHAPE, len(vocab.tokens), qkv_bias=qwen, tied=qwen, seed=3)
    quantized = [] if qwen else [k for k, v in weights.items() if v.ndim == 2 and "embed" not in k]
    for name in quantized:
        weights[name] = quantize_q8_0(weights[name])[1]  # what the file's blocks stand for
    gguf_file = write_gguf(
        tmp_path / f"{arch}.gguf", arch, SHAPE, weights, vocab, quantized=quantized
    )
    # The file holds the quantized blocks; dequantizing again gives the same values.
    ours = import_gguf(gguf_file, tmp_path / "kvmux", dequantize=True)
    assert load_model(ours).model_type == arch
    theirs = export_with_genai_builder(
        _hf_checkpoint(tmp_path / "hf", arch, weights, tokenizer), tmp_path / "genai"
    )

    engine = Engine(ours, EngineOptions(min_bucket=4, intra_op_threads=1))
    for prompt in PROMPTS:
        expected = generator_greedy(theirs, prompt, 60)
        done = engine.generate(prompt, SamplingParams(max_new_tokens=60, temperature=0.0))
        got = done.token_ids + ([EOS] if done.finish_reason == "stop" else [])
        assert got == expected, prompt
        assert len(expected) >= 20, "the comparison must cover real decode steps"
