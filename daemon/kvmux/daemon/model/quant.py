"""Quantized weights as data: one table from a GGUF block type to the MatMulNBits layout it maps
to exactly, and one repacking function per type.

onnxruntime's ``com.microsoft::MatMulNBits`` computes, per output row n and block b of K,
``weight = scale[n, b] * (code - 2^(bits-1))`` with no zero points: that is the layout its fast
kernels take (float zero points fall to a path that dequantizes the whole matrix on every call,
~150x slower; see FACTS.md). A GGUF type whose values are ``d * (q - offset)`` maps onto it as it
is. A type with a per-block minimum (``d * q + m``: Q4_1, Q5_1, Q4_K, Q5_K, Q2_K) maps onto it
plus an *exact correction*: per block, ``weight = scale * (code - 2^(bits-1)) + offset``, and the
offset's share of a matmul is ``sum_b blocksum_b(A) * offset[n, b]``, a small float matmul of the
activations' block sums (``[M, K/block] x [K/block, N]``) the graph adds beside MatMulNBits.

Which MatMulNBits layout each type takes (``LAYOUTS``): 4-bit for types of up to 4 bits, 8-bit
for 5 and 6 bits (a 5-bit or 6-bit code fits an 8-bit one unchanged), the type's own sub-block as
the block (32, or 16 for Q2_K, Q3_K and Q6_K). Every scale is the file's own float16 ``d`` times
its integer sub-scale, exact in float32. ``QuantizedMatrix.dequantize`` is the mapping's meaning;
the tests hold it to gguf-py's own ``dequantize`` type by type.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Final

import numpy as np

__all__ = [
    "LAYOUTS",
    "BlockLayout",
    "QuantError",
    "QuantizedMatrix",
    "quantize_int4",
    "repack",
]

Array = np.ndarray[Any, Any]

#: K-quants' super-block (ggml's QK_K).
_QK_K: Final = 256


class QuantError(ValueError):
    """A quantized tensor kvmux cannot keep as MatMulNBits (its type, its shape, its scales)."""


@dataclass(frozen=True)
class QuantizedMatrix:
    """A matrix ``[rows = N out, cols = K in]`` in MatMulNBits' layout, blocks along K."""

    #: Where the blocks came from: a GGUF type name ("Q4_1"), or "RTN" for kvmux's own.
    source: str
    bits: int
    block: int
    rows: int
    cols: int
    #: uint8 ``[rows, cols / block, block * bits / 8]``; 4-bit: a pair's first in the low nibble.
    packed: Array
    #: float32 ``[rows, cols / block]``.
    scales: Array
    #: float32 ``[rows, cols / block]``: each block's additive offset (a minimum), or None.
    offsets: Array | None

    @property
    def blocks(self) -> int:
        return self.cols // self.block

    @property
    def nbytes(self) -> int:
        extra = 0 if self.offsets is None else self.offsets.nbytes
        return int(self.packed.nbytes + self.scales.nbytes + extra)

    def codes(self) -> Array:
        """The unsigned codes, uint8 ``[rows, blocks, block]``."""
        if self.bits == 8:
            return self.packed
        low, high = self.packed & 0x0F, self.packed >> 4
        return np.stack([low, high], axis=-1).reshape(self.rows, self.blocks, self.block)

    def dequantize(self) -> Array:
        """The float32 matrix ``[rows, cols]`` this stands for (what MatMulNBits computes with)."""
        centered = self.codes().astype(np.float32) - np.float32(1 << (self.bits - 1))
        w = centered * self.scales[:, :, None]
        if self.offsets is not None:
            w += self.offsets[:, :, None]
        return w.reshape(self.rows, self.cols)

    def take_rows(self, order: Array) -> QuantizedMatrix:
        """The same matrix with its rows (output features) in ``order``."""
        return replace(
            self,
            packed=self.packed[order],
            scales=self.scales[order],
            offsets=None if self.offsets is None else self.offsets[order],
        )

    @staticmethod
    def stack(parts: list[QuantizedMatrix]) -> QuantizedMatrix | None:
        """``parts`` as one matrix, their rows one after another (q, k and v as one QKV
        projection), or None when their layouts differ (bits, block, a minimum or not)."""
        first = parts[0]
        layout = (first.bits, first.block, first.cols, first.offsets is None)
        if any((q.bits, q.block, q.cols, q.offsets is None) != layout for q in parts):
            return None
        sources = list(dict.fromkeys(q.source for q in parts))
        return replace(
            first,
            source="+".join(sources),
            rows=sum(q.rows for q in parts),
            packed=np.concatenate([q.packed for q in parts]),
            scales=np.concatenate([q.scales for q in parts]),
            offsets=None
            if first.offsets is None
            else np.concatenate([q.offsets for q in parts if q.offsets is not None]),
        )

    def astype(self, dtype: type[np.floating[Any]]) -> QuantizedMatrix:
        """Scales and offsets in ``dtype`` (MatMulNBits takes scales of the activations' type)."""
        return replace(
            self,
            scales=self.scales.astype(dtype),
            offsets=None if self.offsets is None else self.offsets.astype(dtype),
        )


# --------------------------------------------------------------------------- codes


def _pack(codes: Array, bits: int, rows: int, block: int) -> Array:
    """uint8 codes ``[n_blocks, block]`` (row-major over the matrix) -> MatMulNBits' blob."""
    codes = codes.reshape(rows, -1, block)
    if bits == 8:
        return np.ascontiguousarray(codes, dtype=np.uint8)
    pairs = codes.reshape(rows, codes.shape[1], block // 2, 2)
    return np.ascontiguousarray(pairs[..., 0] | (pairs[..., 1] << 4), dtype=np.uint8)


def _f16(raw: Array) -> Array:
    """Little-endian float16 bytes ``[n, 2]`` -> float32 ``[n, 1]``."""
    return np.ascontiguousarray(raw).view(np.float16).astype(np.float32)


_SHIFT2: Final = np.array([0, 4], np.uint8)
_SHIFT4: Final = np.array([0, 2, 4, 6], np.uint8)
_SHIFT8: Final = np.arange(8, dtype=np.uint8)


def _spread(x: Array, groups: int, shifts: Array) -> Array:
    """ggml's packing of small values into bytes: the bytes in ``groups`` runs, each run
    holding len(shifts) values a byte, value j of shift s at byte j of the run (as gguf-py's
    ``dequantize_blocks`` unpack them). Returns the shifted bytes, still to be masked."""
    n = x.shape[0]
    return (x.reshape(n, groups, 1, -1) >> shifts.reshape(1, 1, -1, 1)).reshape(n, -1)


def _nibbles(qs: Array, groups: int) -> Array:
    return _spread(qs, groups, _SHIFT2) & 0x0F


def _high_bits(qh: Array, values: int) -> Array:
    """ggml's packed fifth bits: value i's bit is bit i of a little-endian uint32 (Q5_0/Q5_1)."""
    n = qh.shape[0]
    word = np.ascontiguousarray(qh).view("<u4").reshape(n, 1)
    return ((word >> np.arange(values, dtype=np.uint32).reshape(1, -1)) & 1).astype(np.uint8)


def _k_scales(scales: Array) -> tuple[Array, Array]:
    """Q4_K / Q5_K's 12 bytes of 6-bit sub-block scales and minimums, 8 of each."""
    n = scales.shape[0]
    s = scales.reshape(n, 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc.astype(np.float32), mn.astype(np.float32)


# Each takes the file's blocks as bytes [n, type_size] and returns (codes uint8 [n * sub, block],
# scales float32 [n * sub], offsets float32 [n * sub] or None) for the layout's bits and block.
Repack = Callable[[Array], tuple[Array, Array, Array | None]]


def _q4_0(b: Array) -> tuple[Array, Array, Array | None]:
    # d * (q - 8): 4-bit as it is.
    return _nibbles(b[:, 2:], 1), _f16(b[:, :2]).ravel(), None


def _q4_1(b: Array) -> tuple[Array, Array, Array | None]:
    # d * q + m = d * (q - 8) + (8 d + m).
    d, m = _f16(b[:, :2]).ravel(), _f16(b[:, 2:4]).ravel()
    return _nibbles(b[:, 4:], 1), d, 8 * d + m


def _q5_0(b: Array) -> tuple[Array, Array, Array | None]:
    # d * (q - 16), q in 0..31: 8-bit code q + 112 = (q - 16) + 128.
    q = _nibbles(b[:, 6:], 1) | (_high_bits(b[:, 2:6], 32) << 4)
    return q + np.uint8(112), _f16(b[:, :2]).ravel(), None


def _q5_1(b: Array) -> tuple[Array, Array, Array | None]:
    # d * q + m: 8-bit code q + 128, offset m.
    q = _nibbles(b[:, 8:], 1) | (_high_bits(b[:, 4:8], 32) << 4)
    return q + np.uint8(128), _f16(b[:, :2]).ravel(), _f16(b[:, 2:4]).ravel()


def _q8_0(b: Array) -> tuple[Array, Array, Array | None]:
    # d * q, q int8: 8-bit code q + 128 (the byte with its top bit flipped).
    return b[:, 2:] ^ np.uint8(0x80), _f16(b[:, :2]).ravel(), None


def _q2_k(b: Array) -> tuple[Array, Array, Array | None]:
    # 16 sub-blocks of 16: d * (sc & 15) * q - dmin * (sc >> 4), q in 0..3; 4-bit code q.
    sc, qs = b[:, :16], b[:, 16:80]
    d, dmin = _f16(b[:, 80:82]), _f16(b[:, 82:84])
    scale = d * (sc & 0x0F).astype(np.float32)
    minimum = dmin * (sc >> 4).astype(np.float32)
    q = _spread(qs, 2, _SHIFT4) & 3
    return q.reshape(-1, 16), scale.ravel(), (8 * scale - minimum).ravel()


def _q3_k(b: Array) -> tuple[Array, Array, Array | None]:
    # 16 sub-blocks of 16: d * (sc - 32) * q, q in -4..3; 4-bit code q + 8.
    hmask, qs, raw, d = b[:, :32], b[:, 32:96], b[:, 96:108], _f16(b[:, 108:110])
    low, high = _spread(raw[:, :8], 1, _SHIFT2), _spread(raw[:, 8:], 1, _SHIFT4)
    sc = ((low & 0x0F) | ((high & 0x03) << 4)).astype(np.float32) - 32
    ql = _spread(qs, 2, _SHIFT4) & 3
    qh = _spread(hmask, 1, _SHIFT8) & 1
    # A set bit of hmask means no offset: q = ql - 4 * (1 - h), so the code is ql + 4 * h + 4.
    code = ql + (qh << 2) + np.uint8(4)
    return code.reshape(-1, 16), (d * sc).ravel(), None


def _q4_k(b: Array) -> tuple[Array, Array, Array | None]:
    # 8 sub-blocks of 32: d * sc * q - dmin * m, q in 0..15; 4-bit code q.
    d, dmin = _f16(b[:, :2]), _f16(b[:, 2:4])
    sc, mn = _k_scales(b[:, 4:16])
    scale, minimum = d * sc, dmin * mn
    return _nibbles(b[:, 16:], 4).reshape(-1, 32), scale.ravel(), (8 * scale - minimum).ravel()


def _q5_k(b: Array) -> tuple[Array, Array, Array | None]:
    # 8 sub-blocks of 32: d * sc * q - dmin * m, q in 0..31; 8-bit code q + 128.
    d, dmin = _f16(b[:, :2]), _f16(b[:, 2:4])
    sc, mn = _k_scales(b[:, 4:16])
    q = _nibbles(b[:, 48:], 4) | ((_spread(b[:, 16:48], 1, _SHIFT8) & 1) << 4)
    return (q + np.uint8(128)).reshape(-1, 32), (d * sc).ravel(), (-(dmin * mn)).ravel()


def _q6_k(b: Array) -> tuple[Array, Array, Array | None]:
    # 16 sub-blocks of 16: d * sc * (q - 32), q in 0..63; 8-bit code q + 96.
    sc = np.ascontiguousarray(b[:, 192:208]).view(np.int8).astype(np.float32)
    d = _f16(b[:, 208:210])
    q = _nibbles(b[:, :128], 2) | ((_spread(b[:, 128:192], 2, _SHIFT4) & 3) << 4)
    return (q + np.uint8(96)).reshape(-1, 16), (d * sc).ravel(), None


@dataclass(frozen=True)
class BlockLayout:
    """How one GGUF type maps onto MatMulNBits."""

    #: The GGUF type's own block (elements) and bytes per block.
    type_block: int
    type_bytes: int
    bits: int
    #: MatMulNBits' block_size: the type's sub-block.
    block: int
    #: A per-block minimum, carried as the exact correction.
    correction: bool
    repack: Repack

    def describe(self) -> str:
        return f"{self.bits}-bit, block {self.block}" + (
            " + min correction" if self.correction else ""
        )


#: GGUF type name -> its MatMulNBits layout; a type not here is refused by name.
LAYOUTS: Final[dict[str, BlockLayout]] = {
    "Q4_0": BlockLayout(32, 18, 4, 32, False, _q4_0),
    "Q4_1": BlockLayout(32, 20, 4, 32, True, _q4_1),
    "Q5_0": BlockLayout(32, 22, 8, 32, False, _q5_0),
    "Q5_1": BlockLayout(32, 24, 8, 32, True, _q5_1),
    "Q8_0": BlockLayout(32, 34, 8, 32, False, _q8_0),
    "Q2_K": BlockLayout(_QK_K, 84, 4, 16, True, _q2_k),
    "Q3_K": BlockLayout(_QK_K, 110, 4, 16, False, _q3_k),
    "Q4_K": BlockLayout(_QK_K, 144, 4, 32, True, _q4_k),
    "Q5_K": BlockLayout(_QK_K, 176, 8, 32, True, _q5_k),
    "Q6_K": BlockLayout(_QK_K, 210, 8, 16, False, _q6_k),
}


def repack(data: Array, type_name: str, rows: int, cols: int) -> QuantizedMatrix:
    """A GGUF tensor's raw blocks (``rows`` x ``cols`` values, blocks along ``cols``) as
    MatMulNBits' layout, exactly; raise :class:`QuantError` naming what does not fit."""
    layout = LAYOUTS.get(type_name)
    if layout is None:
        raise QuantError(
            f"is of type {type_name}, which has no exact MatMulNBits layout (kvmux keeps "
            f"{', '.join(LAYOUTS)}); import with --dequantize to run it as float weights"
        )
    if cols % layout.type_block:
        raise QuantError(
            f"has rows of {cols} values, which {type_name}'s blocks of {layout.type_block} "
            "do not divide"
        )
    raw = np.asarray(data).view(np.uint8).reshape(-1)
    n_blocks = rows * cols // layout.type_block
    if raw.size != n_blocks * layout.type_bytes:
        raise QuantError(
            f"holds {raw.size} bytes, expected {n_blocks * layout.type_bytes} for "
            f"{rows} x {cols} {type_name} values"
        )
    codes, scales, offsets = layout.repack(raw.reshape(n_blocks, layout.type_bytes))
    kb = cols // layout.block
    scales = scales.reshape(rows, kb)
    for what, values in (("scale", scales), ("minimum", offsets)):
        if values is not None and not np.isfinite(values).all():
            bad = int(np.argwhere(~np.isfinite(values.reshape(rows, kb)))[0][0])
            raise QuantError(f"has a {what} that is NaN or infinite (row {bad})")
    return QuantizedMatrix(
        source=type_name,
        bits=layout.bits,
        block=layout.block,
        rows=rows,
        cols=cols,
        packed=_pack(codes, layout.bits, rows, layout.block),
        scales=np.ascontiguousarray(scales, dtype=np.float32),
        offsets=None if offsets is None else np.ascontiguousarray(offsets.reshape(rows, kb)),
    )


def quantize_int4(weight: Array, block: int = 32) -> QuantizedMatrix:
    """``weight`` (float ``[rows, cols]``) as symmetric round-to-nearest int4, no zero points:
    onnxruntime's own quantizer (``quantize_matmul_4bits``), which onnxruntime-genai's builder
    calls for its default int4."""
    from onnxruntime.capi._pybind_state import quantize_matmul_4bits

    rows, cols = weight.shape
    if cols % block:
        raise QuantError(f"has rows of {cols} values, which blocks of {block} do not divide")
    kb = cols // block
    packed = np.zeros((rows, kb, block // 2), np.uint8)
    scales = np.zeros((rows, kb), np.float32)
    zero_points = np.zeros((rows, (kb + 1) // 2), np.uint8)
    # onnxruntime's quantizer takes MatMul's layout, [K, N].
    matmul = np.ascontiguousarray(np.asarray(weight, np.float32).T)
    quantize_matmul_4bits(packed, matmul, scales, zero_points, block, rows, cols, True)
    return QuantizedMatrix("RTN", 4, block, rows, cols, packed, scales, None)
