"""Bad input and vanished clients: typed errors, nothing lost, nothing leaked."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest
import zmq
import zmq.asyncio

from kvmux.client import Item
from kvmux.client import protocol as p
from kvmux.daemon.app import Daemon
from kvmux.daemon.config import Config
from kvmux.daemon.engine import Engine
from kvmux.kv import failpoints

from .conftest import connected, make_config, running
from .helpers import decode_alone, ok_tokens

pytestmark = pytest.mark.anyio

_pack = msgspec.msgpack.encode


def malformed_frames(rng: random.Random, n: int) -> list[tuple[list[bytes], int | None]]:
    """(frames, the id the error reply must echo) for ``n`` broken requests."""
    good_item: dict[str, Any] = {"prompt": "hi"}
    shapes: list[Any] = [
        lambda i: ([rng.randbytes(rng.randint(0, 64))], None),  # noise
        lambda i: ([b""], None),
        lambda i: ([_pack([1, 2, 3])], None),
        lambda i: ([_pack("submit")], None),
        lambda i: ([_pack({"op": "nope", "id": i})], i),
        lambda i: ([_pack({"id": i})], i),  # no op
        lambda i: ([_pack({"op": "submit", "id": i})], i),  # no items
        lambda i: ([_pack({"op": "submit", "id": i, "items": "x"})], i),
        lambda i: ([_pack({"op": "submit", "id": i, "items": []})], i),
        lambda i: ([_pack({"op": "submit", "id": i, "items": [{"prompt": 5}]})], i),
        lambda i: ([_pack({"op": "submit", "id": i, "items": [{**good_item, "evil": 1}]})], i),
        lambda i: ([_pack({"op": "submit", "id": i, "items": [{"prompt_tokens": [-1]}]})], i),
        lambda i: ([_pack({"op": "submit", "id": i, "items": [{"prompt_tokens": [2**40]}]})], i),
        lambda i: (
            [_pack({"op": "submit", "id": i, "items": [{**good_item, "max_new_tokens": 2**40}]})],
            i,
        ),
        lambda i: ([_pack({"op": "submit", "id": i, "items": [{**good_item, "top_p": 7}]})], i),
        lambda i: ([_pack({"op": "submit", "id": i, "items": [{**good_item, "stop": [""]}]})], i),
        lambda i: ([_pack({"op": "submit", "id": i, "items": [good_item], "detach": "y"})], i),
        lambda i: ([_pack({"op": "cancel", "id": i, "job_id": 12})], i),
        lambda i: ([_pack({"op": "cancel", "id": i, "job_id": ""})], i),
        lambda i: ([_pack({"op": "status", "id": -i - 1})], None),
        lambda i: ([_pack({"op": "status", "id": "seven"})], None),
        lambda i: ([_pack({"op": "hello", "id": i})], i),  # no version
        lambda i: ([_pack({"op": "subscribe_logs", "id": i, "level": "loud"})], i),
        lambda i: ([_pack({"op": "status", "id": i}), b"extra"], None),  # two frames
        lambda i: ([_pack({"op": "status", "id": i})[:-1]], None),  # truncated
    ]
    return [rng.choice(shapes)(i) for i in range(n)]


async def test_fuzzed_frames_get_typed_errors_and_the_daemon_keeps_serving(
    tiny_model: Path, sock_dir: Path, reference: Engine
) -> None:
    rng = random.Random(20261202)
    cases = malformed_frames(rng, 3000)
    # Budgets that answer every frame: what is checked here is each reply. Frames
    # that parse but fail validation are requests, which [budget] charges their loop
    # time (a loaded machine once answered the last of them `overloaded`).
    cfg = make_config(
        tiny_model,
        sock_dir,
        server={"bad_frame_burst": 10_000},
        budget={"connection_rate": 0, "owner_rate": 0},
    )
    async with running(cfg) as daemon:
        ctx = zmq.asyncio.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.connect(daemon.endpoint)
        replies: list[p.Reply] = []
        try:
            with anyio.fail_after(60):
                for start in range(0, len(cases), 100):
                    chunk = cases[start : start + 100]
                    for frames, _ in chunk:
                        await sock.send_multipart(frames)
                    for _ in chunk:
                        replies.append(p.decode_reply(await sock.recv()))
        finally:
            sock.close(linger=0)
            ctx.term()
        for (_, want_id), reply in zip(cases, replies, strict=True):
            assert isinstance(reply, p.ErrorReply), reply
            assert reply.error.code == "bad_request"
            assert reply.id == want_id
            assert "Traceback" not in reply.error.message
        good = Item(custom_id="after", prompt="still here?", max_new_tokens=24, temperature=0.0)
        async with connected(daemon) as client:
            after = await (await client.submit([good])).results()
            status = await client.status()
    assert ok_tokens(after)["after"] == decode_alone(reference, good)
    assert status.state == "ready" and status.jobs_active == 0


CLIENT_SCRIPT = textwrap.dedent(
    """
    import sys, anyio
    from kvmux.client import Client, Item, protocol as p

    async def main(endpoint, detach):
        client = Client(endpoint)
        await client.connect()
        items = [Item(custom_id=str(i), prompt="never ending", max_new_tokens=1800,
                      ignore_eos=True) for i in range(6)]
        job = await client.submit(items, detach=detach == "1")
        async for ev in job.events():
            if isinstance(ev, p.TokenDelta):
                print(job.job_id, flush=True)
                break
        await anyio.sleep(3600)

    anyio.run(main, sys.argv[1], sys.argv[2])
    """
)


async def _kill_client_midway(daemon: Daemon, detach: bool) -> str:
    """Run a client process that submits and starts streaming, SIGKILL it; its job id."""
    with subprocess.Popen(
        [sys.executable, "-c", CLIENT_SCRIPT, daemon.endpoint, "1" if detach else "0"],
        stdout=subprocess.PIPE,
        text=True,
    ) as proc:
        try:
            assert proc.stdout is not None
            job_id = await anyio.to_thread.run_sync(proc.stdout.readline)
            assert job_id.strip(), "client process did not start streaming"
        finally:
            os.kill(proc.pid, signal.SIGKILL)
    return job_id.strip()


def _two_at_a_time(tiny_model: Path, sock_dir: Path) -> Config:
    # Six long items, two decoding at once: the job outlives the client by seconds.
    return make_config(tiny_model, sock_dir, scheduler={"max_active_sessions": 2})


async def test_killed_clients_sessions_are_released(tiny_model: Path, sock_dir: Path) -> None:
    # Slowed steps: the job must outlive the client by more than client_timeout.
    failpoints.slow("engine.step", 0.001)
    async with running(_two_at_a_time(tiny_model, sock_dir)) as daemon:
        job_id = await _kill_client_midway(daemon, detach=False)
        async with connected(daemon) as client:
            assert (await client.status()).kv_bytes_in_use > 0
            with anyio.fail_after(10):
                while (status := await client.status()).kv_bytes_in_use:
                    await anyio.sleep(0.1)
            job = await client.attach(job_id)
            results = await job.results()
    assert status.sessions_active == 0 and status.jobs_active == 0
    assert len(results) == 6
    cancelled = [r for r in results if r.error is not None]
    assert cancelled, "the job finished before the client was declared gone"
    for r in cancelled:
        assert r.error is not None and r.error.code == "cancelled"
        assert r.error.details["reason"] == "client_gone"
    assert all(r.status == "ok" for r in results if r.error is None)


async def test_detached_job_survives_its_client_and_reattaches(
    tiny_model: Path, sock_dir: Path, reference: Engine
) -> None:
    async with running(_two_at_a_time(tiny_model, sock_dir)) as daemon:
        job_id = await _kill_client_midway(daemon, detach=True)
        await anyio.sleep(1.5)  # past client_timeout: a non-detached job would be cancelled
        async with connected(daemon) as client:
            job = await client.attach(job_id)
            results = await job.results()
            status = await client.status()
    item = Item(prompt="never ending", max_new_tokens=1800, ignore_eos=True)
    assert [r.status for r in results] == ["ok"] * 6
    assert all(len(r.token_ids) == 1800 for r in results)
    # Each item had its own random seed (none given); the daemon reports it, so
    # the result reproduces in-process.
    for r in results:
        assert r.seed is not None
        reproduced = decode_alone(reference, msgspec.structs.replace(item, seed=r.seed))
        assert r.token_ids == reproduced
    assert status.kv_bytes_in_use == 0


async def test_a_closing_client_says_bye_and_its_jobs_end_at_once(
    tiny_model: Path, sock_dir: Path
) -> None:
    # A long client_timeout: only the goodbye can end the job this quickly.
    cfg = make_config(tiny_model, sock_dir, server={"client_timeout": 60.0})
    long = [
        Item(custom_id=str(i), prompt="long", max_new_tokens=1800, ignore_eos=True)
        for i in range(4)
    ]
    async with running(cfg) as daemon, connected(daemon) as watcher:
        async with connected(daemon) as leaving:
            job = await leaving.submit(long)
            kept = await leaving.submit(long[:1], detach=True)
            async for ev in job.events():
                if isinstance(ev, p.TokenDelta):
                    break
            assert (await watcher.status()).clients == 2
        with anyio.fail_after(5):
            while (status := await watcher.status()).jobs_active > 1:  # the detached one runs on
                await anyio.sleep(0.05)
        results = await (await watcher.attach(job.job_id)).results()
        assert status.clients == 1
        detached = await (await watcher.attach(kept.job_id)).results()
    assert all(
        r.error is not None and r.error.details["reason"] == "client_closed"
        for r in results
        if r.status == "error"
    )
    assert any(r.status == "error" for r in results)
    assert [r.status for r in detached] == ["ok"]


async def test_two_clients_on_one_job_both_get_it_and_either_may_leave(
    tiny_model: Path, sock_dir: Path
) -> None:
    """Attaching adds a watcher: the submitter keeps its events; the job outlives the
    submitter's goodbye because another client is still attached."""
    cfg = make_config(tiny_model, sock_dir, server={"client_timeout": 60.0})
    items = [
        Item(custom_id=str(i), prompt="both", max_new_tokens=600, ignore_eos=True) for i in range(3)
    ]
    failpoints.slow("engine.step", 0.001)  # the job must outlast the first goodbye
    async with running(cfg) as daemon, connected(daemon) as watcher:
        async with connected(daemon) as submitter:
            job = await submitter.submit(items)
            watched = await watcher.attach(job.job_id)
            seen = 0
            async for ev in job.events():  # the submitter keeps receiving after the attach
                if isinstance(ev, p.TokenDelta):
                    seen += len(ev.token_ids)
                    if seen >= 60:
                        break
        # The submitter said bye: with the watcher attached, nothing is cancelled.
        results = await watched.results()
        status = await watcher.status()
    assert [r.status for r in results] == ["ok"] * 3
    assert all(len(r.token_ids) == 600 for r in results)
    assert status.kv_bytes_in_use == 0
