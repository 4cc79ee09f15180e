"""The prefix cache's mechanism: keys, forks through the one growth driver, what is kept,
and memory given back before anyone is refused."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from kvmux.kv import (
    BudgetExceeded,
    CohortPool,
    GrowthFailed,
    Holder,
    KvSpec,
    MemoryBudget,
    PrefixCache,
    PrefixCacheError,
    PromptKey,
    RowKvCache,
    carve,
    ensure_capacity,
    entry_bytes,
    failpoints,
    fork_prefix,
    resolve_hard_max,
)

from .fake_device import FakeDeviceStorage

SPEC = KvSpec(num_layers=2, kv_heads=2, head_dim=8, dtype="float32")
BPT = SPEC.bytes_per_token
HARD = resolve_hard_max(None, 4096)
BLOCK = 4


def _setup(
    budget: MemoryBudget | None = None, max_bytes: int = 1 << 20
) -> tuple[CohortPool, PrefixCache]:
    budget = budget or MemoryBudget()
    pool = CohortPool(SPEC, rows_per_cohort=4, min_bucket=4, budget=budget)
    cache = PrefixCache(SPEC, budget=budget, block=BLOCK, max_bytes=max_bytes)
    return pool, cache


def _fill(cache: RowKvCache, n: int, seed: int) -> np.ndarray:
    """Write ``n`` tokens of distinct KV into ``cache`` (as prefill runs would); returns them
    as ``[2 * layers, heads, n, head]``."""
    ensure_capacity(cache, cache.valid_len + n)
    rng = np.random.default_rng(seed)
    data = rng.standard_normal((2 * SPEC.num_layers, SPEC.kv_heads, n, SPEC.head_dim))
    data = data.astype(np.float32)
    p, start = cache.placement(), cache.valid_len
    for i, buf in enumerate([*p.keys, *p.values]):
        buf[p.row, :, start : start + n, :] = data[i]
    cache.advance(n)
    return data


def _kv(cache: RowKvCache, n: int) -> np.ndarray:
    p = cache.placement()
    return np.stack([buf[p.row, :, :n, :] for buf in [*p.keys, *p.values]])


def _fork_on_a_thread(
    cache: PrefixCache, target: RowKvCache, holder: Holder, key: PromptKey
) -> threading.Event:
    """Fork 32 tokens on a thread of its own, as the model's thread does, slowed at its copy;
    returns once the copy holds its source pinned, with an event set when it is done."""
    failpoints.slow("kv.fork", 0.3)
    done = threading.Event()

    def run() -> None:
        cache.fork(target, holder, key, 32, 33)
        done.set()

    threading.Thread(target=run, daemon=True).start()
    deadline = time.monotonic() + 10
    while not holder.pins and time.monotonic() < deadline:
        time.sleep(0.005)
    assert holder.pins == 1
    return done


def _live(cache: PrefixCache, pool: CohortPool, prompt: list[int], seed: int = 0) -> RowKvCache:
    """A session's row holding ``prompt``'s KV, looked up (as every item is when it leaves
    the queue) and registered as a live holder."""
    row = pool.new_cache(HARD)
    _fill(row, len(prompt), seed)
    key = cache.key(prompt)
    cache.lookup(key)
    holder = cache.register(key)
    assert holder is not None
    cache.attach(holder, row)
    return row


def test_a_block_key_covers_every_token_before_it_and_its_salt() -> None:
    _, cache = _setup()
    a = cache.key(list(range(10, 30)))  # 5 whole blocks; limit: all but the last token
    b = cache.key([*range(10, 22), 99, *range(23, 30)])  # differs in block 3
    assert len(a.chain) == 5 and a.limit == 19 and len(a.tokens) == 20
    assert a.chain[:3] == b.chain[:3] and a.chain[3] != b.chain[3]
    assert a.chain[4] != b.chain[4]  # block 4's tokens agree, what came before does not
    assert cache.key(list(range(10, 31))).chain == a.chain  # a partial last block has no key
    other_owner = cache.key(list(range(10, 30)), salt="uid:1000")
    assert not set(other_owner.chain) & set(a.chain)
    # The keys depend on a secret drawn per cache: they cannot be computed outside.
    _, again = _setup()
    assert again.key(list(range(10, 30))).chain != a.chain


def test_a_fork_copies_the_source_rows_first_tokens_through_the_growth_driver() -> None:
    pool, _ = _setup()
    donor = pool.new_cache(HARD)
    data = _fill(donor, 50, seed=1)  # bucket 64
    fork = pool.new_cache(HARD)
    result = fork_prefix(fork, donor, 20, 21)
    assert (result.grew, result.old_capacity, result.new_capacity) == (True, 0, 32)
    assert result.valid_len == fork.valid_len == 20
    assert result.bytes_copied == 20 * SPEC.kv_bytes_per_token
    assert _kv(fork, 20).tobytes() == data[:, :, :20].tobytes()
    p = fork.placement()
    assert p.mask[p.row, :20].tolist() == [1] * 20 and not p.mask[p.row, 20:].any()
    assert not np.stack([b[p.row, :, 20:, :] for b in [*p.keys, *p.values]]).any()
    # The donor is untouched; a fork into a bigger bucket than the donor's works alike.
    assert donor.valid_len == 50 and _kv(donor, 50).tobytes() == data.tobytes()
    big = pool.new_cache(HARD)
    assert fork_prefix(big, donor, 50, 100).new_capacity == 128
    assert _kv(big, 50).tobytes() == data.tobytes()
    # A growth right after a fork moves the forked tokens with the row.
    more = _fill(fork, 30, seed=2)
    assert fork.capacity == 64
    assert _kv(fork, 50).tobytes() == np.concatenate([data[:, :, :20], more], axis=2).tobytes()


@pytest.mark.parametrize("step", ["kv.allocate", "kv.copy_prefix", "kv.fork", "kv.build_mask"])
def test_a_failed_fork_leaves_the_target_empty_and_charges_nothing(step: str) -> None:
    budget = MemoryBudget()
    pool, _ = _setup(budget)
    donor = pool.new_cache(HARD)
    _fill(donor, 40, seed=3)
    used = budget.used
    fork = pool.new_cache(HARD)
    with failpoints.armed_for(step, 1), pytest.raises(GrowthFailed) as err:
        fork_prefix(fork, donor, 32, 40)
    assert err.value.details["failed_step"] == step.removeprefix("kv.").replace(
        "fork", "copy_prefix"
    )
    assert (fork.capacity, fork.valid_len, budget.used) == (0, 0, used)
    # The same fork, retried, succeeds; an ordinary growth of the target is unaffected.
    assert fork_prefix(fork, donor, 32, 40).valid_len == 32
    with pytest.raises(ValueError, match="empty cache"):
        fork_prefix(fork, donor, 8, 8)


def test_lookup_follows_a_live_prefill_and_stops_at_the_first_differing_block() -> None:
    pool, cache = _setup()
    prompt = list(range(100, 126))  # 6 whole blocks and 2 tokens
    row = pool.new_cache(HARD)
    holder = cache.register(cache.key(prompt))
    assert holder is not None
    later = cache.key([*prompt[:17], 7, 7, 7, 7, 7])  # shares 4 whole blocks
    # Registered before its row exists: nothing ready, 4 blocks coming.
    m = cache.lookup(later)
    assert (m.tokens, m.holder, m.pending, m.prefilling) == (0, None, 16, (holder,))
    cache.attach(holder, row)
    _fill(row, 8, seed=4)  # prefilled 2 blocks so far
    m = cache.lookup(later, count=False)
    assert (m.tokens, m.holder, m.pending) == (8, holder, 16)
    _fill(row, 18, seed=5)  # the whole prompt
    m = cache.lookup(later, count=False)
    assert (m.tokens, m.holder, m.pending, m.prefilling) == (16, holder, 16, ())
    # The same prompt again: every whole block, less the last token (its logits are needed).
    same = cache.lookup(cache.key(prompt))
    assert (same.tokens, same.holder) == (24, holder)
    exact = cache.key(prompt[:24])  # ends on a block boundary
    assert cache.lookup(exact).tokens == 23
    assert cache.stats.lookups == 3 and cache.stats.prompt_tokens == 22 + 26 + 24


def test_a_finished_prompt_is_kept_only_where_another_lookup_asked_for_it() -> None:
    budget = MemoryBudget()
    pool, cache = _setup(budget)
    system = list(range(200, 216))  # 4 blocks every prompt shares
    alone = _live(cache, pool, [*system, 1, 2, 3, 4, 5], seed=6)
    holder = next(iter(cache._index[cache.key(system).chain[0]]))
    # Nobody else asked for its blocks: not kept, its row is the caller's to release.
    assert cache.leave(holder, keep=True) is True and cache.stats.kept == 0
    alone.release()
    first = _live(cache, pool, [*system, 9, 9, 9, 9, 9], seed=7)
    first_holder = cache.lookup(cache.key([*system, 8, 8, 8, 8, 8])).holder  # asks for system
    assert first_holder is not None
    used = budget.used
    assert cache.leave(first_holder, keep=True) is False  # kept: the cache owns the row now
    assert cache.stats.kept == 1 and cache.bytes == first.nbytes and budget.used == used
    # Only the asked-for blocks serve: the system prompt, not its own last block.
    assert cache.lookup(cache.key([*system, 9, 9, 9, 9, 9, 0]), count=False).tokens == 16
    # It moves into the cache's own pool, exactly as long as what it serves.
    assert cache.settle() == 16 * SPEC.kv_bytes_per_token
    assert cache.bytes == entry_bytes(SPEC, 16) and budget.used == entry_bytes(SPEC, 16)
    assert first.capacity == 0  # the session's old row was released
    kept = cache.lookup(cache.key([*system, 5]), count=False)
    assert kept.holder is first_holder and kept.tokens == 16
    # A second finished prompt with the same blocks adds nothing.
    second = _live(cache, pool, [*system, 7, 7, 7, 7, 7], seed=8)
    h2 = next(h for h in cache._index[cache.key(system).chain[3]] if not h.kept)
    assert cache.leave(h2, keep=True) is True and cache.stats.kept == 1
    second.release()


def test_kept_rows_are_given_back_before_an_allocation_is_refused() -> None:
    budget = MemoryBudget(400 * BPT)
    pool, cache = _setup(budget)
    for k in range(3):  # three kept prefixes of 64 tokens each
        prompt = [k + 1] * 64 + [0]
        _live(cache, pool, prompt, seed=k)
        cache.lookup(cache.key(prompt))
        holder = cache.lookup(cache.key(prompt), count=False).holder
        assert holder is not None and cache.leave(holder, keep=True) is False
        cache.settle()
    assert cache.bytes == 3 * entry_bytes(SPEC, 64) == budget.used
    assert budget.committed == 0 and budget.reclaimable == cache.bytes
    # The oldest is the least recently used, unless a fork just used it.
    key0 = cache.key([1] * 64 + [0])
    first = cache.lookup(key0, count=False).holder
    assert first is not None
    target = pool.new_cache(HARD)
    cache.fork(target, first, key0, 8, 8)
    target.release()
    # 256 tokens fit once one kept row is evicted: the least recently used goes.
    session = pool.new_cache(HARD)
    ensure_capacity(session, 256)
    assert cache.stats.evictions == 1 and cache.stats.entries == 2
    assert cache.lookup(cache.key([2] * 64 + [0]), count=False).tokens == 0
    assert cache.lookup(key0, count=False).tokens == 64
    # Then nothing is left to give: the budget refuses as before, every kept row gone.
    with pytest.raises(GrowthFailed) as err:
        ensure_capacity(session, 257)
    assert err.value.details["cause"] == "budget"
    assert cache.bytes == 0 and cache.stats.evictions == 3
    assert budget.used == session.nbytes == 256 * BPT
    with pytest.raises(BudgetExceeded):
        budget.reserve(400 * BPT)


def test_the_size_cap_evicts_the_least_recently_used() -> None:
    pool, cache = _setup(max_bytes=2 * entry_bytes(SPEC, 16))
    holders: list[Holder] = []
    for k in range(3):
        prompt = [k + 1] * 16 + [0]
        _live(cache, pool, prompt, seed=k)
        cache.lookup(cache.key(prompt))
        holder = cache.lookup(cache.key(prompt), count=False).holder
        assert holder is not None
        if k == 2:  # the first is used again: the second is now the oldest
            target = pool.new_cache(HARD)
            cache.fork(target, holders[0], cache.key([1] * 16 + [0]), 16, 17)
            target.release()
        holders.append(holder)
        cache.leave(holder, keep=True)
        cache.settle()
    assert cache.stats.entries == 2 and cache.stats.evictions == 1
    assert cache.lookup(cache.key([2] * 16 + [0]), count=False).tokens == 0
    assert cache.lookup(cache.key([1] * 16 + [0]), count=False).tokens == 16
    assert cache.bytes <= cache.max_bytes


def test_a_pinned_source_is_neither_evicted_nor_released_while_a_fork_copies() -> None:
    """A fork slowed at its copy (on a thread of its own, as on the model's) while the
    source is evicted (a reclaim) or its live session leaves: the copy reads the whole
    prefix, and the source row goes only once the copy is done."""
    budget = MemoryBudget()
    pool, cache = _setup(budget)
    prompt = [5] * 32 + [1]
    donor = _live(cache, pool, prompt, seed=11)
    data = _kv(donor, 32).copy()
    key = cache.key(prompt)
    cache.lookup(key)
    holder = cache.lookup(key, count=False).holder
    assert holder is not None
    target = pool.new_cache(HARD)
    done = _fork_on_a_thread(cache, target, holder, key)
    # The live session leaves mid-copy: the cache takes its row and releases it later.
    assert cache.leave(holder, keep=False) is False
    assert cache.reclaim(1 << 30) == 0  # nothing kept to evict; the pinned row is no entry
    assert donor.capacity > 0
    assert done.wait(10)
    failpoints.disarm()
    assert _kv(target, 32).tobytes() == data.tobytes()
    assert donor.capacity == 0  # released at the last unpin
    with pytest.raises(PrefixCacheError):
        cache.fork(pool.new_cache(HARD), holder, key, 32, 33)


def test_a_kept_row_being_copied_from_is_not_evicted() -> None:
    budget = MemoryBudget()
    pool, cache = _setup(budget)
    prompt = [6] * 32 + [1]
    _live(cache, pool, prompt, seed=12)
    key = cache.key(prompt)
    cache.lookup(key)
    holder = cache.lookup(key, count=False).holder
    assert holder is not None and cache.leave(holder, keep=True) is False
    cache.settle()
    assert holder.cache is not None
    data = _kv(holder.cache, 32).copy()
    target = pool.new_cache(HARD)
    done = _fork_on_a_thread(cache, target, holder, key)
    assert cache.reclaim(1 << 30) == 0 and cache.stats.entries == 1
    assert done.wait(10)
    failpoints.disarm()
    assert _kv(target, 32).tobytes() == data.tobytes()
    assert cache.reclaim(1 << 30) == entry_bytes(SPEC, 32) and budget.used == target.nbytes


def test_on_a_device_a_refused_allocation_takes_kept_rows_back_first() -> None:
    """Device storage (memory held per cohort, as on CUDA) that refuses past its total:
    the claim the device refuses evicts the kept rows, whose cohorts are then freed, and
    is tried again; no budget is involved."""
    carved = carve(SPEC, 64, 1).nbytes
    storage = FakeDeviceStorage(total=3 * carved)
    budget = MemoryBudget()
    pool = CohortPool(SPEC, storage=storage, rows_per_cohort=1, min_bucket=4, budget=budget)
    cache = PrefixCache(SPEC, budget=budget, storage=storage, block=BLOCK)
    prompt = [7] * 64 + [1]
    _live(cache, pool, prompt, seed=13)  # a session's row of 128: more than two of 64
    key = cache.key(prompt)
    holder = cache.lookup(key).holder
    assert holder is not None and cache.leave(holder, keep=True) is False
    cache.settle()  # into a cohort of its own, 64 tokens: its session's 128 is freed
    assert cache.stats.entries == 1 and len(cache.pool.cohorts()) == 1
    sessions = [pool.new_cache(HARD) for _ in range(3)]
    for s in sessions:
        # The device holds three cohorts of 64: the third session's is refused until
        # the kept row's cohort is given back.
        ensure_capacity(s, 64)
    assert cache.stats.evictions == 1 and cache.pool.cohorts() == []
    assert storage.held == 3 * carved
    with pytest.raises(GrowthFailed) as err:
        ensure_capacity(pool.new_cache(HARD), 128)
    assert err.value.details["cause"] == "out_of_memory"


def test_on_a_device_a_new_cohort_is_not_made_narrower_for_kept_rows() -> None:
    """Device storage with a budget: a session's new cohort is sized by what the budget
    has free, and what the cache keeps counts as free: the kept row is evicted and the
    cohort gets the rows it would have had without the cache."""
    unit = 64 * BPT  # one row of 64 tokens
    budget = MemoryBudget(4 * unit)
    storage = FakeDeviceStorage()
    pool = CohortPool(SPEC, storage=storage, rows_per_cohort=4, min_bucket=4, budget=budget)
    cache = PrefixCache(SPEC, budget=budget, storage=storage, block=BLOCK)
    prompt = [7] * 64 + [1]
    _live(cache, pool, prompt, seed=13)
    holder = cache.lookup(cache.key(prompt)).holder  # another asks for it: kept
    assert holder is not None and cache.leave(holder, keep=True) is False
    cache.settle()  # into a cohort of its own, 64 tokens: its session's 128 is freed
    assert budget.used == unit and budget.reclaimable == unit
    # A second cohort of a capacity gets up to as many rows as the first ones hold:
    # 1, 1, then 2 rows, which fit the budget once the kept row is given back.
    sessions = [pool.new_cache(HARD) for _ in range(3)]
    for s in sessions:
        ensure_capacity(s, 64)
    assert [c.rows for c in pool.cohorts()] == [1, 1, 2]
    assert cache.stats.evictions == 1 and budget.used == 4 * unit


def test_lookups_of_one_asker_count_once() -> None:
    """The n choices of one line ask for the same prompt as one asker: they copy it from
    the live session that prefills it, and it is not kept for later; another line's
    lookup makes its blocks shared."""
    pool, cache = _setup()
    prompt = [8] * 24 + [1]
    row = pool.new_cache(HARD)
    _fill(row, len(prompt), seed=14)
    key = cache.key(prompt)
    for _ in range(4):
        cache.lookup(key, asker=("job", 0))
    holder = cache.register(key)
    assert holder is not None
    cache.attach(holder, row)
    assert cache.leave(holder, keep=True) is True and cache.stats.kept == 0
    holder = cache.register(key)
    assert holder is not None
    cache.attach(holder, row)
    cache.lookup(cache.key([8] * 16 + [2] * 9), asker=("job", 4))  # another line: 4 blocks
    assert cache.leave(holder, keep=False) is True  # (a session that did not finish well)
    holder = cache.register(key)
    assert holder is not None
    cache.attach(holder, row)
    assert cache.leave(holder, keep=True) is False and cache.stats.kept == 1
    assert cache.lookup(key, count=False).tokens == 16  # what the other line shares
