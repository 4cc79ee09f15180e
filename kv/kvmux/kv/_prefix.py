"""The prefix cache: prompt KV kept for reuse, matched on whole blocks of tokens.

A prompt is cut into whole blocks of ``block`` tokens; block i's key hashes
block i-1's key with block i's tokens (vLLM's block hashes), so a key stands
for every token before it too. The first key also hashes a salt (the owner,
unless the cache is shared) and a secret drawn at start, so one owner's keys
say nothing about another's prompts and cannot be computed outside.

A *holder* is a row whose first whole blocks hold some prompt's KV:

- a live session's own row, from the moment it opens (its blocks become
  ready as its prefill passes them; the cache charges nothing for it);
- a row the cache keeps after that session finished, charged to the KV
  budget, in LRU order, within ``max_bytes``.

A new session whose prompt begins with ready blocks starts on a copy of them:
:func:`kvmux.kv.fork_prefix`, the growth transaction with another row as the
copy's source. The source is pinned while it copies, so neither a finished
session's release nor an eviction can take it away meanwhile.

What is kept: the blocks of a finished prompt that another asker looked up too
(a prefix that many lines or jobs share), up to what its session had
prefilled; nothing already kept by another row. A prompt nobody else asked
for is not copied anywhere, so a workload without sharing pays only for the
hashing; nor is one only the ``n`` choices of its own line asked for (they
copy it from the live session that prefills it, and nothing later will). Kept
rows live in a pool of their own (whole blocks, no bucket rounding), so they
never sit between the live rows one run decodes together.

Kept rows are the budget's :class:`~kvmux.kv.Reclaimer`: an allocation the
budget or the device refuses first takes memory back from them (the least
recently used first), so the cache never costs a session its room.
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from ._backend import GrowthResult
from ._budget import MemoryBudget
from ._cohort import CohortPool, CohortStorage, RowKvCache
from ._driver import fork_prefix
from ._errors import KvError
from ._hardmax import HardMax
from ._spec import KvSpec

Scope = Literal["owner", "shared"]

# Block keys whose askers are noted (what decides that a block is shared):
# 16-byte keys, so about 100 bytes each with the dict's own.
_SEEN_MAX = 1 << 17
# A block asked for by two askers.
_SHARED = object()


@dataclass(frozen=True, slots=True)
class PromptKey:
    """A prompt as the cache matches it: its whole blocks, their chained keys, and the
    most tokens a fork may copy (all but the last: the last token is run so that its
    logits exist)."""

    tokens: np.ndarray  # int32, the prompt's whole blocks
    chain: tuple[bytes, ...]
    limit: int


@dataclass(eq=False, slots=True)
class Holder:
    """A row whose first whole blocks hold one prompt's KV: a live session's, or one the
    cache keeps. ``cache`` is None until the live session's first row is allocated."""

    tokens: np.ndarray
    chain: tuple[bytes, ...]
    cache: RowKvCache | None = None
    #: Leading tokens whose KV a whole prompt's prefill computes alike (see
    #: DecodeSession.exact_prefix); a fork copies no more than these.
    exact: int = 0
    kept: bool = False
    length: int = 0  # tokens a kept row serves (whole blocks)
    pins: int = 0
    gone: bool = False  # dropped while pinned: its row goes at the last unpin

    def ready_tokens(self, block: int) -> int:
        """Whole-block tokens whose KV the row holds now."""
        if self.kept:
            return self.length
        cache = self.cache
        if cache is None:
            return 0
        return min(cache.valid_len, len(self.tokens)) // block * block


@dataclass(frozen=True, slots=True)
class Match:
    """What a lookup found: ``tokens`` a fork could copy now from ``holder``, and
    ``pending`` tokens that the live holders ``prefilling`` will hold once their
    prefill passes them (more than ``tokens`` only while someone prefills them)."""

    tokens: int = 0
    holder: Holder | None = None
    pending: int = 0
    prefilling: tuple[Holder, ...] = ()


@dataclass(slots=True)
class PrefixStats:
    """The cache's tallies since start, and what it holds now."""

    lookups: int = 0  # items looked up
    prompt_tokens: int = 0  # their prompt tokens
    hits: int = 0  # items that started on a copy
    hit_tokens: int = 0  # tokens copied instead of prefilled
    fork_failures: int = 0  # copies that failed (the item prefilled it all)
    waits: int = 0  # items that waited for another's prefill
    kept: int = 0  # rows kept after their session finished
    evictions: int = 0
    entries: int = 0


class PrefixCacheError(KvError):
    """A prefix cache used against its contract (a programming error, not memory)."""


class PrefixCache:
    """Holders of prompt KV, matched on whole blocks; see the module's docstring.

    Thread-safe: lookups, forks and keeps run on the event loop or the model's
    thread, reclaims on whichever thread an allocation was refused.
    """

    def __init__(
        self,
        spec: KvSpec,
        *,
        budget: MemoryBudget,
        storage: CohortStorage | None = None,
        block: int = 16,
        max_bytes: int = 1 << 30,
        scope: Scope = "owner",
    ) -> None:
        if block < 1 or max_bytes < 0:
            raise ValueError(f"block must be >= 1 and max_bytes >= 0, got {block}, {max_bytes}")
        self.spec = spec
        self.block = block
        self.max_bytes = max_bytes
        self.scope: Scope = scope
        self.budget = budget
        # Kept rows are sized to their whole blocks (a hard max of exactly that
        # many tokens): no bucket floor rounds them up.
        self.pool = CohortPool(spec, storage=storage, min_bucket=1, budget=budget)
        self._secret = os.urandom(16)
        self._index: dict[bytes, dict[Holder, None]] = {}
        self._lru: OrderedDict[Holder, None] = OrderedDict()  # kept rows, oldest use first
        self._seen: OrderedDict[bytes, Hashable] = OrderedDict()
        self._unsettled: list[Holder] = []
        self._bytes = 0
        self._lock = threading.Lock()
        self.stats = PrefixStats()
        budget.reclaimer = self

    # -- keys and lookups ----------------------------------------------------------
    def key(self, prompt: Sequence[int], salt: str = "") -> PromptKey:
        """The prompt's whole blocks and their chained keys; ``salt`` keeps one owner's
        keys apart from another's."""
        block = self.block
        whole = len(prompt) // block * block
        tokens = np.asarray(prompt[:whole], dtype=np.int32)
        data = tokens.astype("<i4", copy=False).tobytes()
        step = 4 * block
        h = hashlib.blake2b(salt.encode(), digest_size=16, key=self._secret).digest()
        chain = []
        for start in range(0, len(data), step):
            h = hashlib.blake2b(h + data[start : start + step], digest_size=16).digest()
            chain.append(h)
        return PromptKey(tokens, tuple(chain), max(len(prompt) - 1, 0))

    def lookup(self, key: PromptKey, *, count: bool = True, asker: Hashable = None) -> Match:
        """The longest run of ``key``'s blocks that some holder has ready, and how far live
        holders will get. ``count``: this is an item's first lookup (tallied, and its
        blocks counted as asked for by ``asker``: lookups of one asker, the choices of
        one line say, count as one; None is an asker of its own)."""
        block = self.block
        with self._lock:
            if count:
                self.stats.lookups += 1
                self.stats.prompt_tokens += key.limit + 1
                self._count_seen(key.chain, object() if asker is None else asker)
            best: Holder | None = None
            ready = deepest = 0
            last: dict[Holder, None] = {}
            for i, h in enumerate(key.chain):
                holders = self._index.get(h)
                if not holders:
                    break
                deepest, last = i + 1, holders
                if ready != i:
                    continue  # ready blocks ended earlier; only the depth is still wanted
                if best is None or best not in holders or best.ready_tokens(block) <= i * block:
                    # The most recent holder with this block ready (most likely to be
                    # the one with the most after it).
                    deeper = next(
                        (x for x in reversed(holders) if x.ready_tokens(block) > i * block), None
                    )
                    if deeper is None:
                        continue
                    best = deeper
                ready = i + 1
        tokens = min(ready * block, key.limit)
        pending = min(deepest * block, key.limit)
        if pending <= tokens:
            return Match(tokens, best if tokens else None, tokens)
        prefilling = tuple(x for x in last if not x.kept)
        return Match(tokens, best if tokens else None, pending, prefilling)

    def _count_seen(self, chain: tuple[bytes, ...], asker: Hashable) -> None:
        """Note who asked for each block: its first asker, or _SHARED once another did."""
        seen = self._seen
        for h in chain:
            first = seen.pop(h, asker)
            seen[h] = first if first is _SHARED or first == asker else _SHARED
        while len(seen) > _SEEN_MAX:
            seen.popitem(last=False)

    # -- live holders --------------------------------------------------------------
    def register(self, key: PromptKey) -> Holder | None:
        """A live session's prompt, whose blocks become ready as it prefills them; None
        when it has no whole block."""
        if not key.chain:
            return None
        holder = Holder(key.tokens, key.chain)
        with self._lock:
            for h in key.chain:
                self._index.setdefault(h, {})[holder] = None
        return holder

    def fork(
        self, target: RowKvCache, holder: Holder, key: PromptKey, tokens: int, required: int
    ) -> GrowthResult:
        """Start the empty ``target`` on ``holder``'s first ``tokens`` (a lookup's match of
        ``key``) with room for ``required``: :func:`kvmux.kv.fork_prefix` with the holder
        pinned. Raises as a growth does (``GrowthFailed``: ``target`` left empty), or
        :class:`PrefixCacheError` when the holder no longer holds those tokens."""
        with self._lock:
            cache = holder.cache
            if (
                holder.gone
                or cache is None
                or holder.ready_tokens(self.block) < tokens
                or not np.array_equal(holder.tokens[:tokens], key.tokens[:tokens])
            ):
                raise PrefixCacheError(f"the holder no longer holds these {tokens} tokens")
            holder.pins += 1
            if holder.kept:
                self._lru.move_to_end(holder)
        try:
            result = fork_prefix(target, cache, tokens, required)
        except Exception:
            with self._lock:
                self.stats.fork_failures += 1
            raise
        finally:
            self._unpin(holder)
        with self._lock:
            self.stats.hits += 1
            self.stats.hit_tokens += tokens
        return result

    def _unpin(self, holder: Holder) -> None:
        with self._lock:
            holder.pins -= 1
            release = holder.gone and holder.pins == 0
        if release and holder.cache is not None:
            holder.cache.release()

    def attach(self, holder: Holder, cache: RowKvCache, exact: int | None = None) -> None:
        """The live session's row now exists: its blocks become ready as it prefills.
        ``exact``: forks may copy at most that many of its tokens (default: all)."""
        holder.cache = cache
        holder.exact = len(holder.tokens) if exact is None else exact

    def leave(self, holder: Holder, *, keep: bool) -> bool:
        """A live session is leaving: finished (``keep``: its prompt's blocks are worth
        keeping), or preempted, failed, cancelled. Returns whether the caller releases
        its row: False when the cache has taken it (kept it, or a fork is copying from
        it right now and the cache releases it once the copy is done).

        What is kept: the blocks of its prompt that another asker looked up too, up
        to what it had prefilled, unless a kept row has them already. The row stays
        where its session decoded until :meth:`settle` moves it (an allocation, under
        the growth lock); meanwhile it is charged its bucket."""
        block = self.block
        cache = holder.cache
        victims: list[Holder] = []
        with self._lock:
            blocks = 0 if cache is None or not keep else holder.ready_tokens(block) // block
            while blocks and self._seen.get(holder.chain[blocks - 1]) is not _SHARED:
                blocks -= 1
            size = entry_bytes(self.spec, blocks * block)
            if (
                cache is None
                or not blocks
                or size > self.max_bytes
                or any(
                    x.kept and x.length >= blocks * block
                    for x in self._index.get(holder.chain[blocks - 1], ())
                )
            ):
                self._unindex(holder, holder.chain)
                if holder.pins:
                    holder.gone = True
                    return False
                return True
            victims = self._make_room(size)
            self._unindex(holder, holder.chain[blocks:])
            holder.kept, holder.length = True, blocks * block
            self._lru[holder] = None
            self._unsettled.append(holder)
            self._bytes += cache.nbytes
            self.stats.kept += 1
            self._tally()
        self._release(victims)
        return False

    # -- kept rows -----------------------------------------------------------------
    def settle(self) -> int:
        """Move rows kept where their session decoded into rows of the cache's own pool,
        exactly as long as what they serve; returns bytes copied. Each move is an
        allocation, so the caller holds the growth lock. A move that fails (budget,
        device) evicts that row instead."""
        with self._lock:
            todo, self._unsettled = self._unsettled, []
            for holder in todo:
                holder.pins += 1
        copied = 0
        for holder in todo:
            old = holder.cache
            assert old is not None
            row = RowKvCache(self.pool, HardMax(holder.length, "prefix cache row"))
            try:
                copied += fork_prefix(row, old, holder.length, holder.length).bytes_copied
            except Exception:  # noqa: BLE001 - what could not move is dropped, not kept
                self._unpin(holder)
                self._evict([holder])
                continue
            with self._lock:
                holder.cache = row
                self._bytes += row.nbytes - old.nbytes
                self._tally()
            old.release()
            self._unpin(holder)
        return copied

    @property
    def unsettled(self) -> bool:
        return bool(self._unsettled)

    def reclaimable(self) -> int:
        with self._lock:
            return sum(h.cache.nbytes for h in self._lru if not h.pins and h.cache is not None)

    def reclaim(self, nbytes: int) -> int:
        """Evict kept rows, least recently used first, until ``nbytes`` are given back."""
        freed = 0
        while freed < nbytes:
            with self._lock:
                victim = next((h for h in self._lru if not h.pins), None)
                if victim is None:
                    break
                freed += self._forget(victim)
            self._release([victim])
        return freed

    def clear(self) -> None:
        """Evict every kept row that no fork is copying from."""
        self.reclaim(1 << 62)

    def _evict(self, holders: list[Holder]) -> None:
        with self._lock:
            gone = [h for h in holders if h in self._lru]
            for h in gone:
                self._forget(h)
        self._release(gone)

    def _make_room(self, nbytes: int) -> list[Holder]:
        """Kept rows to evict (under the lock) so that ``nbytes`` more fit ``max_bytes``
        (rows still where their session decoded count their settled size)."""
        victims = []
        held = sum(entry_bytes(self.spec, h.length) for h in self._lru)
        for h in list(self._lru):
            if held + nbytes <= self.max_bytes:
                break
            if not h.pins:
                held -= entry_bytes(self.spec, h.length)
                self._forget(h)
                victims.append(h)
        return victims

    def _forget(self, holder: Holder) -> int:
        """Take a kept row out of the index (under the lock); its bytes."""
        self._unindex(holder, holder.chain)
        self._lru.pop(holder, None)
        if holder in self._unsettled:
            self._unsettled.remove(holder)
        nbytes = 0 if holder.cache is None else holder.cache.nbytes
        self._bytes -= nbytes
        self.stats.evictions += 1
        self._tally()
        return nbytes

    def _release(self, holders: list[Holder]) -> None:
        for h in holders:
            if h.cache is not None:
                h.cache.release()

    def _unindex(self, holder: Holder, chain: Sequence[bytes]) -> None:
        for h in chain:
            holders = self._index.get(h)
            if holders is not None:
                holders.pop(holder, None)
                if not holders:
                    del self._index[h]

    def _tally(self) -> None:
        self.stats.entries = len(self._lru)

    @property
    def bytes(self) -> int:
        """Bytes of the rows the cache keeps (charged to the budget)."""
        return self._bytes


def entry_bytes(spec: KvSpec, tokens: int) -> int:
    """What a kept prefix of ``tokens`` tokens costs once settled: its row's K, V and mask."""
    return tokens * spec.bytes_per_token
