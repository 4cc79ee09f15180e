"""The GGUF import keeps the file's blocks (MatMulNBits, GatherBlockQuantized), exactly.

Random-weight ``llama`` (untied) and ``qwen2`` (tied, q/k/v biases) files hold every
type the import maps, spread over their tensors; the K-quants, which the gguf package
cannot quantize, are written as raw blocks with valid scales. Imported with
``accuracy="fp32"`` their tokens and logits must equal the ``dequantize`` import's (the
gguf package's own dequantization, in float32): a wrong nibble order, scale or minimum
gives other tokens, not an error. Bad files are refused by name and leave nothing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from kvmux.daemon.engine import Engine, EngineOptions, SamplingParams
from kvmux.daemon.model import GGUFImportError, import_gguf, load_model
from kvmux.daemon.model.quant import LAYOUTS

from .gguf_fixture import TinyShape, Vocab, gguf_name, random_weights, train_vocab, write_gguf

gguf = pytest.importorskip("gguf", reason="GGUF import needs the gguf package (cpu extra)")

#: Rows of 256 values: the K-quants' super-block.
SHAPE = TinyShape(hidden=256, heads=4, kv_heads=2, head=64, inter=512)
TYPES = list(LAYOUTS)
K_QUANTS = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
PROMPTS = ["the cache grows", "a b c d e f", "one two three four five six seven"]


def _raw_k_quant(w: np.ndarray[Any, Any], kind: Any, seed: int) -> np.ndarray[Any, Any]:
    """Random blocks of ``kind`` with finite scales, scaled to ``w``'s spread."""
    block, size = gguf.GGML_QUANT_SIZES[kind]
    rows, cols = w.shape
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    # Where each type keeps its float16 d (and dmin): ggml's block_qN_K structs.
    fields = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}
    offsets = fields[kind.name]

    def set_scale(value: float) -> None:
        half = np.array([value], np.float16).view(np.uint8)
        for at in offsets:
            data[..., at : at + 2] = half

    set_scale(1.0)
    spread = float(np.std(gguf.quants.dequantize(data.reshape(rows, -1), kind)))
    set_scale(float(np.std(w)) / spread)  # d and dmin scale the block's values alike
    return data.reshape(rows, -1)


def _write(path: Path, arch: str, vocab: Vocab, *, seed: int) -> Path:
    tied = arch == "qwen2"
    weights = random_weights(SHAPE, len(vocab.tokens), qkv_bias=tied, tied=tied, seed=seed)
    # The fixture's spreads suit rows of 64; rows of 256 need half of them for attention
    # scores as spread (not saturated), where float32 rounding is not amplified.
    weights = {
        hf: w if w.ndim == 1 or "embed" in hf else w * np.float32(0.5) for hf, w in weights.items()
    }
    raw = {}
    matrices = [hf for hf, w in weights.items() if w.ndim == 2]
    for i, hf in enumerate(matrices):
        kind = gguf.GGMLQuantizationType[TYPES[(i + seed) % len(TYPES)]]
        w = weights[hf]
        if arch == "llama" and hf.endswith(("q_proj.weight", "k_proj.weight")):
            heads = SHAPE.heads if "q_proj" in hf else SHAPE.kv_heads
            w = w.reshape(heads, 2, -1, w.shape[1]).swapaxes(1, 2).reshape(w.shape)
        if kind.name in K_QUANTS:
            data = _raw_k_quant(w, kind, seed + i)
        else:
            data = gguf.quants.quantize(w, kind)
        raw[gguf_name(hf)] = (data, kind)
    skip = set(raw)
    return write_gguf(path, arch, SHAPE, weights, vocab, raw=raw, skip=skip)


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    vocab = train_vocab()[1]
    folder = tmp_path_factory.mktemp("quantized")
    return {
        arch: _write(folder / f"{arch}.gguf", arch, vocab, seed=seed)
        for seed, arch in enumerate(("llama", "qwen2"))
    }


def _types_in(path: Path) -> set[str]:
    reader = gguf.GGUFReader(str(path))
    return {t.tensor_type.name for t in reader.tensors if len(t.shape) == 2}


def _logits(folder: Path, ids: list[int]) -> np.ndarray[Any, Any]:
    spec = load_model(folder)
    session = ort.InferenceSession(str(folder / "model.onnx"), providers=["CPUExecutionProvider"])
    feeds: dict[str, np.ndarray[Any, Any]] = {
        "input_ids": np.array([ids], np.int64),
        "attention_mask": np.ones((1, len(ids)), np.int64),
    }
    empty = np.zeros((1, spec.num_kv_heads, 0, spec.head_size), np.float32)
    for i in range(spec.num_layers):
        feeds[f"past_key_values.{i}.key"] = feeds[f"past_key_values.{i}.value"] = empty
    return np.asarray(session.run(["logits"], feeds)[0])


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_every_mapped_type_imports_exactly(
    files: dict[str, Path], arch: str, tmp_path: Path
) -> None:
    path = files[arch]
    assert _types_in(path) == set(TYPES), "the file holds every mapped type"
    ours = import_gguf(path, tmp_path / "quantized", accuracy="fp32")
    reference = import_gguf(path, tmp_path / "float", dequantize=True)
    ops = {
        n.op_type for n in onnx.load(str(ours / "model.onnx"), load_external_data=False).graph.node
    }
    assert {"MatMulNBits", "GatherBlockQuantized"} <= ops
    assert "MatMulNBits" not in {
        n.op_type
        for n in onnx.load(str(reference / "model.onnx"), load_external_data=False).graph.node
    }
    engines = [Engine(f, EngineOptions(min_bucket=16)) for f in (ours, reference)]
    worst: list[float] = []
    for text in PROMPTS:
        ids = engines[1].encode(text)
        # float32 rounding (MatMulNBits' order of sums against MatMul's) is ~1e-5 at every
        # position; measured: one position in 35 reaches 4e-4, where attention amplifies it.
        diff = np.abs(_logits(ours, ids) - _logits(reference, ids)).max(-1)[0]
        assert diff.max() < 1e-3, diff
        worst.extend(diff.tolist())
        runs = [
            e.generate(ids, SamplingParams(max_new_tokens=32, temperature=0.0)) for e in engines
        ]
        assert runs[0].token_ids == runs[1].token_ids, text
        assert len(runs[0].token_ids) == 32 or runs[0].finish_reason == "stop"
    assert np.quantile(worst, 0.9) < 1e-4, worst
    precision = load_model(ours).features.precision
    for kind in TYPES:
        assert kind in precision, precision
    assert "min correction" in precision and "accuracy fp32" in precision


def test_the_default_accuracy_keeps_the_tokens_close(
    files: dict[str, Path], tmp_path: Path
) -> None:
    """int8 activations are not exact; on these peaked random weights the greedy tokens of
    the default (mixed) import still follow the float import's for the first steps."""
    path = files["llama"]
    ours = Engine(import_gguf(path, tmp_path / "q"), EngineOptions(min_bucket=16))
    reference = Engine(
        import_gguf(path, tmp_path / "f", dequantize=True), EngineOptions(min_bucket=16)
    )
    ids = reference.encode(PROMPTS[0])
    params = SamplingParams(max_new_tokens=8, temperature=0.0)
    assert ours.generate(ids, params).token_ids[:4] == reference.generate(ids, params).token_ids[:4]
    graph = onnx.load(str(tmp_path / "q" / "model.onnx"), load_external_data=False).graph
    levels = {
        n.name: {a.name: a.i for a in n.attribute} for n in graph.node if n.op_type == "MatMulNBits"
    }
    # Mixed: the 4-bit attention projections at fp32 (level 0), everything else at int8 (4).
    for name, a in levels.items():
        assert a["accuracy_level"] == (0 if "/attn/" in name and a["bits"] == 4 else 4), name
    fp32 = sum(a["accuracy_level"] == 0 for a in levels.values())
    assert 0 < fp32 < len(levels)
    assert f"accuracy fp32 x{fp32}, int8 x{len(levels) - fp32}" in ours.spec.features.precision


# ----------------------------------------------------------------------------- bad files


def _bad(tmp_path: Path, vocab: Vocab, name: str, data: Any, kind: Any, **kw: Any) -> Path:
    weights = random_weights(SHAPE, len(vocab.tokens), qkv_bias=False, tied=False)
    return write_gguf(
        tmp_path / "bad.gguf",
        "llama",
        SHAPE,
        weights,
        vocab,
        raw={name: (data, kind)},
        skip=[name],
        **kw,
    )


@pytest.fixture(scope="module")
def vocab() -> Vocab:
    return train_vocab()[1]


def _refused(path: Path, out: Path, match: str) -> None:
    with pytest.raises(GGUFImportError, match=match):
        import_gguf(path, out)
    assert not out.exists()
    assert [p.name for p in out.parent.iterdir() if p.name.startswith(".")] == []


def test_an_unmapped_type_is_refused_by_name(vocab: Vocab, tmp_path: Path) -> None:
    kind = gguf.GGMLQuantizationType.IQ4_NL
    block, size = gguf.GGML_QUANT_SIZES[kind]
    data = np.zeros((SHAPE.hidden, SHAPE.hidden // block * size), np.uint8)
    path = _bad(tmp_path, vocab, "blk.1.attn_output.weight", data, kind)
    _refused(path, tmp_path / "out", r"blk\.1\.attn_output\.weight .*IQ4_NL.*--dequantize")


def test_a_nan_scale_is_refused_naming_the_row(vocab: Vocab, tmp_path: Path) -> None:
    w = np.random.default_rng(0).standard_normal((SHAPE.inter, SHAPE.hidden)).astype(np.float32)
    data = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0).copy()
    data[5, 0:2] = np.array([np.nan], np.float16).view(np.uint8)
    path = _bad(tmp_path, vocab, "blk.0.ffn_up.weight", data, gguf.GGMLQuantizationType.Q8_0)
    _refused(path, tmp_path / "out", r"blk\.0\.ffn_up\.weight .*row 5")


def test_an_infinite_minimum_is_refused(vocab: Vocab, tmp_path: Path) -> None:
    w = np.random.default_rng(0).standard_normal((SHAPE.inter, SHAPE.hidden)).astype(np.float32)
    data = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q4_1).copy()
    data[3, 2:4] = np.array([np.inf], np.float16).view(np.uint8)  # block 0's m
    path = _bad(tmp_path, vocab, "blk.0.ffn_gate.weight", data, gguf.GGMLQuantizationType.Q4_1)
    _refused(path, tmp_path / "out", r"blk\.0\.ffn_gate\.weight .*row 3")


def test_a_shape_that_contradicts_the_metadata_is_refused(vocab: Vocab, tmp_path: Path) -> None:
    # attn_q with half the rows the head count says.
    w = (
        np.random.default_rng(0)
        .standard_normal((SHAPE.hidden // 2, SHAPE.hidden))
        .astype(np.float32)
    )
    data = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0)
    path = _bad(tmp_path, vocab, "blk.0.attn_q.weight", data, gguf.GGMLQuantizationType.Q8_0)
    _refused(path, tmp_path / "out", r"attn_q|q_proj")


def test_truncated_blocks_are_refused(vocab: Vocab, tmp_path: Path) -> None:
    from kvmux.daemon.model.quant import QuantError, repack

    w = np.random.default_rng(0).standard_normal((8, 64)).astype(np.float32)
    data = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q4_0).reshape(-1)
    with pytest.raises(QuantError, match=r"bytes"):
        repack(data[:-5], "Q4_0", 8, 64)
    # A file cut inside its tensor data: the reader refuses it by name before any block.
    good = _bad(
        tmp_path,
        vocab,
        "blk.0.ffn_up.weight",
        gguf.quants.quantize(
            np.ones((SHAPE.inter, SHAPE.hidden), np.float32), gguf.GGMLQuantizationType.Q4_0
        ),
        gguf.GGMLQuantizationType.Q4_0,
    )
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(good.read_bytes()[: good.stat().st_size - 1000])
    _refused(cut, tmp_path / "out", r"cut\.gguf")


def test_a_row_the_block_does_not_divide_is_refused() -> None:
    from kvmux.daemon.model.quant import QuantError, repack

    with pytest.raises(QuantError, match=r"rows of 48 values"):
        repack(np.zeros(8 * 2 * 18, np.uint8), "Q4_0", 8, 48)
