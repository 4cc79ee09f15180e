"""kvmux.kv: the KV-cache capacity mechanism.

Capacities grow in power-of-two buckets; each growth is a transaction driven
by :func:`ensure_capacity` over a :class:`GrowthBackend`'s primitives, which
either commits completely or leaves the session exactly as it was. Ceilings
are facts (an explicit cap, the model's declared maximum), never derived from
free memory. Nothing here knows about ZeroMQ, onnxruntime or the daemon.
"""

from . import failpoints
from ._backend import GroupGrowth, GrowthBackend, GrowthResult, KvCache
from ._bucket import DEFAULT_MIN_BUCKET, MIN_BUCKET_ENV, capacity_bucket, resolve_min_bucket
from ._budget import MemoryBudget, MemoryInfo, Reclaimer, host_memory
from ._buffers import ArrayKvCache, StagedBuffers
from ._cohort import (
    CarvedBuffers,
    Cohort,
    CohortBuffers,
    CohortPool,
    CohortStorage,
    HostStorage,
    RowKvCache,
    StagedRow,
    carve,
)
from ._cuda import CudaStorage, cuda_memory, cuda_unavailable_reason
from ._driver import (
    ForkBackend,
    classify_cause,
    ensure_capacity,
    ensure_capacity_many,
    fork_prefix,
)
from ._errors import (
    BudgetExceeded,
    CapacityExceeded,
    GrowthFailed,
    InjectedFault,
    KvConfigError,
    KvError,
    format_bytes,
)
from ._hardmax import HardMax, resolve_hard_max
from ._host import HostKvCache
from ._placement import Placement
from ._prefix import (
    Holder,
    Match,
    PrefixCache,
    PrefixCacheError,
    PrefixStats,
    PromptKey,
    entry_bytes,
)
from ._spec import KvSpec

__all__ = [
    "DEFAULT_MIN_BUCKET",
    "MIN_BUCKET_ENV",
    "ArrayKvCache",
    "BudgetExceeded",
    "CapacityExceeded",
    "CarvedBuffers",
    "Cohort",
    "CohortBuffers",
    "CohortPool",
    "CohortStorage",
    "CudaStorage",
    "ForkBackend",
    "GroupGrowth",
    "GrowthBackend",
    "GrowthFailed",
    "GrowthResult",
    "HardMax",
    "Holder",
    "HostKvCache",
    "HostStorage",
    "InjectedFault",
    "KvCache",
    "KvConfigError",
    "KvError",
    "KvSpec",
    "Match",
    "MemoryBudget",
    "MemoryInfo",
    "Placement",
    "PrefixCache",
    "PrefixCacheError",
    "PrefixStats",
    "PromptKey",
    "Reclaimer",
    "RowKvCache",
    "StagedBuffers",
    "StagedRow",
    "capacity_bucket",
    "carve",
    "classify_cause",
    "cuda_memory",
    "cuda_unavailable_reason",
    "ensure_capacity",
    "ensure_capacity_many",
    "entry_bytes",
    "failpoints",
    "fork_prefix",
    "format_bytes",
    "host_memory",
    "resolve_hard_max",
    "resolve_min_bucket",
]
