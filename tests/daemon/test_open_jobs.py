"""Open jobs: a job that takes more items after it starts, on a real daemon and socket."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import anyio
import pytest

from kvmux.client import BadRequest, Item, NotFound, Overloaded
from kvmux.client import protocol as p
from kvmux.client._client import Chunk, chunked
from kvmux.daemon.access import Caller
from kvmux.daemon.engine import Engine
from kvmux.kv import failpoints

from .conftest import connected, make_config, running
from .helpers import decode_alone, token_prompt

pytestmark = pytest.mark.anyio


@dataclass
class Bad:
    """A line the client could not parse, as the CLI's LineError carries it."""

    line: int
    reason: str
    custom_id: str


def _item(i: int, n: int = 6) -> Item:
    return Item(
        custom_id=f"c{i}",
        prompt_tokens=token_prompt(3 + i % 5, seed=i),
        max_new_tokens=n,
        ignore_eos=True,
        line=i + 1,
    )


@pytest.fixture
def state() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="kvo-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


async def test_an_open_job_takes_items_until_the_last_and_finishes_only_then(
    tiny_model: Path, sock_dir: Path, reference: Engine
) -> None:
    items = [_item(i) for i in range(6)]
    async with running(make_config(tiny_model, sock_dir)) as daemon, connected(daemon) as client:
        job = await client.submit(items[:2], more=True, format="openai")
        assert job.total == 2
        assert await job.add(items[2:5], [p.Rejected("bad", "not JSON", line=40)]) == 6
        # Everything sent so far ends, but the job is open: it is not finished.
        with anyio.fail_after(30):
            while len(await job.fetch_results()) < 6:
                await anyio.sleep(0.05)
        info = next(j for j in await client.jobs() if j.job_id == job.job_id)
        assert (info.state, info.open, info.total) == ("running", True, 6)
        assert not job.finished
        assert await job.add(items[5:], last=True) == 7
        finished = [ev async for ev in job.events() if isinstance(ev, p.JobFinished)]
        results = await job.results()
        info = next(j for j in await client.jobs() if j.job_id == job.job_id)
        assert (info.state, info.open) == ("done", False)
        with pytest.raises(BadRequest, match="takes no more items"):
            await job.add(items[:1])
        again = await client.attach(job.job_id)
    assert finished == [p.JobFinished(job_id=job.job_id, total=7, ok=6, failed=1)]
    assert again.format == "openai"
    assert [r.index for r in results] == list(range(7))
    # Items in arrival order: each message's items, then its rejected lines.
    assert [r.custom_id for r in results] == ["c0", "c1", "c2", "c3", "c4", "bad", "c5"]
    bad = results[5]
    assert bad.status == "error" and bad.error is not None
    assert bad.error.code == "bad_request" and bad.line == 40
    assert bad.error.details == {"line": 40, "reason": "not JSON"}
    for r, item in zip([*results[:5], results[6]], items, strict=True):
        assert r.status == "ok"
        assert r.token_ids == decode_alone(reference, item)


class _Nowhere:
    """An event sink that drops what it gets (a client that never reads)."""

    def deliver(self, events: list[p.Event]) -> None:
        del events


async def test_job_requests_are_owner_checked_and_bounded(tiny_model: Path, sock_dir: Path) -> None:
    cfg = make_config(tiny_model, sock_dir, scheduler={"max_job_items": 4, "max_job_total": 6})
    async with running(cfg) as daemon, connected(daemon) as client:
        with pytest.raises(BadRequest, match="at least one item"):
            await client.submit([])
        job = await client.submit([], more=True)
        assert job.total == 0
        stranger = Caller("uid:4242424")
        with pytest.raises(NotFound):
            await daemon.service.add_items(_Nowhere(), job.job_id, [_item(0)], caller=stranger)
        with pytest.raises(BadRequest, match="max_job_items"):
            await job.add([_item(i) for i in range(3)], [p.Rejected("r", "no")] * 2)
        assert await job.add([_item(i) for i in range(4)]) == 4
        with pytest.raises(BadRequest, match="max_job_total"):
            await job.add([_item(i) for i in range(3)])
        # Refused messages added nothing; the job goes on and closes normally.
        assert await job.add([_item(4)], last=True) == 5
        results = await job.results()
    assert [r.status for r in results] == ["ok"] * 5


async def test_a_full_queue_refuses_an_addition_whole_and_the_feeder_waits_it_out(
    tiny_model: Path, sock_dir: Path, reference: Engine
) -> None:
    cfg = make_config(
        tiny_model,
        sock_dir,
        scheduler={
            "max_active_sessions": 1,
            "max_queued_items": 4,
            "max_queued_per_owner": 4,
            "max_job_items": 4,
        },
    )
    items = [_item(i, n=12) for i in range(14)]
    waits: list[float] = []
    added: list[tuple[int, int]] = []

    def on_added(chunk: Chunk, total: int) -> None:
        added.append((len(chunk), total))

    async with running(cfg) as daemon, connected(daemon) as client:
        job = await client.submit(items[:4], more=True)
        with pytest.raises(Overloaded) as info:
            await job.add(items[4:6])
        assert info.value.details["retry_after"] > 0
        assert await job.add_all(items[4:], on_wait=waits.append, on_added=on_added) == 14
        results = await job.results()
        status = await client.status()
    assert status.sessions_queued == 0  # every refused or admitted item accounted once
    assert any(w > 0 for w in waits) and waits[-1] == 0.0
    assert sum(n for n, _ in added) == 10 and added[-1][1] == 14
    assert [r.custom_id for r in results] == [it.custom_id for it in items]
    for r, item in zip(results, items, strict=True):
        assert r.token_ids == decode_alone(reference, item)


def test_chunks_stay_within_the_message_limits_and_refuse_what_cannot_fit() -> None:
    entries: list[Item | Bad] = [
        Item(custom_id=f"x{i}", prompt="a" * 300, line=i + 1) for i in range(10)
    ]
    entries.insert(3, Bad(4, "broken", "line-4"))
    entries.append(Item(custom_id="huge", prompt="b" * 5000, line=99))
    entries.append(Item(custom_id="bad", prompt="c", top_p=7.0, line=100))
    chunks = list(chunked(entries, max_items=3, max_bytes=2048))
    assert chunks[-1].last and not any(c.last for c in chunks[:-1])
    assert all(0 < len(c) <= 3 for c in chunks)
    sizes = [sum(len(p.encode(x)) for x in [*c.items, *c.rejected]) for c in chunks]
    assert all(size <= 2048 - 1024 for size in sizes)
    refused = {r.custom_id: r for c in chunks for r in c.rejected}
    assert set(refused) == {"line-4", "huge", "bad"}
    assert "max_message_bytes" in refused["huge"].reason and refused["huge"].line == 99
    assert "top_p" in refused["bad"].reason
    assert sum(len(c.items) for c in chunks) == 10
    assert list(chunked([], max_items=3, max_bytes=2048)) == [Chunk(last=True)]


async def test_a_detached_job_keeps_its_rejected_lines_for_whoever_collects_it(
    tiny_model: Path, sock_dir: Path
) -> None:
    lines: list[Item | Bad] = [_item(0)]
    lines += [Bad(i, f"reason {i}", f"line-{i}") for i in range(2, 9)]
    lines += [_item(8)]
    async with running(make_config(tiny_model, sock_dir)) as daemon:
        async with connected(daemon) as client:
            job = await client.submit_stream(lines, detach=True, keep_results=False)
            job_id = job.job_id
        async with connected(daemon) as later:
            results = await (await later.attach(job_id)).results()
            info = next(j for j in await later.jobs() if j.job_id == job_id)
    assert len(results) == 9
    assert (info.total, info.ok, info.failed) == (9, 2, 7)
    failed = [r for r in results if r.status == "error"]
    assert [r.line for r in failed] == list(range(2, 9))
    assert all(r.error is not None and r.error.code == "bad_request" for r in failed)


async def test_a_journaled_open_job_comes_back_open_and_takes_the_rest(
    tiny_model: Path, state: Path, reference: Engine
) -> None:
    cfg = make_config(
        tiny_model,
        state,
        jobs={"journal": str(state / "jobs.sqlite3")},
        shutdown={"grace": 0.2},
    )
    items = [_item(i) for i in range(5)]
    async with running(cfg) as daemon, connected(daemon) as client:
        job = await client.submit(items[:2], more=True, format="openai", detach=True)
        await job.add(items[2:3], [p.Rejected("gone", "bad line", line=9)])
        job_id = job.job_id
    async with running(cfg) as daemon, connected(daemon) as client:
        job = await client.attach(job_id)
        assert (job.total, job.finished, job.format) == (4, False, "openai")
        assert await job.add(items[3:], last=True) == 6
        results = await job.results()
    assert [r.custom_id for r in results] == ["c0", "c1", "c2", "gone", "c3", "c4"]
    assert results[3].error is not None and results[3].line == 9
    for r, item in zip([*results[:3], *results[4:]], items, strict=True):
        assert r.token_ids == decode_alone(reference, item)


async def test_a_drain_does_not_wait_for_an_open_job_with_nothing_to_decode(
    tiny_model: Path, state: Path
) -> None:
    cfg = make_config(
        tiny_model,
        state,
        jobs={"journal": str(state / "jobs.sqlite3")},
        shutdown={"grace": 30.0},
    )
    async with running(cfg) as daemon, connected(daemon) as client:
        job = await client.submit([_item(0)], more=True)
        with anyio.fail_after(20):
            async for ev in job.events():
                if isinstance(ev, p.ItemFinished):
                    break
        job_id = job.job_id
        await client.detach(job_id)  # else it ends with this client
        stopping = anyio.current_time()
    # The block's exit is the drain: its items are done, only more may come.
    assert anyio.current_time() - stopping < 5.0
    async with running(cfg) as daemon, connected(daemon) as client:
        job = await client.attach(job_id)
        assert (job.total, job.finished) == (1, False)


async def test_an_abandoned_open_job_is_closed_and_finishes_with_what_it_has(
    tiny_model: Path, sock_dir: Path
) -> None:
    cfg = make_config(tiny_model, sock_dir, jobs={"open_timeout": 0.5})
    async with running(cfg) as daemon:
        async with connected(daemon) as client:
            job = await client.submit([_item(0)], more=True, detach=True)
            job_id = job.job_id
        async with connected(daemon) as later:
            with anyio.fail_after(20):
                while [j.state for j in await later.jobs() if j.job_id == job_id] != ["done"]:
                    await anyio.sleep(0.1)
            results = await (await later.attach(job_id)).results()
    assert [r.status for r in results] == ["ok"]


async def test_a_cancelled_item_keeps_the_text_it_had_produced(
    tiny_model: Path, sock_dir: Path, reference: Engine
) -> None:
    item = Item(custom_id="long", prompt="go on", max_new_tokens=1500, ignore_eos=True)
    async with running(make_config(tiny_model, sock_dir)) as daemon, connected(daemon) as client:
        job = await client.submit([item])
        got = 0
        async for ev in job.events():
            if isinstance(ev, p.TokenDelta):
                got += len(ev.token_ids)
                if got >= 5:
                    break
        await client.cancel(job.job_id)
        [result] = await job.results()
    assert result.status == "error" and result.error is not None
    assert result.error.code == "cancelled" and result.error.details["partial"] is True
    n = len(result.token_ids)
    assert 5 <= n < 1500
    alone = Item(prompt="go on", max_new_tokens=n, ignore_eos=True)
    assert result.token_ids == decode_alone(reference, alone)
    assert result.text == reference.tokenizer.decode(result.token_ids)


async def test_an_open_job_is_cancelled_when_its_client_leaves_unless_detached(
    tiny_model: Path, sock_dir: Path
) -> None:
    async with running(make_config(tiny_model, sock_dir)) as daemon:
        # Slowed steps (1500 of at least 2 ms): `left` is surely still decoding
        # when its client leaves, however fast the daemon decodes.
        failpoints.slow("engine.step", 0.002)
        async with connected(daemon) as client:
            left = await client.submit([_item(0, n=1500)], more=True)
            kept = await client.submit([_item(1)], more=True, detach=True)
            # Two additions at once: the second is refused whole, the first goes in.
            # The first's check is slowed so it is still under way when the
            # second arrives, however fast the daemon checks an item.
            failpoints.slow("scheduler.admit", 0.2)
            first, second = await asyncio.gather(
                left.add([_item(2, n=1500)]), left.add([_item(3)]), return_exceptions=True
            )
            failpoints.disarm("scheduler.admit")
        async with connected(daemon) as later:
            with anyio.fail_after(20):
                while [j.state for j in await later.jobs() if j.job_id == left.job_id] != ["done"]:
                    await anyio.sleep(0.05)
            results = await (await later.attach(left.job_id)).results()
            still = next(j for j in await later.jobs() if j.job_id == kept.job_id)
            assert await (await later.attach(kept.job_id)).add([_item(4)], last=True) == 2
    assert first == 2 and isinstance(second, Overloaded)
    assert [r.error.code if r.error else None for r in results] == ["cancelled", "cancelled"]
    assert still.state == "running"


async def test_one_owner_holds_a_bounded_number_of_open_jobs(
    tiny_model: Path, sock_dir: Path
) -> None:
    # An open job needs no item: without this bound a client could open jobs
    # until the daemon's memory and journal are full.
    cfg = make_config(tiny_model, sock_dir, jobs={"max_open_per_owner": 2})
    async with running(cfg) as daemon, connected(daemon) as client:
        first = await client.submit([], more=True)
        await client.submit([], more=True)
        with pytest.raises(Overloaded, match="max_open_per_owner"):
            await client.submit([], more=True)
        # A job that is not open does not count.
        done = await client.submit([_item(0)])
        assert (await done.results())[0].status == "ok"
        await first.add([_item(1)], last=True)
        third = await client.submit([], more=True)
        assert third.total == 0
