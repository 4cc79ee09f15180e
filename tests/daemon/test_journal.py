"""Durable jobs: a real kvmuxd process killed and restarted loses nothing and repeats nothing."""

from __future__ import annotations

import json
import random
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import anyio
import msgspec
import pytest

from bench.bench_daemon import kvmuxd
from kvmux.client import Client, Item, ItemResult, StorageFull, results_through_restarts
from kvmux.daemon.config import EX_CONFIG
from kvmux.daemon.engine import Engine

from .conftest import connected, make_config, running
from .helpers import decode_alone, token_prompt

pytestmark = pytest.mark.anyio

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def state() -> Iterator[Path]:
    # Short: the ipc socket lives here too.
    path = Path(tempfile.mkdtemp(prefix="kvj-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _tables(state: Path, **scheduler: object) -> dict[str, dict[str, object]]:
    return {
        "server": {"heartbeat_interval": 0.2, "client_timeout": 2.0},
        "kv": {"min_bucket": 8},
        "scheduler": {"max_active_sessions": 16, "max_job_items": 4096, **scheduler},
        "jobs": {"journal": str(state / "jobs.sqlite3")},
        "shutdown": {"grace": 0.5},
    }


def _items(n: int, seed: int) -> list[Item]:
    """Greedy items, items with their own seed, and sampled items whose seed the daemon picks."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        kind = i % 3
        out.append(
            Item(
                custom_id=f"i{i}",
                prompt_tokens=token_prompt(rng.randint(2, 24), seed=seed * 100_000 + i),
                max_new_tokens=rng.randint(4, 24),
                temperature=0.0 if kind == 0 else 0.9,
                seed=rng.randrange(2**31) if kind == 1 else None,
                ignore_eos=True,
            )
        )
    return out


def _cli(*args: str, endpoint: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "kvmux.client.cli", *args, "--endpoint", endpoint],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )


async def test_sigkilled_ten_times_every_item_ends_once_with_the_tokens_of_an_uninterrupted_run(
    tiny_model: Path, state: Path, reference: Engine
) -> None:
    endpoint = f"ipc://{state}/kvmuxd.sock"
    items = _items(2000, seed=1)
    batch = _items(150, seed=2)
    batch_file = state / "batch.jsonl"
    batch_file.write_text(
        "".join(
            msgspec.json.encode(msgspec.structs.replace(it, custom_id=f"b{i}")).decode() + "\n"
            for i, it in enumerate(batch)
        )
    )
    out_file = state / "out.jsonl"
    rng = random.Random(20261202)
    kills = 0
    cli: subprocess.Popen[str] | None = None
    job_id = ""
    with anyio.fail_after(300):
        while True:
            async with kvmuxd(tiny_model, threads=1, tables=_tables(state), endpoint=endpoint) as d:
                if not job_id:
                    async with Client(endpoint, timeout=30.0) as client:
                        job_id = (await client.submit(items, detach=True)).job_id
                    cli = _cli(
                        "submit", str(batch_file), "--out", str(out_file),
                        "--wait-daemon", "60", endpoint=endpoint,
                    )  # fmt: skip
                    # Killed only once the CLI's job is in: a daemon gone before the CLI
                    # first connects is "not running" at once, not a restart to wait for.
                    async with Client(endpoint, timeout=30.0) as client:
                        while len(await client.jobs()) < 2:
                            await anyio.sleep(0.02)
                if kills == 10:
                    async with Client(endpoint, timeout=30.0) as client:
                        results = await (await client.attach(job_id)).results()
                    break
                await anyio.sleep(rng.uniform(0.2, 1.2))
                d.proc.send_signal(signal.SIGKILL)  # as an OOM kill or a crash would
                d.proc.wait()
                kills += 1
    assert cli is not None
    _, cli_err = await anyio.to_thread.run_sync(lambda: cli.communicate(timeout=120))
    # The job: every item exactly one result, each the tokens of decoding it alone.
    assert sorted(r.index for r in results) == list(range(len(items)))
    for item, r in zip(items, sorted(results, key=lambda r: r.index), strict=True):
        assert r.status == "ok", r.error
        seeded = msgspec.structs.replace(item, seed=r.seed)  # the seed the daemon chose
        assert r.token_ids == decode_alone(reference, seeded), item.custom_id
    # The CLI rode through the same ten restarts: exit 0, one line per input line.
    assert cli.returncode == 0, cli_err
    lines = [json.loads(line) for line in out_file.read_text().splitlines()]
    assert Counter(line["custom_id"] for line in lines) == Counter(f"b{i}" for i in range(150))
    assert all(line["status"] == "ok" for line in lines)
    assert "re-attached" in cli_err or "waiting up to" in cli_err


async def test_sigterm_then_restart_runs_the_rest_and_nothing_twice(
    tiny_model: Path, state: Path
) -> None:
    endpoint = f"ipc://{state}/kvmuxd.sock"
    long = [
        Item(custom_id=str(i), prompt_tokens=[5 + i], max_new_tokens=150 + 40 * i, ignore_eos=True)
        for i in range(40)
    ]
    tables = _tables(state, max_active_sessions=4)
    async with kvmuxd(tiny_model, threads=1, tables=tables, endpoint=endpoint) as first:
        async with Client(endpoint, timeout=30.0) as client:
            job_id = (await client.submit(long, detach=True)).job_id
        await anyio.sleep(1.0)
        first.proc.send_signal(signal.SIGTERM)
        await anyio.to_thread.run_sync(first.proc.wait)
        assert first.proc.returncode == 0
        started_first = {e["session_id"] for e in first.events("session_started")}
        finished_first = {e["session_id"] for e in first.events("session_finished")}
        stopping = list(first.events("daemon_stopping_with_work"))
    async with kvmuxd(tiny_model, threads=1, tables=tables, endpoint=endpoint) as second:
        async with Client(endpoint, timeout=30.0) as client:
            results = await (await client.attach(job_id)).results()
        started_second = {e["session_id"] for e in second.events("session_started")}
    assert stopping, "the first daemon had nothing left to leave in the journal"
    assert finished_first and started_second  # work on both sides of the restart
    assert not finished_first & started_second  # nothing that had finished ran again
    assert started_first | started_second >= {f"{job_id}/{i}" for i in range(40)}
    assert [r.status for r in sorted(results, key=lambda r: r.index)] == ["ok"] * 40
    assert [len(r.token_ids) for r in sorted(results, key=lambda r: r.index)] == [
        150 + 40 * i for i in range(40)
    ]


async def test_kvmux_jobs_lists_only_the_callers_jobs_across_a_restart(
    tiny_model: Path, state: Path
) -> None:
    endpoint = f"ipc://{state}/kvmuxd.sock"
    tables = _tables(state)
    async with (
        kvmuxd(tiny_model, threads=1, tables=tables, endpoint=endpoint),
        Client(endpoint, timeout=30.0) as client,
    ):
        job = await client.submit([Item(prompt="hi", max_new_tokens=4)], detach=True)
        await job.results()
    async with kvmuxd(tiny_model, threads=1, tables=tables, endpoint=endpoint):
        cli = _cli("jobs", "--json", endpoint=endpoint)
        out, err = await anyio.to_thread.run_sync(lambda: cli.communicate(timeout=60))
    assert cli.returncode == 0, err
    (listed,) = [json.loads(line) for line in out.splitlines()]
    assert listed["job_id"] == job.job_id and listed["state"] == "done"
    assert (listed["ok"], listed["failed"], listed["total"]) == (1, 0, 1)


@pytest.mark.parametrize("problem", ["corrupt", "locked", "unwritable"])
def test_a_journal_that_cannot_be_used_is_a_clear_error_at_start(
    tiny_model: Path, state: Path, problem: str
) -> None:
    journal = state / "jobs.sqlite3"
    holder = None
    if problem == "corrupt":
        journal.write_bytes(b"this is not a SQLite database " * 100)
    elif problem == "locked":
        holder = subprocess.Popen(
            [sys.executable, "-c", _HOLD_LOCK, str(journal)], stdout=subprocess.PIPE, text=True
        )
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
    else:
        journal = Path("/proc/kvmux-no-such-dir/jobs.sqlite3")  # not even root writes there
    cfg = state / "k.toml"
    cfg.write_text(
        f'[model]\npath = "{tiny_model}"\n[server]\nendpoint = "ipc://{state}/k.sock"\n'
        f'[jobs]\njournal = "{journal}"\n[log]\nformat = "json"\n'
    )
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "kvmux.daemon", "--config", str(cfg)],
            capture_output=True,
            text=True,
            timeout=60,
        )
    finally:
        if holder is not None:
            holder.kill()
            holder.communicate()
    assert proc.returncode == EX_CONFIG, proc.stdout + proc.stderr
    failure = [json.loads(line) for line in proc.stdout.splitlines() if "startup_failed" in line]
    assert failure and str(journal) in failure[0]["error"]
    expected = {"corrupt": "cannot be used", "locked": "in use by another kvmuxd"}
    assert expected.get(problem, "cannot create") in failure[0]["error"]


_HOLD_LOCK = """
import sys
from pathlib import Path
from kvmux.daemon.journal import Journal
j = Journal(Path(sys.argv[1]))
print("held", flush=True)
sys.stdin.read() if False else __import__("time").sleep(120)
"""


async def test_a_full_disk_refuses_new_submits_and_spares_running_items(
    tiny_model: Path, sock_dir: Path, reference: Engine
) -> None:
    cfg = make_config(tiny_model, sock_dir, jobs={"journal": str(sock_dir / "jobs.sqlite3")})
    running_item = Item(custom_id="r", prompt="keep going", max_new_tokens=300, ignore_eos=True)
    async with running(cfg) as daemon, connected(daemon) as client:
        job = await client.submit([running_item])
        assert daemon.journal is not None
        # SQLite's own page limit: writes past it fail with SQLITE_FULL, as a full disk does.
        db = daemon.journal._db
        pages = db.execute("PRAGMA page_count").fetchone()[0]
        db.execute(f"PRAGMA max_page_count = {pages + 1}")
        big = [Item(prompt="x" * 2000, max_new_tokens=1) for _ in range(200)]
        with pytest.raises(StorageFull, match="journal"):
            await client.submit(big)
        (result,) = await job.results()
    assert result.status == "ok"
    assert result.token_ids == decode_alone(reference, running_item)


async def test_the_python_client_waits_out_a_restart_and_gets_every_result(
    tiny_model: Path, state: Path, reference: Engine
) -> None:
    endpoint = f"ipc://{state}/kvmuxd.sock"
    items = _items(60, seed=3)
    got: list[ItemResult] = []
    async with anyio.create_task_group() as tg:
        async with kvmuxd(tiny_model, threads=1, tables=_tables(state), endpoint=endpoint) as d:
            async with Client(endpoint, timeout=30.0) as client:
                job_id = (await client.submit(items, detach=True)).job_id

            async def follow() -> None:
                got.extend(await results_through_restarts(job_id, endpoint, wait_daemon=60))

            tg.start_soon(follow)
            await anyio.sleep(0.5)
            d.proc.send_signal(signal.SIGKILL)
            d.proc.wait()
        await anyio.sleep(1.0)  # nobody answers for a while
        async with kvmuxd(tiny_model, threads=1, tables=_tables(state), endpoint=endpoint):
            with anyio.fail_after(120):
                while not got:
                    await anyio.sleep(0.1)
    assert [r.index for r in got] == list(range(60))
    for item, r in zip(items, got, strict=True):
        assert r.token_ids == decode_alone(reference, msgspec.structs.replace(item, seed=r.seed))


# "interrupted": a crash after the upgrade's first step committed, before user_version.
@pytest.mark.parametrize("interrupted", [False, True], ids=["version-1", "interrupted"])
def test_a_version_1_journal_is_upgraded_in_place_and_keeps_its_jobs(
    state: Path, interrupted: bool
) -> None:
    from kvmux.daemon.journal import SCHEMA_VERSION, Journal

    path = state / "old.sqlite3"
    item = Item(custom_id="a", prompt="hi", max_new_tokens=3)
    db = sqlite3.connect(path)
    db.executescript(
        """
        CREATE TABLE jobs (job_id TEXT PRIMARY KEY, owner TEXT NOT NULL, name TEXT NOT NULL,
            detached INTEGER NOT NULL, created REAL NOT NULL, finished REAL,
            total INTEGER NOT NULL);
        CREATE TABLE items (job_id TEXT NOT NULL REFERENCES jobs(job_id) ON DELETE CASCADE,
            idx INTEGER NOT NULL, item BLOB NOT NULL, result BLOB,
            PRIMARY KEY (job_id, idx)) WITHOUT ROWID;
        PRAGMA user_version = 1;
        """
    )
    if interrupted:
        db.execute("ALTER TABLE jobs ADD COLUMN format TEXT NOT NULL DEFAULT 'kvmux'")
    db.execute(
        "INSERT INTO jobs (job_id, owner, name, detached, created, finished, total) "
        "VALUES ('j1', 'uid:1', 'old', 1, 1.0, NULL, 1)"
    )
    db.execute("INSERT INTO items VALUES ('j1', 0, ?, NULL)", (msgspec.msgpack.encode(item),))
    db.commit()
    db.close()
    journal = Journal(path)
    try:
        [job] = journal.load()
        assert (job.job_id, job.format, job.open, job.items) == ("j1", "kvmux", False, [item])
        # The new columns are written from now on: an open job and its additions.
        journal.add_job("j2", "uid:1", "new", False, [item], format="openai", open=True).result(10)
        journal.add_items("j2", 1, [item], close=False).result(10)
        reloaded = {j.job_id: j for j in journal.load()}
        # Version 3's tables for the Files and Batch API are there too.
        journal.put_record("files", "file-1", "uid:1", b"\x80").result(10)
        journal.put_record("batches", "batch_1", "uid:1", b"\x81").result(10)
        records = (journal.load_records("files"), journal.load_records("batches"))
    finally:
        journal.close()
    assert records == ([("file-1", "uid:1", b"\x80")], [("batch_1", "uid:1", b"\x81")])
    assert (reloaded["j2"].format, reloaded["j2"].open, len(reloaded["j2"].items)) == (
        "openai",
        True,
        2,
    )
    version = sqlite3.connect(path).execute("PRAGMA user_version").fetchone()[0]
    assert version == SCHEMA_VERSION == 3
