"""Write small GGUF files with ggml's own ``gguf`` library (GGUFWriter), as llama.cpp's
converter lays them out: helpers only, no tests.

Weights come in Hugging Face's layout and names (numpy, [out, in]); ``write_gguf``
renames them to GGUF's, permutes a llama file's q/k rows as llama.cpp's
``convert_hf_to_gguf.py`` does, and optionally stores the matrices quantized.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kvmux.daemon.model.builder import _corpus

CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # ids 0, 1, 2


@dataclass
class TinyShape:
    hidden: int = 64
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    head: int = 16
    inter: int = 128
    context: int = 512
    rope_theta: float = 10000.0
    eps: float = 1e-5


@dataclass
class Vocab:
    tokens: list[str]
    merges: list[str]
    types: list[int] = field(default_factory=list)


def train_vocab(size: int = 384, seed: int = 7) -> tuple[Any, Vocab]:
    """A byte-level BPE (``tokenizers``) trained on the builder's synthetic corpus."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=size,
        special_tokens=list(SPECIALS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(seed), trainer=trainer)
    vocab = tok.get_vocab(with_added_tokens=True)
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    merges = json.loads(tok.to_str())["model"]["merges"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in merges]
    types = [3 if t in SPECIALS else 1 for t in tokens]
    return tok, Vocab(tokens, merges, types)


def random_weights(
    shape: TinyShape, vocab: int, *, qkv_bias: bool, tied: bool, seed: int = 0
) -> dict[str, np.ndarray[Any, Any]]:
    """Hugging Face names and layout; scales that make logits peaked (greedy is stable)."""
    rng = np.random.default_rng(seed)
    h, nh, nkv, d, inter = shape.hidden, shape.heads, shape.kv_heads, shape.head, shape.inter

    def n(*dims: int, std: float = 0.2) -> np.ndarray[Any, Any]:
        return (rng.standard_normal(dims) * std).astype(np.float32)

    w = {"model.embed_tokens.weight": n(vocab, h, std=1.0), "model.norm.weight": 1 + n(h, std=0.1)}
    if not tied:
        w["lm_head.weight"] = n(vocab, h)
    for i in range(shape.layers):
        p = f"model.layers.{i}"
        w[f"{p}.input_layernorm.weight"] = 1 + n(h, std=0.1)
        w[f"{p}.post_attention_layernorm.weight"] = 1 + n(h, std=0.1)
        w[f"{p}.self_attn.q_proj.weight"] = n(nh * d, h)
        w[f"{p}.self_attn.k_proj.weight"] = n(nkv * d, h)
        w[f"{p}.self_attn.v_proj.weight"] = n(nkv * d, h)
        w[f"{p}.self_attn.o_proj.weight"] = n(h, nh * d)
        w[f"{p}.mlp.gate_proj.weight"] = n(inter, h)
        w[f"{p}.mlp.up_proj.weight"] = n(inter, h)
        w[f"{p}.mlp.down_proj.weight"] = n(h, inter)
        if qkv_bias:
            w[f"{p}.self_attn.q_proj.bias"] = n(nh * d)
            w[f"{p}.self_attn.k_proj.bias"] = n(nkv * d)
            w[f"{p}.self_attn.v_proj.bias"] = n(nkv * d)
    return w


_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}


def gguf_name(hf: str) -> str:
    top = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    if hf in top:
        return top[hf]
    _, _, i, rest = hf.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{i}.{_NAMES[module]}.{kind}"


def _permute(w: np.ndarray[Any, Any], heads: int) -> np.ndarray[Any, Any]:
    """llama.cpp convert_hf_to_gguf.py's LlamaModel.permute."""
    half = w.shape[0] // heads // 2
    return w.reshape(heads, 2, half, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def quantize_q8_0(w: np.ndarray[Any, Any]) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """(the Q8_0 bytes gguf writes, the float32 values they stand for)."""
    import gguf

    q = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0)
    return q, gguf.quants.dequantize(q, gguf.GGMLQuantizationType.Q8_0)


def writer(
    path: Path,
    arch: str,
    shape: TinyShape,
    vocab: Vocab,
    *,
    pre: str = "gpt2",
    tokenizer_model: str = "gpt2",
    add_bos: bool = False,
    name: str = "kvmux test model",
) -> Any:
    """A ``gguf.GGUFWriter`` holding ``shape``'s and ``vocab``'s metadata (BOS 1, EOS 2,
    PAD 0, the ChatML template); the tensors are the caller's."""
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(name)
    w.add_block_count(shape.layers)
    w.add_context_length(shape.context)
    w.add_embedding_length(shape.hidden)
    w.add_feed_forward_length(shape.inter)
    w.add_head_count(shape.heads)
    w.add_head_count_kv(shape.kv_heads)
    w.add_rope_dimension_count(shape.head)
    w.add_rope_freq_base(shape.rope_theta)
    w.add_layer_norm_rms_eps(shape.eps)
    w.add_tokenizer_model(tokenizer_model)
    w.add_tokenizer_pre(pre)
    w.add_token_list(vocab.tokens)
    w.add_token_types(vocab.types)
    w.add_token_merges(vocab.merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(0)
    w.add_add_bos_token(add_bos)
    w.add_chat_template(CHAT_TEMPLATE)
    return w


def write_gguf(
    path: Path,
    arch: str,
    shape: TinyShape,
    weights: Mapping[str, np.ndarray[Any, Any]],
    vocab: Vocab,
    *,
    quantized: Iterable[str] = (),
    raw: Mapping[str, tuple[np.ndarray[Any, Any], Any]] | None = None,
    skip: Iterable[str] = (),
    pre: str = "gpt2",
    tokenizer_model: str = "gpt2",
    add_bos: bool = False,
) -> Path:
    """A GGUF file of ``weights``; names in ``quantized`` stored as Q8_0, ``raw`` added as
    given (GGUF name -> (bytes, type)), GGUF names in ``skip`` left out."""
    import gguf

    quantized, skip = set(quantized), set(skip)
    w = writer(path, arch, shape, vocab, pre=pre, tokenizer_model=tokenizer_model, add_bos=add_bos)
    for hf, array in weights.items():
        name = gguf_name(hf)
        if name in skip:
            continue
        if arch == "llama" and name.endswith(("attn_q.weight", "attn_k.weight")):
            heads = shape.heads if "attn_q" in name else shape.kv_heads
            array = _permute(array, heads)
        if hf in quantized:
            q, _ = quantize_q8_0(array)
            w.add_tensor(name, q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(name, np.ascontiguousarray(array, dtype=np.float32))
    for name, (data, kind) in (raw or {}).items():
        w.add_tensor(name, data, raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# --------------------------------------------------------------------------- SentencePiece


def train_sentencepiece(
    *,
    add_dummy_prefix: bool = True,
    user_defined: Iterable[str] = (),
    ids: Mapping[str, int] | None = None,
    size: int = 600,
) -> Any:
    """A SentencePiece BPE trained by the sentencepiece package on the builder's synthetic
    corpus, set up as Llama's and Gemma's are: byte fallback, digits split, no normalization.

    ``ids`` places the pieces ``unk``, ``bos``, ``eos`` and ``pad`` (-1: none); Llama's
    order by default."""
    import io

    import sentencepiece as spm

    place = {"unk": 0, "bos": 1, "eos": 2, "pad": -1, **(ids or {})}
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(_corpus(7)),
        model_writer=model,
        vocab_size=size,
        model_type="bpe",
        byte_fallback=True,
        split_digits=True,
        character_coverage=0.9995,
        add_dummy_prefix=add_dummy_prefix,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        allow_whitespace_only_pieces=True,
        user_defined_symbols=list(user_defined),
        unk_id=place["unk"],
        bos_id=place["bos"],
        eos_id=place["eos"],
        pad_id=place["pad"],
        num_threads=1,
        minloglevel=2,
    )
    return spm.SentencePieceProcessor(model_proto=model.getvalue())


def sentencepiece_vocab(sp: Any, *, user_defined: Iterable[str] = ()) -> tuple[Vocab, list[float]]:
    """(the vocabulary, its scores) as llama.cpp's convert_hf_to_gguf.py writes a
    SentencePiece model (``_create_vocab_sentencepiece``): each piece's text, score and
    type; the pieces a tokenizer_config.json lists as ordinary added tokens
    (``user_defined``) become USER_DEFINED, with "▁" written as a space, scored -1000."""
    import gguf

    kinds = gguf.TokenType
    user_defined = set(user_defined)
    tokens, scores, types = [], [], []
    for i in range(sp.get_piece_size()):
        piece = sp.id_to_piece(i)
        score, kind = sp.get_score(i), kinds.NORMAL
        if sp.is_unknown(i):
            kind = kinds.UNKNOWN
        elif sp.is_control(i):
            kind = kinds.CONTROL
        elif sp.is_unused(i):
            kind = kinds.UNUSED
        elif sp.is_byte(i):
            kind = kinds.BYTE
        if piece in user_defined:
            piece, kind, score = piece.replace("\u2581", " "), kinds.USER_DEFINED, -1000.0
        tokens.append(piece)
        scores.append(score)
        types.append(int(kind))
    return Vocab(tokens, [], types), scores


def _metadata_value(value: Any) -> Any:
    """gguf_new_metadata's MetadataDetails for a Python value."""
    import gguf
    from gguf.scripts.gguf_new_metadata import MetadataDetails

    kind = gguf.GGUFValueType
    scalar = {bool: kind.BOOL, int: kind.UINT32, float: kind.FLOAT32, str: kind.STRING}
    if isinstance(value, list):
        return MetadataDetails(kind.ARRAY, value, sub_type=scalar[type(value[0])])
    return MetadataDetails(scalar[type(value)], value)


def with_metadata(
    src: Path, dst: Path, values: Mapping[str, Any], *, remove: Iterable[str] = ()
) -> Path:
    """A copy of GGUF file ``src`` with metadata keys set or added (``values``) and keys
    left out (``remove``), made by gguf's own gguf_new_metadata."""
    import gguf
    from gguf.scripts.gguf_new_metadata import copy_with_new_metadata

    reader = gguf.GGUFReader(src, "r")
    arch = reader.get_field(gguf.Keys.General.ARCHITECTURE)
    assert arch is not None, src
    writer = gguf.GGUFWriter(str(dst), str(arch.contents()), endianess=reader.endianess)
    new = {key: _metadata_value(value) for key, value in values.items()}
    copy_with_new_metadata(reader, writer, new, list(remove))
    return dst


def write_sentencepiece_gguf(
    path: Path,
    arch: str,
    shape: TinyShape,
    weights: Mapping[str, np.ndarray[Any, Any]],
    vocab: Vocab,
    scores: list[float],
    *,
    add_space_prefix: bool | None = None,
    add_bos: bool | None = None,
    ids: Mapping[str, int] | None = None,
) -> Path:
    """``write_gguf`` with a SentencePiece vocabulary (``tokenizer.ggml.model = "llama"``,
    scores, no merges) as convert_hf_to_gguf.py writes one. None leaves the add-space-prefix
    and add-BOS flags out of the file; ``ids`` sets ``tokenizer.ggml.<name>_token_id``."""
    plain = write_gguf(
        path.with_name(f".{path.name}.plain"),
        arch,
        shape,
        weights,
        vocab,
        pre="default",
        tokenizer_model="llama",
    )
    values: dict[str, Any] = {"tokenizer.ggml.scores": scores}
    values |= {f"tokenizer.ggml.{name}_token_id": i for name, i in (ids or {}).items()}
    if add_space_prefix is not None:
        values["tokenizer.ggml.add_space_prefix"] = add_space_prefix
    if add_bos is not None:
        values["tokenizer.ggml.add_bos_token"] = add_bos
    remove = [] if add_bos is not None else ["tokenizer.ggml.add_bos_token"]
    with_metadata(plain, path, values, remove=remove)
    plain.unlink()
    return path


# --------------------------------------------------------------------------- rope scaling


def llama3_rope_freqs(
    base: float,
    dim: int,
    *,
    factor: float,
    low_freq_factor: float,
    high_freq_factor: float,
    original_max_position_embeddings: int,
) -> np.ndarray[Any, Any]:
    """The ``rope_freqs.weight`` llama.cpp's convert_hf_to_gguf.py writes for a checkpoint
    with Llama 3.1's ``rope_scaling`` (LlamaModel.generate_extra_tensors): its arithmetic,
    float32 as its torch tensors are."""
    import math

    freqs = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)))
    old = original_max_position_embeddings
    low_freq_wavelen, high_freq_wavelen = old / low_freq_factor, old / high_freq_factor
    factors = []
    for freq in freqs:
        wavelen = np.float32(2 * math.pi) / freq
        if wavelen < high_freq_wavelen:
            factors.append(1.0)
        elif wavelen > low_freq_wavelen:
            factors.append(factor)
        else:
            smooth = (old / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)
