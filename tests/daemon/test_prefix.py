"""Prefix sharing through a real kvmuxd: every item decoded from a cached prefix gives
exactly the tokens it gets with the cache off, items racing for one prefix prefill it
once, another owner never hits, and the cache never costs a session its room."""

from __future__ import annotations

import shutil
from pathlib import Path

import anyio
import msgspec
import pytest
import zmq.auth

from kvmux.client import Client, Item, ItemResult
from kvmux.client.curve import load_curve
from kvmux.daemon.app import Daemon
from kvmux.daemon.engine import Engine
from kvmux.kv import failpoints

from .conftest import connected, make_config, running
from .helpers import decode_alone, ok_tokens, token_prompt

pytestmark = pytest.mark.anyio

replace = msgspec.structs.replace


def _items(system: list[int], n: int, tag: int, **fields: object) -> list[Item]:
    """``n`` items whose prompts begin with ``system``, each with 5-14 tokens of its own."""
    base = Item(max_new_tokens=24, temperature=0.0, ignore_eos=True)
    return [
        replace(
            base,
            custom_id=f"{tag}-{i}",
            prompt_tokens=[*system, *token_prompt(5 + i % 10, seed=tag * 100 + i)],
            **fields,
        )
        for i in range(n)
    ]


def _choices(prompt: list[int], n: int, seed: int) -> list[Item]:
    """One line with ``n`` sampled choices, as the client expands it: choice j samples
    with seed + j."""
    return [
        Item(
            custom_id="line",
            prompt_tokens=prompt,
            max_new_tokens=30,
            temperature=0.9,
            top_k=50,
            seed=seed + j,
            choice=j,
            choices=n,
            n=n,
            ignore_eos=True,
        )
        for j in range(n)
    ]


async def _run(daemon: Daemon, items: list[Item]) -> list[ItemResult]:
    async with connected(daemon) as client:
        return await (await client.submit(items)).results()


async def test_items_sharing_a_prefix_decode_exactly_as_with_the_cache_off(
    tiny_model: Path, sock_dir: Path, reference: Engine
) -> None:
    """A system prompt ending mid-block (100 tokens) and one ending on a block (96),
    greedy and seeded items mixed, two jobs in a row: the second finds the first's
    prefixes kept."""
    mid, aligned = token_prompt(100, seed=1), token_prompt(96, seed=2)
    sampled = {"temperature": 0.8, "top_p": 0.95, "seed": 11}
    first = [*_items(mid, 6, tag=3), *_items(aligned, 5, tag=4, **sampled)]
    second = [*_items(mid, 3, tag=5), *_items(aligned, 3, tag=6)]
    got: dict[bool, dict[str, ItemResult]] = {}
    for cache in (True, False):
        cfg = make_config(tiny_model, sock_dir, kv={"min_bucket": 4, "prefix_cache": cache})
        async with running(cfg) as daemon:
            results = [*await _run(daemon, first), *await _run(daemon, second)]
            async with connected(daemon) as client:
                status = await client.status()
        got[cache] = {r.custom_id: r for r in results}
        assert status.kv_bytes_in_use == 0 and status.sessions_active == 0
        if not cache:
            assert status.prefix_cache is None
            continue
        pc = status.prefix_cache
        assert pc is not None
        # The first wave raced for two prefixes: all but one item of each waited.
        assert pc.waits == 6 - 1 + 5 - 1 and pc.fork_failures == 0
        # One prefix of each kept (96 tokens: what the others asked for), in rows of
        # exactly that length.
        assert pc.kept == pc.entries == 2 and pc.bytes == 2 * 96 * reference.kv_spec.bytes_per_token
        assert pc.hits == len(first) - 2 + len(second)
    on, off = got[True], got[False]
    for item in [*first, *second]:
        assert on[item.custom_id].status == off[item.custom_id].status == "ok"
        assert on[item.custom_id].token_ids == off[item.custom_id].token_ids
        assert on[item.custom_id].token_ids == decode_alone(reference, item)
        usage, plain = on[item.custom_id].usage, off[item.custom_id].usage
        assert usage is not None and plain is not None
        assert replace(usage, cached_tokens=0) == plain and plain.cached_tokens == 0
    # Whole blocks of the shared prefix were copied: 96 of both (100 ends mid-block).
    cached = [on[i.custom_id].usage.cached_tokens for i in [*first, *second]]  # type: ignore[union-attr]
    assert cached == [0, *[96] * 5, 0, *[96] * 4, *[96] * 6]


async def test_n_choices_prefill_their_prompt_once_and_sample_as_with_the_cache_off(
    tiny_model: Path, sock_dir: Path, reference: Engine
) -> None:
    prompt = token_prompt(80, seed=20)  # 5 whole blocks
    items = _choices(prompt, 4, seed=7)
    got = {}
    for cache in (True, False):
        cfg = make_config(tiny_model, sock_dir, kv={"min_bucket": 4, "prefix_cache": cache})
        async with running(cfg) as daemon:
            got[cache] = await _run(daemon, items)
    on, off = got[True], got[False]
    assert [r.token_ids for r in on] == [r.token_ids for r in off]
    assert [r.token_ids for r in on] == [decode_alone(reference, i) for i in items]
    assert len({tuple(r.token_ids) for r in on}) == 4  # the seeds still tell them apart
    assert [r.seed for r in on] == [7, 8, 9, 10]
    # One prefill: the first choice's; the others copy all but the last 2 prompt tokens
    # (the last one alone would run by onnxruntime's one-token path: other logits).
    assert [r.usage.cached_tokens for r in on] == [0, 78, 78, 78]  # type: ignore[union-attr]


async def test_another_owners_identical_prompt_misses_the_cache(
    tiny_model: Path, sock_dir: Path, tmp_path: Path, reference: Engine
) -> None:
    """Two CURVE keys are two owners. By default an owner's prompts serve only that owner;
    kv.prefix_cache_scope = "shared" opens them to everyone."""
    keys, allowed = tmp_path / "keys", tmp_path / "allowed"
    keys.mkdir()
    allowed.mkdir()
    _, server_secret = zmq.auth.create_certificates(keys, "server")
    curves = {}
    for name in ("alice", "bob"):
        public, secret = zmq.auth.create_certificates(keys, name)
        shutil.copy(public, allowed)
        curves[name] = load_curve(keys / "server.key", secret)
    prompt = token_prompt(80, seed=30)
    mine = Item(custom_id="p", prompt_tokens=prompt, max_new_tokens=12, temperature=0.0)
    for scope, bob_cached in (("owner", 0), ("shared", 78)):
        endpoint = f"ipc://{sock_dir}/curve.sock"
        cfg = make_config(
            tiny_model,
            sock_dir,
            kv={"min_bucket": 4, "prefix_cache_scope": scope},
            server={
                "endpoint": endpoint,
                "curve_secret_key": str(server_secret),
                "curve_authorized_keys": str(allowed),
            },
        )
        async with running(cfg):
            async with Client(endpoint, curve=curves["alice"], timeout=10.0) as alice:
                # Twice: the second copies the first's prefill, which is then kept.
                done = await (await alice.submit([mine, mine])).results()
                assert [r.usage.cached_tokens for r in done] == [0, 78]  # type: ignore[union-attr]
                assert (await alice.status()).prefix_cache.entries == 1  # type: ignore[union-attr]
            async with Client(endpoint, curve=curves["bob"], timeout=10.0) as bob:
                (theirs,) = await (await bob.submit([mine])).results()
        assert theirs.token_ids == decode_alone(reference, mine)
        assert theirs.usage is not None and theirs.usage.cached_tokens == bob_cached


@pytest.mark.parametrize("policy", ["wait", "fail"])
async def test_a_tight_budget_evicts_the_cache_before_refusing_anyone(
    tiny_model: Path, sock_dir: Path, reference: Engine, policy: str
) -> None:
    """The first job leaves a kept prefix charged to the budget. The second job's item
    fits the budget alone but not beside that prefix: its growth takes the prefix back
    instead of being refused, so it neither parks nor fails."""
    bpt = reference.kv_spec.bytes_per_token
    # A: two items of one 200-token prompt -> 192 tokens kept (in a row of their own).
    shared = token_prompt(200, seed=40)
    a = [
        Item(custom_id=f"a{i}", prompt_tokens=shared, max_new_tokens=10, temperature=0.0)
        for i in range(2)
    ]
    # B: 250 + 300 tokens grows 512 -> 1024 at the end: a peak of 1536 tokens.
    b = Item(
        custom_id="b",
        prompt_tokens=token_prompt(250, seed=41),
        max_new_tokens=300,
        temperature=0.0,
        ignore_eos=True,
    )
    cfg = make_config(
        tiny_model,
        sock_dir,
        kv={"min_bucket": 16, "memory_budget": (1536 + 100) * bpt},
        scheduler={"on_growth_failure": policy},
    )
    async with running(cfg) as daemon, connected(daemon) as client:
        first = await (await client.submit(a)).results()
        kept = await client.status()
        (second,) = await (await client.submit([b])).results()
        status = await client.status()
    assert [r.status for r in first] == ["ok", "ok"]
    assert kept.prefix_cache is not None and kept.prefix_cache.entries == 1
    assert second.status == "ok" and second.token_ids == decode_alone(reference, b)
    assert status.growth.failures == {} and status.growth.parked_retries == 0
    pc = status.prefix_cache
    assert pc is not None and pc.evictions == 1 and pc.entries == 0 and pc.bytes == 0
    assert status.kv_peak_bytes <= (1536 + 100) * bpt and status.kv_bytes_in_use == 0


async def test_under_a_tight_wait_budget_every_item_that_fits_alone_finishes(
    tiny_model: Path, sock_dir: Path, reference: Engine
) -> None:
    """Twelve items sharing a prefix, each fitting an 800-token budget alone (at most 334
    tokens: a growth 256 -> 512 holds 768), eight at a time: forks and kept prefixes
    beside parked and preempted sessions, and every item finishes with its own tokens."""
    bpt = reference.kv_spec.bytes_per_token
    items = _items(token_prompt(120, seed=50), 12, tag=51, max_new_tokens=200)
    cfg = make_config(
        tiny_model,
        sock_dir,
        kv={"min_bucket": 16, "memory_budget": 800 * bpt},
        scheduler={"on_growth_failure": "wait", "max_active_sessions": 8},
    )
    async with running(cfg) as daemon:
        results = await _run(daemon, items)
        async with connected(daemon) as client:
            # The last items' prompts are kept where they decoded, and moved into the
            # cache's own pool by the loop's next turn, off the loop: a status answered
            # during that move (a loaded machine's) counts the new row as held.
            with anyio.fail_after(20):
                while (status := await client.status()).kv_bytes_in_use:
                    await anyio.sleep(0.01)
    got = ok_tokens(results)
    for item in items:
        assert got[item.custom_id] == decode_alone(reference, item)
    assert status.prefix_cache is not None and status.prefix_cache.hits > 0
    assert status.kv_peak_bytes <= 800 * bpt


async def test_a_fork_that_fails_leaves_its_item_to_prefill_the_whole_prompt(
    tiny_model: Path, sock_dir: Path, reference: Engine
) -> None:
    items = _items(token_prompt(64, seed=60), 4, tag=61)
    failpoints.arm("kv.fork")  # every copy from a cached prefix fails
    async with running(make_config(tiny_model, sock_dir)) as daemon:
        results = await _run(daemon, items)
        async with connected(daemon) as client:
            # A finished prompt is kept where it decoded until the next turn moves it
            # into the cache's own pool (here: fails to, a fork too, and drops it).
            with anyio.fail_after(20):
                while (status := await client.status()).prefix_cache.entries:  # type: ignore[union-attr]
                    await anyio.sleep(0.01)
    got = ok_tokens(results)
    for item, result in zip(items, results, strict=True):
        assert got[item.custom_id] == decode_alone(reference, item)
        assert result.usage is not None and result.usage.cached_tokens == 0
    pc = status.prefix_cache
    assert pc is not None and pc.fork_failures >= 3 and pc.hits == 0
    # The kept prefix could not move into the cache's pool either (that copy is a fork
    # too): it was dropped, not kept half-way.
    assert pc.kept >= 1 and pc.evictions == pc.kept and pc.bytes == 0
    assert status.kv_bytes_in_use == 0 and status.growth.failures == {}


async def test_a_donor_cancelled_while_a_fork_copies_from_it(
    tiny_model: Path, sock_dir: Path, reference: Engine
) -> None:
    """The copy runs on the model's thread (slowed at the copy); the donor's job is
    cancelled meanwhile. The copy reads the whole prefix, and the donor's row goes only
    after it: the fork's tokens are exact and nothing is left allocated."""
    prompt = token_prompt(90, seed=70)
    donor = Item(
        custom_id="donor",
        prompt_tokens=prompt,
        max_new_tokens=2000,
        temperature=0.0,
        ignore_eos=True,
    )
    fork = Item(custom_id="fork", prompt_tokens=[*prompt, 5, 6, 7], max_new_tokens=20)
    async with running(make_config(tiny_model, sock_dir)) as daemon:
        engine = daemon.engine
        assert engine is not None and engine.prefix is not None
        async with connected(daemon) as client:
            donor_job = await client.submit([donor])
            with anyio.fail_after(20):
                while (await client.status()).growth.growths < 5:  # past its prefill
                    await anyio.sleep(0.01)
            failpoints.slow("kv.fork", 0.5)
            fork_job = await client.submit([fork])
            with anyio.fail_after(20):  # the copy has begun: its source is pinned
                while not any(h.pins for hs in engine.prefix._index.values() for h in hs):
                    await anyio.sleep(0.005)
            await client.cancel(donor_job.job_id)
            (cancelled,) = await donor_job.results()
            (forked,) = await fork_job.results()
            failpoints.disarm()
            # The fork's own prefix may still be moving into the cache's pool (a copy
            # slowed like any fork): until it lands, that row counts as a session's.
            with anyio.fail_after(20):
                while (status := await client.status()).kv_bytes_in_use:
                    await anyio.sleep(0.01)
    assert cancelled.error is not None and cancelled.error.code == "cancelled"
    assert forked.status == "ok" and forked.token_ids == decode_alone(reference, fork)
    assert forked.usage is not None and forked.usage.cached_tokens == 80
    assert status.prefix_cache is not None and status.prefix_cache.entries == 1
