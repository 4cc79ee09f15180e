"""The scheduler: every item of every job becomes a decode session; sessions take turns.

One loop owns all session state. Each turn it settles what happened since the
last one (cancellations, failed growths), admits queued items up to
``scheduler.max_active_sessions`` (to the owner with the fewest active
sessions first, round-robin across that owner's jobs, so neither a big job
nor a big user starves anyone), sends every session that needs more KV to the
growth coordinator, and steps every other ready session — prefill in chunks
of ``prefill_chunk`` tokens, decode one token, or a few decode tokens while
nothing can change the ready set — in a single call to the engine's worker
thread. A failure inside one session ends that item alone.

What a refused growth means (wait, retry, preempt, fail) is the growth
coordinator's policy (:mod:`kvmux.daemon.coordinator`); the loop carries out
its verdicts.
"""

from ._admission import item_params, item_prompt
from ._jobs import ItemState, JobState, Phase, Sink
from ._prefix import prefix_stats
from ._scheduler import Scheduler

__all__ = [
    "ItemState",
    "JobState",
    "Phase",
    "Scheduler",
    "Sink",
    "item_params",
    "item_prompt",
    "prefix_stats",
]
