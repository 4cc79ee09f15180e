"""The CUDA backend: KV buffers in CuPy device memory, bound to onnxruntime by pointer."""

from __future__ import annotations

from typing import Any

from ._budget import MemoryBudget, MemoryInfo
from ._buffers import ArrayKvCache, StagedBuffers
from ._errors import KvConfigError
from ._hardmax import HardMax
from ._spec import KvSpec


def cuda_unavailable_reason() -> str | None:
    """Why :class:`CudaKvCache` cannot run here, or None when it can.

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


class CudaKvCache(ArrayKvCache):
    """KV buffers in CuPy device memory; prefix copies are device-to-device.

    CuPy's ``OutOfMemoryError`` is a ``MemoryError``, so the shared driver
    translates a device refusal into :class:`~kvmux.kv.GrowthFailed` like any
    other allocation failure.
    """

    def __init__(
        self,
        spec: KvSpec,
        hard_max: HardMax,
        *,
        device_id: int = 0,
        min_bucket: int | None = None,
        budget: MemoryBudget | None = None,
    ) -> None:
        reason = cuda_unavailable_reason()
        if reason is not None:
            raise KvConfigError(f"CudaKvCache is unavailable: {reason}")
        import cupy

        self.device_id = device_id
        self._cupy: Any = cupy
        with cupy.cuda.Device(device_id):
            super().__init__(spec, hard_max, xp=cupy, min_bucket=min_bucket, budget=budget)

    # The daemon grows sessions on a thread other than the one that runs the
    # model, so every primitive names its device, and the copy is complete
    # before the driver commits: the next run may read the buffers from
    # onnxruntime's own stream.
    def allocate(self, new_capacity: int) -> Any:
        with self._cupy.cuda.Device(self.device_id):
            return super().allocate(new_capacity)

    def copy_prefix(self, staged: StagedBuffers) -> int:
        with self._cupy.cuda.Device(self.device_id):
            copied = super().copy_prefix(staged)
            self._cupy.cuda.get_current_stream().synchronize()
        return copied

    def build_mask(self, staged: StagedBuffers) -> None:
        with self._cupy.cuda.Device(self.device_id):
            super().build_mask(staged)
            self._cupy.cuda.get_current_stream().synchronize()

    def memory(self) -> MemoryInfo | None:
        budget = self.budget.memory()
        if budget is not None:
            return budget
        return cuda_memory(self.device_id)

    def ptr(self, array: Any) -> int:
        return int(array.data.ptr)
