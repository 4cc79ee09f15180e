"""The shape of one session's KV cache and what a token of it costs."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

# bf16 has no NumPy dtype: its buffers are stored as uint16 bit patterns and
# bound to onnxruntime with the element type named here.
_STORAGE: dict[str, np.dtype[np.generic]] = {
    "float32": np.dtype(np.float32),
    "float16": np.dtype(np.float16),
    "bfloat16": np.dtype(np.uint16),
}


@dataclass(frozen=True, slots=True)
class KvSpec:
    """Layers, KV heads, head size and element type of a decoder's KV cache.

    ``mask_dtype`` is the element type of the attention mask the backend keeps
    at the capacity's width (None: no mask slot).
    """

    num_layers: int
    kv_heads: int
    head_dim: int
    dtype: str = "float32"
    mask_dtype: str | None = "int64"
    # K and V of every layer for one token; the same plus the mask slot, for one
    # token of capacity. Derived once: every allocation, release and charge reads
    # them (~1-3 us each to compute, several times a session's start and end).
    kv_bytes_per_token: int = field(init=False, repr=False, compare=False)
    bytes_per_token: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("num_layers", "kv_heads", "head_dim"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"KvSpec.{name} must be a positive integer, got {value!r}")
        if self.dtype not in _STORAGE:
            raise ValueError(f"KvSpec.dtype must be one of {sorted(_STORAGE)}, got {self.dtype!r}")
        kv = 2 * self.num_layers * self.kv_heads * self.head_dim * self.storage_dtype.itemsize
        mask = 0 if self.mask_dtype is None else np.dtype(self.mask_dtype).itemsize
        object.__setattr__(self, "kv_bytes_per_token", kv)
        object.__setattr__(self, "bytes_per_token", kv + mask)

    @property
    def storage_dtype(self) -> np.dtype[np.generic]:
        return _STORAGE[self.dtype]

    def buffer_shape(self, capacity: int) -> tuple[int, int, int, int]:
        return (1, self.kv_heads, capacity, self.head_dim)
