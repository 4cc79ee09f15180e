"""``stream`` false: a client that wants only results gets no token updates, the same
results, and its job's text decoded once at each item's end (issue 28, item 5)."""

from __future__ import annotations

import asyncio
import concurrent.futures
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest

from kvmux.client import Client, Item, Job
from kvmux.client import protocol as p
from kvmux.daemon.engine import DecodeSession, Engine, StepOutput
from kvmux.daemon.scheduler import _loop
from kvmux.kv import failpoints

from .conftest import connected, make_config, running

pytestmark = pytest.mark.anyio


def _items() -> list[Item]:
    return [
        Item(custom_id="greedy", prompt="once upon", max_new_tokens=40, ignore_eos=True),
        Item(
            custom_id="sampled",
            prompt="a time",
            max_new_tokens=40,
            temperature=0.9,
            seed=7,
            ignore_eos=True,
        ),
        # Stop strings are looked for on the model thread, which decodes as it goes.
        Item(custom_id="stops", prompt="there", max_new_tokens=40, stop=["zq"]),
    ]


async def _events(job: Job) -> list[p.Event]:
    return [ev async for ev in job.events()]


async def _quiet_and_under_way(client: Client, item: Item) -> Job:
    """``item`` submitted with ``stream`` false, once some of its tokens went by
    (steps are slowed to 2 ms by the caller)."""
    job = await client.submit([item], stream=False)
    async for ev in job.events():
        if isinstance(ev, p.ItemStarted):
            break
    await anyio.sleep(0.2)
    return job


async def test_a_job_without_stream_gets_the_same_results_and_no_token_updates(
    tiny_model: Path, sock_dir: Path, reference: Engine
) -> None:
    async with running(make_config(tiny_model, sock_dir)) as daemon, connected(daemon) as client:
        quiet = await client.submit(_items(), stream=False)
        quiet_events = await _events(quiet)
        streamed = await client.submit(_items())
        streamed_events = await _events(streamed)
        status = await client.status()
    kinds = [type(ev).__name__ for ev in quiet_events]
    assert "TokenDelta" not in kinds
    assert kinds.count("ItemStarted") == 3 and kinds.count("ItemFinished") == 3
    assert kinds[-1] == "JobFinished"
    results = {
        ev.result.custom_id: ev.result for ev in quiet_events if isinstance(ev, p.ItemFinished)
    }
    want = {
        ev.result.custom_id: ev.result for ev in streamed_events if isinstance(ev, p.ItemFinished)
    }
    assert all(r.status == "ok" for r in results.values())
    for name, r in results.items():
        assert (r.token_ids, r.text) == (want[name].token_ids, want[name].text), name
        # The text is the whole decode of the tokens, not only the last chunk's.
        assert r.text == reference.tokenizer.decode(r.token_ids), name
    # The streamed job's updates add up to its results.
    for index in range(3):
        deltas = [
            ev for ev in streamed_events if isinstance(ev, p.TokenDelta) and ev.index == index
        ]
        result = next(r for r in want.values() if r.index == index)
        assert [t for d in deltas for t in d.token_ids] == result.token_ids
        assert "".join(d.text for d in deltas) == result.text
    assert status.kv_bytes_in_use == 0


async def test_a_client_attaching_with_stream_gets_the_rest_of_a_quiet_job(
    tiny_model: Path, sock_dir: Path
) -> None:
    """The submitter takes no updates; a second client attaches with ``stream`` and
    gets every token from then on, and the text that nobody took before comes with
    its first update. The submitter never gets one."""
    item = Item(custom_id="long", prompt="go on", max_new_tokens=300, ignore_eos=True)
    failpoints.slow("engine.step", 0.002)
    try:
        async with (
            running(make_config(tiny_model, sock_dir)) as daemon,
            connected(daemon) as submitter,
            connected(daemon) as watcher,
        ):
            job = await _quiet_and_under_way(submitter, item)  # nobody takes its tokens
            watched = await watcher.attach(job.job_id)
            deltas = [ev for ev in await _events(watched) if isinstance(ev, p.TokenDelta)]
            rest = await _events(job)
    finally:
        failpoints.disarm()
    [result] = [ev.result for ev in rest if isinstance(ev, p.ItemFinished)]
    assert result.status == "ok" and len(result.token_ids) == 300
    assert not any(isinstance(ev, p.TokenDelta) for ev in rest)
    ids = [t for d in deltas for t in d.token_ids]
    text = "".join(d.text for d in deltas)
    assert 0 < len(ids) < 300  # it attached mid-item
    assert result.token_ids[-len(ids) :] == ids
    # Nobody had read the text before: the first update carried all of it.
    assert text == result.text


async def test_a_quiet_item_cancelled_mid_decode_keeps_all_its_text(
    tiny_model: Path, sock_dir: Path, reference: Engine
) -> None:
    item = Item(custom_id="long", prompt="go on", max_new_tokens=1500, ignore_eos=True)
    failpoints.slow("engine.step", 0.002)
    try:
        async with (
            running(make_config(tiny_model, sock_dir)) as daemon,
            connected(daemon) as client,
        ):
            job = await _quiet_and_under_way(client, item)
            await client.cancel(job.job_id)
            [result] = await job.results()
    finally:
        failpoints.disarm()
    assert result.error is not None and result.error.code == "cancelled"
    assert result.error.details["partial"] is True
    assert 0 < len(result.token_ids) < 1500
    assert result.text == reference.tokenizer.decode(result.token_ids)


async def test_a_quiet_run_hands_its_chunks_to_the_loop_together(
    tiny_model: Path, sock_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each hand-over of a run's chunks wakes the event loop while the model runs. A
    run that nobody streams hands a few sessions' chunks over together (same tokens:
    the first test); a streamed run, or a quiet one of more sessions' outputs than
    ``_QUIET_OUTPUTS``, hands them over chunk by chunk."""
    item = Item(custom_id="long", prompt="go on", max_new_tokens=300, ignore_eos=True)
    handed: list[int] = []  # chunks in each hand-over
    # A first bucket that holds the whole item: no growth ends a run early.
    config = make_config(tiny_model, sock_dir, kv={"min_bucket": 512})
    async with running(config) as daemon, connected(daemon) as client:
        scheduler = daemon.scheduler
        assert scheduler is not None
        took = scheduler._took_chunks

        def counted(ready: list[object], chunks: list[object]) -> None:
            handed.append(len(chunks))
            took(ready, chunks)  # type: ignore[arg-type]

        monkeypatch.setattr(scheduler, "_took_chunks", counted)

        async def handovers(items: list[Item], *, stream: bool) -> list[int]:
            handed.clear()
            events = await _events(await client.submit(items, stream=stream))
            assert all(ev.result.status == "ok" for ev in events if isinstance(ev, p.ItemFinished))
            return list(handed)

        quiet = await handovers([item], stream=False)
        streamed = await handovers([item], stream=True)
        monkeypatch.setattr(_loop, "_QUIET_OUTPUTS", 2)
        many = await handovers(
            [msgspec.structs.replace(item, custom_id=f"{i}") for i in range(3)], stream=False
        )
    # 300 tokens take at least five chunks (of at most _MAX_CHUNK_STEPS steps).
    assert set(streamed) == {1} and len(streamed) >= 5
    assert sum(quiet) >= 5 and len(quiet) < sum(quiet), quiet
    assert set(many) == {1} and len(many) >= 5


def test_a_quiet_call_waits_longer_for_endings_the_more_sessions_and_the_longer_items() -> None:
    """While an item waits for a slot, a quiet call returns at a session's end once it
    has run ``_endings_seconds``: longer with more sessions (a turn costs more) and
    longer items (an idle slot costs less), within (1 ms, the quiet chunk); a
    streamed chunk's length before any item has ended."""
    w = _loop._endings_seconds
    assert w(16, 0.0) == _loop._chunk_seconds(16)
    assert 0.001 < w(16, 0.034) < w(64, 0.034) < w(64, 0.14) < w(256, 0.56)
    assert w(256, 60.0) == _loop._QUIET_CHUNK_SECONDS
    assert w(1, 1e-6) == 0.001


async def test_an_arrival_ends_a_quiet_chunk_after_the_step_under_way(
    tiny_model: Path, sock_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A quiet run's chunks are long (up to ``_QUIET_CHUNK_SECONDS``), but a poke (here
    another job's arrival) does not wait for a chunk's end: the engine call under way
    returns after its step, with fewer steps than it was asked for though no session
    ended, and the newcomer is admitted."""
    long = Item(custom_id="long", prompt="go on", max_new_tokens=400, ignore_eos=True)
    other = Item(custom_id="other", prompt="hi", max_new_tokens=4)
    calls: list[tuple[int, int, bool]] = []  # steps asked, most tokens taken, one ended
    sent: list[concurrent.futures.Future[Job]] = []
    failpoints.slow("engine.step", 0.005)  # decode chunks of ~20 steps, ~100 ms
    try:
        config = make_config(tiny_model, sock_dir, kv={"min_bucket": 512})
        async with running(config) as daemon, connected(daemon) as client:
            engine = daemon.engine
            assert engine is not None
            step_many = engine.step_many
            loop = asyncio.get_running_loop()

            def recorded(
                sessions: list[DecodeSession], steps: int = 1, **kw: Any
            ) -> list[StepOutput | Exception]:
                if len(calls) == 3:  # the long item's third decode chunk is starting
                    submit = client.submit([other], stream=False)
                    sent.append(asyncio.run_coroutine_threadsafe(submit, loop))
                outs = step_many(sessions, steps, **kw)
                done = [o for o in outs if not isinstance(o, Exception)]
                taken = max((len(o.token_ids) for o in done), default=0)
                ended = len(done) < len(outs) or any(o.finished for o in done)
                calls.append((steps, taken, ended))
                return outs

            monkeypatch.setattr(engine, "step_many", recorded)
            job = await client.submit([long], stream=False)
            while not sent:
                await anyio.sleep(0.01)
            other_events = await _events(await asyncio.wrap_future(sent[0]))
            rest = await _events(job)
    finally:
        failpoints.disarm()
    results = [ev.result for ev in [*other_events, *rest] if isinstance(ev, p.ItemFinished)]
    assert [r.status for r in results] == ["ok", "ok"]
    assert len(results[1].token_ids) == 400
    asked, taken, ended = calls[3]
    assert asked > 2 and 1 <= taken < asked and not ended, calls
