"""Build kvmux's own deterministic random-weight decoder in onnxruntime-genai's folder format.

The folder holds what onnxruntime-genai's model builder writes for a Llama-like
model, so kvmux loads it through exactly the path a real exported model takes:

- ``model.onnx``: a decoder with ``com.microsoft::GroupQueryAttention`` (inputs 0-8
  only, rotary inside GQA), past/present KV in BNSH layout so one buffer can be
  bound as both ``past_key_values.{i}.*`` and ``present.{i}.*``;
- ``genai_config.json``: the keys genai's builder writes;
- ``tokenizer.json`` (+ ``tokenizer_config.json``): a byte-level tokenizer, so any
  UTF-8 text round-trips;
- ``chat_template.jinja``: a small ChatML-like template (``<|role|>`` lines, then
  ``<|assistant|>``), so chat requests work on the built-ins as on exported models.

Weights come from a fixed-seed NumPy generator: building twice gives byte-identical
files. Weight scales are picked so logits are far from uniform and depend on the
past tokens (a corrupted KV copy changes the logits).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from kvmux.daemon.model.quant import QuantizedMatrix, quantize_int4
from kvmux.daemon.model.tokenizer import bytes_to_unicode

__all__ = [
    "ACCURACIES",
    "BUILTIN_SIZES",
    "DTYPES",
    "PRECISIONS",
    "BuiltinSize",
    "DecoderShape",
    "ExternalData",
    "WeightSource",
    "build_atomically",
    "build_builtin",
    "build_decoder",
    "builtin_folder_name",
    "ensure_builtin",
    "genai_config",
    "write_json",
]

#: Bump when the builder's output changes, so cached folders are rebuilt.
BUILDER_VERSION: Final = 3

BOS_TOKEN: Final = "<s>"
EOS_TOKEN: Final = "</s>"
PAD_TOKEN: Final = "<pad>"
SPECIAL_TOKENS: Final = (BOS_TOKEN, EOS_TOKEN, PAD_TOKEN)

MODEL_FILENAME: Final = "model.onnx"
WEIGHTS_FILENAME: Final = MODEL_FILENAME + ".data"
CONFIG_FILENAME: Final = "genai_config.json"
TOKENIZER_FILENAME: Final = "tokenizer.json"
TOKENIZER_CONFIG_FILENAME: Final = "tokenizer_config.json"
CHAT_TEMPLATE_FILENAME: Final = "chat_template.jinja"

# The role markers are plain text to the byte-level tokenizer (no added tokens),
# so the vocabulary, and with it every weight, stays what it was.
CHAT_TEMPLATE: Final = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'developer', 'user', 'assistant', 'tool'] %}"
    "{{ raise_exception('unknown role ' ~ message['role'] ~ "
    "': expected system, developer, user, assistant or tool') }}"
    "{% endif %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

OPSET: Final = 21
IR_VERSION: Final = 10
RMS_EPS: Final = 1e-6
ROPE_THETA: Final = 10000.0


@dataclass(frozen=True)
class BuiltinSize:
    """The shape of one built-in model."""

    name: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_size: int
    intermediate_size: int
    context_length: int
    #: None: pure byte vocabulary (256 bytes + specials); else a trained byte-level BPE
    bpe_vocab_size: int | None
    seed: int


BUILTIN_SIZES: Final[dict[str, BuiltinSize]] = {
    "tiny": BuiltinSize(
        name="tiny",
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_size=16,
        intermediate_size=128,
        context_length=2048,
        bpe_vocab_size=None,
        seed=20240601,
    ),
    "small": BuiltinSize(
        name="small",
        hidden_size=512,
        num_layers=8,
        num_heads=8,
        num_kv_heads=4,
        head_size=64,
        intermediate_size=1408,
        context_length=8192,
        bpe_vocab_size=4096,
        seed=20240602,
    ),
}

DTYPES: Final[dict[str, tuple[type[np.floating[Any]], int]]] = {
    "float32": (np.float32, TensorProto.FLOAT),
    "float16": (np.float16, TensorProto.FLOAT16),
}

#: A built-in's weights: as drawn ("float", in the graph's dtype), or symmetric round-to-nearest
#: int4 in blocks of 32 (onnxruntime-genai's builder's default int4), embeddings left float.
PRECISIONS: Final = ("float", "int4")

#: How MatMulNBits computes (its accuracy_level), by name:
#: - "int8" (level 4) quantizes the activations to int8 per block, as llama.cpp does for its
#:   dot products: the fast CPU path.
#: - "fp32" (level 0) computes in float: exact, 2-3x slower for 4-bit weights, and for 8-bit
#:   weights onnxruntime's slow path (the whole weight dequantized on every call, ~100x).
#: - "mixed", the GGUF import's default: the 4-bit attention projections (q, k, v, o) at
#:   fp32, everything else at int8. Measured on SmolLM2's Q4_1 file: all int8 turns the
#:   first token of its answer to "What is the capital of France?" from "The" to "L" (a 0.08
#:   logit gap) and the answer into French, as llama-server answers on the same file; q/k/v/o
#:   in float restore "The capital of France is Paris." while the MLP and lm_head (three
#:   quarters of the weights) keep the int8 path. 8-bit attention weights stay at int8.
#: Level 0 differs in one more way: onnxruntime sums a one-row product (M = 1) in another
#: order than a batched one, so a row's logits move by ~1e-5 between decoding alone and in a
#: batch; level 4 gives the same bits either way.
#: onnxruntime's CUDA kernels compute in the activations' float16 whatever the level.
ACCURACIES: Final = ("mixed", "int8", "fp32")


def accuracy_level(accuracy: str, prefix: str, bits: int) -> int:
    """MatMulNBits' accuracy_level for the matrix ``prefix`` of ``bits`` under ``accuracy``."""
    if accuracy == "fp32":
        return 0
    if accuracy == "mixed" and bits == 4 and "/attn/" in prefix:
        return 0
    return 4


def _size(size: str) -> BuiltinSize:
    try:
        return BUILTIN_SIZES[size]
    except KeyError:
        raise ValueError(
            f"unknown built-in model size {size!r}; expected one of {sorted(BUILTIN_SIZES)}"
        ) from None


def _dtype(dtype: str) -> tuple[type[np.floating[Any]], int]:
    try:
        return DTYPES[dtype]
    except KeyError:
        raise ValueError(
            f"unknown model dtype {dtype!r}; expected one of {sorted(DTYPES)}"
        ) from None


# --------------------------------------------------------------------------- tokenizer


_COMMON_WORDS: Final = (
    "the of and to in is that it for on with as was at by be this are from or have an "
    "not they which one you were her all she there would their we him been has when who "
    "will more no if out so said what up its about into than them can only other new "
    "some could time these two may then do first any my now such like our over man me "
    "even most made after also did many before must through back years where much your "
    "way well down should because each just those people how too little state good very "
    "make world still own see men work long get here between both life being under never "
    "day same another know while last might us great old year off come since against go "
    "came right used take three session cache buffer token model decode growth capacity "
    "memory device error bucket prompt daemon client server request reply"
)
_ONSETS: Final = "b c d f g h k l m n p r s t v z st tr ch sh th pl gr br"
_VOWELS: Final = "a e i o u ai ea ou io"
_CODAS: Final = "n r s t l m nd st ng"
_FOREIGN: Final = (
    "café naïve über straße niño 日本語 東京 中文 한국어 привет мир γειά שלום مرحبا 🙂 🚀 ✓ € — …"
)
_CODE: Final = "def return self import None True False () [] {} == != -> :: += 0x // # \" ' ; : , ."


def _corpus(seed: int) -> list[str]:
    """A deterministic synthetic corpus: English-ish words, numbers, code, some non-ASCII."""
    rng = np.random.Generator(np.random.PCG64(seed))
    common = _COMMON_WORDS.split()
    onsets = _ONSETS.split()
    vowels = _VOWELS.split()
    codas = ["", "", *_CODAS.split()]
    foreign = _FOREIGN.split()
    code = _CODE.split()
    lines: list[str] = []
    for _ in range(3000):
        n = int(rng.integers(4, 16))
        words: list[str] = []
        for _ in range(n):
            r = float(rng.random())
            if r < 0.55:
                words.append(common[int(rng.integers(len(common)))])
            elif r < 0.80:
                syl = int(rng.integers(1, 4))
                words.append(
                    "".join(
                        onsets[int(rng.integers(len(onsets)))]
                        + vowels[int(rng.integers(len(vowels)))]
                        + codas[int(rng.integers(len(codas)))]
                        for _ in range(syl)
                    )
                )
            elif r < 0.88:
                words.append(str(int(rng.integers(0, 10_000))))
            elif r < 0.95:
                words.append(code[int(rng.integers(len(code)))])
            else:
                words.append(foreign[int(rng.integers(len(foreign)))])
        line = " ".join(words)
        if rng.random() < 0.3:
            line = line.capitalize() + "."
        lines.append(line)
    return lines


def _build_tokenizer(spec: BuiltinSize) -> tuple[Any, dict[str, int]]:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if spec.bpe_vocab_size is None:
        # One token per byte, token id == byte value; specials after the bytes.
        alphabet = bytes_to_unicode()
        vocab = {alphabet[b]: b for b in range(256)}
        tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
        tok.pre_tokenizer = byte_level
        tok.decoder = decoders.ByteLevel()
        tok.add_special_tokens(list(SPECIAL_TOKENS))
    else:
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = byte_level
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=spec.bpe_vocab_size,
            min_frequency=2,
            special_tokens=list(SPECIAL_TOKENS),
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        tok.train_from_iterator(_corpus(spec.seed), trainer=trainer)
    ids: dict[str, int] = {}
    for t in SPECIAL_TOKENS:
        token_id = tok.token_to_id(t)
        assert token_id is not None, t
        ids[t] = int(token_id)
    return tok, ids


# --------------------------------------------------------------------------- graph


class ExternalData:
    """Initializers written to one data file beside the model as they are made, so a model
    of any size is written tensor by tensor and never held whole in memory (a protobuf
    holds at most 2 GB; genai's exports keep their weights outside it too)."""

    #: Tensors smaller than this stay inside the model file.
    THRESHOLD: Final = 1024
    #: Each tensor starts on a page, so onnxruntime may map it rather than copy it.
    ALIGN: Final = 4096

    def __init__(self, folder: Path, filename: str = WEIGHTS_FILENAME) -> None:
        self.filename = filename
        self._file = open(Path(folder) / filename, "wb")  # noqa: SIM115 (closed by close())
        self._offset = 0
        self.written = 0

    def tensor(self, name: str, array: np.ndarray[Any, Any]) -> onnx.TensorProto:
        array = np.ascontiguousarray(array)
        if array.nbytes < self.THRESHOLD:
            return numpy_helper.from_array(array, name)
        pad = -self._offset % self.ALIGN
        if pad:
            self._file.write(b"\0" * pad)
            self._offset += pad
        self._file.write(array.data)
        t = onnx.TensorProto()
        t.name = name
        t.data_type = helper.np_dtype_to_tensor_dtype(array.dtype)
        t.dims.extend(array.shape)
        t.data_location = onnx.TensorProto.EXTERNAL
        for key, value in (
            ("location", self.filename),
            ("offset", str(self._offset)),
            ("length", str(array.nbytes)),
        ):
            entry = t.external_data.add()
            entry.key, entry.value = key, value
        self._offset += array.nbytes
        self.written += array.nbytes
        return t

    def close(self) -> None:
        self._file.close()


class _Graph:
    """Accumulates nodes and initializers with deterministic names."""

    def __init__(
        self,
        np_dtype: type[np.floating[Any]],
        onnx_dtype: int,
        external: ExternalData | None = None,
        accuracy: str = "mixed",
    ) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.np_dtype = np_dtype
        self.onnx_dtype = onnx_dtype
        self.external = external
        self.accuracy = accuracy
        # One block-sum of an activation serves every corrected matmul that reads it.
        self._block_sums: dict[tuple[str, int], str] = {}
        self._consts: set[str] = set()

    def init(self, name: str, array: np.ndarray[Any, Any]) -> str:
        if self.external is not None:
            self.inits.append(self.external.tensor(name, array))
        else:
            self.inits.append(numpy_helper.from_array(np.ascontiguousarray(array), name))
        return name

    def weight(self, name: str, array: np.ndarray[Any, Any]) -> str:
        return self.init(name, array.astype(self.np_dtype))

    def const(self, name: str, array: np.ndarray[Any, Any]) -> str:
        """A constant by its name, made the first time it is asked for."""
        if name not in self._consts:
            self._consts.add(name)
            self.init(name, array)
        return name

    def node(
        self,
        op: str,
        inputs: list[str],
        outputs: list[str],
        name: str,
        domain: str = "",
        doc: str = "",
        **attrs: Any,
    ) -> list[str]:
        node = helper.make_node(op, inputs, outputs, name=name, domain=domain, **attrs)
        if doc:
            node.doc_string = doc
        self.nodes.append(node)
        return outputs

    def op(self, op: str, inputs: list[str], name: str, **attrs: Any) -> str:
        return self.node(op, inputs, [f"{name}/out"], name, **attrs)[0]

    def rms_norm(self, x: str, weight: str, name: str, eps: str = "const/eps") -> str:
        sq = self.op("Mul", [x, x], f"{name}/sq")
        mean = self.op("ReduceMean", [sq, "const/axis_last"], f"{name}/mean", keepdims=1)
        var = self.op("Add", [mean, eps], f"{name}/add_eps")
        rms = self.op("Sqrt", [var], f"{name}/sqrt")
        normed = self.op("Div", [x, rms], f"{name}/div")
        return self.op("Mul", [normed, weight], f"{name}/scale")

    # ----------------------------------------------------------------- quantized

    def quantized(self, name: str, q: QuantizedMatrix) -> tuple[str, str]:
        """The blocks and scales of ``q`` as initializers ``name.packed`` / ``name.scales``."""
        packed = self.init(f"{name}.packed", q.packed)
        scales = self.init(f"{name}.scales", q.scales.astype(self.np_dtype))
        return packed, scales

    def block_sums(self, x: str, block: int, k: int) -> str:
        """``x`` [..., K] summed over each block of ``block`` values: [..., K / block]."""
        key = (x, block)
        if key not in self._block_sums:
            shape = self.const(
                f"const/blocks_{k // block}x{block}", np.array([0, 0, k // block, block], np.int64)
            )
            blocks = self.op("Reshape", [x, shape], f"{x}/blocks{block}")
            self._block_sums[key] = self.op(
                "ReduceSum", [blocks, "const/axis_last"], f"{x}/block_sums{block}", keepdims=0
            )
        return self._block_sums[key]

    def matmul_nbits(
        self,
        x: str,
        q: QuantizedMatrix,
        packed: str,
        scales: str,
        prefix: str,
        offsets: str | None = None,
        output: str | None = None,
    ) -> str:
        """``x @ q.T``: MatMulNBits, plus the exact correction of a per-block minimum
        (the block sums of ``x`` times the offsets ``[K / block, N]``)."""
        doc = f"weights {q.source}"
        mm_out = output if output is not None and q.offsets is None else f"{prefix}/out"
        y = self.node(
            "MatMulNBits",
            [x, packed, scales],
            [mm_out],
            prefix,
            domain="com.microsoft",
            doc=doc,
            K=q.cols,
            N=q.rows,
            bits=q.bits,
            block_size=q.block,
            accuracy_level=accuracy_level(self.accuracy, prefix, q.bits),
        )[0]
        if q.offsets is None:
            return y
        if offsets is None:
            offsets = self.init(
                f"{packed.removesuffix('.packed')}.offsets", q.offsets.T.astype(self.np_dtype)
            )
        correction = self.op(
            "MatMul", [self.block_sums(x, q.block, q.cols), offsets], f"{prefix}/min_correction"
        )
        out = output if output is not None else f"{prefix}/corrected"
        return self.node("Add", [y, correction], [out], f"{prefix}/add_min")[0]


@dataclass(frozen=True)
class DecoderShape:
    """What the decoder graph is built from: a built-in's sizes or an imported model's."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_size: int
    intermediate_size: int
    context_length: int
    vocab_size: int
    rope_theta: float = ROPE_THETA
    rms_eps: float = RMS_EPS
    #: Qwen2 adds a bias after the q, k and v projections.
    qkv_bias: bool = False
    #: lm_head is the embedding matrix, transposed (SmolLM2, Qwen2.5 small sizes).
    tied_embeddings: bool = False
    #: RMSNorm computed in float32 inside a float16 graph: real models' activations
    #: squared overflow float16.
    norm_in_float32: bool = False
    #: What each rotary frequency (head_size / 2 of them, the fastest first) is divided
    #: by: llama.cpp's freq factors (Llama 3.1's ``rope_freqs``) times a linear
    #: scaling's factor. None: unscaled.
    rope_factors: tuple[float, ...] | None = None


#: A weight by the graph's initializer name and shape, asked for in a fixed order: a float
#: array in the graph's layout (matrices [in, out], as MatMul takes them), or, for a matrix
#: or the token embedding, a QuantizedMatrix ([out, in] blocks along in; the embedding
#: [vocab, hidden] blocks along hidden), which the graph runs as MatMulNBits.
WeightSource = Callable[[str, tuple[int, ...]], "np.ndarray[Any, Any] | QuantizedMatrix"]


def _rope_caches(shape: DecoderShape) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    half = shape.head_size // 2
    inv_freq = 1.0 / (
        shape.rope_theta ** (np.arange(0, half, dtype=np.float64) * 2.0 / shape.head_size)
    )
    if shape.rope_factors is not None:
        if len(shape.rope_factors) != half:
            raise ValueError(
                f"{len(shape.rope_factors)} rope factors for {half} rotary frequencies"
            )
        inv_freq = inv_freq / np.asarray(shape.rope_factors, dtype=np.float64)
    positions = np.arange(shape.context_length, dtype=np.float64)
    angles = np.outer(positions, inv_freq)
    return np.cos(angles), np.sin(angles)


def _random_weights(spec: BuiltinSize) -> WeightSource:
    """The built-ins' seeded weights, drawn in the order the graph asks for them.

    Embedding rows have unit scale; the residual stream starts there. q/k scales
    make attention peaked (scores of std ~2), so outputs depend on which past rows
    are where; v/o/mlp keep the residual stream at unit scale; lm_head's 3/sqrt(h)
    gives logits of std ~3, a peaked but varied distribution.
    """
    rng = np.random.Generator(np.random.PCG64(spec.seed))
    h, d, nh, inter = spec.hidden_size, spec.head_size, spec.num_heads, spec.intermediate_size
    stds = {
        "embed_tokens.weight": 1.0,
        "q_proj.weight": 1.5 / np.sqrt(h),
        "k_proj.weight": 1.5 / np.sqrt(h),
        "v_proj.weight": 1.0 / np.sqrt(h),
        "o_proj.weight": 1.0 / np.sqrt(nh * d),
        "gate_proj.weight": 1.0 / np.sqrt(h),
        "up_proj.weight": 1.0 / np.sqrt(h),
        "down_proj.weight": 1.0 / np.sqrt(inter),
        "lm_head.weight": 3.0 / np.sqrt(h),
    }

    def draw(name: str, shape: tuple[int, ...]) -> np.ndarray[Any, Any]:
        if name.endswith("norm.weight"):
            return np.float32(1.0) + rng.standard_normal(shape, dtype=np.float32) * np.float32(0.1)
        std = stds[name.rsplit(".", 2)[-2] + ".weight"]
        return rng.standard_normal(shape, dtype=np.float32) * np.float32(std)

    return draw


def build_decoder(
    shape: DecoderShape,
    weights: WeightSource,
    dtype: str,
    *,
    graph_name: str = "kvmux-builtin",
    external: ExternalData | None = None,
    accuracy: str = "mixed",
) -> onnx.ModelProto:
    """The decoder graph (GroupQueryAttention, rotary inside it, not interleaved: the
    rotate-half layout of Hugging Face checkpoints) with ``weights`` as initializers.

    Quantized matrices run as ``MatMulNBits`` at ``accuracy`` (``ACCURACIES``); a
    quantized embedding as ``GatherBlockQuantized``, sharing its blocks with a tied lm_head.
    With ``external``, every initializer is written to its data file as it is made.
    """
    np_dtype, onnx_dtype = _dtype(dtype)
    if accuracy not in ACCURACIES:
        raise ValueError(f"unknown accuracy {accuracy!r}; expected one of {list(ACCURACIES)}")
    g = _Graph(np_dtype, onnx_dtype, external, accuracy)
    h, d, nh, nkv, inter = (
        shape.hidden_size,
        shape.head_size,
        shape.num_heads,
        shape.num_kv_heads,
        shape.intermediate_size,
    )
    vocab_size = shape.vocab_size
    upcast = shape.norm_in_float32 and onnx_dtype != TensorProto.FLOAT

    def fetch(name: str, dims: tuple[int, ...]) -> np.ndarray[Any, Any] | QuantizedMatrix:
        array = weights(name, dims)
        if isinstance(array, QuantizedMatrix):
            # [out, in] for a matrix asked for as [in, out]; the embedding as it is.
            got: tuple[int, ...] = (array.rows, array.cols)
            if name != "model.embed_tokens.weight":
                got = got[::-1]
        else:
            got = tuple(array.shape)
        if got != dims:
            raise ValueError(f"weight {name} has shape {got}, expected {dims}")
        return array

    def weight(name: str, dims: tuple[int, ...]) -> str:
        array = fetch(name, dims)
        if isinstance(array, QuantizedMatrix):
            raise ValueError(f"weight {name} is quantized; the graph takes it as float only")
        return g.weight(name, array)

    def rms_norm(x: str, name: str, prefix: str) -> str:
        w = weight(name, (h,))
        if not upcast:
            return g.rms_norm(x, w, prefix)
        x32 = g.op("Cast", [x], f"{prefix}/to_float", to=TensorProto.FLOAT)
        w32 = g.op("Cast", [w], f"{prefix}/weight_to_float", to=TensorProto.FLOAT)
        normed = g.rms_norm(x32, w32, prefix, eps="const/eps_float")
        return g.op("Cast", [normed], f"{prefix}/to_dtype", to=onnx_dtype)

    def matmul(
        x: str, name: str, dims: tuple[int, int], prefix: str, output: str | None = None
    ) -> str:
        return emit(x, name, fetch(name, dims), prefix, output)

    def emit(
        x: str,
        name: str,
        w: np.ndarray[Any, Any] | QuantizedMatrix,
        prefix: str,
        output: str | None = None,
    ) -> str:
        if isinstance(w, QuantizedMatrix):
            packed, scales = g.quantized(name, w)
            return g.matmul_nbits(x, w, packed, scales, prefix, output=output)
        out = output if output is not None else f"{prefix}/out"
        return g.node("MatMul", [x, g.weight(name, w)], [out], prefix)[0]

    def projections(
        x: str, parts: list[tuple[str, int]], prefix: str, fused: str, bias: bool
    ) -> list[str] | str:
        """``x`` through the matrices ``parts`` ((name, out features), read in this order,
        each weight before its bias). Quantized ones of one layout run as one MatMulNBits
        (and one min correction) over their stacked rows, returned as that one output
        named ``prefix/fused``: fewer, larger nodes (at SmolLM2's size a decode step's
        time is largely per-node overhead). Otherwise one output per part."""
        ws = []
        for name, n in parts:
            ws.append(fetch(f"{name}.weight", (h, n)))
            if bias:
                ws.append(fetch(f"{name}.bias", (n,)))
        mats = ws[:: 2 if bias else 1]
        biases = [np.asarray(b) for b in ws[1::2]] if bias else []
        quantized = [w for w in mats if isinstance(w, QuantizedMatrix)]
        stacked = QuantizedMatrix.stack(quantized) if len(quantized) == len(mats) else None
        if stacked is not None:
            base = parts[0][0].rsplit(".", 1)[0]
            out = emit(x, f"{base}.{fused}.weight", stacked, f"{prefix}/{fused}")
            if bias:
                b = g.weight(f"{base}.{fused}.bias", np.concatenate(biases))
                out = g.op("Add", [out, b], f"{prefix}/{fused}/bias")
            return out
        outs = []
        for i, (name, _n) in enumerate(parts):
            short = name.rsplit(".", 1)[-1]
            out = emit(x, f"{name}.weight", mats[i], f"{prefix}/{short}")
            if bias:
                b = g.weight(f"{name}.bias", biases[i])
                out = g.op("Add", [out, b], f"{prefix}/{short}/bias")
            outs.append(out)
        return outs

    g.init("const/axis_last", np.array([-1], dtype=np.int64))
    g.init("const/axis_1", np.array([1], dtype=np.int64))
    g.init("const/one_i64", np.array(1, dtype=np.int64))
    g.init("const/index_1", np.array(1, dtype=np.int64))
    g.weight("const/eps", np.array(shape.rms_eps, dtype=np.float32))
    if upcast:
        g.init("const/eps_float", np.array(shape.rms_eps, dtype=np.float32))
    cos, sin = _rope_caches(shape)
    g.weight("cos_cache", cos)
    g.weight("sin_cache", sin)

    # seqlens_k = ReduceSum(attention_mask, axis 1) - 1 as int32 [batch];
    # total_sequence_length = Shape(attention_mask)[1] as an int32 scalar.
    mask_sum = g.op("ReduceSum", ["attention_mask", "const/axis_1"], "mask/sum", keepdims=0)
    mask_sub = g.op("Sub", [mask_sum, "const/one_i64"], "mask/sub")
    seqlens_k = g.op("Cast", [mask_sub], "mask/seqlens_k", to=TensorProto.INT32)
    mask_shape = g.op("Shape", ["attention_mask"], "mask/shape")
    total_len_i64 = g.op("Gather", [mask_shape, "const/index_1"], "mask/total_len", axis=0)
    total_len = g.op("Cast", [total_len_i64], "mask/total_len_i32", to=TensorProto.INT32)

    embed_name = "model.embed_tokens.weight"
    embed_w = fetch(embed_name, (vocab_size, h))
    embed_q: tuple[QuantizedMatrix, str, str] | None = None
    if isinstance(embed_w, QuantizedMatrix):
        packed, scales = g.quantized(embed_name, embed_w)
        embed_q = (embed_w, packed, scales)
        x = _gather_quantized(g, embed_w, packed, scales, embed_name, h)
    else:
        embed = g.weight(embed_name, embed_w)
        x = g.op("Gather", [embed, "input_ids"], "model/embed", axis=0)

    graph_inputs = [
        helper.make_tensor_value_info(
            "input_ids", TensorProto.INT64, ["batch_size", "sequence_length"]
        ),
        helper.make_tensor_value_info(
            "attention_mask", TensorProto.INT64, ["batch_size", "total_sequence_length"]
        ),
    ]
    graph_outputs = [
        helper.make_tensor_value_info(
            "logits", onnx_dtype, ["batch_size", "sequence_length", vocab_size]
        ),
    ]
    for i in range(shape.num_layers):
        p = f"model.layers.{i}"
        past_k, past_v = f"past_key_values.{i}.key", f"past_key_values.{i}.value"
        pres_k, pres_v = f"present.{i}.key", f"present.{i}.value"
        past_dims: list[str | int] = ["batch_size", nkv, "past_sequence_length", d]
        for name in (past_k, past_v):
            graph_inputs.append(helper.make_tensor_value_info(name, onnx_dtype, past_dims))
        for name in (pres_k, pres_v):
            graph_outputs.append(
                helper.make_tensor_value_info(
                    name, onnx_dtype, ["batch_size", nkv, "total_sequence_length", d]
                )
            )

        xn = rms_norm(x, f"{p}.input_layernorm.weight", f"{p}/input_layernorm")
        qkv = projections(
            xn,
            [
                (f"{p}.attn.q_proj", nh * d),
                (f"{p}.attn.k_proj", nkv * d),
                (f"{p}.attn.v_proj", nkv * d),
            ],
            f"{p}/attn",
            "qkv_proj",
            shape.qkv_bias,
        )
        # One packed [q | k | v] input, key and value left out: GQA's packed form.
        q, k, v = [qkv, "", ""] if isinstance(qkv, str) else qkv
        attn = g.node(
            "GroupQueryAttention",
            [q, k, v, past_k, past_v, seqlens_k, total_len, "cos_cache", "sin_cache"],
            [f"{p}/attn/gqa/out", pres_k, pres_v],
            f"{p}/attn/gqa",
            domain="com.microsoft",
            num_heads=nh,
            kv_num_heads=nkv,
            do_rotary=1,
            rotary_interleaved=0,
            local_window_size=-1,
            scale=float(1.0 / np.sqrt(d)),
        )[0]
        o = matmul(attn, f"{p}.attn.o_proj.weight", (nh * d, h), f"{p}/attn/o_proj")
        x = g.op("Add", [x, o], f"{p}/attn/residual")

        xn = rms_norm(x, f"{p}.post_attention_layernorm.weight", f"{p}/post_attention_layernorm")
        gate_up = projections(
            xn,
            [(f"{p}.mlp.gate_proj", inter), (f"{p}.mlp.up_proj", inter)],
            f"{p}/mlp",
            "gate_up_proj",
            False,
        )
        if isinstance(gate_up, str):
            gate, up = g.node(
                "Split",
                [gate_up],
                [f"{p}/mlp/gate", f"{p}/mlp/up"],
                f"{p}/mlp/split",
                axis=-1,
                num_outputs=2,
            )
        else:
            gate, up = gate_up
        sig = g.op("Sigmoid", [gate], f"{p}/mlp/sigmoid")
        silu = g.op("Mul", [gate, sig], f"{p}/mlp/silu")
        act = g.op("Mul", [silu, up], f"{p}/mlp/act")
        down = matmul(act, f"{p}.mlp.down_proj.weight", (inter, h), f"{p}/mlp/down_proj")
        x = g.op("Add", [x, down], f"{p}/mlp/residual")

    xn = rms_norm(x, "model.norm.weight", "model/norm")
    if shape.tied_embeddings and embed_q is not None:
        # The embedding's own blocks (and scales) as the lm_head's: one copy in the file.
        q_embed, packed, scales = embed_q
        offsets = None
        if q_embed.offsets is not None:
            offsets = g.op("Transpose", [f"{embed_name}.offsets"], "lm_head/offsets", perm=[1, 0])
        g.matmul_nbits(xn, q_embed, packed, scales, "lm_head", offsets=offsets, output="logits")
    elif shape.tied_embeddings:
        # ORT folds the Transpose of a constant once, at session creation; the
        # file keeps one copy of the matrix.
        lm = g.op("Transpose", [embed], "lm_head/transpose", perm=[1, 0])
        g.node("MatMul", [xn, lm], ["logits"], "lm_head")
    else:
        matmul(xn, "lm_head.weight", (h, vocab_size), "lm_head", output="logits")

    graph = helper.make_graph(g.nodes, graph_name, graph_inputs, graph_outputs, initializer=g.inits)
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid("com.microsoft", 1)],
        producer_name="kvmux",
        producer_version=str(BUILDER_VERSION),
    )
    model.ir_version = IR_VERSION
    return model


def _gather_quantized(
    g: _Graph, q: QuantizedMatrix, packed: str, scales: str, name: str, hidden: int
) -> str:
    """The embedding rows of ``input_ids`` from blocks: GatherBlockQuantized over the
    [vocab, blocks, blob] table (the layout MatMulNBits shares), plus each block's offset."""
    # GatherBlockQuantized takes scales of the data's rank: [vocab, blocks, 1].
    scales3 = g.op("Unsqueeze", [scales, "const/axis_last"], "model/embed/scales")
    rows = g.node(
        "GatherBlockQuantized",
        [packed, "input_ids", scales3],
        ["model/embed/blocks"],
        "model/embed",
        domain="com.microsoft",
        doc=f"weights {q.source}",
        bits=q.bits,
        block_size=q.block,
        gather_axis=0,
        quantize_axis=2,
    )[0]
    if q.offsets is not None:
        offsets = g.init(f"{name}.offsets", q.offsets.astype(g.np_dtype))
        picked = g.op("Gather", [offsets, "input_ids"], "model/embed/offsets", axis=0)
        column = g.op("Unsqueeze", [picked, "const/axis_last"], "model/embed/offsets_column")
        rows = g.op("Add", [rows, column], "model/embed/add_min")
    flat = g.init("const/embed_shape", np.array([0, 0, hidden], np.int64))
    return g.op("Reshape", [rows, flat], "model/embed/rows")


def _decoder_shape(spec: BuiltinSize, vocab_size: int) -> DecoderShape:
    return DecoderShape(
        hidden_size=spec.hidden_size,
        num_layers=spec.num_layers,
        num_heads=spec.num_heads,
        num_kv_heads=spec.num_kv_heads,
        head_size=spec.head_size,
        intermediate_size=spec.intermediate_size,
        context_length=spec.context_length,
        vocab_size=vocab_size,
    )


# --------------------------------------------------------------------------- config


def genai_config(
    shape: DecoderShape,
    *,
    bos_token_id: int | None,
    eos_token_id: int | list[int],
    pad_token_id: int | None,
    model_type: str = "llama",
) -> dict[str, Any]:
    """genai_config.json as onnxruntime-genai's builder writes it for this decoder."""
    model: dict[str, Any] = {}
    if bos_token_id is not None:
        model["bos_token_id"] = bos_token_id
    model["context_length"] = shape.context_length
    model["decoder"] = {
        "session_options": {"log_id": "onnxruntime-genai", "provider_options": []},
        "filename": MODEL_FILENAME,
        "head_size": shape.head_size,
        "hidden_size": shape.hidden_size,
        "inputs": {
            "input_ids": "input_ids",
            "attention_mask": "attention_mask",
            "past_key_names": "past_key_values.%d.key",
            "past_value_names": "past_key_values.%d.value",
        },
        "outputs": {
            "logits": "logits",
            "present_key_names": "present.%d.key",
            "present_value_names": "present.%d.value",
        },
        "num_attention_heads": shape.num_heads,
        "num_hidden_layers": shape.num_layers,
        "num_key_value_heads": shape.num_kv_heads,
    }
    model["eos_token_id"] = eos_token_id
    if pad_token_id is not None:
        model["pad_token_id"] = pad_token_id
    model["type"] = model_type
    model["vocab_size"] = shape.vocab_size
    return {
        "model": model,
        "search": {
            "diversity_penalty": 0.0,
            "do_sample": False,
            "early_stopping": True,
            "length_penalty": 1.0,
            "max_length": shape.context_length,
            "min_length": 0,
            "no_repeat_ngram_size": 0,
            "num_beams": 1,
            "num_return_sequences": 1,
            "past_present_share_buffer": True,
            "repetition_penalty": 1.0,
            "temperature": 1.0,
            "top_k": 50,
            "top_p": 1.0,
        },
    }


def _tokenizer_config(spec: BuiltinSize) -> dict[str, Any]:
    return {
        "add_bos_token": True,
        "add_eos_token": False,
        "bos_token": BOS_TOKEN,
        "clean_up_tokenization_spaces": False,
        "eos_token": EOS_TOKEN,
        "model_max_length": spec.context_length,
        "pad_token": PAD_TOKEN,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=4, sort_keys=False) + "\n", encoding="utf-8")


# --------------------------------------------------------------------------- public


def _int4(source: WeightSource) -> WeightSource:
    """``source`` with every matrix but the embedding as :func:`quant.quantize_int4`."""

    def load(name: str, dims: tuple[int, ...]) -> np.ndarray[Any, Any] | QuantizedMatrix:
        w = source(name, dims)
        if isinstance(w, np.ndarray) and w.ndim == 2 and not name.endswith("embed_tokens.weight"):
            return quantize_int4(w.T)  # the graph's [in, out] as the quantizer's [out, in]
        return w

    return load


def _precision(precision: str) -> None:
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; expected one of {list(PRECISIONS)}")


def build_builtin(
    size: str, out_dir: Path, *, dtype: str = "float32", precision: str = "float"
) -> Path:
    """Write the built-in model ``size`` ("tiny" or "small") into ``out_dir``; return it.

    ``precision`` "int4" quantizes the drawn weights (``PRECISIONS``). Deterministic: the
    same size, dtype and precision give byte-identical files. Files already in ``out_dir``
    with the same names are overwritten.
    """
    spec = _size(size)
    _dtype(dtype)
    _precision(precision)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    tok, ids = _build_tokenizer(spec)
    vocab_size = int(tok.get_vocab_size(with_added_tokens=True))
    tok.save(str(out_dir / TOKENIZER_FILENAME), pretty=True)
    write_json(out_dir / TOKENIZER_CONFIG_FILENAME, _tokenizer_config(spec))
    (out_dir / CHAT_TEMPLATE_FILENAME).write_text(CHAT_TEMPLATE + "\n", encoding="utf-8")

    weights = _random_weights(spec)
    # int8 activations, as onnxruntime-genai's builder writes int4 for CPU: its kernels give
    # a row the same bits alone or batched, which fp32's (M = 1 against M > 1) do not.
    model = build_decoder(
        _decoder_shape(spec, vocab_size),
        _int4(weights) if precision == "int4" else weights,
        dtype,
        accuracy="int8",
    )
    (out_dir / MODEL_FILENAME).write_bytes(model.SerializeToString(deterministic=True))
    # Written last: a folder with genai_config.json has everything else already.
    config = genai_config(
        _decoder_shape(spec, vocab_size),
        bos_token_id=ids[BOS_TOKEN],
        eos_token_id=ids[EOS_TOKEN],
        pad_token_id=ids[PAD_TOKEN],
    )
    write_json(out_dir / CONFIG_FILENAME, config)
    return out_dir


def builtin_folder_name(size: str, dtype: str = "float32", precision: str = "float") -> str:
    """The cache folder name for a built-in model; it changes when the builder does."""
    _size(size)
    _dtype(dtype)
    _precision(precision)
    weights = "" if precision == "float" else f"-{precision}"
    return f"kvmux-{size}-{dtype}{weights}-v{BUILDER_VERSION}"


def ensure_builtin(
    size: str, cache_dir: Path, *, dtype: str = "float32", precision: str = "float"
) -> Path:
    """Return the built-in model folder under ``cache_dir``, building it on first use."""
    final = Path(cache_dir) / builtin_folder_name(size, dtype, precision)
    return build_atomically(
        final, lambda tmp: build_builtin(size, tmp, dtype=dtype, precision=precision)
    )


def build_atomically(final: Path, build: Callable[[Path], object]) -> Path:
    """Return ``final``, first calling ``build(tmp)`` and renaming ``tmp`` to it if absent.

    The model is built in a temporary sibling folder and renamed into place, so the
    final folder either exists complete or not at all, even after a crash. If another
    process finishes first, its folder is used and ours is discarded.
    """
    if (final / CONFIG_FILENAME).is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.building-", dir=final.parent))
    try:
        build(tmp)
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / CONFIG_FILENAME).is_file():
                raise
            # Lost a race to another builder: its folder is just as good.
    finally:
        if tmp.exists():
            with contextlib.suppress(OSError):
                shutil.rmtree(tmp)
    return final
