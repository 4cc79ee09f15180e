"""One session's own KV buffers over any NumPy-like array module (HostKvCache is its instance)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ._bucket import resolve_min_bucket
from ._budget import MemoryBudget, MemoryInfo
from ._hardmax import HardMax
from ._placement import Placement, new_group
from ._spec import KvSpec


@dataclass(slots=True)
class StagedBuffers:
    """Buffers of a growth in progress, not yet visible to the session."""

    capacity: int
    keys: list[Any]
    values: list[Any]
    mask: Any
    nbytes: int
    bytes_copied: int = 0
    released: bool = field(default=False)


class KvState:
    """What the growth driver and the scheduler read of any cache, whatever its layout."""

    spec: KvSpec
    _hard_max: HardMax
    _min_bucket: int
    _capacity: int
    _valid_len: int
    _nbytes: int

    # -- state the driver reads ------------------------------------------
    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def valid_len(self) -> int:
        return self._valid_len

    @property
    def bytes_per_token(self) -> int:
        return self.spec.bytes_per_token

    @property
    def hard_max(self) -> HardMax:
        return self._hard_max

    @property
    def min_bucket(self) -> int:
        return self._min_bucket

    @property
    def nbytes(self) -> int:
        """Bytes of the live buffers (K, V and mask)."""
        return self._nbytes


class ArrayKvCache(KvState):
    """Per-layer K and V buffers ``[1, kv_heads, capacity, head_dim]`` plus a mask.

    ``xp`` is NumPy or CuPy: slicing assignment is a strided host copy in one
    and a device-to-device copy in the other, so the primitives are written
    once. A new cache holds nothing (capacity 0); its first
    :func:`~kvmux.kv.ensure_capacity` allocates the bucket of the prompt, so the
    first allocation and every growth take the same transactional path.

    The mask is an int64 row ``[1, capacity]``: ones on valid tokens, zeros
    after, so it can be bound as the model's ``attention_mask`` at the
    capacity's width.
    """

    memory_source = "array"

    def __init__(
        self,
        spec: KvSpec,
        hard_max: HardMax,
        *,
        xp: Any,
        min_bucket: int | None = None,
        budget: MemoryBudget | None = None,
    ) -> None:
        self.spec = spec
        self._hard_max = hard_max
        self._min_bucket = resolve_min_bucket(min_bucket)
        self.budget = budget if budget is not None else MemoryBudget()
        self.xp = xp
        self._capacity = 0
        self._valid_len = 0
        self._nbytes = 0
        self.keys: list[Any] = []
        self.values: list[Any] = []
        self.mask: Any = xp.zeros((1, 0), dtype=spec.mask_dtype or "int64")
        # Bumped whenever buffer addresses change; a captured graph recorded at
        # an older generation must not be replayed.
        self.capture_generation = 0
        self.capture_valid = False
        self._group = new_group()

    # -- the session's own bookkeeping ------------------------------------
    def advance(self, n: int) -> None:
        """Count ``n`` more tokens as valid (their rows are being written by a run)."""
        end = self._valid_len + n
        if n < 0 or end > self._capacity:
            raise ValueError(
                f"cannot advance {n} tokens: valid {self._valid_len}, capacity {self._capacity}"
            )
        self.mask[0, self._valid_len : end] = 1
        self._valid_len = end

    def counted(self, n: int) -> None:
        """Count ``n`` tokens whose mask columns a runner has written itself."""
        end = self._valid_len + n
        if n < 0 or end > self._capacity:
            raise ValueError(
                f"cannot count {n} tokens: valid {self._valid_len}, capacity {self._capacity}"
            )
        self._valid_len = end

    def truncate(self, length: int) -> None:
        """Forget tokens past ``length`` (a run that failed after :meth:`advance`)."""
        if not 0 <= length <= self._valid_len:
            raise ValueError(f"cannot truncate to {length}: valid {self._valid_len}")
        self.mask[0, length : self._valid_len] = 0
        self._valid_len = length

    def release(self) -> None:
        """Free every buffer and its budget charge; the cache is empty afterwards."""
        self.budget.release(self._nbytes)
        self.keys, self.values = [], []
        self.mask = self.xp.zeros((1, 0), dtype=self.spec.mask_dtype or "int64")
        self._capacity = self._valid_len = self._nbytes = 0
        self.capture_valid = False
        self.capture_generation += 1
        self._group = new_group()

    # -- growth primitives -----------------------------------------------
    def allocate(self, new_capacity: int) -> StagedBuffers:
        spec = self.spec
        nbytes = new_capacity * spec.bytes_per_token
        self.budget.reserve(nbytes)
        try:
            shape = spec.buffer_shape(new_capacity)
            dtype = spec.storage_dtype
            # Zeroed at allocation, so copy_prefix writes only the prefix: the
            # tail is zero for free (calloc'd pages on the host are mapped
            # lazily; CuPy memsets on device). GQA never reads past the valid
            # length, but a mask-based attention would.
            keys = [self.xp.zeros(shape, dtype=dtype) for _ in range(spec.num_layers)]
            values = [self.xp.zeros(shape, dtype=dtype) for _ in range(spec.num_layers)]
            mask = self.xp.zeros((1, new_capacity), dtype=spec.mask_dtype or "int64")
        except BaseException:
            self.budget.release(nbytes)
            raise
        return StagedBuffers(new_capacity, keys, values, mask, nbytes)

    def copy_prefix(self, staged: StagedBuffers) -> int:
        n = self._valid_len
        # A cache that never allocated (capacity 0) has no old buffers to copy.
        olds = self.keys + self.values or [None] * (2 * self.spec.num_layers)
        if n:
            for old, new in zip(olds, staged.keys + staged.values, strict=True):
                new[:, :, :n, :] = old[:, :, :n, :]
        staged.bytes_copied = n * self.spec.kv_bytes_per_token
        return staged.bytes_copied

    def build_mask(self, staged: StagedBuffers) -> None:
        staged.mask[0, : self._valid_len] = 1

    def invalidate_capture(self) -> None:
        self.capture_valid = False

    def commit(self, staged: StagedBuffers) -> None:
        old_nbytes = self._nbytes
        self.keys, self.values, self.mask = staged.keys, staged.values, staged.mask
        self._capacity = staged.capacity
        self._nbytes = staged.nbytes
        self.capture_generation += 1
        self._group = new_group()
        self.budget.release(old_nbytes)

    def discard(self, staged: StagedBuffers) -> None:
        if not staged.released:
            staged.released = True
            staged.keys.clear()
            staged.values.clear()
            self.budget.release(staged.nbytes)

    def memory(self) -> MemoryInfo | None:
        return self.budget.memory()

    def placement(self) -> Placement:
        """Its own buffers, one row: a group of one that a runner binds alone."""
        return Placement(self._group, 0, 1, self._capacity, self.keys, self.values, self.mask)

    # -- addresses for binding by pointer ----------------------------------
    def ptr(self, array: Any) -> int:
        """The address of an array of this cache's module (host or device)."""
        raise NotImplementedError

    def key_ptr(self, layer: int) -> int:
        return self.ptr(self.keys[layer])

    def value_ptr(self, layer: int) -> int:
        return self.ptr(self.values[layer])

    def mask_ptr(self) -> int:
        return self.ptr(self.mask)
