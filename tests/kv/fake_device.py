"""Device-like cohort storage over NumPy: the CUDA storage's semantics, failing on demand.

It implements :class:`kvmux.kv.CohortStorage` as :class:`kvmux.kv.CudaStorage`
does — one allocation per cohort, held whole until the cohort is dropped
(``per_row`` False), carved by :func:`kvmux.kv.carve` — but over host bytes,
so the pool's device path (per-cohort charging, doubling rows, halving on a
refusal, the translated failure) runs on CPU. A real device cannot refuse on
demand; this one refuses past ``total`` bytes, or at the capacities in
``refuse_capacities``, with a ``MemoryError`` as CuPy's ``OutOfMemoryError`` is.
"""

from __future__ import annotations

import threading
import weakref
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import numpy as np

from kvmux.kv import CarvedBuffers, CohortBuffers, KvSpec, MemoryInfo, carve


class FakeOutOfMemory(MemoryError):
    """The fake device's refusal, a MemoryError like CuPy's OutOfMemoryError."""


class FakeDeviceStorage:
    xp = np
    source = "fake device"
    per_row = False

    def __init__(self, total: int = 1 << 30, refuse_capacities: set[int] | None = None) -> None:
        self.total = total
        self.refuse_capacities = refuse_capacities or set()
        self.held = 0
        self.allocated_rows: list[tuple[int, int]] = []  # (capacity, rows) of each allocation
        self.syncs = 0
        self.depth = 0  # inside on_device()
        # CudaStorage's capture gate: every device call of the storage holds it.
        self.gate = threading.RLock()

    def allocate(self, spec: KvSpec, capacity: int, rows: int) -> CohortBuffers:
        assert self.depth > 0, "allocations must name their device"
        nbytes = carve(spec, capacity, rows).nbytes
        if capacity in self.refuse_capacities or self.held + nbytes > self.total:
            raise FakeOutOfMemory(
                f"Out of memory allocating {nbytes:,} bytes "
                f"(allocated so far: {self.held:,} bytes)."
            )
        # Device memory comes back dirty; CudaStorage zeroes it (memset) before use.
        raw = np.full(nbytes, 0xA5, dtype=np.uint8)
        raw[:] = 0
        self.held += nbytes
        self.allocated_rows.append((capacity, rows))
        weakref.finalize(raw, self._freed, nbytes)

        def view(offset: int, shape: tuple[int, ...], dtype: np.dtype[Any]) -> Any:
            return np.ndarray(shape, dtype=dtype, buffer=raw, offset=offset)

        return CarvedBuffers(spec, capacity, rows, view, raw)

    def _freed(self, nbytes: int) -> None:
        self.held -= nbytes

    def on_device(self) -> AbstractContextManager[Any]:
        return self._device()

    def exclusive(self) -> AbstractContextManager[Any]:
        return self.gate

    @contextmanager
    def _device(self) -> Any:
        with self.gate:
            self.depth += 1
            try:
                yield self
            finally:
                self.depth -= 1

    def synchronize(self) -> None:
        self.syncs += 1

    def memory(self) -> MemoryInfo | None:
        with self.gate:
            return MemoryInfo(self.total - self.held, self.total, self.source)

    def ptr(self, array: Any) -> int:
        return int(array.ctypes.data)
