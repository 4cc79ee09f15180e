"""Prefix sharing in the turn loop: which cached prefix an item starts from, and which
items wait for another's prefill of their prefix instead of repeating it.

The cache itself (keys, holders, what is kept, eviction) is
:class:`kvmux.kv.PrefixCache`; this module is the loop's side of it. An item is
looked up when it leaves the queue. If live sessions are prefilling blocks of
its prompt beyond what is ready (a batch's first wave, ``n`` > 1 choices of
one prompt, a list of prompts that begin alike), it waits, holding an active
slot but no memory, until they get there or stop (parked, preempted, gone);
then it opens like any item, on a copy of what is ready. Every opening item
registers its own prompt, so the next item can wait for it.

Keys carry the owner unless ``kv.prefix_cache_scope = "shared"``: by default
an owner's items never match another owner's prompts.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import structlog

from kvmux.client.protocol import PrefixCacheStats
from kvmux.kv import Holder, PrefixCache, PromptKey, RowKvCache

from ..engine import DecodeSession
from ._jobs import ItemState

log = structlog.get_logger("kvmux.scheduler")

# Phases of an item whose session is getting on with its prefill (or about to).
_PROGRESSING = frozenset({"opening", "active", "growing"})


@dataclass(eq=False, slots=True)
class ItemPrefix:
    """An item's prompt as the cache matches it; while it waits, whose prefill it waits
    for and how far; while its session lives, the holder of its prompt."""

    key: PromptKey
    holder: Holder | None = None
    waiting_on: tuple[Holder, ...] = ()
    target: int = 0


@dataclass(frozen=True, slots=True)
class Start:
    """Where an opening item may start: on a copy of at most ``holder``'s first ``tokens``
    (the session takes what keeps its logits exact: DecodeSession.fork_tokens)."""

    holder: Holder
    key: PromptKey
    tokens: int


class PrefixPlanner:
    """The loop's bookkeeping for the prefix cache: live holders' items and waiters.

    Only the loop calls it, except :meth:`start`, which the opening call makes
    (on the model thread or the loop) while the loop changes nothing."""

    def __init__(self, cache: PrefixCache | None) -> None:
        self.cache = cache
        self._items: dict[Holder, ItemState] = {}
        self.waiting: list[ItemState] = []

    def _plan(self, state: ItemState, cache: PrefixCache) -> ItemPrefix | None:
        """``state``'s prompt as the cache matches it (worked out once: a preempted item
        keeps it)."""
        if state.prefix is None and state.admission is not None:
            salt = state.job.owner if cache.scope == "owner" else ""
            state.prefix = ItemPrefix(cache.key(state.admission.prompt_ids, salt))
        return state.prefix

    # -- leaving the queue ---------------------------------------------------------
    def waits(self, state: ItemState) -> bool:
        """Whether ``state``, just out of the queue, waits for another's prefill of its
        prefix (else the loop opens it now: :meth:`opening`)."""
        cache = self.cache
        if cache is None:
            return False
        fresh = state.prefix is None
        plan = self._plan(state, cache)
        if plan is None:
            return False
        # Every item is counted, so the hit rate is over all prompt tokens; the choices of
        # one line (consecutive items from its first) ask as one.
        asker = (state.job.job_id, state.index - state.choice)
        match = cache.lookup(plan.key, count=fresh, asker=asker)
        if not plan.key.chain:
            return False
        waiting_on = tuple(h for h in match.prefilling if self._progressing(h))
        if not waiting_on:
            return False
        plan.waiting_on, plan.target = waiting_on, match.pending
        self.waiting.append(state)
        cache.stats.waits += 1
        log.debug(
            "prefix_wait",
            job_id=state.job.job_id,
            session_id=state.session_id,
            ready_tokens=match.tokens,
            pending_tokens=match.pending,
        )
        return True

    def ready_waiters(self) -> Iterator[ItemState]:
        """Waiting items that need wait no longer, oldest first: what they waited for is
        ready, or whoever was prefilling it stopped (parked, preempted, gone). Each is
        looked up as it comes, so one the caller opened (:meth:`opening`) is seen by
        the next: when a stopped prefill releases several, the first prefills and the
        rest wait for it."""
        cache = self.cache
        if cache is None:
            return
        for state in list(self.waiting):
            plan = state.prefix
            assert plan is not None
            match = cache.lookup(plan.key, count=False)
            waiting_on = tuple(h for h in match.prefilling if self._progressing(h))
            plan.waiting_on, plan.target = waiting_on, match.pending
            if not waiting_on:
                yield state

    def opening(self, state: ItemState) -> None:
        """``state`` opens now: it waits no more, and its prompt is registered, so that
        the items after it can wait for its prefill."""
        if state in self.waiting:
            self.waiting.remove(state)
        cache, plan = self.cache, state.prefix
        if cache is None or plan is None or not plan.key.chain or plan.holder is not None:
            return
        plan.waiting_on, plan.target = (), 0
        holder = cache.register(plan.key)
        plan.holder = holder
        if holder is not None:
            self._items[holder] = state

    def any_waiter_ready(self) -> bool:
        """Whether some waiting item could start now. Read on the model thread between
        the chunks of a run (the loop changes nothing it reads meanwhile); cheap."""
        cache = self.cache
        if cache is None:
            return False
        block = cache.block
        for state in tuple(self.waiting):
            plan = state.prefix
            assert plan is not None
            for h in plan.waiting_on:
                if h.ready_tokens(block) >= plan.target or not self._progressing(h):
                    return True
        return False

    def _progressing(self, holder: Holder) -> bool:
        item = self._items.get(holder)
        return item is not None and item.phase in _PROGRESSING

    # -- opening ---------------------------------------------------------------------
    def start(self, state: ItemState) -> Start | None:
        """The prefix ``state`` starts on, looked up now (under the growth lock)."""
        cache, plan = self.cache, state.prefix
        if cache is None or plan is None or not plan.key.chain:
            return None
        match = cache.lookup(plan.key, count=False)
        holder = match.holder
        if holder is None or holder is plan.holder:
            return None
        tokens = min(match.tokens, holder.exact)
        return Start(holder, plan.key, tokens) if tokens > 0 else None

    def copy_tokens(self, batch: list[ItemState]) -> int:
        """About how many tokens opening ``batch`` now would copy from cached prefixes."""
        total = 0
        for state in batch:
            start = self.start(state)
            total += 0 if start is None else start.tokens
        return total

    def opened(self, state: ItemState, session: DecodeSession | None) -> None:
        """``state``'s session exists now (its blocks become ready as it prefills), or
        it could not be opened (its prompt is forgotten)."""
        plan = state.prefix
        if self.cache is None or plan is None or plan.holder is None:
            return
        if session is not None and isinstance(session.cache, RowKvCache):
            self.cache.attach(plan.holder, session.cache, session.exact_prefix())
            return
        holder, plan.holder = plan.holder, None
        self._items.pop(holder, None)
        self.cache.leave(holder, keep=False)

    # -- endings -----------------------------------------------------------------------
    def leave(self, state: ItemState, session: DecodeSession | None, *, keep: bool) -> None:
        """``state`` ends or is preempted: its session's KV is released, or kept by the
        cache (``keep``, when the cache wants what it prefilled)."""
        if state in self.waiting:
            self.waiting.remove(state)
        plan = state.prefix
        holder = None if plan is None else plan.holder
        if holder is None or self.cache is None:
            if session is not None:
                session.release()
            return
        assert plan is not None
        plan.holder = None
        self._items.pop(holder, None)
        if self.cache.leave(holder, keep=keep) and session is not None:
            session.release()


def prefix_stats(cache: PrefixCache | None) -> PrefixCacheStats | None:
    """The cache as ``kvmux status`` shows it."""
    if cache is None:
        return None
    st = cache.stats
    return PrefixCacheStats(
        scope=cache.scope,
        block=cache.block,
        max_bytes=cache.max_bytes,
        entries=st.entries,
        bytes=cache.bytes,
        lookups=st.lookups,
        prompt_tokens=st.prompt_tokens,
        hits=st.hits,
        hit_tokens=st.hit_tokens,
        fork_failures=st.fork_failures,
        waits=st.waits,
        kept=st.kept,
        evictions=st.evictions,
    )
