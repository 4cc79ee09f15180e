"""A backend that records calls and fails on demand: the seam's fault injection.

It implements :class:`kvmux.kv.GrowthBackend` like the real caches do; its
buffers are plain Python lists so a test can see identity and contents.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvmux.kv import GrowthBackend, HardMax, MemoryInfo


@dataclass
class Staged:
    capacity: int
    rows: list[int]
    mask: list[int] = field(default_factory=list)


class Boom(RuntimeError):
    pass


class RecordingBackend:
    def __init__(self, capacity: int = 4, valid_len: int = 3, hard_max: int | None = 1024) -> None:
        self._capacity = capacity
        self._valid_len = valid_len
        self.rows = [100 + i for i in range(valid_len)] + [0] * (capacity - valid_len)
        self.mask = [1] * valid_len + [0] * (capacity - valid_len)
        self.capture_valid = True
        self.calls: list[str] = []
        self.fail_at: set[str] = set()
        self.discarded: list[Staged] = []
        self._hard_max = HardMax(hard_max, f"explicit cap {hard_max}", 2048)

    # state
    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def valid_len(self) -> int:
        return self._valid_len

    @property
    def bytes_per_token(self) -> int:
        return 64

    @property
    def hard_max(self) -> HardMax:
        return self._hard_max

    @property
    def min_bucket(self) -> int:
        return 4

    def _step(self, name: str) -> None:
        self.calls.append(name)
        if name in self.fail_at:
            raise Boom(f"{name} refused")

    # primitives
    def allocate(self, new_capacity: int) -> Staged:
        self._step("allocate")
        return Staged(new_capacity, [0] * new_capacity)

    def copy_prefix(self, staged: Staged) -> int:
        self._step("copy_prefix")
        staged.rows[: self._valid_len] = self.rows[: self._valid_len]
        return self._valid_len * 60

    def build_mask(self, staged: Staged) -> None:
        self._step("build_mask")
        staged.mask = [1] * self._valid_len + [0] * (staged.capacity - self._valid_len)

    def invalidate_capture(self) -> None:
        self._step("invalidate_capture")
        self.capture_valid = False

    def commit(self, staged: Staged) -> None:
        self.calls.append("commit")
        self.rows, self.mask, self._capacity = staged.rows, staged.mask, staged.capacity

    def discard(self, staged: Staged) -> None:
        self.calls.append("discard")
        self.discarded.append(staged)

    def memory(self) -> MemoryInfo | None:
        return MemoryInfo(free=1000, total=4000, source="recording")

    def snapshot(self) -> tuple[int, int, int, int, list[int], list[int], bool]:
        return (
            self._capacity,
            self._valid_len,
            id(self.rows),
            id(self.mask),
            list(self.rows),
            list(self.mask),
            self.capture_valid,
        )


def _conforms(backend: GrowthBackend[Staged]) -> None:
    """Type-checked proof (mypy) that the fake implements the real Protocol."""


_conforms(RecordingBackend())
