"""Valid requests cost against a budget per connection and per owner; past it they are
answered ``overloaded`` with a ``retry_after``, which the client and the CLI wait out."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import anyio
import msgspec
import pytest
import zmq
import zmq.asyncio

from kvmux.client import Client, Item
from kvmux.client import protocol as p
from kvmux.daemon.budget import Bucket, RequestBudget
from kvmux.daemon.config import BudgetConfig

from .conftest import connected, make_config, running

pytestmark = pytest.mark.anyio

# A budget a handful of requests spends: the refusals and their retries are what is tested.
# The burst is under six requests' fixed overhead (50 us each), whatever the machine.
TIGHT = {
    "connection_rate": 0.01,
    "connection_burst": 0.0003,
    "owner_rate": 0.02,
    "owner_burst": 0.0006,
}


def test_a_bucket_refuses_once_spent_and_names_when_to_come_back() -> None:
    budget = RequestBudget(BudgetConfig(**TIGHT))
    conn = budget.connection()
    budget.check(conn, "alice")  # full: passes
    budget.charge(conn, "alice", 0.0083, 0)
    with pytest.raises(Exception) as info:
        budget.check(conn, "alice")
    exc = info.value
    assert getattr(exc, "code", None) == "overloaded"
    details = getattr(exc, "details", {})
    assert details["budget"] in ("connection", "owner")
    # 8.3 ms spent from a 0.3 ms burst at 10 ms a second: 0.8 s until it is positive again.
    assert 0.7 < details["retry_after"] <= 0.9
    assert budget.refused == 1
    # Another owner on another connection is not held back by alice's spending.
    budget.check(budget.connection(), "bob")


def test_an_owner_spending_over_many_connections_is_refused_on_all() -> None:
    budget = RequestBudget(BudgetConfig(**TIGHT))
    conns = [budget.connection() for _ in range(8)]
    for conn in conns:
        budget.charge(conn, "alice", 0.001, 0)  # spread over eight connections
    with pytest.raises(Exception, match="owner"):
        budget.check(budget.connection(), "alice")


def test_reply_bytes_are_charged_and_full_owners_are_forgotten() -> None:
    budget = RequestBudget(BudgetConfig(owner_rate=1000.0, owner_burst=0.001))
    conn: Bucket = budget.connection()
    budget.charge(conn, "alice", 0.0, 10_000_000)  # 10 MB of replies: ~20 ms
    assert budget._owners["alice"].level < 0
    time.sleep(0.01)  # refills at 1000 s a second
    budget.prune()
    assert "alice" not in budget._owners


async def test_the_client_waits_out_refusals_and_every_answer_arrives(
    tiny_model: Path, sock_dir: Path
) -> None:
    config = make_config(tiny_model, sock_dir, budget=TIGHT)
    async with running(config) as daemon, connected(daemon) as client:
        job = await client.submit(
            [Item(custom_id=str(i), prompt_tokens=[5, 6, 7], max_new_tokens=4) for i in range(3)]
        )
        results = await job.results()
        assert [r.status for r in results] == ["ok"] * 3
        statuses = [await client.status() for _ in range(12)]
        pages = [await client._results_page(job.job_id, 0) for _ in range(6)]
        assert all(len(page.results) == 3 for page in pages)
        assert statuses[-1].requests_refused > 0  # they were refused, and waited out
        assert (await client.jobs())[0].job_id == job.job_id


async def test_a_refusal_on_the_wire_is_typed_and_cancel_is_never_refused(
    tiny_model: Path, sock_dir: Path
) -> None:
    config = make_config(tiny_model, sock_dir, budget=TIGHT)
    async with running(config) as daemon:
        ctx = zmq.asyncio.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(daemon.endpoint)
        try:
            replies = []
            for i in range(40):
                await sock.send(p.encode(p.Status(id=i)))
                replies.append(p.decode_reply(await sock.recv()))
            refused = [r for r in replies if isinstance(r, p.ErrorReply)]
            assert refused, "a tight budget refused none of 40 status requests"
            for r in refused:
                assert r.error.code == "overloaded"
                assert r.error.details["retry_after"] > 0
            # Still spent: a cancel (of an unknown job) is answered for what it is.
            await sock.send(p.encode(p.Cancel(id=99, job_id="nope")))
            reply = p.decode_reply(await sock.recv())
            assert isinstance(reply, p.ErrorReply) and reply.id == 99
            assert reply.error.code == "not_found"
        finally:
            sock.close(linger=0)
            ctx.term()


async def test_kvmux_results_rides_through_refusals(tiny_model: Path, sock_dir: Path) -> None:
    config = make_config(tiny_model, sock_dir, budget=TIGHT)
    async with running(config) as daemon:
        async with Client(daemon.endpoint, timeout=10.0) as client:
            items = [
                Item(custom_id=f"c{i}", prompt_tokens=[4 + i], max_new_tokens=3) for i in range(20)
            ]
            job = await client.submit(items, detach=True)
            want = {r.custom_id: r.token_ids for r in await job.results()}
        for _ in range(3):  # each run's pages spend the budget the next one meets
            done = await anyio.run_process(
                [sys.executable, "-m", "kvmux.client.cli", "results", job.job_id, "-q"],
                env={**os.environ, "KVMUX_ENDPOINT": daemon.endpoint},
                stdin=subprocess.DEVNULL,
                check=False,
            )
            assert done.returncode == 0, done.stderr.decode()
            lines = [msgspec.json.decode(line) for line in done.stdout.splitlines()]
            assert {obj["custom_id"]: obj["token_ids"] for obj in lines} == want
