"""Build a tiny model with onnxruntime-genai's own model builder, offline.

This module holds helpers only (no tests). It lets a test compare kvmux's
decoder against onnxruntime-genai's Generator on the very same ONNX model:

* ``build_hf_llama``: a random-weight ``LlamaForCausalLM`` (seeded) plus a
  byte-level BPE tokenizer trained locally on a corpus generated in code,
  saved as a Hugging Face folder. Nothing is downloaded.
* ``export_with_genai_builder``: ``python -m onnxruntime_genai.models.builder``
  on that folder (fp32, cpu), with the Hugging Face hub forced offline.
* ``generator_greedy``: onnxruntime-genai's Generator, greedy, returning only
  the new tokens.
* ``smollm2_reference_export``: the builder's export of SmolLM2 as transformers
  loads it from its GGUF file (the reference kvmux's import is checked against).

Heavy imports (torch, transformers, tokenizers, onnxruntime_genai) happen
inside the functions, so importing this module is cheap; the conftest skips
when they are missing.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

# Special-token ids, fixed so that tests can rely on them.
PAD_ID = 0
BOS_ID = 1
EOS_ID = 2
UNK_ID = 3
SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<unk>"]  # index == id

# Model shape: small enough that build + export take seconds on 2 cores.
# VOCAB_SIZE must differ from every nn.Linear out_features in the model: the
# genai builder (0.18.0, Model.has_lm_head) treats ANY Linear whose
# out_features == vocab_size as the LM head, and with vocab == intermediate
# it silently wires logits to layer 0's post-attention norm (the exported
# model then disagrees with the HF model). _check_shapes() guards this.
VOCAB_SIZE = 448
HIDDEN_SIZE = 256
INTERMEDIATE_SIZE = 512
NUM_LAYERS = 4
NUM_HEADS = 8
NUM_KV_HEADS = 4
HEAD_DIM = HIDDEN_SIZE // NUM_HEADS  # 32
MAX_POSITIONS = 1024
# Larger than Llama's default 0.02, so the random model's logits are peaked
# and greedy argmax is not decided by float-rounding noise.
INITIALIZER_RANGE = 0.2

_WORDS = [
    "the",
    "a",
    "cache",
    "key",
    "value",
    "token",
    "head",
    "layer",
    "decode",
    "prefill",
    "session",
    "buffer",
    "grow",
    "copy",
    "shard",
    "page",
    "block",
    "mask",
    "step",
    "batch",
    "model",
    "query",
    "attention",
    "rotary",
    "position",
    "sequence",
    "length",
    "capacity",
    "offset",
    "slot",
    "swap",
    "evict",
    "request",
    "reply",
    "daemon",
    "client",
    "socket",
    "frame",
    "tensor",
    "shape",
    "float",
    "half",
]


def _offline_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        HF_HUB_DISABLE_TELEMETRY="1",
        TOKENIZERS_PARALLELISM="false",
    )
    return env


def _corpus(seed: int, lines: int = 2000) -> list[str]:
    """A deterministic pseudo-English corpus for tokenizer training."""
    rng = random.Random(seed)
    out = []
    for i in range(lines):
        n = rng.randint(4, 16)
        words = [rng.choice(_WORDS) for _ in range(n)]
        if rng.random() < 0.3:
            words.append(str(rng.randint(0, 9999)))
        if rng.random() < 0.2:
            words.insert(0, words.pop().capitalize())
        out.append(" ".join(words) + rng.choice([".", ",", "!", "?", ";"]) + f" #{i}")
    return out


def _train_tokenizer(seed: int) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(seed), trainer=trainer)
    for i, t in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(t) == i, (t, tok.token_to_id(t))
    # Prepend BOS like Llama tokenizers do.
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", BOS_ID)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
        model_max_length=MAX_POSITIONS,
    )


def _check_shapes(vocab: int) -> None:
    linear_widths = {
        NUM_HEADS * HEAD_DIM,  # q_proj
        NUM_KV_HEADS * HEAD_DIM,  # k_proj, v_proj
        HIDDEN_SIZE,  # o_proj, down_proj
        INTERMEDIATE_SIZE,  # gate_proj, up_proj
    }
    if vocab in linear_widths:
        raise ValueError(
            f"vocab_size {vocab} equals an nn.Linear width {sorted(linear_widths)}; "
            "onnxruntime-genai's builder would mistake that Linear for lm_head"
        )


def build_hf_llama(out_dir: Path, *, seed: int = 0) -> Path:
    """Save a random-weight Llama + local BPE tokenizer to ``out_dir``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    tokenizer = _train_tokenizer(seed)
    vocab = len(tokenizer)
    if vocab != VOCAB_SIZE:  # corpus too small to reach the target vocab
        raise RuntimeError(f"tokenizer trained to {vocab} tokens, wanted {VOCAB_SIZE}")
    _check_shapes(vocab)

    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=HIDDEN_SIZE,
        intermediate_size=INTERMEDIATE_SIZE,
        num_hidden_layers=NUM_LAYERS,
        num_attention_heads=NUM_HEADS,
        num_key_value_heads=NUM_KV_HEADS,
        head_dim=HEAD_DIM,
        max_position_embeddings=MAX_POSITIONS,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        initializer_range=INITIALIZER_RANGE,
        tie_word_embeddings=False,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        torch_dtype="float32",
    )
    config.architectures = ["LlamaForCausalLM"]

    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.float32).eval()
    gen_cfg = model.generation_config
    gen_cfg.bos_token_id, gen_cfg.eos_token_id, gen_cfg.pad_token_id = BOS_ID, EOS_ID, PAD_ID
    gen_cfg.do_sample = False
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    return out_dir


class BuilderFailed(RuntimeError):
    """onnxruntime-genai's model builder exited without writing a model folder."""

    def __init__(self, message: str, last_line: str) -> None:
        super().__init__(message)
        self.last_line = last_line  # the builder's own last word, e.g. "KeyError: 'rope_type'"


def export_with_genai_builder(
    hf_dir: Path, out_dir: Path, precision: str = "fp32", extra_options: tuple[str, ...] = ()
) -> Path:
    """Run onnxruntime-genai's model builder (cpu, ``precision``) on a local HF folder.

    Returns ``out_dir`` (holding genai_config.json, model.onnx, tokenizer files);
    raises :class:`BuilderFailed` when the builder fails.
    Note: ``builder --help`` crashes in 0.18.0 (a '%' in a help string); the
    flags used here are read from its argparse source.
    """
    # Absolute paths: the builder takes a non-directory -i as a hub repo id.
    hf_dir, out_dir = Path(hf_dir).resolve(), Path(out_dir).resolve()
    if not (hf_dir / "config.json").is_file():
        raise FileNotFoundError(f"no Hugging Face folder at {hf_dir}")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    cache_dir = out_dir.parent / (out_dir.name + ".builder-cache")
    cmd = [
        sys.executable,
        "-m",
        "onnxruntime_genai.models.builder",
        "-i",
        str(hf_dir),
        "-o",
        str(out_dir),
        "-p",
        precision,
        "-e",
        "cpu",
        "-c",
        str(cache_dir),  # default is ./cache_dir relative to cwd
        "--extra_options",
        "hf_token=false",
        *extra_options,
    ]
    proc = subprocess.run(
        cmd,
        env=_offline_env(),
        cwd=str(out_dir.parent),
        capture_output=True,
        text=True,
        timeout=600,
    )
    if proc.returncode != 0 or not (out_dir / "genai_config.json").is_file():
        lines = [ln for ln in (proc.stderr or proc.stdout).splitlines() if ln.strip()]
        raise BuilderFailed(
            f"genai builder failed (rc={proc.returncode}): {' '.join(cmd)}\n"
            f"--- stdout ---\n{proc.stdout[-4000:]}\n--- stderr ---\n{proc.stderr[-4000:]}",
            lines[-1] if lines else f"builder exited with {proc.returncode}",
        )
    return out_dir


def generator_greedy(model_dir: Path, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Greedy decode with onnxruntime-genai's Generator; only the new tokens.

    Stops early if the model emits its eos id (the Generator's own rule);
    the eos token, when produced, is included in the result.
    """
    import onnxruntime_genai as og

    model = og.Model(str(model_dir))
    params = og.GeneratorParams(model)
    params.set_search_options(
        do_sample=False,
        max_length=len(prompt_ids) + max_new_tokens,
        batch_size=1,
    )
    gen = og.Generator(model, params)
    gen.append_tokens([int(t) for t in prompt_ids])
    new: list[int] = []
    while not gen.is_done() and len(new) < max_new_tokens:
        gen.generate_next_token()
        new.append(int(gen.get_next_tokens()[0]))
    return new


def smollm2_reference_export(cache: Path) -> Path:
    """onnxruntime-genai's builder (fp32, cpu) on transformers' float32 load of SmolLM2's
    GGUF file, with kvmux's tokenizer files (the builder copies them); made once under
    ``cache`` beside kvmux's own import of the file."""
    import shutil

    from kvmux.daemon.model.builder import build_atomically
    from kvmux.daemon.model.smollm2 import GGUF_NAME, ensure_smollm2, fetch_smollm2

    gguf_file = fetch_smollm2(cache)
    ours = ensure_smollm2(cache)

    def build(out: Path) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        hf = out.parent / f".{out.name}.hf"
        loaded = AutoModelForCausalLM.from_pretrained(
            gguf_file.parent, gguf_file=GGUF_NAME, dtype=torch.float32
        )
        # transformers marks a GGUF load "quantized, not serializable": the same
        # (dequantized) weights go into a plain model of the same config to be saved.
        config = loaded.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.load_state_dict(loaded.state_dict())
        model.save_pretrained(hf)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(ours / name, hf / name)
        try:
            export_with_genai_builder(hf, out / "model", precision="fp32")
        finally:
            shutil.rmtree(hf, ignore_errors=True)
            shutil.rmtree(out / "model.builder-cache", ignore_errors=True)
        (out / "genai_config.json").write_text((out / "model" / "genai_config.json").read_text())

    return build_atomically(cache / "smollm2-genai-reference-v1", build) / "model"
