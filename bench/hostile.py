"""Hostile and careless clients against a real kvmuxd: it survives, stays fair, leaks nothing.

Each scenario starts its own ``kvmuxd`` subprocess (the ``tiny`` model, an ipc
socket or loopback tcp: nothing leaves the machine), does what a hostile or
clumsy user would, and returns its figures; ``tests/daemon/test_hostile.py``
runs every scenario small and asserts on the same figures. Scenarios:

- ``frames``: thousands of hostile frames of every kind (noise, msgpack nested
  a thousand deep, multi-frame, oversized, wrong types, absurd values) from
  several senders while a legitimate client decodes: the daemon never dies and
  the legitimate tokens equal decoding alone;
- ``flood``: two senders blast garbage as fast as they can: status round trips
  of a legitimate client and its job's tokens are unaffected; the flooders are
  cut off once their budget of bad frames is spent;
- ``slow_consumer``: a client that never reads asks for a finished job's
  results thousands of times: the daemon's RSS stays bounded;
- ``half_open``: 1,100 plain ``connect()``s that never speak ZeroMQ, under a
  1024-descriptor limit: the daemon stops accepting instead of aborting, and
  serves the next client once they are gone;
- ``big_prompt``: a 4 MB prompt while another client streams: refused at once,
  and nobody's events stall;
- ``fairness``: one client submits ten times the queue; another's small job is
  accepted and runs before the first one's backlog;
- ``orphan``: a client that dies while its big submit is being checked: its
  job never starts;
- ``wait``: a tight ``kv.memory_budget`` under ``on_growth_failure = "wait"``:
  every item that fits the budget alone finishes, with the tokens of decoding
  alone;
- ``two_users`` (ipc, needs root to run clients as two OS users) and
  ``two_keys`` (CURVE on loopback tcp): every attempt of B to see, read,
  cancel or detach A's job fails with ``not_found``, B's status and log stream
  show nothing of A's; a CURVE key removed from the folder stops working on
  SIGHUP.

Usage: python -m bench.hostile [--quick] [--only NAME[,NAME...]]
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import msgspec
import zmq
import zmq.asyncio
import zmq.auth

from bench.bench_daemon import DaemonProcess, kvmuxd
from bench.common import builtin, write_json
from kvmux.client import Client, Item, KvmuxError, Overloaded
from kvmux.client import protocol as p
from kvmux.client.curve import CLIENT_KEY_ENV, SERVER_KEY_ENV, CurveKeys, load_curve

ROOT = Path(__file__).resolve().parent.parent
_pack = msgspec.msgpack.encode
Figures = dict[str, Any]

# A client that decodes alongside the abuse; its tokens must equal decoding alone.
LEGIT = [
    Item(custom_id=f"legit-{i}", prompt_tokens=[7 + i] * (3 + 5 * i), max_new_tokens=48)
    for i in range(4)
]


def reference_tokens(model: Path, items: list[Item]) -> dict[str, list[int]]:
    """What each greedy item decodes to in-process, alone, in one big buffer."""
    from kvmux.daemon.engine import Engine, EngineOptions, SamplingParams

    engine = Engine(model, EngineOptions(min_bucket=4096, intra_op_threads=1))
    out = {}
    for item in items:
        params = SamplingParams(
            max_new_tokens=item.max_new_tokens,
            temperature=item.temperature,
            seed=item.seed,
            ignore_eos=item.ignore_eos,
        )
        prompt = item.prompt if item.prompt is not None else list(item.prompt_tokens or [])
        out[item.custom_id] = engine.generate(prompt, params).token_ids
    return out


async def run_legit(endpoint: str, items: list[Item] = LEGIT) -> dict[str, list[int]]:
    async with Client(endpoint, timeout=30.0) as client:
        results = await (await client.submit(items)).results()
    out = {}
    for r in results:
        if r.status != "ok":
            raise AssertionError(f"legitimate item {r.custom_id} failed: {r.error}")
        out[r.custom_id] = r.token_ids
    return out


# -- hostile frames ------------------------------------------------------------------------


def hostile_frame(rng: random.Random, rid: int) -> list[bytes]:
    """One hostile or broken message, of a kind picked at random."""
    item: dict[str, Any] = {"prompt": "hi"}
    depth = rng.randint(200, 5000)
    kinds: list[Callable[[], list[bytes]]] = [
        lambda: [rng.randbytes(rng.randint(0, 256))],
        lambda: [b""],
        lambda: [b"\x91" * depth + b"\xc0"],  # arrays nested `depth` deep
        lambda: [b"\x81\xa1a" * depth + b"\xc0"],  # maps nested `depth` deep
        lambda: [_pack({"op": "submit", "id": rid, "items": [{"prompt": [[[[[]]]]]}]})],
        lambda: [_pack({"op": "status", "id": rid}), b"x", b"y"],  # three frames
        lambda: [_pack({"op": "status", "id": rid})[:-1]],  # truncated
        lambda: [_pack({"op": "nope", "id": rid})],
        lambda: [_pack({"op": "submit", "id": rid, "items": [{**item, "evil": 1}]})],
        lambda: [_pack({"op": "submit", "id": rid, "items": [{"prompt_tokens": [-1]}]})],
        lambda: [_pack({"op": "submit", "id": rid, "items": [{**item, "top_p": 7}]})],
        lambda: [_pack({"op": "submit", "id": rid, "items": [{**item, "temperature": -1}]})],
        lambda: [_pack({"op": "submit", "id": rid, "items": [{**item, "max_new_tokens": 2**40}]})],
        lambda: [_pack({"op": "submit", "id": rid, "items": [item] * 70000})],  # over 65536
        lambda: [_pack({"op": "cancel", "id": rid, "job_id": "x" * 100})],
        lambda: [_pack({"op": "attach", "id": rid, "job_id": 12})],
        lambda: [_pack({"op": "status", "id": 2**64 - 1})],
        lambda: [_pack({"op": "status", "id": "seven"})],
        lambda: [_pack({"op": "hello", "id": rid, "version": "1"})],
        lambda: [_pack({"op": "subscribe_logs", "id": rid, "level": "loud"})],
        lambda: [msgspec.msgpack.encode(msgspec.msgpack.Ext(1, b"\x00" * 8))],
        lambda: [b"\xc1" * 64],  # a byte msgpack never uses
    ]
    return rng.choice(kinds)()


async def _drain(sock: zmq.asyncio.Socket) -> int:
    n = 0
    while True:
        try:
            await sock.recv(flags=zmq.NOBLOCK)
        except zmq.Again:
            return n
        n += 1


async def frames(model: Path, n: int = 10_000, senders: int = 4) -> Figures:
    """Hostile frames from ``senders`` DEALERs, until the daemon has handled ``n`` of
    them, while a legitimate job decodes."""
    want = reference_tokens(model, LEGIT)
    rng = random.Random(20261202)
    tables = {"server": {"max_message_bytes": 1 << 20}, "kv": {"min_bucket": 8}}
    async with kvmuxd(model, threads=1, tables=tables) as daemon:
        ctx = zmq.asyncio.Context()
        socks = []
        for _ in range(senders):
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(daemon.endpoint)
            socks.append(sock)
        # An oversized message (over max_message_bytes): libzmq drops that connection.
        big = ctx.socket(zmq.DEALER)
        big.setsockopt(zmq.LINGER, 0)
        big.connect(daemon.endpoint)
        replies = sent = 0
        started = time.monotonic()
        legit: dict[str, list[int]] = {}
        try:
            async with (
                anyio.create_task_group() as tg,
                Client(daemon.endpoint, timeout=30.0) as monitor,
            ):

                async def legit_job() -> None:
                    legit.update(await run_legit(daemon.endpoint))

                tg.start_soon(legit_job)
                await big.send(b"\x00" * (2 << 20))
                handled = 0
                with anyio.fail_after(300):
                    while handled < n:
                        for _ in range(200):
                            await socks[sent % senders].send_multipart(hostile_frame(rng, sent))
                            sent += 1
                        for s in socks:
                            replies += await _drain(s)
                        st = await monitor.status()
                        handled = st.frames_rejected + st.frames_dropped
        finally:
            for s in [*socks, big]:
                s.close(linger=0)
            ctx.term()
        alive = daemon.alive()
        after = await run_legit(daemon.endpoint)
        async with Client(daemon.endpoint) as client:
            status = await client.status()
        failures = sum(1 for _ in daemon.events("frame_handling_failed"))
    return {
        "frames_sent": sent,
        "frames_handled": status.frames_rejected + status.frames_dropped,
        "senders": senders,
        "seconds": round(time.monotonic() - started, 2),
        "typed_replies_received": replies,
        "frames_rejected": status.frames_rejected,
        "frames_dropped": status.frames_dropped,
        "senders_disconnected": status.clients_disconnected,
        "daemon_alive": alive,
        "frame_handling_failures": failures,
        "legit_tokens_identical": legit == want and after == want,
    }


async def _garbage_loop(endpoint: str, stop: anyio.Event, counter: list[int]) -> None:
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 1000)
    sock.connect(endpoint)
    rng = random.Random(len(counter))
    try:
        while not stop.is_set():
            try:
                await sock.send_multipart(hostile_frame(rng, counter[0]), flags=zmq.NOBLOCK)
                counter[0] += 1
            except zmq.Again:
                await anyio.sleep(0.001)
            if counter[0] % 64 == 0:
                await _drain(sock)
                await anyio.sleep(0)
    finally:
        sock.close(linger=0)
        ctx.term()


async def flood(model: Path, seconds: float = 4.0) -> Figures:
    """Two garbage senders at full speed; a legitimate client measures status round trips."""
    want = reference_tokens(model, LEGIT)
    tables = {"server": {"heartbeat_interval": 0.5, "client_timeout": 3.0}}
    async with kvmuxd(model, threads=1, tables=tables) as daemon:
        stop = anyio.Event()
        counters = [[0], [0]]
        trips: list[float] = []
        legit: dict[str, list[int]] = {}
        async with anyio.create_task_group() as tg:
            for c in counters:
                tg.start_soon(_garbage_loop, daemon.endpoint, stop, c)
            await anyio.sleep(0.3)  # the flood is on before the legitimate client connects

            async def legit_job() -> None:
                legit.update(await run_legit(daemon.endpoint))

            tg.start_soon(legit_job)
            async with Client(daemon.endpoint, timeout=10.0) as client:
                end = time.monotonic() + seconds
                while time.monotonic() < end:
                    t0 = time.perf_counter()
                    await client.status()
                    trips.append(time.perf_counter() - t0)
                    await anyio.sleep(0.05)
            stop.set()
        alive = daemon.alive()
        events = list(daemon.events())
    trips.sort()
    return {
        "seconds": seconds,
        "garbage_frames_sent": sum(c[0] for c in counters),
        "status_round_trips": len(trips),
        "status_p50_ms": round(1000 * trips[len(trips) // 2], 2),
        "status_max_ms": round(1000 * trips[-1], 2),
        "flooders_disconnected": sum(1 for e in events if e.get("event") == "client_disconnected"),
        "legit_tokens_identical": legit == want,
        "daemon_alive": alive,
    }


async def _ask_never_reading(
    daemon: DaemonProcess, requests: int, request: Callable[[int], p.Request]
) -> int:
    """Send ``request(i)`` for ``i`` < ``requests`` from a client that never reads its
    replies; the daemon's peak RSS meanwhile and for a second after."""
    peak = daemon.rss()
    ctx = zmq.asyncio.Context()
    sock = await _raw_dealer(ctx, daemon.endpoint, reads=False)
    try:
        for i in range(requests):
            await sock.send(p.encode(request(i)))
            if i % 100 == 0:
                await anyio.sleep(0.01)
                peak = max(peak, daemon.rss())
        for _ in range(20):
            await anyio.sleep(0.05)
            peak = max(peak, daemon.rss())
    finally:
        sock.close(linger=0)
        ctx.term()
    return peak


async def slow_consumer(model: Path, requests: int = 4000) -> Figures:
    """A client that never reads asks again and again for a finished job's results."""
    async with kvmuxd(model, threads=1) as daemon:
        items = [
            Item(
                custom_id=str(i),
                prompt_tokens=[5 + i % 50] * 8,
                max_new_tokens=200,
                ignore_eos=True,
            )
            for i in range(64)
        ]
        async with Client(daemon.endpoint, timeout=30.0) as client:
            job = await client.submit(items, detach=True)
            await job.results()
        base = daemon.rss()

        def request(i: int) -> p.Request:
            if i % 2:
                return p.Attach(id=i, job_id=job.job_id)
            return p.Results(id=i, job_id=job.job_id)

        peak = await _ask_never_reading(daemon, requests, request)
        async with Client(daemon.endpoint, timeout=10.0) as other:
            served = (await other.status()).state == "ready"
    return {
        "requests": requests,
        "rss_base_mib": round(base / 2**20, 1),
        "rss_peak_mib": round(peak / 2**20, 1),
        "rss_growth_mib": round((peak - base) / 2**20, 1),
        "others_served": served,
    }


async def half_open(model: Path, n: int = 1100, nofile: int = 1024) -> Figures:
    """``n`` unix connects that never speak ZeroMQ, the daemon limited to ``nofile`` fds."""
    async with kvmuxd(
        model, threads=1, nofile=nofile, tables={"server": {"handshake_timeout": 2.0}}
    ) as daemon:
        path = daemon.endpoint.removeprefix("ipc://")
        conns: list[socket.socket] = []
        refused = 0
        for _ in range(n):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                s.connect(path)
            except OSError:
                refused += 1
                s.close()
                continue
            conns.append(s)
        await anyio.sleep(0.5)
        alive_while_held = daemon.alive()
        for s in conns:
            s.close()
        t0 = time.monotonic()
        served = False
        with anyio.move_on_after(30):
            while not served:
                try:
                    got = await run_legit(daemon.endpoint, LEGIT[:1])
                    served = bool(got)
                except KvmuxError:
                    await anyio.sleep(0.1)
        events = list(daemon.events())
        return {
            "connects": n,
            "accepted": len(conns),
            "refused": refused,
            "fd_limit": nofile,
            "listening_paused": sum(1 for e in events if e.get("event") == "listening_paused"),
            "daemon_alive": alive_while_held and daemon.alive(),
            "next_client_served": served,
            "seconds_until_served": round(time.monotonic() - t0, 2),
        }


async def big_prompt(model: Path, megabytes: int = 4) -> Figures:
    """A huge text prompt while another client streams tokens: refused at once, no stall."""
    async with kvmuxd(model, threads=1) as daemon:
        gaps: list[float] = []
        refused_in = 0.0
        code = ""
        async with Client(daemon.endpoint, timeout=30.0) as streamer:
            long = [Item(custom_id="s", prompt="go", max_new_tokens=1500, ignore_eos=True)]
            job = await streamer.submit(long)
            async with anyio.create_task_group() as tg:

                async def watch() -> None:
                    last = time.perf_counter()
                    async for ev in job.events():
                        if isinstance(ev, p.TokenDelta):
                            now = time.perf_counter()
                            gaps.append(now - last)
                            last = now

                tg.start_soon(watch)
                await anyio.sleep(0.2)
                async with Client(daemon.endpoint, timeout=30.0) as big:
                    t0 = time.perf_counter()
                    item = Item(custom_id="big", prompt="word " * (megabytes * 2**20 // 5))
                    results = await (await big.submit([item])).results()
                    refused_in = time.perf_counter() - t0
                    error = results[0].error
                    code = error.code if error is not None else "ok"
    return {
        "prompt_mib": megabytes,
        "result": code,
        "answered_in_ms": round(1000 * refused_in, 1),
        "streamer_max_gap_ms": round(1000 * max(gaps), 1),
    }


async def fairness(model: Path, queue: int = 64) -> Figures:
    """Client A submits ten times the queue; client B's one-item job must not be refused."""
    tables = {
        "scheduler": {
            "max_active_sessions": 2,
            "max_queued_items": queue,
            "max_job_items": queue // 4,
        },
    }
    async with kvmuxd(model, threads=1, tables=tables) as daemon:
        item = Item(prompt="a", max_new_tokens=64, ignore_eos=True)
        async with (
            Client(daemon.endpoint, timeout=30.0) as a,
            Client(daemon.endpoint, timeout=30.0) as b,
        ):
            a_jobs, a_refused = [], 0
            for _ in range(40):  # 40 jobs of queue/4 items: ten times the queue
                try:
                    a_jobs.append(await a.submit([item] * (queue // 4)))
                except Overloaded:
                    a_refused += 1
            b_refused = 0
            try:
                b_job = await b.submit([Item(custom_id="b", prompt="b", max_new_tokens=8)])
            except Overloaded:
                b_refused = 1
                b_queued_left = -1
            else:
                await b_job.results()
                # How much of A's backlog was still waiting when B's job was done.
                b_queued_left = (await a.status()).sessions_queued
            for job in a_jobs:
                await a.cancel(job.job_id)
    return {
        "queue": queue,
        "a_items_offered": 40 * (queue // 4),
        "a_jobs_accepted": len(a_jobs),
        "a_jobs_refused_overloaded": a_refused,
        "b_refused_overloaded": b_refused,
        "a_items_still_queued_when_b_done": b_queued_left,
    }


_ORPHAN_CLIENT = textwrap.dedent(
    """
    import sys, anyio
    from kvmux.client import Client, Item

    async def main(endpoint):
        client = Client(endpoint)
        await client.connect()
        print("sending", flush=True)
        await client.submit([Item(custom_id=str(i), prompt="w" * 200) for i in range(64)])

    anyio.run(main, sys.argv[1])
    """
)


async def orphan(model: Path, check_seconds: float = 3.0) -> Figures:
    """A client SIGKILLed while its submit is being checked: its job never starts.

    The check is slowed (failpoint ``scheduler.admit``) past the time it takes
    to notice the client is gone, as a big submit on a busy daemon would be."""
    tables: dict[str, dict[str, object]] = {
        "server": {"heartbeat_interval": 0.2, "client_timeout": 1.0},
    }
    env = {"KVMUX_SLOW_FAILPOINTS": f"scheduler.admit={check_seconds}"}
    async with kvmuxd(model, threads=1, tables=tables, env=env) as daemon:
        with subprocess.Popen(
            [sys.executable, "-c", _ORPHAN_CLIENT, daemon.endpoint],
            stdout=subprocess.PIPE,
            text=True,
            cwd=ROOT,
        ) as proc:
            assert proc.stdout is not None
            await anyio.to_thread.run_sync(proc.stdout.readline)
            await anyio.sleep(0.3)  # the submit is on its way, its check under way
            proc.kill()
        with anyio.fail_after(check_seconds + 30):
            while not any(daemon.events("job_dropped")) and not any(daemon.events("job_accepted")):
                await anyio.sleep(0.1)
        async with Client(daemon.endpoint, timeout=10.0) as client:
            status = await client.status()
        started = sum(1 for _ in daemon.events("session_started"))
        dropped = sum(1 for _ in daemon.events("job_dropped"))
    return {
        "check_seconds": check_seconds,
        "jobs_dropped": dropped,
        "sessions_started": started,
        "jobs_active_after": status.jobs_active,
    }


async def wait_budget(model: Path, n: int = 32) -> Figures:
    """A tight budget under "wait": every item that fits alone finishes, tokens unchanged."""
    from kvmux.daemon.engine import Engine, EngineOptions

    bpt = Engine(model, EngineOptions(intra_op_threads=1)).kv_spec.bytes_per_token
    rng = random.Random(7)
    items = [
        Item(
            custom_id=str(i),
            prompt_tokens=[rng.randrange(3, 250) for _ in range(rng.randint(4, 60))],
            max_new_tokens=rng.randint(100, 400),
            ignore_eos=True,
        )
        for i in range(n)
    ]
    budget_tokens = 1536  # an item needs at most 512 + 256 alone: fits; 32 together do not
    tables: dict[str, dict[str, object]] = {
        "kv": {"min_bucket": 16, "memory_budget": budget_tokens * bpt},
        "scheduler": {"max_active_sessions": 16, "on_growth_failure": "wait", "growth_retries": 2},
    }
    want = reference_tokens(model, items)
    async with (
        kvmuxd(model, threads=1, tables=tables) as daemon,
        Client(daemon.endpoint, timeout=60.0) as client,
    ):
        job = await client.submit(items)
        streamed: dict[int, list[int]] = {}
        async for ev in job.events():
            if isinstance(ev, p.TokenDelta):
                streamed.setdefault(ev.index, []).extend(ev.token_ids)
        results = await job.results()
        status = await client.status()
    failed = [r for r in results if r.status != "ok"]
    got = {r.custom_id: r.token_ids for r in results if r.status == "ok"}
    return {
        "items": n,
        "budget_tokens": budget_tokens,
        "failed": len(failed),
        "failure_codes": sorted({r.error.code for r in failed if r.error is not None}),
        "tokens_identical": got == want,
        "streamed_equal_results": all(
            streamed.get(r.index, []) == r.token_ids for r in results if r.status == "ok"
        ),
        "preemptions": status.growth.preemptions,
        "parked_retries": status.growth.parked_retries,
        "kv_peak_over_budget": round(status.kv_peak_bytes / (budget_tokens * bpt), 3),
    }


# -- bounded cost per client -----------------------------------------------------------------


# One item whose result is over 500 KiB: 1,900 tokens with 20 alternatives each.
def large_items(n: int) -> list[Item]:
    return [
        Item(
            custom_id=f"large-{i}",
            prompt_tokens=[5 + i, 6, 7],
            max_new_tokens=1900,
            logprobs=20,
            ignore_eos=True,
        )
        for i in range(n)
    ]


_LARGE_TABLES: dict[str, dict[str, object]] = {"scheduler": {"max_new_tokens": 2000}}


async def _raw_dealer(
    ctx: zmq.asyncio.Context, endpoint: str, curve: CurveKeys | None = None, reads: bool = True
) -> zmq.asyncio.Socket:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if not reads:
        sock.setsockopt(zmq.RCVHWM, 1)  # and never recv(): replies pile up on the daemon's side
        sock.setsockopt(zmq.RCVBUF, 4096)
    if curve is not None:
        sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = curve
    sock.connect(endpoint)
    return sock


async def _walk_results(sock: zmq.asyncio.Socket, job_id: str) -> tuple[int, dict[int, bytes]]:
    """Every result of a job as the wire carries it, a page (or a part) at a time:
    the largest message seen, and each result's encoding joined from its parts."""
    largest = 0
    joined: dict[int, bytes] = {}
    at: int | None = 0
    offset = 0
    rid = 0
    while at is not None:
        rid += 1
        await sock.send(p.encode(p.Results(id=rid, job_id=job_id, start=at, offset=offset)))
        data = await sock.recv()
        reply = p.decode_reply(data)
        if isinstance(reply, p.Events | p.LogEvents):
            continue
        largest = max(largest, len(data))
        assert isinstance(reply, p.ResultsPage), reply
        for r in reply.results:
            joined[r.index] = p.encode(r)
        if reply.part is not None:
            part = reply.part
            joined[part.index] = joined.get(part.index, b"")[: part.offset] + part.data
        at, offset = reply.next, reply.next_offset
    return largest, joined


async def large_results(model: Path, results: int = 4, requests: int = 2000) -> Figures:
    """Results of over 500 KiB each: every message on the wire stays within a page, the
    parts join back to the very bytes of the result, and a client that asks again and
    again without reading pins no more than the documented bound."""
    async with kvmuxd(model, threads=1, tables=_LARGE_TABLES) as daemon:
        async with Client(daemon.endpoint, timeout=60.0) as client:
            job = await client.submit(large_items(results), detach=True)
            got = {r.index: p.encode(r) for r in await job.results()}
        ctx = zmq.asyncio.Context()
        try:
            reader = await _raw_dealer(ctx, daemon.endpoint)
            largest, joined = await _walk_results(reader, job.job_id)
            reader.close(linger=0)
        finally:
            ctx.term()
        base = daemon.rss()
        peak = await _ask_never_reading(
            daemon, requests, lambda i: p.Results(id=i, job_id=job.job_id)
        )
        async with Client(daemon.endpoint, timeout=10.0) as other:
            status = await other.status()
    return {
        "results": results,
        "result_kib": round(min(len(b) for b in got.values()) / 1024, 1),
        "largest_message_kib": round(largest / 1024, 1),
        "parts_byte_identical": joined == got,
        "requests_never_read": requests,
        "rss_growth_mib": round((peak - base) / 2**20, 1),
        "bound_mib": round(status.client_bound_bytes / 2**20, 1),
        "replies_dropped": status.replies_dropped,
        "requests_refused": status.requests_refused,
        "others_served": status.state == "ready",
    }


# The decoding that a flood must not slow down, and whose tokens must not change.
def steady_items(n: int = 16, tokens: int = 1900) -> list[Item]:
    return [
        Item(
            custom_id=f"steady-{i}",
            prompt_tokens=[9 + i] * (4 + i),
            max_new_tokens=tokens,
            ignore_eos=True,
        )
        for i in range(n)
    ]


async def _flood(
    endpoint: str, curve: CurveKeys, job_id: str, rate: float, connections: int, emit: Emit
) -> None:
    """``results`` requests for ``job_id`` at ``rate`` per second over ``connections``
    connections, each reading what comes back, until killed; emits how many it has
    sent so far every 0.1 s (in a process of its own: a flooder in the measuring
    process would slow the measurement, not the daemon)."""
    ctx = zmq.asyncio.Context()
    socks = [await _raw_dealer(ctx, endpoint, curve) for _ in range(connections)]
    sent = 0
    started = last = time.monotonic()
    emit("0")
    while True:
        now = time.monotonic()
        due = int((now - started) * rate)
        while sent < due:
            try:
                await socks[sent % connections].send(
                    p.encode(p.Results(id=sent, job_id=job_id)), flags=zmq.NOBLOCK
                )
            except zmq.Again:
                break  # its pipe is full: the daemon is not taking more now
            sent += 1
        for sock in socks:
            await _drain(sock)
        if now - last > 0.1:
            emit(str(sent))
            last = now
        await anyio.sleep(0.005)


async def results_flood(
    model: Path, rate: float = 2000.0, connections: int = 1, repeats: int = 3, tokens: int = 1900
) -> Figures:
    """A client floods valid ``results`` requests for its own job of large results
    (``rate`` a second, over ``connections`` connections of one owner) while another
    owner decodes: that one's tokens/s against a quiet daemon, measured alternately in
    one run, its tokens, and its status round trips."""
    items = steady_items(tokens=tokens)
    want = reference_tokens(model, items)
    async with curve_kvmuxd(model, ["flooder", "steady"], _LARGE_TABLES) as (daemon, keys):
        async with Client(daemon.endpoint, timeout=60.0, curve=keys.curve("flooder")) as fl:
            big = await fl.submit(large_items(2), detach=True)
            await big.results()

        async def steady_run() -> tuple[float, dict[str, list[int]]]:
            async with Client(daemon.endpoint, timeout=60.0, curve=keys.curve("steady")) as c:
                t0 = time.perf_counter()
                results = await (await c.submit(items)).results()
                wall = time.perf_counter() - t0
            out = {r.custom_id: r.token_ids for r in results if r.status == "ok"}
            return sum(map(len, out.values())) / wall, out

        quiet: list[float] = []
        loud: list[float] = []
        trips: list[float] = []
        sent = 0
        identical = True
        for _ in range(repeats):
            tps, got = await steady_run()
            quiet.append(tps)
            identical = identical and got == want
            args = (daemon.endpoint, keys.curve("flooder"), big.job_id, rate, connections)
            flooder = await anyio.to_thread.run_sync(functools.partial(_Forked, _flood, args))
            await flooder.readline()  # it is on
            stop = anyio.Event()
            async with anyio.create_task_group() as tg:

                async def status_task(stop: anyio.Event = stop) -> None:
                    async with Client(
                        daemon.endpoint, timeout=10.0, curve=keys.curve("steady")
                    ) as c:
                        while not stop.is_set():
                            t0 = time.perf_counter()
                            await c.status()
                            trips.append(time.perf_counter() - t0)
                            await anyio.sleep(0.1)

                tg.start_soon(status_task)
                await anyio.sleep(0.3)  # the flood is on before the job starts
                tps, got = await steady_run()
                stop.set()
            os.kill(flooder.pid, signal.SIGKILL)
            counts = [line.strip() for line in await anyio.to_thread.run_sync(flooder.lines)]
            await flooder.wait()
            loud.append(tps)
            sent += int(counts[-1]) if counts else 0
            identical = identical and got == want
        async with Client(daemon.endpoint, timeout=10.0, curve=keys.curve("steady")) as c:
            status = await c.status()
        alive = daemon.alive()
    return {
        "connections": connections,
        "requests_per_second": rate,
        "requests_sent": sent,
        "requests_refused": status.requests_refused,
        "quiet_tokens_per_s": [round(x) for x in quiet],
        "flood_tokens_per_s": [round(x) for x in loud],
        "flood_over_quiet": round(statistics.median(loud) / statistics.median(quiet), 3),
        "tokens_identical": identical,
        "status_max_ms": round(1000 * max(trips), 1),
        "daemon_alive": alive,
    }


# -- two owners ----------------------------------------------------------------------------

Emit = Callable[[str], None]


async def _intruder(endpoint: str, job_id: str, emit: Emit) -> None:
    """Everything B might try on A's job; one JSON line of what each attempt got."""
    out: Figures = {}
    async with Client(endpoint, timeout=10.0) as c:
        attempts: list[tuple[str, Callable[[], Coroutine[Any, Any, object]]]] = [
            ("attach", lambda: c.attach(job_id)),
            ("results", lambda: c._results_page(job_id, 0)),
            ("cancel", lambda: c.cancel(job_id)),
            ("detach", lambda: c.detach(job_id)),
            ("logs_for_job", lambda: c.subscribe_logs(job_id=job_id)),
        ]
        for name, call in attempts:
            try:
                await call()
                out[name] = "succeeded"
            except KvmuxError as exc:
                out[name] = exc.code
        st = await c.status()
        out["status_shows_job"] = any(s.job_id == job_id for s in st.sessions)
        out["status_caller"] = st.caller
        seen = False
        stream = await c.subscribe_logs(level="debug")
        with anyio.move_on_after(1.5):
            async with contextlib.aclosing(stream):
                async for record in stream:
                    seen = seen or record.get("job_id") == job_id
        out["log_stream_shows_job"] = seen
    emit(json.dumps(out))


async def _owner(endpoint: str, n: int, emit: Emit) -> None:
    """A submits a detached job, says its id, and later how many items finished ok."""
    async with Client(endpoint, timeout=30.0) as c:
        items = [
            Item(custom_id=str(i), prompt="mine", max_new_tokens=400, ignore_eos=True)
            for i in range(n)
        ]
        job = await c.submit(items, detach=True)
        emit(job.job_id)
        results = await job.results()
        emit(str(sum(r.status == "ok" for r in results)))


class _Forked:
    """``main(*args, emit)`` in a forked child, as another OS user or with another
    environment; its ``emit``ted lines come back through a pipe.

    A fork, not a new interpreter: this Python lives where other users may not
    read, and a child that already holds every module it needs reads nothing.
    Call it off the event loop's thread (the child must not inherit a running loop).
    """

    def __init__(
        self,
        main: Callable[..., Coroutine[Any, Any, None]],
        args: tuple[Any, ...],
        uid: int | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                os.close(read)
                os.environ.update(env or {})
                if uid is not None:
                    os.setgroups([])
                    os.setgid(uid)
                    os.setuid(uid)
                out = os.fdopen(write, "w", buffering=1)

                async def child() -> None:
                    await main(*args, lambda line: print(line, file=out, flush=True))

                anyio.run(child)
                code = 0
            except BaseException:  # noqa: BLE001 - the parent sees the exit status
                import traceback

                traceback.print_exc()
            os._exit(code)
        os.close(write)
        self.pid = pid
        self._lines = os.fdopen(read)

    async def readline(self) -> str:
        return await anyio.to_thread.run_sync(self._lines.readline)

    def lines(self) -> list[str]:
        """Every line still to come (blocks until the child closes its end)."""
        return self._lines.readlines()

    async def wait(self) -> int:
        _, status = await anyio.to_thread.run_sync(os.waitpid, self.pid, 0)
        self._lines.close()
        return os.waitstatus_to_exitcode(status)


def _attempts(figures: Figures) -> tuple[int, int]:
    """(succeeded, attempted) among the intruder's attempts on the other's job."""
    keys = ("attach", "results", "cancel", "detach", "logs_for_job")
    leaks = ("status_shows_job", "log_stream_shows_job")
    ok = sum(figures[k] == "succeeded" for k in keys) + sum(bool(figures[k]) for k in leaks)
    return ok, len(keys) + len(leaks)


async def _owner_and_intruder(endpoint: str, a: dict[str, Any], b: dict[str, Any]) -> Figures:
    """A's job, B's attempts on it (``a``/``b``: _Forked's uid/env); then A's results."""
    owner = await anyio.to_thread.run_sync(lambda: _Forked(_owner, (endpoint, 3), **a))
    job_id = (await owner.readline()).strip()
    if not job_id:
        raise AssertionError(f"the owner's client did not submit (exit {await owner.wait()})")
    intruder = await anyio.to_thread.run_sync(lambda: _Forked(_intruder, (endpoint, job_id), **b))
    line = await intruder.readline()
    await intruder.wait()
    if not line:
        raise AssertionError("the intruder's client failed; see its traceback above")
    figures: Figures = json.loads(line)
    done = (await owner.readline()).strip()
    await owner.wait()
    figures["owner_items_ok"] = int(done or 0)
    figures["intruder_succeeded"], figures["intruder_attempts"] = _attempts(figures)
    return figures


async def two_users(model: Path, uids: tuple[int, int] = (65501, 65502)) -> Figures:
    """Two OS users on the ipc socket (the test runs them as other uids: needs root)."""
    if os.geteuid() != 0:
        return {"skipped": "needs root to run clients as two other OS users"}
    async with kvmuxd(model, threads=1) as daemon:
        path = Path(daemon.endpoint.removeprefix("ipc://"))
        # The folder and socket are private to the daemon's user; open them to
        # the two test users, as group membership does for a real service.
        path.parent.chmod(0o755)
        path.chmod(0o666)
        figures = await _owner_and_intruder(daemon.endpoint, {"uid": uids[0]}, {"uid": uids[1]})
    figures["owners"] = [f"uid:{u}" for u in uids]
    return figures


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def _curve_env(server_public: Path, client_secret: Path) -> Any:
    saved = {k: os.environ.get(k) for k in (SERVER_KEY_ENV, CLIENT_KEY_ENV)}
    os.environ[SERVER_KEY_ENV], os.environ[CLIENT_KEY_ENV] = str(server_public), str(client_secret)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class CurveKeysFolder:
    """A folder of CURVE certificates: the server's, and one per client name, all
    authorized; ``curve(name)`` is that client's keys for :class:`Client`."""

    def __init__(self, names: list[str]) -> None:
        self.folder = Path(tempfile.mkdtemp(prefix="kvx-keys-"))
        self.allowed = self.folder / "allowed"
        self.allowed.mkdir()
        public, secret = zmq.auth.create_certificates(self.folder, "server")
        self.server_public, self.server_secret = Path(public), Path(secret)
        self.secrets: dict[str, Path] = {}
        for name in names:
            pub, sec = zmq.auth.create_certificates(self.folder, name)
            shutil.copy(pub, self.allowed)
            self.secrets[name] = Path(sec)

    def public(self, name: str) -> str:
        return zmq.auth.load_certificate(self.secrets[name])[0].decode()

    def curve(self, name: str) -> CurveKeys:
        return load_curve(self.server_public, self.secrets[name])

    def env(self, name: str) -> dict[str, str]:
        return {SERVER_KEY_ENV: str(self.server_public), CLIENT_KEY_ENV: str(self.secrets[name])}

    def tables(self, operators: list[str] = []) -> dict[str, object]:  # noqa: B006 - read only
        return {
            "curve_secret_key": str(self.server_secret),
            "curve_authorized_keys": str(self.allowed),
            "operator_keys": [self.public(n) for n in operators],
        }

    def remove(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)


@contextlib.asynccontextmanager
async def curve_kvmuxd(
    model: Path, names: list[str], tables: dict[str, dict[str, object]] | None = None
) -> AsyncIterator[tuple[DaemonProcess, CurveKeysFolder]]:
    """A kvmuxd on loopback tcp with CURVE, one authorized key per name (the first an
    operator, whose keys the startup probe uses): distinct owners without root."""
    keys = CurveKeysFolder(names)
    try:
        all_tables = {**(tables or {})}
        all_tables["server"] = {**all_tables.get("server", {}), **keys.tables([names[0]])}
        endpoint = f"tcp://127.0.0.1:{_free_port()}"
        with _curve_env(keys.server_public, keys.secrets[names[0]]):
            async with kvmuxd(model, threads=1, tables=all_tables, endpoint=endpoint) as daemon:
                yield daemon, keys
    finally:
        keys.remove()


async def two_keys(model: Path) -> Figures:
    """Two CURVE keys on loopback tcp; then one key removed and SIGHUP."""
    async with curve_kvmuxd(model, ["operator", "alice", "bob"]) as (daemon, keys):
        endpoint = daemon.endpoint
        figures = await _owner_and_intruder(
            endpoint, {"env": keys.env("alice")}, {"env": keys.env("bob")}
        )
        async with Client(endpoint, curve=keys.curve("bob")) as bob:
            await bob.status()
            (keys.allowed / "bob.key").unlink()
            daemon.proc.send_signal(signal.SIGHUP)
            with anyio.fail_after(10):
                while len(list(daemon.events("curve_keys_loaded"))) < 2:
                    await anyio.sleep(0.05)
            try:
                await bob.status()
                figures["revoked_key_refused"] = False
            except KvmuxError as exc:
                figures["revoked_key_refused"] = exc.code == "unauthorized"
    figures["owners"] = ["key:alice", "key:bob"]
    return figures


SCENARIOS: dict[str, Callable[..., Coroutine[Any, Any, Figures]]] = {
    "frames": frames,
    "flood": flood,
    "slow_consumer": slow_consumer,
    "half_open": half_open,
    "big_prompt": big_prompt,
    "fairness": fairness,
    "orphan": orphan,
    "wait": wait_budget,
    "two_users": two_users,
    "two_keys": two_keys,
    "large_results": large_results,
    "results_flood": results_flood,
    "results_flood_8": lambda model, **kw: results_flood(model, connections=8, **kw),
}

QUICK: dict[str, dict[str, Any]] = {
    "frames": {"n": 2000},
    "flood": {"seconds": 2.0},
    "slow_consumer": {"requests": 2000},
    "half_open": {"n": 1100},
    "big_prompt": {"megabytes": 4},
    "fairness": {},
    "orphan": {"check_seconds": 2.0},
    "wait": {"n": 16},
    "two_users": {},
    "two_keys": {},
    "large_results": {"results": 2, "requests": 1000},
    "results_flood": {"repeats": 1, "tokens": 900},
    "results_flood_8": {"repeats": 1, "tokens": 900},
}


async def run_all(names: list[str], quick: bool) -> dict[str, Figures]:
    model = builtin("tiny")
    out = {}
    for name in names:
        kwargs = QUICK[name] if quick else {}
        t0 = time.monotonic()
        out[name] = await SCENARIOS[name](model, **kwargs)
        out[name]["scenario_seconds"] = round(time.monotonic() - t0, 1)
        print(f"{name}: {json.dumps(out[name])}", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.hostile", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="smaller runs (what the tests do)")
    parser.add_argument("--only", default="", help="comma-separated scenario names")
    args = parser.parse_args(argv)
    names = [n for n in args.only.split(",") if n] or list(SCENARIOS)
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        parser.error(f"unknown scenario(s) {unknown}; known: {', '.join(SCENARIOS)}")
    results = anyio.run(run_all, names, args.quick)
    path = write_json("hostile", {"quick": args.quick, "scenarios": results})
    print(f"written to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
