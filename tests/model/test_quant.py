"""GGUF's block types as MatMulNBits' layouts, type by type against gguf-py's own dequantization,
and what onnxruntime's MatMulNBits computes from them."""

from __future__ import annotations

from typing import Any

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from kvmux.daemon.model.quant import LAYOUTS, QuantError, QuantizedMatrix, quantize_int4, repack

gguf = pytest.importorskip("gguf", reason="the GGUF mapping is tested against the gguf package")

ROWS, COLS = 24, 512
#: Types gguf-py can quantize itself; the K-quants are written as raw blocks.
QUANTIZABLE = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")


def _f16_bytes(values: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    return values.astype(np.float16).view(np.uint8).reshape(values.shape[0], 2)


def raw_blocks(type_name: str, rows: int, cols: int, seed: int = 0) -> np.ndarray[Any, Any]:
    """A tensor of ``type_name`` as the bytes a GGUF file holds: quantized by gguf-py where it
    can, else random blocks whose float16 scales are set to finite, moderate values."""
    rng = np.random.default_rng(seed)
    qtype = gguf.GGMLQuantizationType[type_name]
    if type_name in QUANTIZABLE:
        w = rng.standard_normal((rows, cols)).astype(np.float32)
        w += rng.standard_normal((rows, 1)).astype(np.float32)  # blocks with a minimum
        return np.asarray(gguf.quants.quantize(w, qtype))
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    n = rows * cols // block
    b = rng.integers(0, 256, (n, size), dtype=np.uint8)
    d = _f16_bytes(rng.uniform(0.001, 0.01, n))
    dmin = _f16_bytes(rng.uniform(0.001, 0.01, n))
    # Where each type keeps its float16 d (and dmin), from gguf-py's dequantize_blocks.
    if type_name == "Q2_K":
        b[:, 80:82], b[:, 82:84] = d, dmin
    elif type_name == "Q3_K":
        b[:, 108:110] = d
    elif type_name in ("Q4_K", "Q5_K"):
        b[:, 0:2], b[:, 2:4] = d, dmin
    elif type_name == "Q6_K":
        b[:, 208:210] = d
    return b.reshape(rows, cols // block * size)


@pytest.mark.parametrize("type_name", sorted(LAYOUTS))
def test_each_type_maps_to_what_gguf_dequantizes(type_name: str) -> None:
    data = raw_blocks(type_name, ROWS, COLS)
    qtype = gguf.GGMLQuantizationType[type_name]
    want = gguf.quants.dequantize(data, qtype).reshape(ROWS, COLS)
    q = repack(data, type_name, ROWS, COLS)
    layout = LAYOUTS[type_name]
    expected = (layout.bits, layout.block, layout.correction)
    assert (q.bits, q.block, q.offsets is not None) == expected
    assert q.packed.shape == (ROWS, COLS // q.block, q.block * q.bits // 8)
    got = q.dequantize()
    # Exact but for float32 rounding of d * (q - c) + offset against d * q + m.
    np.testing.assert_allclose(got, want, rtol=0, atol=4e-7 * np.abs(want).max())
    if layout.correction:
        assert not np.array_equal(got, q.astype(np.float32).dequantize() * 0), "offsets matter"


def _matmul_nbits(q: QuantizedMatrix, accuracy_level: int) -> ort.InferenceSession:
    inputs = ["A", "B", "S"]
    inits = [numpy_helper.from_array(q.packed, "B"), numpy_helper.from_array(q.scales, "S")]
    nodes = [
        helper.make_node(
            "MatMulNBits",
            inputs,
            ["Y0" if q.offsets is not None else "Y"],
            domain="com.microsoft",
            K=q.cols,
            N=q.rows,
            bits=q.bits,
            block_size=q.block,
            accuracy_level=accuracy_level,
        )
    ]
    if q.offsets is not None:
        kb = q.cols // q.block
        inits += [
            numpy_helper.from_array(q.offsets.T.copy(), "C"),
            numpy_helper.from_array(np.array([0, kb, q.block], np.int64), "shape"),
            numpy_helper.from_array(np.array([-1], np.int64), "axis"),
        ]
        nodes += [
            helper.make_node("Reshape", ["A", "shape"], ["Ab"]),
            helper.make_node("ReduceSum", ["Ab", "axis"], ["As"], keepdims=0),
            helper.make_node("MatMul", ["As", "C"], ["Yc"]),
            helper.make_node("Add", ["Y0", "Yc"], ["Y"]),
        ]
    graph = helper.make_graph(
        nodes,
        "q",
        [helper.make_tensor_value_info("A", TensorProto.FLOAT, ["M", q.cols])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["M", q.rows])],
        initializer=inits,
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)]
    )
    model.ir_version = 10
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("type_name", sorted(LAYOUTS))
def test_matmul_nbits_computes_the_files_matrix(type_name: str) -> None:
    data = raw_blocks(type_name, ROWS, COLS, seed=1)
    w = gguf.quants.dequantize(data, gguf.GGMLQuantizationType[type_name]).reshape(ROWS, COLS)
    q = repack(data, type_name, ROWS, COLS)
    a = np.random.default_rng(2).standard_normal((5, COLS)).astype(np.float32)
    want = a.astype(np.float64) @ w.T.astype(np.float64)
    scale = np.abs(want).max()
    exact = _matmul_nbits(q, 0).run(None, {"A": a})[0]
    # float32 sums of 512 products: a few ulps of the largest output.
    np.testing.assert_allclose(exact, want, rtol=0, atol=1e-5 * scale)
    # int8 activations (llama.cpp's own choice for these dot products): close, not exact.
    fast = _matmul_nbits(q, 4).run(None, {"A": a})[0]
    np.testing.assert_allclose(fast, want, rtol=0, atol=3e-2 * scale)


def test_rows_can_be_reordered() -> None:
    data = raw_blocks("Q4_K", ROWS, COLS)
    q = repack(data, "Q4_K", ROWS, COLS)
    order = np.random.default_rng(0).permutation(ROWS)
    np.testing.assert_array_equal(q.take_rows(order).dequantize(), q.dequantize()[order])


def test_an_unmapped_type_is_refused_by_name() -> None:
    with pytest.raises(QuantError, match=r"of type IQ4_XS, which has no exact MatMulNBits layout"):
        repack(np.zeros(10, np.uint8), "IQ4_XS", 1, 256)


def test_a_row_the_block_does_not_divide() -> None:
    with pytest.raises(QuantError, match="rows of 576 values, which Q4_K's blocks of 256"):
        repack(np.zeros(1000, np.uint8), "Q4_K", 1, 576)


def test_blocks_short_of_the_shape() -> None:
    data = raw_blocks("Q8_0", 4, 64)
    with pytest.raises(QuantError, match=r"holds 270 bytes, expected 272 for 4 x 64 Q8_0"):
        repack(data.reshape(-1)[:-2], "Q8_0", 4, 64)


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_a_scale_that_is_not_finite(bad: float) -> None:
    data = raw_blocks("Q4_1", 4, 64).copy()
    data[2, 0:2] = np.array([bad], np.float16).view(np.uint8)
    with pytest.raises(QuantError, match=r"has a scale that is NaN or infinite \(row 2\)"):
        repack(data, "Q4_1", 4, 64)
    data = raw_blocks("Q4_1", 4, 64).copy()
    data[3, 22:24] = np.array([bad], np.float16).view(np.uint8)  # the second block's minimum
    with pytest.raises(QuantError, match=r"has a minimum that is NaN or infinite \(row 3\)"):
        repack(data, "Q4_1", 4, 64)


def test_int4_is_symmetric_round_to_nearest_in_blocks_of_32() -> None:
    w = np.random.default_rng(3).standard_normal((16, 128)).astype(np.float32)
    q = quantize_int4(w)
    assert (q.bits, q.block, q.offsets) == (4, 32, None)
    blocks = w.reshape(16, 4, 32)
    scale = q.scales[:, :, None]
    # Symmetric: the block's value of largest magnitude is the code 0 end, -8 * scale.
    extreme = np.take_along_axis(blocks, np.abs(blocks).argmax(-1)[..., None], -1)
    np.testing.assert_allclose(-8 * scale, extreme, rtol=1e-6)
    # Round to nearest, clamped to the 16 codes (the other sign's extreme lands on 15).
    np.testing.assert_array_equal(q.codes(), np.clip(np.rint(blocks / scale) + 8, 0, 15))
