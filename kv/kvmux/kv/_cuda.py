"""CUDA storage for cohorts: one CuPy allocation per cohort, bound to onnxruntime by pointer."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import numpy as np

from ._budget import MemoryInfo
from ._cohort import CarvedBuffers, CohortBuffers, carve
from ._errors import KvConfigError
from ._spec import KvSpec

# cudaErrorMemoryAllocation: what a raw cudaMalloc says when the device refuses.
_CUDA_ERROR_MEMORY_ALLOCATION = 2


def cuda_unavailable_reason() -> str | None:
    """Why CUDA storage cannot run here, or None when it can.

    Importing CuPy succeeds without a driver; only a device query tells.
    """
    try:
        import cupy
    except ImportError as exc:
        return f"CuPy is not installed ({exc}); install kvmux[cuda12] or kvmux[cuda13]"
    try:
        count = int(cupy.cuda.runtime.getDeviceCount())
    except Exception as exc:  # noqa: BLE001 - CUDARuntimeError without a driver
        return f"no usable CUDA device: {type(exc).__name__}: {exc}"
    if count == 0:
        return "no CUDA device is visible (check CUDA_VISIBLE_DEVICES)"
    return None


def cuda_memory(device_id: int) -> MemoryInfo:
    """Free/total bytes of one device now, from ``cudaMemGetInfo``."""
    import cupy

    with cupy.cuda.Device(device_id):
        free, total = cupy.cuda.runtime.memGetInfo()
    return MemoryInfo(int(free), int(total), f"cudaMemGetInfo (device {device_id})")


class CudaStorage:
    """Cohorts in one device's memory: a :class:`~kvmux.kv.CohortStorage` over CuPy.

    A cohort is one ``cupy.cuda.alloc`` (CuPy's current allocator, its memory
    pool by default, which on a refusal frees its cached blocks and retries
    before raising ``OutOfMemoryError``, a ``MemoryError``), zeroed and
    synchronized before any row of it is handed out, and carved into K, V and
    mask arrays by ``memptr`` offsets. Device memory is held whole from
    allocation to free, so the pool charges the budget per cohort
    (``per_row`` False).

    Every copy and zeroing the pool issues, from whichever thread (growths,
    the model thread's compaction, the event loop's releases), runs on one
    non-blocking stream of this storage and is synchronized before the
    primitive returns: so they are ordered among themselves, never wait on
    onnxruntime's stream or another thread's default stream, and have landed
    before a commit lets the model thread run the row.
    """

    per_row = False

    def __init__(self, device_id: int = 0) -> None:
        # Reentrant: a primitive inside on_device may ask for memory() in an error path.
        self._gate = threading.RLock()
        reason = cuda_unavailable_reason()
        if reason is not None:
            raise KvConfigError(f"CUDA KV storage is unavailable: {reason}")
        import cupy

        self.xp: Any = cupy
        self.device_id = device_id
        self.source = f"cudaMemGetInfo (device {device_id})"
        with cupy.cuda.Device(device_id):
            self.stream = cupy.cuda.Stream(non_blocking=True)

    def allocate(self, spec: KvSpec, capacity: int, rows: int) -> CohortBuffers:
        cupy = self.xp
        nbytes = carve(spec, capacity, rows).nbytes
        try:
            base = cupy.cuda.alloc(nbytes)
        except cupy.cuda.runtime.CUDARuntimeError as exc:
            # An allocator set to raw cudaMalloc reports a refusal as a runtime
            # error; it is the same refusal as the pool's OutOfMemoryError.
            if getattr(exc, "status", None) != _CUDA_ERROR_MEMORY_ALLOCATION:
                raise
            raise MemoryError(f"cudaMalloc refused {nbytes} bytes: {exc}") from exc
        # Not zeroed by cudaMalloc: a row must read as zeros before its first
        # claim, and the claim may write it from another thread's stream.
        base.memset_async(0, nbytes, self.stream)
        self.stream.synchronize()

        def view(offset: int, shape: tuple[int, ...], dtype: np.dtype[Any]) -> Any:
            return cupy.ndarray(shape, dtype=dtype, memptr=base + offset)

        return CarvedBuffers(spec, capacity, rows, view, base)

    @contextmanager
    def _on_device(self) -> Iterator[None]:
        # CuPy keeps the current device and stream per thread; the gate keeps every
        # thread's device work out of a CUDA graph capture (see exclusive).
        with self._gate, self.xp.cuda.Device(self.device_id), self.stream:
            yield

    def on_device(self) -> AbstractContextManager[Any]:
        return self._on_device()

    def exclusive(self) -> AbstractContextManager[Any]:
        """onnxruntime captures graphs in ``cudaStreamCaptureModeGlobal``: a cudaMalloc,
        memset or synchronizing copy from any other thread meanwhile fails itself and
        invalidates the capture. Every device call of this storage (allocations,
        copies, zeroing, memory queries) runs under this lock, so while the model
        thread holds it for a capturing run, none of them can overlap it."""
        return self._gate

    def synchronize(self) -> None:
        self.stream.synchronize()

    def memory(self) -> MemoryInfo | None:
        with self._gate:
            return cuda_memory(self.device_id)

    def ptr(self, array: Any) -> int:
        return int(array.data.ptr)
