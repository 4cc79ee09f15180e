"""Sessions crossing into one bucket at one step grow together: one hold of the growth lock
for all of them, each judged alone, tokens as decoded alone."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvmux.client import Item
from kvmux.daemon.engine import Engine

from .conftest import connected, make_config, running
from .helpers import decode_alone, ok_tokens, token_prompt

pytestmark = pytest.mark.anyio


def _lockstep(n: int, new: int) -> list[Item]:
    """Equal prompt lengths: they prefill in one chunk and cross each bucket together."""
    return [
        Item(
            custom_id=str(i),
            prompt_tokens=token_prompt(10, seed=70 + i),
            max_new_tokens=new,
            temperature=0.0,
            ignore_eos=True,
        )
        for i in range(n)
    ]


async def test_a_step_s_growths_take_the_lock_once(
    tiny_model: Path, sock_dir: Path, reference: Engine
) -> None:
    """16 sessions grow 16 -> 32 -> 64 -> 128 at the same steps: 48 growths (and 16
    first allocations) under a handful of lock holds, not 64."""
    n = 16
    cfg = make_config(
        tiny_model, sock_dir, kv={"min_bucket": 16}, scheduler={"max_active_sessions": n}
    )
    items = _lockstep(n, 100)
    async with running(cfg) as daemon, connected(daemon) as client:
        job = await client.submit(items)
        results = await job.results()
        status = await client.status()
    got = ok_tokens(results)
    for item in items:
        assert got[item.custom_id] == decode_alone(reference, item), item.custom_id
    growth = status.growth
    assert growth.growths == 4 * n and not growth.failures
    assert 0 < growth.lock_holds <= growth.growths // 4, growth
    assert status.kv_bytes_in_use == 0


async def test_the_budget_takes_some_of_a_group_and_the_rest_fail_translated(
    tiny_model: Path, sock_dir: Path, reference: Engine
) -> None:
    """Four sessions at 64 and room for two rows of 128 more: the two oldest grow, whose
    old rows make room for a third; the newest is refused, with the same translated
    error a growth alone gets, and the three finish as if decoded alone."""
    n, bpt = 4, reference.kv_spec.bytes_per_token
    budget = (n * 64 + 2 * 128) * bpt
    cfg = make_config(
        tiny_model,
        sock_dir,
        kv={"min_bucket": 16, "memory_budget": budget},
        scheduler={"max_active_sessions": n, "on_growth_failure": "fail"},
    )
    items = _lockstep(n, 100)
    async with running(cfg) as daemon, connected(daemon) as client:
        job = await client.submit(items)
        results = await job.results()
        status = await client.status()
    by_id = {r.custom_id: r for r in results}
    refused = by_id.pop("3")
    assert refused.status == "error" and refused.error is not None
    assert refused.error.code == "kv_growth_failed"
    d = refused.error.details
    assert d["cause"] == "budget" and d["failed_step"] == "allocate"
    assert (d["old_capacity"], d["new_capacity"]) == (64, 128)
    assert d["transient_peak_bytes"] == (64 + 128) * bpt and d["bytes_per_token"] == bpt
    assert d["memory_source"] == "kv.memory_budget" and d["session_unchanged"] is True
    assert d["levers"]
    got = ok_tokens(list(by_id.values()))
    for item in items[:3]:
        assert got[item.custom_id] == decode_alone(reference, item), item.custom_id
    assert status.growth.failures == {"budget": 1}
    # Each step's growths under one hold (the refused included), the budget's rounds too.
    assert status.growth.lock_holds <= status.growth.growths // 3, status.growth
    assert status.kv_peak_bytes <= budget and status.kv_bytes_in_use == 0
