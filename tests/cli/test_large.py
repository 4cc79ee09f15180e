"""A file far beyond one message's limits: ``kvmux submit`` streams it into one job.

20,000 lines (the 50,000-line run, with memory figures, is ``bench/bench_batchfile.py``)
through a real ``kvmuxd`` process whose ``max_job_items`` and ``max_message_bytes``
are a small fraction of the file; the same streaming through a daemon killed midway;
and a detached job that keeps the lines that did not parse.
"""

from __future__ import annotations

import json
import signal
import subprocess
import tempfile
from pathlib import Path

import anyio
import pytest

from bench.bench_batchfile import submit_file, write_lines
from bench.bench_daemon import kvmuxd as kvmuxd_process
from kvmux.client import Client

from .conftest import Kvmuxd, cli_env, kvmux_argv

pytestmark = pytest.mark.anyio

LINES = 20_000
TABLES: dict[str, dict[str, object]] = {
    "server": {"max_message_bytes": 32 * 1024},
    "kv": {"min_bucket": 16},
    "scheduler": {
        "max_active_sessions": 64,
        "max_job_items": 500,
        "max_queued_items": 1000,
        "prefill_chunk": 64,
    },
    "log": {"level": "warning"},
}


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def test_a_file_of_20000_lines_is_one_job_with_a_result_for_every_line(
    tiny_model: Path,
) -> None:
    with tempfile.TemporaryDirectory(prefix="kvl-") as tmp:
        work = Path(tmp)
        batch = write_lines(work / "big.jsonl", LINES)
        with batch.open("a") as f:
            f.write("{not json\n")  # line LINES + 1: refused, and still has its result
        out = work / "out.jsonl"
        async with kvmuxd_process(tiny_model, threads=1, tables=TABLES) as d:
            with anyio.fail_after(240):
                done = await anyio.to_thread.run_sync(lambda: submit_file(d.endpoint, batch, out))
            async with Client(d.endpoint) as client:
                jobs = await client.jobs()
        results = [json.loads(line) for line in out.read_text().splitlines()]
    assert done.returncode == 2, done.stderr[-2000:]  # one line failed
    assert [(j.total, j.ok, j.failed, j.state) for j in jobs] == [(LINES + 1, LINES, 1, "done")]
    by_id = {r["custom_id"]: r for r in results}
    assert len(results) == len(by_id) == LINES + 1
    assert set(by_id) == {f"r{i}" for i in range(LINES)} | {f"line-{LINES + 1}"}
    refused = by_id[f"line-{LINES + 1}"]
    assert refused["status"] == "error" and refused["error"]["code"] == "bad_request"
    assert refused["line"] == LINES + 1
    for i in (0, 1, 4999, LINES - 1):
        r = by_id[f"r{i}"]
        assert r["status"] == "ok" and r["line"] == i + 1
        assert len(r["token_ids"]) <= 1 + i % 2
    assert all(r["status"] == "ok" for r in results if r["custom_id"].startswith("r"))


async def test_a_file_streaming_in_rides_through_a_daemon_killed_midway(tiny_model: Path) -> None:
    lines = 3000
    with tempfile.TemporaryDirectory(prefix="kvr-") as tmp:
        work = Path(tmp)
        endpoint = f"ipc://{work}/kvmuxd.sock"
        # Few sessions and a small queue: the file goes in slowly, so the kill lands mid-file.
        limits = {"max_active_sessions": 4, "max_job_items": 100, "max_queued_items": 200}
        tables: dict[str, dict[str, object]] = {
            **TABLES,
            "scheduler": {**TABLES["scheduler"], **limits},
            "jobs": {"journal": str(work / "jobs.sqlite3")},
        }
        batch = write_lines(work / "big.jsonl", lines)
        out = work / "out.jsonl"
        with anyio.fail_after(240):
            async with kvmuxd_process(tiny_model, threads=1, tables=tables, endpoint=endpoint) as d:
                cli = subprocess.Popen(
                    kvmux_argv("submit", str(batch), "--out", str(out), "--wait-daemon", "60"),
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.PIPE,
                    text=True,
                    env=cli_env(endpoint),
                )
                async with Client(endpoint) as client:
                    while not (jobs := await client.jobs()) or jobs[0].total < lines // 3:
                        await anyio.sleep(0.02)
                at_kill = jobs[0].total
                d.proc.send_signal(signal.SIGKILL)  # mid-file: the rest is not sent yet
                d.proc.wait()
            async with kvmuxd_process(tiny_model, threads=1, tables=tables, endpoint=endpoint) as d:
                _, err = await anyio.to_thread.run_sync(lambda: cli.communicate(timeout=200))
                async with Client(endpoint) as client:
                    jobs = await client.jobs()
        results = [json.loads(line) for line in out.read_text().splitlines()]
    assert cli.returncode == 0, err[-3000:]
    assert at_kill < lines and "re-attached" in err
    assert [(j.total, j.ok, j.state) for j in jobs] == [(lines, lines, "done")]
    ids = sorted(r["custom_id"] for r in results)
    assert ids == sorted(f"r{i}" for i in range(lines))  # each line once: none lost, none twice


def test_a_detached_job_keeps_the_lines_that_did_not_parse(kvmuxd: Kvmuxd, tmp_path: Path) -> None:
    batch = tmp_path / "nine.jsonl"
    good = '{"custom_id": "%s", "prompt": "hi", "max_tokens": 2}'
    bad = ["{oops", "[1]", '"text"', '{"prompt": 5}', "{}", '{"prompt": "x", "top_p": 9}', "nul"]
    batch.write_text("\n".join([good % "first", *bad, good % "last"]) + "\n")
    submitted = kvmuxd.run("submit", "--detach", str(batch))
    job_id = submitted.stdout.strip()
    out = tmp_path / "out.jsonl"
    collected = kvmuxd.run("results", job_id, "--out", str(out), "--format", "kvmux")
    results = sorted((json.loads(x) for x in out.read_text().splitlines()), key=lambda r: r["line"])
    assert submitted.returncode == 2 and job_id, submitted.stderr
    assert collected.returncode == 2 and "9/9 items, 7 failed" in collected.stderr
    assert [r["line"] for r in results] == list(range(1, 10))
    assert [r["status"] for r in results] == ["ok", *["error"] * 7, "ok"]
    assert all(r["error"]["code"] == "bad_request" for r in results[1:8])
