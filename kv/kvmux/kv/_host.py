"""The host backend: KV buffers in NumPy, device memory = host memory or a budget."""

from __future__ import annotations

from typing import Any

import numpy as np

from ._budget import MemoryBudget, MemoryInfo, host_memory
from ._buffers import ArrayKvCache
from ._hardmax import HardMax
from ._spec import KvSpec


class HostKvCache(ArrayKvCache):
    """KV buffers in host memory (onnxruntime's CPU provider binds them by pointer)."""

    def __init__(
        self,
        spec: KvSpec,
        hard_max: HardMax,
        *,
        min_bucket: int | None = None,
        budget: MemoryBudget | None = None,
    ) -> None:
        super().__init__(spec, hard_max, xp=np, min_bucket=min_bucket, budget=budget)

    def memory(self) -> MemoryInfo | None:
        return self.budget.memory() or host_memory()

    def ptr(self, array: Any) -> int:
        return int(array.ctypes.data)
