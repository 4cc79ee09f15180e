"""What a decoder graph does that kvmux's KV handling depends on, read from the graph itself.

kvmux binds one buffer per layer as both ``past_key_values.i.*`` and
``present.i.*``, grows it by buckets, and binds an attention mask as wide as
the buffer. That is sound for onnxruntime's ``GroupQueryAttention`` (it reads
each sequence's length from the mask's sum and writes only the new rows), and
only there. This module reads the graph's nodes (no weights are loaded) and
``genai_config.json``'s ``sliding_window`` section, and decides, per feature,
whether kvmux runs the model as the Generator does, runs it with a tighter
limit, or refuses it with the reason.

Measured against onnxruntime-genai 0.18's Generator (tests/genai/test_model_matrix.py,
``python -m bench.model_matrix``; the comparisons with the source transformers
model were made by hand when these rules were written):

* ``local_window_size`` on GQA over kvmux's full-prefix buffer gives the
  Generator's tokens (Gemma2 exported with ``windowed_kv_cache=false``).
* ``sliding_window_cache=1`` (the builder's default for windowed layers)
  means those layers' buffers are window-sized rings that the runtime evicts
  from. Over kvmux's full-prefix buffer the kernel computes the same
  attention in another order: logits drift by ~1e-6 once the ring wraps and
  tokens part at the next near tie (Gemma2 int4: new token 155). Refused,
  naming the re-export that kvmux runs exactly.
* A window declared in genai_config.json that no GQA node applies
  (``local_window_size`` -1, the builder's Mistral export) attends to the
  whole prefix, unlike the source model once the sequence passes the
  window; the Generator itself sizes its cache by the window and fails soon
  after it. kvmux caps the context at the window: up to there, full and
  windowed attention agree.
* LongRoPE (Phi-3 long-context exports) picks its rotary caches with
  ``If(Greater(mask width, T))``. The Generator's mask is as wide as the
  sequence, kvmux's as wide as the bucket: the two pass T at the same step
  only when T is a power of two no smaller than the first bucket.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvmux.daemon.model.errors import ModelFormatError

__all__ = ["ModelFeatures", "read_features"]

_GQA = "GroupQueryAttention"
#: Attention ops that keep their own past/present tensors (concatenating, or
#: paged): one shared, growing buffer does not fit them.
_OTHER_ATTENTION = (
    "MultiHeadAttention",
    "Attention",
    "PagedAttention",
    "SparseAttention",
    "DecoderMaskedMultiHeadAttention",
)
_FLOAT_TYPES = {1: "fp32", 10: "fp16", 16: "bf16", 11: "fp64"}


@dataclass(frozen=True)
class ModelFeatures:
    """The graph and config features kvmux relies on, and the limits they impose."""

    #: Weight precision as exported: "fp32", "fp16", or each quantized kind, e.g. "Q4_1 →
    #: 4-bit + min correction, 210 MatMulNBits (block 32); ...; 118.7 MB of weights".
    precision: str
    attention_layers: int  # GroupQueryAttention nodes
    #: Window declared by genai_config.json model.decoder.sliding_window, if any.
    declared_window: int | None
    #: local_window_size of the GQA nodes that apply one, and how many do.
    graph_window: int | None
    windowed_layers: int
    softcap: float  # GQA's attention logit soft cap (0: none)
    rotary: str  # where rotary embeddings happen
    #: A context limit the features impose (None: none), and why.
    context_cap: int | None
    context_cap_reason: str
    #: The sequence length past which the graph switches its rotary caches
    #: (LongRoPE: an If on the attention mask's width > T); None: no switch.
    length_switch: int | None = None

    def lines(self) -> list[str]:
        """``kvmux-model info`` lines: one feature each."""
        if self.declared_window is None and self.graph_window is None:
            window = "none"
        else:
            applied = (
                f"applied by {self.windowed_layers} of {self.attention_layers} GQA layers "
                f"(local_window_size {self.graph_window})"
                if self.graph_window is not None
                else "applied by no GQA layer (local_window_size -1)"
            )
            declared = (
                "not declared in genai_config.json"
                if self.declared_window is None
                else f"declared {self.declared_window}"
            )
            window = f"{declared}, {applied}"
        return [
            f"precision:         {self.precision}",
            f"attention:         GroupQueryAttention x {self.attention_layers}, shared "
            "past/present buffer (kvmux relies on it)",
            f"sliding window:    {window}",
            f"attention softcap: {self.softcap:g}" if self.softcap else "attention softcap: none",
            f"rotary:            {self.rotary}"
            + (
                ""
                if self.length_switch is None
                else f"; long factors past {self.length_switch} tokens (mask width)"
            ),
            "context cap:       "
            + (
                "none"
                if self.context_cap is None
                else f"{self.context_cap} ({self.context_cap_reason})"
            ),
        ]


def _attrs(node: Any) -> dict[str, Any]:
    from onnx import helper

    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


#: Bytes per element of the initializer types weights come in.
_ITEM_BYTES = {1: 4, 2: 1, 3: 1, 10: 2, 16: 2, 11: 8, 6: 4, 7: 8}
_LEVELS = {0: "fp32", 1: "fp32", 2: "fp16", 3: "bf16", 4: "int8"}


def _precision(graph: Any, nodes: list[Any]) -> str:
    """Each weight kind's precision, as kvmux's import names it in the nodes' doc strings
    ("weights Q4_1"), the MatMulNBits accuracy levels, and the bytes of weights."""
    floats: dict[str, int] = {}
    weight_bytes = 0
    for init in graph.initializer:
        n = 1
        for d in init.dims:
            n *= int(d)
        weight_bytes += n * _ITEM_BYTES.get(init.data_type, 4)
        name = _FLOAT_TYPES.get(init.data_type)
        if name is not None and len(init.dims) == 2:  # matrices: the weights that matter
            floats[name] = floats.get(name, 0) + n
    dense = max(floats, key=lambda k: floats[k]) if floats else "fp32"
    names = {n.name for n in nodes}
    gathered = {n.input[0]: n for n in nodes if n.op_type == "GatherBlockQuantized"}
    groups: dict[tuple[str, int, int, bool], int] = {}
    tied: list[str] = []
    levels: dict[str, int] = {}
    for node in nodes:
        if node.op_type != "MatMulNBits":
            continue
        a = _attrs(node)
        bits, block = int(a.get("bits", 4)), int(a.get("block_size", 0))
        source = node.doc_string.removeprefix("weights ") if node.doc_string else f"int{bits}"
        corrected = f"{node.name}/min_correction" in names
        key = (source, bits, block, corrected)
        groups[key] = groups.get(key, 0) + 1
        if len(node.input) > 1 and node.input[1] in gathered:
            tied.append(node.name)
        level = _LEVELS.get(int(a.get("accuracy_level", 0)), str(a.get("accuracy_level")))
        levels[level] = levels.get(level, 0) + 1
    if not groups and not gathered:
        return dense
    parts = []
    for (source, bits, block, corrected), count in groups.items():
        kind = "" if source == f"int{bits}" else f" → {bits}-bit"
        fix = " + min correction" if corrected else ""
        parts.append(f"{source}{kind}{fix}, {count} MatMulNBits (block {block})")
    for node in gathered.values():
        a = _attrs(node)
        source = node.doc_string.removeprefix("weights ") if node.doc_string else "quantized"
        tie = f", tied to {', '.join(tied)}" if tied else ""
        bits = int(a.get("bits", 4))
        parts.append(f"embeddings {source} → {bits}-bit (GatherBlockQuantized{tie})")
    if levels:
        parts.append("accuracy " + ", ".join(f"{k} x{v}" for k, v in sorted(levels.items())))
    parts.append(f"other weights {dense}; {weight_bytes / 1e6:.1f} MB of weights")
    return "; ".join(parts)


def _constant_ints(graph: Any) -> dict[str, list[int]]:
    """Integer constants by name: initializers stored inline and Constant nodes."""
    from onnx import numpy_helper

    out: dict[str, list[int]] = {}
    tensors = [(t.name, t) for t in graph.initializer if t.data_type in (6, 7) and t.raw_data]
    tensors += [
        (n.output[0], a.t)
        for n in graph.node
        if n.op_type == "Constant"
        for a in n.attribute
        if a.name == "value" and a.t.data_type in (6, 7)
    ]
    for name, tensor in tensors:
        out[name] = [int(v) for v in numpy_helper.to_array(tensor).reshape(-1)]
    return out


def _length_switches(graph: Any, name: str, problems: list[str]) -> list[int]:
    """Thresholds T of ``If(Greater(length, T))`` nodes; anything else is a problem."""
    producers = {o: n for n in graph.node for o in n.output}
    constants: dict[str, list[int]] | None = None
    switches = []
    for node in graph.node:
        if node.op_type != "If":
            continue
        cond = producers.get(node.input[0])
        if constants is None:
            constants = _constant_ints(graph)
        t = constants.get(cond.input[1]) if cond is not None and cond.op_type == "Greater" else None
        if t is None or len(t) != 1:
            problems.append(
                f"{name} has an If node ({node.name}) whose condition kvmux cannot read: "
                "kvmux binds an attention mask as wide as its KV bucket, so it runs only "
                "graphs whose branches depend on the sequence length as Greater(length, T)"
            )
            continue
        switches.append(t[0])
    return switches


def read_features(folder: Path, name: str, model: Any, config: Mapping[str, Any]) -> ModelFeatures:
    """Read the attention features of ``model`` (an ``onnx.ModelProto`` loaded without its
    weights, file ``name``); raise ``ModelFormatError`` for what kvmux cannot run as the
    Generator does."""
    graph = model.graph
    nodes = list(graph.node)
    gqa = [_attrs(n) for n in nodes if n.op_type == _GQA]
    other = sorted({n.op_type for n in nodes if n.op_type in _OTHER_ATTENTION})
    problems: list[str] = []

    # Hybrid models (LFM2's short convolutions, Mamba layers) carry a state
    # between steps beside the attention KV; the builder names it past.N.conv
    # / past.N.ssm and the like.
    inits = {t.name for t in graph.initializer}
    states = sorted(
        i.name
        for i in graph.input
        if i.name not in inits and any(k in i.name for k in (".conv", ".ssm", "state"))
    )
    if states:
        problems.append(
            f"{name} carries a recurrent state between steps ({', '.join(states)}): a hybrid "
            "model's convolution or state-space layers, which kvmux does not keep (it holds "
            "attention KV only); it would need per-layer state buffers carried across steps"
        )
    elif not gqa or other:
        problems.append(
            f"{name} attends with {', '.join(other) or 'no attention op kvmux knows'}"
            f"{' besides GroupQueryAttention' if gqa else ''}: kvmux binds one growing buffer "
            "as both past and present KV, which needs com.microsoft.GroupQueryAttention in "
            "every layer (what onnxruntime-genai's builder writes for -e cuda, and for -e cpu at "
            "fp32 or int4)"
        )

    decoder = config.get("model", {}).get("decoder", {}) if isinstance(config, Mapping) else {}
    sw = decoder.get("sliding_window") if isinstance(decoder, Mapping) else None
    declared: int | None = None
    if isinstance(sw, Mapping):
        size = sw.get("window_size")
        if isinstance(size, int) and not isinstance(size, bool) and size > 0:
            declared = size
        for key in ("slide_key_value_cache", "slide_inputs"):
            if sw.get(key) is True:
                problems.append(
                    f"genai_config.json model.decoder.sliding_window.{key} is true: that model "
                    "expects its runtime to slide a window-sized KV cache (and its inputs), "
                    "while kvmux keeps the whole prefix in a growing buffer; export it for "
                    "-e cpu or -e cuda, whose GQA applies the window itself"
                )

    windows = [int(a.get("local_window_size", -1)) for a in gqa]
    applied = [w for w in windows if w >= 0]
    graph_window = max(applied) if applied else None
    ringed = sum(1 for a in gqa if int(a.get("sliding_window_cache", 0)))
    if ringed:
        problems.append(
            f"{name} keeps the KV of {ringed} windowed GroupQueryAttention layers in "
            "window-sized rings (sliding_window_cache=1), while kvmux keeps the whole prefix "
            "in growing buffers: the same attention summed in another order, so tokens part "
            "from the Generator's at near ties; re-export with --extra_options "
            "windowed_kv_cache=false (the window stays applied, over full-length buffers)"
        )

    cap: int | None = None
    cap_reason = ""
    if declared is not None and graph_window is None:
        cap = declared
        cap_reason = (
            f"genai_config.json declares a sliding window of {declared} that no "
            f"GroupQueryAttention in {name} applies: past it the graph would attend to the "
            "whole prefix, unlike the model"
        )
    elif declared is not None and graph_window is not None and graph_window != declared:
        problems.append(
            f"genai_config.json declares a sliding window of {declared} but {name}'s "
            f"GroupQueryAttention nodes use local_window_size {graph_window}: re-export so "
            "that both agree"
        )

    switches = _length_switches(graph, name, problems)
    for t in switches:
        if t < 1 or t & (t - 1):
            problems.append(
                f"{name} switches its rotary caches when the attention mask is wider than {t} "
                "tokens (LongRoPE): kvmux binds a mask as wide as its power-of-two KV bucket, "
                f"which passes {t} at the same step as the sequence only if {t} is a power "
                "of two; kvmux would use the long factors too early"
            )

    if problems:
        raise ModelFormatError(folder, problems)

    rotary_in_gqa = sum(1 for a in gqa if int(a.get("do_rotary", 0)))
    rotary_nodes = sum(1 for n in nodes if n.op_type == "RotaryEmbedding")
    parts = []
    if rotary_in_gqa:
        parts.append(f"inside GQA in {rotary_in_gqa} of {len(gqa)} layers")
    if rotary_nodes:
        parts.append(f"{rotary_nodes} RotaryEmbedding nodes")
    rotary = "; ".join(parts) or "none"
    softcap = max((float(a.get("softcap", 0.0)) for a in gqa), default=0.0)
    return ModelFeatures(
        precision=_precision(graph, nodes),
        attention_layers=len(gqa),
        declared_window=declared,
        graph_window=graph_window,
        windowed_layers=len(applied),
        softcap=softcap,
        rotary=rotary,
        context_cap=cap,
        context_cap_reason=cap_reason,
        length_switch=min(switches) if switches else None,
    )
