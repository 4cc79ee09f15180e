"""Where a cache's tokens live: which shared buffers, which row of them."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

# Never reused (unlike id()), so a runner may key its bindings by it: buffers
# freed and reallocated at the same address still get a new group.
_groups = itertools.count(1)


def new_group() -> int:
    return next(_groups)


@dataclass(frozen=True, slots=True)
class Placement:
    """A cache's row in buffers ``[rows, kv_heads, capacity, head_dim]`` shared by ``rows`` rows.

    Caches with the same ``group`` share the buffers, so adjacent rows of one
    group can be bound together (by pointer offset) and decoded in one run.
    """

    group: int
    row: int
    rows: int
    capacity: int
    keys: Sequence[Any]
    values: Sequence[Any]
    mask: Any  # [rows, capacity]
