"""Import a GGUF file (llama.cpp's and Ollama's format) into the folder kvmux serves.

The file is read with ggml's own ``gguf`` package (metadata, tensors), one tensor at a
time, and written through the same graph code as the built-in models
(``builder.build_decoder``): ``model.onnx`` with GroupQueryAttention plus
``model.onnx.data``, ``genai_config.json``, ``tokenizer.json`` rebuilt from the file's
vocabulary, ``tokenizer_config.json`` and the file's chat template as
``chat_template.jinja``. The quantized matrices keep the file's own blocks
(``quant.repack``: MatMulNBits, GatherBlockQuantized for the embedding, a block minimum
as an exact correction); F32/F16/BF16 tensors and, with ``dequantize``, every weight are
written as float (``gguf.quants.dequantize``).

Architectures: ``llama`` (SmolLM2, Llama 2/3/3.1, TinyLlama's weights) and ``qwen2``.
llama.cpp's converter reorders the rows of a ``llama`` file's q and k projections
for its interleaved rotary; they are put back in the rotate-half order the graph's
GroupQueryAttention (``rotary_interleaved=0``) and Hugging Face checkpoints use.
``qwen2`` files are written in that order already.
Rope scaling is read as llama.cpp reads it: linear (a factor on every frequency) and
Llama 3.1's (a ``llama`` file's ``rope_freqs.weight``, a factor per frequency), both
folded into the rotary caches. Anything else (another architecture, YaRN or another
rope scaling, a tensor the graph has no place for, a tokenizer that is neither
byte-level BPE nor SentencePiece, a tensor type with no mapping) is refused by name.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import numpy as np

from kvmux.daemon.model.builder import (
    ACCURACIES,
    CHAT_TEMPLATE_FILENAME,
    CONFIG_FILENAME,
    DTYPES,
    MODEL_FILENAME,
    TOKENIZER_CONFIG_FILENAME,
    TOKENIZER_FILENAME,
    DecoderShape,
    ExternalData,
    WeightSource,
    build_decoder,
    genai_config,
    write_json,
)
from kvmux.daemon.model.gguf_file import GGUFFile, GGUFImportError, sha256_of
from kvmux.daemon.model.gguf_tokenizer import (
    GGUFTokenizer,
    read_gguf_tokenizer,
    read_tokenizer,
    tokenizer_config,
)
from kvmux.daemon.model.quant import QuantError, QuantizedMatrix, repack

__all__ = [
    "IMPORT_VERSION",
    "SUPPORTED_ARCHITECTURES",
    "GGUFImportError",
    "import_gguf",
    "read_tokenizer",
    "sha256_of",
]

#: Bump when the import's output changes, so cached imports are redone.
IMPORT_VERSION: Final = 2
SUPPORTED_ARCHITECTURES: Final = ("llama", "qwen2")


@dataclass(frozen=True)
class _Model:
    arch: str
    shape: DecoderShape
    #: Every tensor the graph reads, by the graph's initializer name.
    names: dict[str, str]


def _read_model(f: GGUFFile) -> _Model:
    arch = f.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise f.fail(
            f"architecture {arch!r} is not supported; kvmux imports "
            f"{' and '.join(SUPPORTED_ARCHITECTURES)}"
        )
    hidden = f.int_(f"{arch}.embedding_length")
    heads = f.int_(f"{arch}.attention.head_count")
    kv_heads = f.int_(f"{arch}.attention.head_count_kv", heads)
    head_size = f.int_(f"{arch}.attention.key_length", hidden // max(heads, 1))
    rotary = f.int_(f"{arch}.rope.dimension_count", head_size)
    if rotary != head_size:
        raise f.fail(f"partial rotary ({rotary} of {head_size} dims) is not supported")
    rope_factors, rope_tensors = _rope_scaling(f, arch, rotary)
    if heads == 0 or kv_heads == 0 or heads % kv_heads:
        raise f.fail(f"{heads} attention heads do not group over {kv_heads} kv heads")
    embed = f.tensors.get("token_embd.weight")
    if embed is None:
        raise f.fail("tensor 'token_embd.weight' is missing")
    layers = f.int_(f"{arch}.block_count")
    tied = "output.weight" not in f.tensors
    shape = DecoderShape(
        hidden_size=hidden,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_size=head_size,
        intermediate_size=f.int_(f"{arch}.feed_forward_length"),
        context_length=f.int_(f"{arch}.context_length"),
        vocab_size=int(embed.shape[-1]),
        rope_theta=f.float_(f"{arch}.rope.freq_base", 10000.0),
        rms_eps=f.float_(f"{arch}.attention.layer_norm_rms_epsilon"),
        qkv_bias=arch == "qwen2",
        tied_embeddings=tied,
        norm_in_float32=True,
        rope_factors=rope_factors,
    )
    names = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
    }
    if not tied:
        names["lm_head.weight"] = "output.weight"
    per_layer = {
        "input_layernorm.weight": "attn_norm.weight",
        "attn.q_proj.weight": "attn_q.weight",
        "attn.k_proj.weight": "attn_k.weight",
        "attn.v_proj.weight": "attn_v.weight",
        "attn.o_proj.weight": "attn_output.weight",
        "post_attention_layernorm.weight": "ffn_norm.weight",
        "mlp.gate_proj.weight": "ffn_gate.weight",
        "mlp.up_proj.weight": "ffn_up.weight",
        "mlp.down_proj.weight": "ffn_down.weight",
    }
    if shape.qkv_bias:
        for x in "qkv":
            per_layer[f"attn.{x}_proj.bias"] = f"attn_{x}.bias"
    for i in range(layers):
        for ours, theirs in per_layer.items():
            names[f"model.layers.{i}.{ours}"] = f"blk.{i}.{theirs}"
    missing = [n for n in names.values() if n not in f.tensors]
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise f.fail(f"tensor {', '.join(map(repr, missing[:5]))}{more} missing ({arch})")
    unused = sorted(set(f.tensors) - set(names.values()) - rope_tensors)
    if unused:
        # A sliding window's, a MoE's, LongRoPE's factors: each changes what the
        # model computes, so none is dropped silently.
        raise f.fail(
            f"tensor {', '.join(map(repr, unused[:5]))} has no place in kvmux's {arch} "
            "graph (not supported)"
        )
    return _Model(arch, shape, names)


def _rope_scaling(f: GGUFFile, arch: str, rotary: int) -> tuple[tuple[float, ...] | None, set[str]]:
    """(what each rotary frequency is divided by, or None; the tensors that say so), as
    llama.cpp reads them: a scaling type absent means "linear", whose factor (absent or
    0: none) divides every frequency; a ``llama`` file's ``rope_freqs.weight`` (Llama
    3.1's scaling, as convert_hf_to_gguf computes it) divides each by its own factor."""
    import gguf

    scaling = f.get(f"{arch}.rope.scaling.type", "linear")
    if scaling not in ("none", "linear"):
        raise f.fail(
            f"rope scaling {scaling!r} is not supported; kvmux imports linear scaling "
            "and Llama 3.1's rope_freqs"
        )
    factor = 1.0
    if scaling == "linear":
        key = f"{arch}.rope.scaling.factor"
        if f.get(key, None) is None:
            key = f"{arch}.rope.scale_linear"  # the key's older name
        factor = f.float_(key, 0.0) or 1.0
        if not 0.0 < factor < float("inf"):
            raise f.fail(f"metadata {key} is {factor!r}, expected a positive factor")
    # llama.cpp scales every rotated q and k by it, whatever the scaling type.
    attn_factor = f.float_(f"{arch}.rope.scaling.attn_factor", 1.0)
    if attn_factor != 1.0:
        raise f.fail(
            f"metadata {arch}.rope.scaling.attn_factor is {attn_factor!r}; "
            "a rope attention factor is not supported"
        )
    factors = np.full(rotary // 2, factor)
    tensors: set[str] = set()
    freqs = f.tensors.get("rope_freqs.weight")
    if freqs is not None and arch == "llama":
        values = np.asarray(gguf.quants.dequantize(freqs.data, freqs.tensor_type), np.float64)
        if values.size != rotary // 2:
            raise f.fail(
                f"tensor rope_freqs.weight has {values.size} factors, expected "
                f"{rotary // 2} (one per rotary frequency)"
            )
        if not np.all(np.isfinite(values) & (values > 0)):
            raise f.fail("tensor rope_freqs.weight holds a factor that is not a positive number")
        factors = factors * values.reshape(-1)
        tensors.add("rope_freqs.weight")
    if np.all(factors == 1.0):
        return None, tensors
    return tuple(float(x) for x in factors), tensors


def _unpermute(rows: np.ndarray[Any, Any], heads: int) -> np.ndarray[Any, Any]:
    """Undo llama.cpp's convert_hf_to_gguf ``permute`` of q/k rows (per head, the two
    rotary halves interleaved) back to Hugging Face's rotate-half order."""
    half = rows.shape[0] // heads // 2
    return rows.reshape(heads, half, 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


#: Tensor types that stay float (converted to the graph's dtype); every other type is
#: kept as its blocks (``quant.LAYOUTS``) or, with ``dequantize``, turned into float.
_FLOAT_TYPES: Final = ("F32", "F16", "BF16")


def _weights(f: GGUFFile, model: _Model, *, dequantize: bool) -> WeightSource:
    import gguf

    permute = {"attn_q.weight": model.shape.num_heads, "attn_k.weight": model.shape.num_kv_heads}

    def load(name: str, dims: tuple[int, ...]) -> np.ndarray[Any, Any] | QuantizedMatrix:
        theirs = model.names[name]
        t = f.tensors[theirs]
        kind = t.tensor_type.name
        heads = permute.get(theirs.split(".", 2)[-1]) if model.arch == "llama" else None
        try:
            if kind in _FLOAT_TYPES or dequantize or len(t.shape) != 2:
                return _float(t, name, heads, dims)
            # ggml's shape is (ne0 = values a row, ne1 = rows).
            cols, rows = (int(n) for n in t.shape)
            q = repack(t.data, kind, rows, cols)
            if heads:
                q = q.take_rows(_unpermute(np.arange(rows), heads))
            return q
        except QuantError as exc:
            raise f.fail(f"tensor {theirs} {exc}") from exc
        except NotImplementedError as exc:
            raise f.fail(
                f"tensor {theirs} is of type {kind}, which the gguf library cannot dequantize"
            ) from exc
        finally:
            f.release(t)

    def _float(t: Any, name: str, heads: int | None, dims: tuple[int, ...]) -> np.ndarray[Any, Any]:
        array = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
        if heads:
            array = _unpermute(array, heads)
        # GGUF stores matrices [out, in] (numpy order); the graph's MatMul takes [in, out].
        if array.ndim == 2 and not name.endswith("embed_tokens.weight"):
            array = array.T
        if array.shape != dims:
            raise f.fail(
                f"tensor {model.names[name]} has shape {list(array.shape)} after import, "
                f"expected {list(dims)}"
            )
        return array

    return load


# --------------------------------------------------------------------------- public


def import_gguf(
    path: Path,
    out_dir: Path,
    *,
    dtype: str = "float32",
    dequantize: bool = False,
    accuracy: str = "mixed",
    sha256: str | None = None,
) -> Path:
    """Write the model folder for the GGUF file ``path`` into ``out_dir``; return it.

    The file's quantized matrices are kept as their blocks (MatMulNBits at ``accuracy``, see
    ``builder.ACCURACIES``); ``dequantize`` writes every weight as float instead. ``dtype``
    is the graph's float type (activations, KV, float weights). ``sha256`` (hex), when given,
    must match the file's digest before anything is read. ``out_dir`` must be absent or an
    empty folder: the model is written beside it and renamed into place, so a failed import
    leaves nothing. Raises :class:`GGUFImportError` naming what is wrong or unsupported.
    """
    path, out_dir = Path(path), Path(out_dir)
    if dtype not in DTYPES:
        raise ValueError(f"unknown model dtype {dtype!r}; expected one of {sorted(DTYPES)}")
    if accuracy not in ACCURACIES:
        raise ValueError(f"unknown accuracy {accuracy!r}; expected one of {list(ACCURACIES)}")
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise FileExistsError(f"{out_dir} exists and is not an empty folder; import into a new one")
    if sha256 is not None:
        if not path.is_file():
            raise GGUFImportError(path, "does not exist")
        actual = sha256_of(path)
        if actual != sha256.lower():
            raise GGUFImportError(
                path,
                f"SHA-256 is {actual}, expected {sha256.lower()} (a different or damaged file)",
            )
    f = GGUFFile(path)
    model = _read_model(f)
    tok = read_gguf_tokenizer(f)
    if len(tok.tokens) != model.shape.vocab_size:
        raise f.fail(
            f"the vocabulary has {len(tok.tokens)} tokens, the embedding "
            f"{model.shape.vocab_size} rows"
        )
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.importing-", dir=out_dir.parent))
    try:
        _write_folder(f, model, tok, staging, dtype=dtype, dequantize=dequantize, accuracy=accuracy)
        if out_dir.exists():
            out_dir.rmdir()  # empty, checked above; a file put there since fails here
        os.rename(staging, out_dir)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return out_dir


def _write_folder(
    f: GGUFFile,
    model: _Model,
    tok: GGUFTokenizer,
    out_dir: Path,
    *,
    dtype: str,
    dequantize: bool,
    accuracy: str,
) -> None:
    tok.tokenizer.save(str(out_dir / TOKENIZER_FILENAME), pretty=True)
    write_json(
        out_dir / TOKENIZER_CONFIG_FILENAME, tokenizer_config(tok, model.shape.context_length)
    )
    if tok.chat_template is not None:
        # As transformers saves it: the template's text, nothing added.
        (out_dir / CHAT_TEMPLATE_FILENAME).write_text(tok.chat_template, encoding="utf-8")

    external = ExternalData(out_dir)
    try:
        graph = build_decoder(
            model.shape,
            _weights(f, model, dequantize=dequantize),
            dtype,
            graph_name=f"kvmux-gguf-{model.arch}",
            external=external,
            accuracy=accuracy,
        )
    except ValueError as exc:  # a tensor's shape that contradicts the metadata
        raise f.fail(str(exc)) from exc
    finally:
        external.close()
    (out_dir / MODEL_FILENAME).write_bytes(graph.SerializeToString())
    del graph
    eos_ids = tok.eos_token_ids
    eos: int | list[int] = eos_ids[0] if len(eos_ids) == 1 else eos_ids
    config = genai_config(
        model.shape,
        bos_token_id=tok.bos_token_id,
        eos_token_id=eos,
        pad_token_id=tok.pad_token_id,
        model_type=model.arch,
    )
    # Written last: a folder with genai_config.json has everything else already.
    write_json(out_dir / CONFIG_FILENAME, config)
