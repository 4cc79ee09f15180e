"""Read an onnxruntime-genai model folder into a validated, immutable ``ModelSpec``.

The folder is what onnxruntime-genai's model builder writes: ``genai_config.json``,
the decoder ONNX file it names, and ``tokenizer.json``. Unknown keys are ignored;
keys genai treats as optional get genai's defaults. The decoder graph's inputs and
outputs are checked against the config when the folder is loaded (names, KV heads
and head size, dtypes), and ``check_session_io`` repeats that check against a live
onnxruntime session.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Protocol

import numpy as np

from kvmux.client import jsonin
from kvmux.daemon.model.chat import find_chat_template
from kvmux.daemon.model.errors import ModelFormatError
from kvmux.daemon.model.features import ModelFeatures, read_features

__all__ = [
    "CONFIG_FILENAME",
    "TOKENIZER_FILENAME",
    "IOInfo",
    "ModelSpec",
    "SearchDefaults",
    "check_session_io",
    "load_model",
]

CONFIG_FILENAME: Final = "genai_config.json"
TOKENIZER_FILENAME: Final = "tokenizer.json"

# Fallbacks used only where genai_config.json leaves a value out; they are
# onnxruntime-genai's own defaults (src/config.h), so a model means the same here.
DEFAULT_INPUT_IDS: Final = "input_ids"
DEFAULT_ATTENTION_MASK: Final = "attention_mask"
DEFAULT_POSITION_IDS: Final = "position_ids"
DEFAULT_PAST_KEY: Final = "past_key_values.%d.key"
DEFAULT_PAST_VALUE: Final = "past_key_values.%d.value"
DEFAULT_LOGITS: Final = "logits"
DEFAULT_PRESENT_KEY: Final = "present.%d.key"
DEFAULT_PRESENT_VALUE: Final = "present.%d.value"

_ONNX_TYPE_TO_NUMPY: Final[dict[str, np.dtype[Any]]] = {
    "tensor(float)": np.dtype(np.float32),
    "tensor(float16)": np.dtype(np.float16),
    "tensor(double)": np.dtype(np.float64),
    "tensor(int64)": np.dtype(np.int64),
    "tensor(int32)": np.dtype(np.int32),
}
_INDEX_DTYPES: Final = (np.dtype(np.int64), np.dtype(np.int32))


class NodeArgLike(Protocol):
    """What kvmux reads from onnxruntime's ``NodeArg`` (``session.get_inputs()``)."""

    @property
    def name(self) -> str: ...

    @property
    def shape(self) -> Sequence[int | str | None]: ...

    @property
    def type(self) -> str: ...


@dataclass(frozen=True)
class IOInfo:
    """One graph input or output: name, shape (symbolic dims as str or None), type string."""

    name: str
    shape: tuple[int | str | None, ...]
    type: str  # onnxruntime's spelling, e.g. "tensor(float)"


@dataclass(frozen=True)
class SearchDefaults:
    """Generation defaults the model declares (genai_config.json ``search``).

    Values the model declares are canonical; fields it leaves out get
    onnxruntime-genai's defaults.
    """

    do_sample: bool = False
    max_length: int | None = None
    min_length: int = 0
    num_beams: int = 1
    temperature: float = 1.0
    top_k: int = 0  # 0: no top-k filter
    top_p: float = 1.0  # 1.0 (or <= 0): no nucleus filter
    repetition_penalty: float = 1.0
    past_present_share_buffer: bool = False
    random_seed: int = -1


@dataclass(frozen=True)
class ModelSpec:
    """Everything kvmux needs to know about one model folder."""

    folder: Path
    config_path: Path
    model_path: Path
    tokenizer_path: Path
    model_type: str

    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_size: int
    hidden_size: int
    vocab_size: int
    #: The model's declared maximum sequence length: model.context_length, else
    #: search.max_length, else None (unbounded as far as the model says).
    context_length: int | None
    #: Where context_length came from, e.g. "genai_config.json model.context_length".
    context_length_source: str

    kv_dtype: np.dtype[Any]
    logits_dtype: np.dtype[Any]
    input_ids_dtype: np.dtype[Any]
    attention_mask_dtype: np.dtype[Any]

    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    pad_token_id: int | None

    input_ids_name: str
    attention_mask_name: str
    #: Set when the decoder graph also takes position ids (some genai exports do).
    position_ids_name: str | None
    logits_name: str
    past_key_names: tuple[str, ...]
    past_value_names: tuple[str, ...]
    present_key_names: tuple[str, ...]
    present_value_names: tuple[str, ...]

    search: SearchDefaults
    #: What the graph does that kvmux relies on (attention, window, precision).
    features: ModelFeatures
    #: Where the folder's own chat template is (None: it has none).
    chat_template: str | None = None

    @property
    def has_position_ids(self) -> bool:
        return self.position_ids_name is not None

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes one token's K and V take across all layers (batch 1)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_size * self.kv_dtype.itemsize

    def describe(self) -> str:
        """A human-readable multi-line summary."""
        ctx = "unbounded" if self.context_length is None else str(self.context_length)
        eos = ", ".join(str(e) for e in self.eos_token_ids)
        lines = [
            f"folder:            {self.folder}",
            f"model:             {self.model_path.name} (family {self.model_type or '?'})",
            f"layers:            {self.num_layers}",
            f"heads:             {self.num_attention_heads} q / {self.num_kv_heads} kv, "
            f"head_size {self.head_size}, hidden {self.hidden_size}",
            f"vocab_size:        {self.vocab_size}",
            f"context_length:    {ctx} ({self.context_length_source})",
            f"kv dtype:          {self.kv_dtype.name}, {self.kv_bytes_per_token} bytes/token",
            f"logits dtype:      {self.logits_dtype.name}",
            f"tokens:            bos {self.bos_token_id}, eos [{eos}], pad {self.pad_token_id}",
            f"inputs:            {self.input_ids_name}, {self.attention_mask_name}"
            + (f", {self.position_ids_name}" if self.position_ids_name else "")
            + f", {self.past_key_names[0]}.., {self.past_value_names[0]}..",
            f"outputs:           {self.logits_name}, {self.present_key_names[0]}.., "
            f"{self.present_value_names[0]}..",
            f"search:            {self.search}",
            "chat template:     "
            + (self.chat_template or 'none (chat requests need model.chat_template = "FILE")'),
            *self.features.lines(),
        ]
        return "\n".join(lines)


# --------------------------------------------------------------------------- json access


class _Reader:
    """Typed access to genai_config.json that names the folder and key path on errors."""

    def __init__(self, folder: Path, data: Mapping[str, Any]) -> None:
        self.folder = folder
        self.data = data

    def _err(self, problem: str) -> ModelFormatError:
        return ModelFormatError(self.folder, f"{CONFIG_FILENAME}: {problem}")

    def get(self, path: str) -> Any:
        node: Any = self.data
        walked: list[str] = []
        for part in path.split("."):
            if not isinstance(node, Mapping):
                raise self._err(f"{'.'.join(walked)} is {type(node).__name__}, expected an object")
            if part not in node:
                return None
            node = node[part]
            walked.append(part)
        return node

    def section(self, path: str, *, required: bool) -> Mapping[str, Any]:
        value = self.get(path)
        if value is None:
            if required:
                raise self._err(f"missing key {path!r}, expected an object")
            return {}
        if not isinstance(value, Mapping):
            raise self._err(f"{path} is {type(value).__name__}, expected an object")
        return value

    def int_(self, path: str, *, required: bool, minimum: int = 0) -> int | None:
        value = self.get(path)
        if value is None:
            if required:
                raise self._err(f"missing key {path!r}, expected an integer >= {minimum}")
            return None
        if isinstance(value, bool) or not isinstance(value, int):
            raise self._err(f"{path} is {value!r}, expected an integer >= {minimum}")
        if value < minimum:
            raise self._err(f"{path} is {value}, expected an integer >= {minimum}")
        return value

    def float_(self, path: str, default: float) -> float:
        value = self.get(path)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise self._err(f"{path} is {value!r}, expected a number")
        return float(value)

    def bool_(self, path: str, default: bool) -> bool:
        value = self.get(path)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise self._err(f"{path} is {value!r}, expected true or false")
        return value

    def str_(self, path: str, default: str) -> str:
        value = self.get(path)
        if value is None:
            return default
        if not isinstance(value, str) or not value:
            raise self._err(f"{path} is {value!r}, expected a non-empty string")
        return value

    def token_ids(self, path: str, *, required: bool) -> tuple[int, ...]:
        value = self.get(path)
        if value is None:
            if required:
                raise self._err(f"missing key {path!r}, expected a token id or a list of them")
            return ()
        items = value if isinstance(value, list) else [value]
        if not items or any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in items):
            raise self._err(
                f"{path} is {value!r}, expected a token id (int >= 0) or a non-empty list of them"
            )
        return tuple(items)


def _layer_names(reader: _Reader, path: str, default: str, num_layers: int) -> tuple[str, ...]:
    pattern = reader.str_(path, default)
    if "%d" not in pattern:
        if num_layers == 1:
            return (pattern,)
        raise reader._err(f"{path} is {pattern!r}, expected a per-layer name pattern containing %d")
    try:
        return tuple(pattern % i for i in range(num_layers))
    except (TypeError, ValueError) as exc:
        raise reader._err(
            f"{path} is {pattern!r}, expected a name pattern with one %d ({exc})"
        ) from None


# --------------------------------------------------------------------------- graph IO


def _load_graph(folder: Path, model_path: Path) -> Any:
    """The decoder's ONNX model without its external weights (the graph, IO, attributes)."""
    import onnx

    try:
        return onnx.load(str(model_path), load_external_data=False)
    except Exception as exc:
        raise ModelFormatError(
            folder, f"{model_path.name} is not a readable ONNX model ({exc})"
        ) from exc


def _onnx_io(model: Any) -> tuple[list[IOInfo], list[IOInfo]]:
    """The decoder graph's inputs and outputs."""
    from onnx import helper

    initializers = {init.name for init in model.graph.initializer}

    def info(vi: Any) -> IOInfo:
        tensor = vi.type.tensor_type
        shape: list[int | str | None] = []
        for dim in tensor.shape.dim:
            if dim.HasField("dim_value"):
                shape.append(int(dim.dim_value))
            elif dim.HasField("dim_param"):
                shape.append(str(dim.dim_param))
            else:
                shape.append(None)
        try:
            np_dtype = helper.tensor_dtype_to_np_dtype(tensor.elem_type)
            type_str = _numpy_to_type_string(np.dtype(np_dtype))
        except (KeyError, ValueError):
            type_str = f"tensor(elem_type {tensor.elem_type})"
        return IOInfo(vi.name, tuple(shape), type_str)

    inputs = [info(vi) for vi in model.graph.input if vi.name not in initializers]
    outputs = [info(vi) for vi in model.graph.output]
    return inputs, outputs


def _numpy_to_type_string(dtype: np.dtype[Any]) -> str:
    for name, np_dtype in _ONNX_TYPE_TO_NUMPY.items():
        if np_dtype == dtype:
            return name
    return f"tensor({dtype.name})"


def _as_info(arg: NodeArgLike | IOInfo) -> IOInfo:
    if isinstance(arg, IOInfo):
        return arg
    return IOInfo(str(arg.name), tuple(arg.shape), str(arg.type))


def _check_io(
    folder: Path,
    spec_names: _Names,
    inputs: Sequence[NodeArgLike | IOInfo],
    outputs: Sequence[NodeArgLike | IOInfo],
    *,
    source: str,
) -> tuple[np.dtype[Any], np.dtype[Any], np.dtype[Any], np.dtype[Any], str | None]:
    """Check graph IO against the config; return (kv, logits, ids, mask dtypes, position ids)."""
    ins = {i.name: i for i in map(_as_info, inputs)}
    outs = {o.name: o for o in map(_as_info, outputs)}
    problems: list[str] = []
    n = spec_names

    def need(table: Mapping[str, IOInfo], name: str, kind: str, config_key: str) -> IOInfo | None:
        if name not in table:
            have = ", ".join(sorted(table)[:8]) + (" ..." if len(table) > 8 else "")
            problems.append(
                f"{source} has no {kind} {name!r} (named by genai_config.json {config_key}); "
                f"its {kind}s are: {have}"
            )
            return None
        return table[name]

    def dtype_of(io: IOInfo) -> np.dtype[Any] | None:
        return _ONNX_TYPE_TO_NUMPY.get(io.type)

    def index_dtype(io: IOInfo | None) -> np.dtype[Any]:
        if io is None:
            return np.dtype(np.int64)
        dt = dtype_of(io)
        if dt not in _INDEX_DTYPES:
            problems.append(
                f"{source} {kind_of(io)} {io.name!r} is {io.type}, "
                "expected tensor(int64) or tensor(int32)"
            )
            return np.dtype(np.int64)
        assert dt is not None
        return dt

    def kind_of(io: IOInfo) -> str:
        return "input" if io.name in ins and ins[io.name] is io else "output"

    ids_dtype = index_dtype(need(ins, n.input_ids, "input", "decoder.inputs.input_ids"))
    mask_dtype = index_dtype(need(ins, n.attention_mask, "input", "decoder.inputs.attention_mask"))
    logits_io = need(outs, n.logits, "output", "decoder.outputs.logits")

    kv_dtype: np.dtype[Any] | None = None
    kv_io: list[IOInfo] = []
    for kind, table, key, names in (
        ("input", ins, "decoder.inputs.past_key_names", n.past_key),
        ("input", ins, "decoder.inputs.past_value_names", n.past_value),
        ("output", outs, "decoder.outputs.present_key_names", n.present_key),
        ("output", outs, "decoder.outputs.present_value_names", n.present_value),
    ):
        for name in names:
            io = need(table, name, kind, key)
            if io is not None:
                kv_io.append(io)
    for io in kv_io:
        what = f"{source} {kind_of(io)} {io.name!r}"
        if len(io.shape) != 4:
            problems.append(
                f"{what} has shape {list(io.shape)}, expected 4 dims "
                f"[batch, {n.num_kv_heads} kv heads, sequence, {n.head_size}]"
            )
            continue
        heads, head_size = io.shape[1], io.shape[3]
        if isinstance(heads, int) and heads != n.num_kv_heads:
            problems.append(
                f"{what} has {heads} heads (dim 1), expected num_key_value_heads = "
                f"{n.num_kv_heads} from genai_config.json"
            )
        if isinstance(head_size, int) and head_size != n.head_size:
            problems.append(
                f"{what} has head size {head_size} (dim 3), expected head_size = "
                f"{n.head_size} from genai_config.json"
            )
        dt = dtype_of(io)
        if dt is None or dt.kind != "f":
            problems.append(f"{what} is {io.type}, expected a float tensor")
        elif kv_dtype is None:
            kv_dtype = dt
        elif dt != kv_dtype:
            problems.append(
                f"{what} is {io.type}, expected {_numpy_to_type_string(kv_dtype)} "
                "like the other KV tensors"
            )

    logits_dtype: np.dtype[Any] = np.dtype(np.float32)
    if logits_io is not None:
        dt = dtype_of(logits_io)
        if dt is None or dt.kind != "f":
            problems.append(
                f"{source} output {logits_io.name!r} is {logits_io.type}, expected a float tensor"
            )
        else:
            logits_dtype = dt
        last = logits_io.shape[-1] if logits_io.shape else None
        if isinstance(last, int) and last != n.vocab_size:
            problems.append(
                f"{source} output {logits_io.name!r} has {last} classes (last dim), "
                f"expected vocab_size = {n.vocab_size} from genai_config.json"
            )

    position_ids = n.position_ids if n.position_ids in ins else None
    if position_ids is not None:
        index_dtype(ins[position_ids])
    known = {n.input_ids, n.attention_mask, *n.past_key, *n.past_value}
    if position_ids is not None:
        known.add(position_ids)
    unknown = sorted(set(ins) - known)
    if unknown:
        problems.append(
            f"{source} has inputs kvmux cannot feed: {', '.join(unknown)}; expected only "
            "input_ids, attention_mask, optional position_ids and past key/value inputs"
        )
    if n.expected_position_ids and position_ids is None:
        problems.append(
            f"{source} has no input {n.position_ids!r}, which kvmux expected from the "
            "session it was checked against"
        )

    if problems:
        raise ModelFormatError(folder, problems)
    assert kv_dtype is not None
    return kv_dtype, logits_dtype, ids_dtype, mask_dtype, position_ids


@dataclass(frozen=True)
class _Names:
    input_ids: str
    attention_mask: str
    position_ids: str
    logits: str
    past_key: tuple[str, ...]
    past_value: tuple[str, ...]
    present_key: tuple[str, ...]
    present_value: tuple[str, ...]
    num_kv_heads: int
    head_size: int
    vocab_size: int
    expected_position_ids: bool = False


# --------------------------------------------------------------------------- public


def load_model(folder: Path) -> ModelSpec:
    """Read and validate the model folder; raise ``ModelFormatError`` naming what is wrong."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ModelFormatError(folder, "not a directory, expected a model folder")
    config_path = folder / CONFIG_FILENAME
    if not config_path.is_file():
        raise ModelFormatError(
            folder,
            f"missing {CONFIG_FILENAME}, expected the file onnxruntime-genai's model "
            "builder writes next to the decoder model",
        )
    try:
        text = config_path.read_text(encoding="utf-8")
        jsonin.check_depth(text)
        data = json.loads(text)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, jsonin.TooDeep) as exc:
        raise ModelFormatError(
            folder, f"{CONFIG_FILENAME} is not valid JSON ({exc}), expected a JSON object"
        ) from exc
    if not isinstance(data, dict):
        raise ModelFormatError(
            folder, f"{CONFIG_FILENAME} holds a {type(data).__name__}, expected a JSON object"
        )
    r = _Reader(folder, data)
    r.section("model", required=True)
    decoder = r.section("model.decoder", required=True)
    if decoder.get("pipeline"):
        raise r._err(
            "model.decoder.pipeline is set: multi-session pipeline models are not supported, "
            "expected a single decoder model file"
        )
    if r.get("model.decoder.inputs.past_names") or r.get("model.decoder.outputs.present_names"):
        raise r._err(
            "model.decoder.inputs.past_names / outputs.present_names is set: combined "
            "key/value tensors are not supported, expected separate key and value names"
        )

    filename = r.str_("model.decoder.filename", "")
    if not filename:
        raise r._err("missing key 'model.decoder.filename', expected the decoder ONNX file name")
    model_path = folder / filename
    if not model_path.is_file():
        raise ModelFormatError(
            folder,
            f"missing {filename} (named by {CONFIG_FILENAME} model.decoder.filename), "
            "expected the decoder ONNX model",
        )
    tokenizer_path = folder / TOKENIZER_FILENAME
    if not tokenizer_path.is_file():
        raise ModelFormatError(
            folder, f"missing {TOKENIZER_FILENAME}, expected a Hugging Face tokenizers file"
        )

    num_layers = r.int_("model.decoder.num_hidden_layers", required=True, minimum=1)
    num_heads = r.int_("model.decoder.num_attention_heads", required=True, minimum=1)
    assert num_layers is not None and num_heads is not None
    # genai: num_key_value_heads defaults to num_attention_heads.
    num_kv = r.int_("model.decoder.num_key_value_heads", required=False, minimum=1) or num_heads
    head_size = r.int_("model.decoder.head_size", required=False, minimum=1)
    hidden = r.int_("model.decoder.hidden_size", required=False, minimum=1)
    if head_size is None:
        if hidden is None:
            raise r._err(
                "missing key 'model.decoder.head_size' (and no hidden_size to derive it from), "
                "expected the attention head size"
            )
        if hidden % num_heads:
            raise r._err(
                f"model.decoder.head_size is missing and hidden_size {hidden} is not a multiple "
                f"of num_attention_heads {num_heads}, expected an explicit head_size"
            )
        head_size = hidden // num_heads
    if hidden is None:
        hidden = num_heads * head_size
    if num_heads % num_kv:
        raise r._err(
            f"model.decoder.num_attention_heads {num_heads} is not a multiple of "
            f"num_key_value_heads {num_kv}, expected grouped-query heads to divide evenly"
        )
    vocab_size = r.int_("model.vocab_size", required=True, minimum=1)
    assert vocab_size is not None

    eos = r.token_ids("model.eos_token_id", required=True)
    bos_ids = r.token_ids("model.bos_token_id", required=False)
    pad_ids = r.token_ids("model.pad_token_id", required=False)
    for key, ids in (("eos_token_id", eos), ("bos_token_id", bos_ids), ("pad_token_id", pad_ids)):
        bad = [i for i in ids if i >= vocab_size]
        if bad:
            raise r._err(
                f"model.{key} {bad} is outside the vocabulary, expected ids < vocab_size "
                f"{vocab_size}"
            )

    context_length = r.int_("model.context_length", required=False, minimum=0) or None
    ctx_source = f"{CONFIG_FILENAME} model.context_length"
    max_length = r.int_("search.max_length", required=False, minimum=0) or None
    if context_length is None:
        context_length = max_length
        ctx_source = (
            f"{CONFIG_FILENAME} search.max_length"
            if max_length is not None
            else f"{CONFIG_FILENAME} declares none"
        )

    search = SearchDefaults(
        do_sample=r.bool_("search.do_sample", False),
        max_length=max_length if max_length is not None else context_length,
        min_length=r.int_("search.min_length", required=False) or 0,
        num_beams=r.int_("search.num_beams", required=False, minimum=1) or 1,
        temperature=r.float_("search.temperature", 1.0),
        top_k=r.int_("search.top_k", required=False) or 0,
        top_p=r.float_("search.top_p", 1.0),
        repetition_penalty=r.float_("search.repetition_penalty", 1.0),
        past_present_share_buffer=r.bool_("search.past_present_share_buffer", False),
        random_seed=_signed_int(r, "search.random_seed", -1),
    )

    names = _Names(
        input_ids=r.str_("model.decoder.inputs.input_ids", DEFAULT_INPUT_IDS),
        attention_mask=r.str_("model.decoder.inputs.attention_mask", DEFAULT_ATTENTION_MASK),
        position_ids=r.str_("model.decoder.inputs.position_ids", DEFAULT_POSITION_IDS),
        logits=r.str_("model.decoder.outputs.logits", DEFAULT_LOGITS),
        past_key=_layer_names(
            r, "model.decoder.inputs.past_key_names", DEFAULT_PAST_KEY, num_layers
        ),
        past_value=_layer_names(
            r, "model.decoder.inputs.past_value_names", DEFAULT_PAST_VALUE, num_layers
        ),
        present_key=_layer_names(
            r, "model.decoder.outputs.present_key_names", DEFAULT_PRESENT_KEY, num_layers
        ),
        present_value=_layer_names(
            r, "model.decoder.outputs.present_value_names", DEFAULT_PRESENT_VALUE, num_layers
        ),
        num_kv_heads=num_kv,
        head_size=head_size,
        vocab_size=vocab_size,
    )
    # Features first: a model kvmux refuses for what it is (hybrid, another
    # attention) gets that reason rather than a list of IO mismatches.
    graph_model = _load_graph(folder, model_path)
    features = read_features(folder, model_path.name, graph_model, data)
    inputs, outputs = _onnx_io(graph_model)
    template = find_chat_template(folder)
    kv_dtype, logits_dtype, ids_dtype, mask_dtype, position_ids = _check_io(
        folder, names, inputs, outputs, source=f"{filename} graph"
    )
    cap = features.context_cap
    if cap is not None and (context_length is None or cap < context_length):
        ctx_source = f"capped: {features.context_cap_reason}"
        context_length = cap

    return ModelSpec(
        folder=folder,
        config_path=config_path,
        model_path=model_path,
        tokenizer_path=tokenizer_path,
        model_type=r.str_("model.type", ""),
        num_layers=num_layers,
        num_attention_heads=num_heads,
        num_kv_heads=num_kv,
        head_size=head_size,
        hidden_size=hidden,
        vocab_size=vocab_size,
        context_length=context_length,
        context_length_source=ctx_source,
        kv_dtype=kv_dtype,
        logits_dtype=logits_dtype,
        input_ids_dtype=ids_dtype,
        attention_mask_dtype=mask_dtype,
        bos_token_id=bos_ids[0] if bos_ids else None,
        eos_token_ids=eos,
        pad_token_id=pad_ids[0] if pad_ids else None,
        input_ids_name=names.input_ids,
        attention_mask_name=names.attention_mask,
        position_ids_name=position_ids,
        logits_name=names.logits,
        past_key_names=names.past_key,
        past_value_names=names.past_value,
        present_key_names=names.present_key,
        present_value_names=names.present_value,
        search=search,
        features=features,
        chat_template=None if template is None else template.origin,
    )


def _signed_int(r: _Reader, path: str, default: int) -> int:
    value = r.get(path)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise r._err(f"{path} is {value!r}, expected an integer")
    return value


def check_session_io(
    spec: ModelSpec,
    inputs: Sequence[NodeArgLike | IOInfo],
    outputs: Sequence[NodeArgLike | IOInfo],
) -> None:
    """Check a live session's IO (``session.get_inputs()``, ``get_outputs()``) against ``spec``.

    Every expected name must be present; past/present KV must be 4-D with the
    config's KV heads (dim 1) and head size (dim 3) where those dims are concrete
    (symbolic dims pass); dtypes must match the spec. Raises ``ModelFormatError``
    listing every mismatch.
    """
    names = _Names(
        input_ids=spec.input_ids_name,
        attention_mask=spec.attention_mask_name,
        position_ids=spec.position_ids_name or DEFAULT_POSITION_IDS,
        logits=spec.logits_name,
        past_key=spec.past_key_names,
        past_value=spec.past_value_names,
        present_key=spec.present_key_names,
        present_value=spec.present_value_names,
        num_kv_heads=spec.num_kv_heads,
        head_size=spec.head_size,
        vocab_size=spec.vocab_size,
        expected_position_ids=spec.position_ids_name is not None,
    )
    kv, logits, ids, mask, _ = _check_io(
        spec.folder, names, inputs, outputs, source="onnxruntime session"
    )
    problems = [
        f"onnxruntime session {what} dtype is {got.name}, expected {want.name} as loaded "
        "from the model folder"
        for what, got, want in (
            ("KV", kv, spec.kv_dtype),
            ("logits", logits, spec.logits_dtype),
            ("input_ids", ids, spec.input_ids_dtype),
            ("attention_mask", mask, spec.attention_mask_dtype),
        )
        if got != want
    ]
    if problems:
        raise ModelFormatError(spec.folder, problems)
