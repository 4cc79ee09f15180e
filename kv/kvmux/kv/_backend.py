"""The growth seam: the primitives a KV backend implements, and nothing more."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from ._budget import MemoryInfo
from ._hardmax import HardMax
from ._placement import Placement

Staged = TypeVar("Staged")


class GrowthBackend(Protocol[Staged]):
    """A KV cache as the growth driver sees it.

    A backend implements primitives, never policy: bucket choice, the hard-max
    check, step order and failure translation all live in
    :func:`kvmux.kv.ensure_capacity`. ``allocate`` through
    ``invalidate_capture`` may fail; ``commit`` and ``discard`` must not.
    """

    @property
    def capacity(self) -> int: ...

    @property
    def valid_len(self) -> int: ...

    @property
    def bytes_per_token(self) -> int: ...

    @property
    def hard_max(self) -> HardMax: ...

    @property
    def min_bucket(self) -> int: ...

    def allocate(self, new_capacity: int) -> Staged:
        """Stage buffers of ``new_capacity`` tokens; touch nothing live."""
        ...

    def copy_prefix(self, staged: Staged) -> int:
        """Copy ``staged``'s valid tokens from its source into it (the cache's own valid
        prefix, or for a fork another row's first tokens); return bytes copied."""
        ...

    def build_mask(self, staged: Staged) -> None:
        """Build the attention mask at the staged width."""
        ...

    def invalidate_capture(self) -> None:
        """Drop any captured graph bound to the live buffers' addresses."""
        ...

    def commit(self, staged: Staged) -> None:
        """Swap in ``staged`` by plain assignment (its valid length with it), then
        release the old buffers."""
        ...

    def discard(self, staged: Staged) -> None:
        """Release buffers staged by a growth that did not commit."""
        ...

    def memory(self) -> MemoryInfo | None:
        """Device free/total now, or None when it cannot be measured."""
        ...


class GroupGrowth(Protocol[Staged]):
    """Primitives that move several caches into one new bucket at once (one claim, batched
    copies, one mask operation per target buffer): what :func:`kvmux.kv.ensure_capacity_many`
    drives. Each stages, copies or builds for every cache it is given or raises having
    touched nothing live; what it staged is committed by :meth:`commit_many`, or dropped
    by the caches' own :meth:`GrowthBackend.discard`.
    """

    def allocate_many(
        self, backends: Sequence[Any], new_capacity: int
    ) -> tuple[list[Staged], MemoryError | None]:
        """Stage ``new_capacity`` for as many of ``backends``, in order, as memory allows:
        the staged (for ``backends[:len(staged)]``) and, when some were left out, the
        refusal that left them out."""
        ...

    def copy_prefix_many(self, staged: Sequence[Staged]) -> list[int]:
        """Copy each staged cache's valid prefix into it; bytes copied, per staged."""
        ...

    def build_mask_many(self, staged: Sequence[Staged]) -> None:
        """Build every staged mask, then wait until the copies and masks have landed."""
        ...

    def commit_many(self, backends: Sequence[Any], staged: Sequence[Staged]) -> None:
        """Each of ``backends`` swaps in its staged buffers (as its own
        :meth:`GrowthBackend.commit`), then their old buffers are released; must not fail."""
        ...


class KvCache(GrowthBackend[Any], Protocol):
    """A session's KV cache as the engine uses it, whatever its layout (its own
    buffers, or a row of a cohort)."""

    capture_valid: bool
    capture_generation: int

    @property
    def nbytes(self) -> int: ...

    @property
    def keys(self) -> list[Any]: ...

    @property
    def values(self) -> list[Any]: ...

    @property
    def mask(self) -> Any: ...

    def advance(self, n: int) -> None: ...

    def counted(self, n: int) -> None: ...

    def truncate(self, length: int) -> None: ...

    def release(self) -> None: ...

    def placement(self) -> Placement: ...

    def ptr(self, array: Any) -> int: ...


@dataclass(frozen=True, slots=True)
class GrowthResult:
    """What one :func:`ensure_capacity` call did."""

    grew: bool
    old_capacity: int
    new_capacity: int
    valid_len: int
    bytes_copied: int = 0
    seconds: float = 0.0
