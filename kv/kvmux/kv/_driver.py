"""The one growth driver every backend shares: check, stage, commit, or leave untouched."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, Protocol, TypeVar

from . import failpoints
from ._backend import GroupGrowth, GrowthBackend, GrowthResult
from ._bucket import capacity_bucket
from ._budget import MemoryInfo
from ._errors import BudgetExceeded, CapacityExceeded, GrowthFailed, InjectedFault, format_bytes

S = TypeVar("S")

CAPACITY_LEVERS = (
    "shorten the prompt so it fits the hard maximum",
    "raise or drop the explicit cap (per-item max_context, kv.max_len) when it is below "
    "the model's maximum",
    "use a model with a longer declared context if the task needs it",
)
GROWTH_LEVERS = (
    "set an explicit smaller cap (per-item max_context or kv.max_len) so the session "
    "stops before this bucket",
    "shorten the prompt or lower max_new_tokens",
    "run fewer concurrent sessions (scheduler.max_active_sessions)",
    "free device memory held by other processes, or raise kv.memory_budget if one is set",
)


def _memory_now(backend: GrowthBackend[Any]) -> MemoryInfo | None:
    # Diagnostics only: a failing probe must not mask the error being reported.
    try:
        return backend.memory()
    except Exception:  # noqa: BLE001
        return None


def _memory_details(mem: MemoryInfo | None) -> dict[str, Any]:
    if mem is None:
        return {
            "device_free_bytes": None,
            "device_total_bytes": None,
            "memory_source": "unavailable",
        }
    return {
        "device_free_bytes": mem.free,
        "device_total_bytes": mem.total,
        "memory_source": mem.source,
    }


def _memory_text(mem: MemoryInfo | None) -> str:
    if mem is None:
        return "device memory unavailable"
    return f"device free {format_bytes(mem.free)} of {format_bytes(mem.total)} ({mem.source})"


def classify_cause(exc: BaseException) -> str:
    """A short, stable cause kind for metrics: out_of_memory, budget, injected, error."""
    if isinstance(exc, BudgetExceeded):
        return "budget"
    if isinstance(exc, InjectedFault):
        return "injected"
    if isinstance(exc, MemoryError) or "Failed to allocate memory" in str(exc):
        # CuPy's OutOfMemoryError is a MemoryError; onnxruntime reports its
        # allocator failures only as text in a RuntimeError.
        return "out_of_memory"
    return "error"


def capacity_exceeded(backend: GrowthBackend[Any], required: int) -> CapacityExceeded:
    hard = backend.hard_max
    mem = _memory_now(backend)
    bpt = backend.bytes_per_token
    details: dict[str, Any] = {
        "requested_tokens": required,
        "hard_max": hard.value,
        "hard_max_source": hard.source,
        "model_max": hard.model_max,
        "bytes_per_token": bpt,
        **_memory_details(mem),
        "levers": list(CAPACITY_LEVERS),
    }
    message = (
        f"KV capacity exceeded: {required} tokens requested, hard maximum {hard.describe()} "
        f"from {hard.source}; model declares max_length "
        f"{'none' if hard.model_max is None else hard.model_max}; "
        f"{format_bytes(bpt)} per token; {_memory_text(mem)}. Nothing was allocated. "
        f"To proceed: {'; '.join(CAPACITY_LEVERS)}."
    )
    return CapacityExceeded(message, details)


def _growth_failed(
    backend: GrowthBackend[Any],
    old: int,
    new: int,
    step: str,
    exc: Exception,
    group: Sequence[GrowthBackend[Any]] = (),
    mem: MemoryInfo | None = None,
) -> GrowthFailed:
    if mem is None:
        mem = _memory_now(backend)
    bpt = backend.bytes_per_token
    cause = classify_cause(exc)
    hard = backend.hard_max
    details: dict[str, Any] = {
        "old_capacity": old,
        "new_capacity": new,
        "valid_len": backend.valid_len,
        "failed_step": step,
        "cause": cause,
        "cause_message": f"{type(exc).__name__}: {exc}",
        "new_alloc_bytes": new * bpt,
        "transient_peak_bytes": (old + new) * bpt,
        "bytes_per_token": bpt,
        **_memory_details(mem),
        "hard_max": hard.value,
        "hard_max_source": hard.source,
        "session_unchanged": True,
        "levers": list(GROWTH_LEVERS),
    }
    together = ""
    if len(group) > 1:
        group_peak = sum(b.capacity + new for b in group) * bpt
        details["group_size"] = len(group)
        details["group_transient_peak_bytes"] = group_peak
        together = (
            f"It grew together with {len(group) - 1} other session(s) into the same bucket: "
            f"their transient peak together is {format_bytes(group_peak)}. "
        )
    message = (
        f"KV growth {old} -> {new} tokens failed at {step} ({cause}: {type(exc).__name__}: {exc}). "
        f"New allocation {format_bytes(new * bpt)}; transient peak "
        f"{format_bytes((old + new) * bpt)} (old + new buffers alive together) at "
        f"{format_bytes(bpt)} per token; {_memory_text(mem)}. {together}"
        f"Session state was left unchanged. To proceed: {'; '.join(GROWTH_LEVERS)}."
    )
    return GrowthFailed(message, details)


def ensure_capacity(backend: GrowthBackend[S], required: int) -> GrowthResult:
    """Make ``backend`` hold at least ``required`` tokens, growing by one transaction.

    Raises :class:`CapacityExceeded` (nothing touched) past the hard maximum, and
    :class:`GrowthFailed` when a fallible step fails; then capacity, valid
    length, buffers, mask and capture state are exactly as before, and the same
    call may be retried.
    """
    return _transact(backend, required, fork=False)


def ensure_capacity_many(
    backends: Sequence[GrowthBackend[Any]], required: Sequence[int]
) -> list[GrowthResult | CapacityExceeded | GrowthFailed]:
    """:func:`ensure_capacity` for many caches at once: each ``backends[i]`` to hold at
    least ``required[i]`` tokens; one outcome per cache, in order, raised for none.

    Caches that grow into the same new bucket through the same :class:`GroupGrowth`
    (a :class:`~kvmux.kv.CohortPool`'s rows: a cache's ``grows_with``) move together,
    as one transaction: one claim of their rows (one allocation where a new cohort is
    needed), the prefix copies batched, one mask operation per target cohort and one
    wait for the device; each failpoint (``kv.allocate``, ``kv.copy_prefix``,
    ``kv.build_mask``, ``kv.invalidate_capture``) is hit once for them. Then all
    commit (which cannot fail), their old rows freed together. A failure before
    commit leaves every cache of the group exactly as it was, and each gets its own
    :class:`GrowthFailed`, the one :func:`ensure_capacity` would raise (besides
    ``group_size`` and ``group_transient_peak_bytes``). Other caches grow one by one.

    Memory may take only some of a group: the first that fit (in the order given)
    grow, which frees their old rows, and the rest try again as a group of their
    own, while any of a round could grow; those memory refused when none could
    each get their translated :class:`GrowthFailed` (cause ``budget`` or
    ``out_of_memory``). Where rows are charged one by one (host memory), no cache
    is refused that growing the caches one by one, in this order, would have grown.

    The transient peak: a group holds its members' old rows and new rows at once,
    so its peak is the sum of theirs. Growths of every session are serialized by
    the caller (the daemon's growth lock is held around this whole call), so no
    two groups' peaks, nor a group's and a single growth's, overlap. ``required``
    values that are not non-negative integers, or a cache given twice, raise
    ``ValueError`` before anything is touched.
    """
    if len(backends) != len(required):
        raise ValueError(f"{len(backends)} caches but {len(required)} required lengths")
    if len({id(b) for b in backends}) != len(backends):
        raise ValueError("a cache is given twice")
    for need in required:
        _check_required(need)
    out: list[GrowthResult | CapacityExceeded | GrowthFailed | None] = [None] * len(backends)
    groups: dict[tuple[int, int], tuple[GroupGrowth[Any], list[int]]] = {}
    for i, (backend, need) in enumerate(zip(backends, required, strict=True)):
        hard = backend.hard_max.value
        old = backend.capacity
        seam: GroupGrowth[Any] | None = getattr(backend, "grows_with", None)
        if (hard is not None and need > hard) or need <= old or seam is None:
            try:
                out[i] = ensure_capacity(backend, need)
            except (CapacityExceeded, GrowthFailed) as exc:
                out[i] = exc
            continue
        new = capacity_bucket(need, hard, backend.min_bucket)
        groups.setdefault((id(seam), new), (seam, []))[1].append(i)
    for (_, new), (seam, members) in groups.items():
        grown = _transact_group(seam, [backends[i] for i in members], new)
        for i, outcome in zip(members, grown, strict=True):
            out[i] = outcome
    return [o for o in out if o is not None]


def _transact_group(
    seam: GroupGrowth[S], backends: list[GrowthBackend[S]], new: int
) -> list[GrowthResult | GrowthFailed]:
    """Grow ``backends`` into bucket ``new`` together, in rounds while memory takes only
    some of them (see :func:`ensure_capacity_many`)."""
    outcome: dict[int, GrowthResult | GrowthFailed] = {}
    pending = backends
    while pending:
        started = time.perf_counter()
        olds = [b.capacity for b in pending]
        step = "allocate"
        staged: list[S] = []
        copied: list[int] = []
        refused: MemoryError | None = None
        try:
            failpoints.hit("kv.allocate")
            staged, refused = seam.allocate_many(pending, new)
            if staged:
                step = "copy_prefix"
                failpoints.hit("kv.copy_prefix")
                copied = seam.copy_prefix_many(staged)
                step = "build_mask"
                failpoints.hit("kv.build_mask")
                seam.build_mask_many(staged)
                step = "invalidate_capture"
                failpoints.hit("kv.invalidate_capture")
                for backend in pending[: len(staged)]:
                    backend.invalidate_capture()
        except BaseException as exc:
            for backend, rows in zip(pending, staged, strict=False):
                backend.discard(rows)
            if not isinstance(exc, Exception):
                raise
            mem = _memory_now(pending[0])
            for backend, old in zip(pending, olds, strict=True):
                outcome[id(backend)] = _growth_failed(backend, old, new, step, exc, pending, mem)
            break
        grown = pending[: len(staged)]
        seam.commit_many(grown, staged)
        seconds = time.perf_counter() - started
        for backend, old, nbytes in zip(grown, olds, copied, strict=False):
            outcome[id(backend)] = GrowthResult(True, old, new, backend.valid_len, nbytes, seconds)
        rest = pending[len(staged) :]
        if rest and (refused is None or not staged):
            # Nothing more could be had (or the seam stopped short without saying why).
            cause = refused or MemoryError(f"{len(rest)} of {len(pending)} rows not had")
            mem = _memory_now(rest[0])
            for backend in rest:
                outcome[id(backend)] = _growth_failed(
                    backend, backend.capacity, new, "allocate", cause, pending, mem
                )
            break
        pending = rest
    return [outcome[id(b)] for b in backends]


def _check_required(required: int) -> None:
    if isinstance(required, bool) or not isinstance(required, int) or required < 0:
        raise ValueError(f"required must be a non-negative integer, got {required!r}")


class ForkBackend(GrowthBackend[S], Protocol):
    """A backend whose next growth can copy another cache's first tokens instead of its own."""

    def seed(self, source: Any, tokens: int = 0) -> None: ...


def fork_prefix(backend: ForkBackend[S], source: Any, tokens: int, required: int) -> GrowthResult:
    """Start the empty ``backend`` on ``source``'s first ``tokens`` positions (a cached
    prompt prefix), with room for ``required`` tokens.

    This is a growth: the same transaction and failpoints as
    :func:`ensure_capacity`, from capacity 0, whose prefix copy reads
    ``source``'s row (and the ``kv.fork`` failpoint besides). It commits holding
    ``tokens`` valid tokens, or raises as a growth does and leaves ``backend``
    empty. ``source`` must hold ``tokens`` and must not move or be released
    until this returns: its owner pins it.
    """
    if backend.capacity or backend.valid_len:
        raise ValueError(f"a fork starts an empty cache, not one of capacity {backend.capacity}")
    if not 0 < tokens <= required:
        raise ValueError(f"cannot fork {tokens} tokens into room for {required}")
    backend.seed(source, tokens)
    try:
        return _transact(backend, required, fork=True)
    finally:
        backend.seed(None)


def _transact(backend: GrowthBackend[S], required: int, *, fork: bool) -> GrowthResult:
    _check_required(required)
    hard = backend.hard_max.value
    if hard is not None and required > hard:
        raise capacity_exceeded(backend, required)
    old = backend.capacity
    if required <= old:
        return GrowthResult(False, old, old, backend.valid_len)

    new = capacity_bucket(required, hard, backend.min_bucket)
    started = time.perf_counter()
    step = "allocate"
    staged: S | None = None
    try:
        failpoints.hit("kv.allocate")
        staged = backend.allocate(new)
        step = "copy_prefix"
        failpoints.hit("kv.copy_prefix")
        if fork:
            failpoints.hit("kv.fork")
        copied = backend.copy_prefix(staged)
        step = "build_mask"
        failpoints.hit("kv.build_mask")
        backend.build_mask(staged)
        step = "invalidate_capture"
        failpoints.hit("kv.invalidate_capture")
        backend.invalidate_capture()
    except BaseException as exc:
        if staged is not None:
            backend.discard(staged)
        if isinstance(exc, Exception):
            raise _growth_failed(backend, old, new, step, exc) from exc
        raise
    backend.commit(staged)
    return GrowthResult(True, old, new, backend.valid_len, copied, time.perf_counter() - started)
