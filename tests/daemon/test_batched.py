"""The daemon decodes ready sessions of one bucket in one run; a row's failure stays its own."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest

from kvmux.client import Item
from kvmux.client import protocol as p
from kvmux.daemon.engine import Engine
from kvmux.kv import failpoints

from .conftest import connected, make_config, running
from .helpers import decode_alone, ok_tokens, token_prompt

pytestmark = pytest.mark.anyio


async def test_a_run_failing_for_one_row_fails_that_item_alone(
    tiny_model: Path, sock_dir: Path, reference: Engine
) -> None:
    """Eight items share one cohort (bucket 256), so every decode run holds all of them;
    runs holding item 5's row fail from the moment the failpoint is armed. The batch is
    split until that row fails alone: item 5 gets ``run_failed``, the others their tokens."""
    cfg = make_config(tiny_model, sock_dir, kv={"min_bucket": 256})
    items = [
        Item(
            custom_id=str(i),
            prompt_tokens=token_prompt(6 + i, seed=i),
            max_new_tokens=150,
            temperature=0.0,
            ignore_eos=True,
        )
        for i in range(8)
    ]
    failpoints.slow("engine.step", 0.001)  # item 5 is still decoding when armed
    async with running(cfg) as daemon, connected(daemon) as client:
        job = await client.submit(items)
        failpoints.arm("engine.run", key=f"{job.job_id}/5")
        results = await job.results()
        failpoints.disarm()
        status = await client.status()
        assert daemon.engine is not None
        runner = daemon.engine.runner
        assert runner.rows_run > 2 * runner.runs  # decode runs held rows 0-4 and 6-7
    by_id = {r.custom_id: r for r in results}
    err = by_id["5"].error
    assert err is not None and err.code == "run_failed"
    assert err.details["cause"] == "injected" and err.details["session_unchanged"] is True
    others = [r for r in results if r.custom_id != "5"]
    got = ok_tokens(others)
    for item in items:
        if item.custom_id != "5":
            assert got[item.custom_id] == decode_alone(reference, item)
    assert status.kv_bytes_in_use == 0


async def test_a_job_arriving_mid_run_joins_at_the_next_chunk(
    tiny_model: Path, sock_dir: Path, reference: Engine
) -> None:
    """The model thread decodes a run of many steps while the loop only streams its
    chunks; an arrival asks for the loop, so the run ends at its next chunk and the
    new item starts then, not when the run would have ended (its budget is 200 steps).

    Steps are slowed to 5 ms, so a chunk is two steps; counted in the first job's
    tokens, the second job starts within a few of them."""
    cfg = make_config(tiny_model, sock_dir, kv={"min_bucket": 256})

    def item(name: str, n: int, seed: int) -> Item:
        return Item(
            custom_id=name,
            prompt_tokens=token_prompt(8, seed=seed),
            max_new_tokens=n,
            temperature=0.0,
            ignore_eos=True,
        )

    long, late = item("long", 200, 1), item("late", 4, 2)
    failpoints.slow("engine.step", 0.005)
    long_tokens = 0
    joined_at: int | None = None
    async with running(cfg) as daemon, connected(daemon) as client:
        first = await client.submit([long])
        async for ev in first.events():
            if isinstance(ev, p.TokenDelta):
                long_tokens += len(ev.token_ids)
                if long_tokens >= 20:
                    break
        second = await client.submit([late])
        submitted_at = long_tokens

        async def watch_second() -> None:
            nonlocal joined_at
            async for ev in second.events():
                if isinstance(ev, p.TokenDelta) and joined_at is None:
                    joined_at = long_tokens

        async with anyio.create_task_group() as tg:
            tg.start_soon(watch_second)
            async for ev in first.events():
                if isinstance(ev, p.TokenDelta):
                    long_tokens += len(ev.token_ids)
        results = [*(await first.results()), *(await second.results())]
        failpoints.disarm()
    assert joined_at is not None
    assert joined_at - submitted_at <= 12, (submitted_at, joined_at)
    got = ok_tokens(results)
    assert got["long"] == decode_alone(reference, long)
    assert got["late"] == decode_alone(reference, late)


async def test_every_growth_of_a_batched_run_goes_through_the_coordinator(
    tiny_model: Path, sock_dir: Path, reference: Engine
) -> None:
    """A run stops before a step that would not fit a session's bucket, so every
    growth is the coordinator's (under its lock), none the model thread's own.

    Eight items of 6-13 prompt tokens and 150 new ones each pass through the
    buckets 16, 32, 64, 128 and 256: five allocations each (the first included),
    forty in all, every one counted by the coordinator."""
    cfg = make_config(tiny_model, sock_dir, kv={"min_bucket": 16})
    items = [
        Item(
            custom_id=str(i),
            prompt_tokens=token_prompt(6 + i, seed=20 + i),
            max_new_tokens=150,
            temperature=0.0,
            ignore_eos=True,
        )
        for i in range(8)
    ]
    async with running(cfg) as daemon, connected(daemon) as client:
        results = await (await client.submit(items)).results()
        status = await client.status()
    got = ok_tokens(results)
    for item in items:
        assert got[item.custom_id] == decode_alone(reference, item)
    assert status.growth.growths == 5 * len(items)
    assert status.kv_bytes_in_use == 0
