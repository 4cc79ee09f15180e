"""The growth coordinator under memory pressure: the lock's purpose, isolation, the wait policy.

Memory pressure is real accounting: a ``kv.memory_budget`` sized in tokens of
the tiny model (``bytes_per_token`` bytes each) so that a given growth must be
refused. The one artificial part is a slowed prefix copy (a failpoint delay),
which holds each growth's transient peak open long enough that concurrent
growths overlap every time, as they would with a large model's copy.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest

from kvmux.client import Item
from kvmux.daemon.config import Config
from kvmux.daemon.engine import Engine
from kvmux.kv import failpoints

from .conftest import connected, make_config, running
from .helpers import decode_alone, ok_tokens, token_prompt

pytestmark = pytest.mark.anyio

GROWTH_DETAILS = {
    "old_capacity",
    "new_capacity",
    "valid_len",
    "failed_step",
    "cause",
    "cause_message",
    "new_alloc_bytes",
    "transient_peak_bytes",
    "bytes_per_token",
    "device_free_bytes",
    "device_total_bytes",
    "memory_source",
    "hard_max",
    "hard_max_source",
    "session_unchanged",
    "levers",
}


def a_waits_for_b(
    model: Path, sock_dir: Path, reference: Engine, **b_overrides: Any
) -> tuple[Config, Item, Item]:
    """An 800-token budget under the wait policy; A (250-token prompt) must grow
    256 -> 512 (peak 768) while B (200-token prompt) holds 256: A parks until B ends."""
    bpt = reference.kv_spec.bytes_per_token
    cfg = make_config(
        model,
        sock_dir,
        kv={"min_bucket": 16, "memory_budget": 800 * bpt},
        scheduler={"on_growth_failure": "wait", "growth_retries": 4},
    )
    a = Item(
        custom_id="A",
        prompt_tokens=token_prompt(250, seed=1),
        max_new_tokens=40,
        temperature=0.0,
        ignore_eos=True,
    )
    b = Item(
        custom_id="B",
        prompt_tokens=token_prompt(200, seed=2),
        max_new_tokens=50,
        temperature=0.0,
        ignore_eos=True,
    )
    return cfg, a, msgspec.structs.replace(b, **b_overrides)


@pytest.mark.parametrize("serialize", [True, False], ids=["with-lock", "lock-disabled"])
async def test_lock_keeps_transient_peaks_apart(
    tiny_model: Path, sock_dir: Path, reference: Engine, serialize: bool
) -> None:
    """8 sessions grow 16 -> 32 -> 64 -> 128 at the same steps. The budget holds all
    eight at 128 plus ONE transient peak (old 64 + new 128 of one session)."""
    n, bpt = 8, reference.kv_spec.bytes_per_token
    budget = (n * 128 + 64) * bpt
    cfg = make_config(
        tiny_model,
        sock_dir,
        kv={"min_bucket": 16, "memory_budget": budget},
        scheduler={"max_active_sessions": n, "on_growth_failure": "fail"},
    )
    items = [
        Item(
            custom_id=str(i),
            prompt_tokens=token_prompt(10, seed=i),
            max_new_tokens=100,
            temperature=0.0,
            ignore_eos=True,
        )
        for i in range(n)
    ]
    # Without the lock the peaks overlap only if the copies do, and the growths' 4
    # threads alone keep the 64 -> 128 peaks within the budget (8 x 64 + 4 x 128 fits)
    # unless sessions that grew first are still decoding at 128 when the others copy:
    # a race, which sessions that finish a few ms after their growth sometimes won.
    # So every growth gets a thread, and the copies are slow: all eight 0.3 s copies
    # of one step overlap (8 x 64 + 8 x 128 is over the budget) however the loop's
    # ms-apart starts fall.
    failpoints.slow("kv.copy_prefix", 0.05 if serialize else 0.3)
    async with (
        running(cfg, serialize_growth=serialize, growth_threads=n) as daemon,
        connected(daemon) as client,
    ):
        job = await client.submit(items)
        results = await job.results()
        status = await client.status()
    assert status.kv_bytes_in_use == 0
    assert status.kv_peak_bytes <= budget
    failed = [r for r in results if r.status == "error"]
    if serialize:
        assert not failed and not status.growth.failures
        got = ok_tokens(results)
        for item in items:
            assert got[item.custom_id] == decode_alone(reference, item)
    else:
        # Without the lock the peaks overlap and the budget refuses some growths.
        assert failed and status.growth.failures.get("budget", 0) == len(failed)
        for r in failed:
            assert r.error is not None and r.error.code == "kv_growth_failed"
            assert r.error.details["cause"] == "budget"


async def test_one_failed_growth_stays_with_its_item(
    tiny_model: Path, sock_dir: Path, reference: Engine
) -> None:
    """Seven short items end by bucket 32; one long item needs 256 -> 512, whose peak
    (768 tokens) the 700-token budget can never hold. Only that item fails."""
    bpt = reference.kv_spec.bytes_per_token
    cfg = make_config(
        tiny_model,
        sock_dir,
        kv={"min_bucket": 16, "memory_budget": 700 * bpt},
        scheduler={"on_growth_failure": "fail"},
    )
    others = [
        Item(
            custom_id=f"short-{i}",
            prompt_tokens=token_prompt(8, seed=50 + i),
            max_new_tokens=20,
            temperature=0.0 if i % 2 else 0.7,
            seed=i,
            ignore_eos=True,
        )
        for i in range(7)
    ]
    target = Item(
        custom_id="long",
        prompt_tokens=token_prompt(8, seed=99),
        max_new_tokens=300,
        temperature=0.0,
        ignore_eos=True,
    )
    async with running(cfg) as daemon:
        async with connected(daemon) as a, connected(daemon) as b:
            job_a = await a.submit([target, *others[:3]])
            job_b = await b.submit(others[3:])
            results = [*await job_a.results(), *await job_b.results()]
        # The daemon keeps serving after the failure.
        async with connected(daemon) as c:
            after = await (await c.submit([others[0]])).results()
            status = await c.status()

    by_id = {r.custom_id: r for r in results}
    err = by_id["long"].error
    assert by_id["long"].status == "error" and err is not None
    assert err.code == "kv_growth_failed"
    assert set(err.details) >= GROWTH_DETAILS
    d = err.details
    assert (d["old_capacity"], d["new_capacity"], d["cause"]) == (256, 512, "budget")
    assert d["transient_peak_bytes"] == (256 + 512) * bpt
    assert d["bytes_per_token"] == bpt and d["session_unchanged"] is True
    assert d["device_total_bytes"] == 700 * bpt and d["memory_source"] == "kv.memory_budget"
    assert "256 -> 512" in err.message
    for item in others:
        assert by_id[item.custom_id].token_ids == decode_alone(reference, item)
    assert ok_tokens(after)[others[0].custom_id] == decode_alone(reference, others[0])
    assert status.kv_bytes_in_use == 0 and status.growth.failures == {"budget": 1}


async def test_wait_policy_parks_until_memory_is_freed(
    tiny_model: Path, sock_dir: Path, reference: Engine
) -> None:
    """A (250-token prompt) must grow 256 -> 512 (peak 768) while B holds 256 of an
    800-token budget: refused, parked; B finishes, A retries and completes."""
    cfg, a, b = a_waits_for_b(tiny_model, sock_dir, reference)
    # Slowed steps: B is still decoding when A asks to grow, however loaded the machine.
    failpoints.slow("engine.step", 0.002)
    async with running(cfg) as daemon, connected(daemon) as client:
        results = await (await client.submit([a, b])).results()
        status = await client.status()
    got = ok_tokens(results)
    assert got["A"] == decode_alone(reference, a)
    assert got["B"] == decode_alone(reference, b)
    assert status.growth.failures == {"budget": 1}
    assert status.growth.parked_retries == 1
    assert status.kv_bytes_in_use == 0


async def test_wait_policy_gives_up_when_nobody_can_free(
    tiny_model: Path, sock_dir: Path, reference: Engine
) -> None:
    """Alone under a budget it can never fit, a parked session fails instead of waiting forever."""
    bpt = reference.kv_spec.bytes_per_token
    cfg = make_config(
        tiny_model,
        sock_dir,
        kv={"min_bucket": 16, "memory_budget": 100 * bpt},
        scheduler={"on_growth_failure": "wait"},
    )
    item = Item(
        custom_id="x", prompt_tokens=token_prompt(8, seed=3), max_new_tokens=200, ignore_eos=True
    )
    async with running(cfg) as daemon, connected(daemon) as client:
        (result,) = await (await client.submit([item])).results()
        status = await client.status()
    assert result.error is not None and result.error.code == "kv_growth_failed"
    assert result.error.details["new_capacity"] == 128
    assert status.kv_bytes_in_use == 0 and status.sessions_parked == 0


async def test_cancel_while_growing_or_parked_releases_everything(
    tiny_model: Path, sock_dir: Path, reference: Engine
) -> None:
    """A cancel that lands mid-growth waits for the growth to end, then releases; a parked
    session is released at once; the session that kept running is untouched."""
    # B is capped at 256 tokens, so it holds its bucket for a while and then ends.
    cfg, a, b = a_waits_for_b(tiny_model, sock_dir, reference, max_new_tokens=400, max_context=256)
    async with running(cfg) as daemon, connected(daemon) as client:
        # Mid-growth: every copy takes 0.3 s, so the cancel lands inside the first one.
        failpoints.slow("kv.copy_prefix", 0.3)
        growing = await client.submit([Item(prompt="x", max_new_tokens=50)])
        await client.cancel(growing.job_id)
        (cancelled,) = await growing.results()
        failpoints.disarm()
        assert (await client.status()).kv_bytes_in_use == 0
        # Parked: A waits for B's memory (as in the wait-policy test); cancel A.
        # Slowed steps keep B (and so A's parking) alive long enough to watch.
        failpoints.slow("engine.step", 0.005)
        job_b = await client.submit([b])
        job_a = await client.submit([a])
        with anyio.fail_after(20):
            while (await client.status()).sessions_parked == 0:
                await anyio.sleep(0.01)
        await client.cancel(job_a.job_id)
        failpoints.disarm()
        (result_a,) = await job_a.results()
        (result_b,) = await job_b.results()
        status = await client.status()
    assert cancelled.error is not None and cancelled.error.code == "cancelled"
    assert result_a.error is not None and result_a.error.code == "cancelled"
    assert result_b.token_ids == decode_alone(reference, b)
    assert status.kv_bytes_in_use == 0 and status.sessions_parked == 0
