"""A batch file of any size through ``kvmux submit``: wall time, peak memory, tokens/s.

One run, side by side, on the built-in ``tiny`` model served by a ``kvmuxd``
subprocess (one intra-op thread):

- **one file**: ``kvmux submit`` of N lines (default 50,000: OpenAI's batch
  limit) of tiny prompts (``max_tokens`` 1 or 2), which the CLI streams
  into one open job in messages of at most ``scheduler.max_job_items`` lines;
- **split**: the same lines as N/1000 files of 1,000 lines, one ``kvmux
  submit`` after the other (what a user had to do before).

Reported for each: wall time, completion tokens/s (counted from the written
results), the client's peak RSS (``ru_maxrss`` of that ``kvmux`` process,
from ``wait4``) and the daemon's peak RSS (``VmHWM`` of its process; a fresh
daemon per side, so each peak is its own). Every line must have exactly one
ok result. Usage: ``python -m bench.bench_batchfile [--lines N] [--quick]``

:func:`write_lines` and :func:`submit_file` are what ``tests/cli/test_large.py``
runs too.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio

from bench.bench_daemon import DaemonProcess, kvmuxd
from bench.common import builtin, write_json

# A daemon's limits well below the file's size, so the file must stream in.
TABLES: dict[str, dict[str, object]] = {
    "server": {"max_message_bytes": 256 * 1024},
    "kv": {"min_bucket": 16},
    "scheduler": {
        "max_active_sessions": 64,
        "max_job_items": 1000,
        "max_queued_items": 4000,
        "prefill_chunk": 64,
    },
    "log": {"level": "warning"},
}


def write_lines(path: Path, n: int, *, start: int = 0) -> Path:
    """``n`` JSONL lines of tiny prompts, ``max_tokens`` 1 or 2, ids ``r<start+i>``."""
    with path.open("w", encoding="utf-8") as f:
        for i in range(start, start + n):
            f.write(json.dumps({"custom_id": f"r{i}", "prompt": f"n{i}", "max_tokens": 1 + i % 2}))
            f.write("\n")
    return path


@dataclass
class Submitted:
    """One ``kvmux submit`` process, finished."""

    returncode: int
    wall: float
    maxrss_bytes: int  # the process's own peak (Linux reports ru_maxrss in KiB)
    stderr: str


def submit_file(
    endpoint: str, batch: Path, out: Path, *extra: str, timeout: float = 600.0
) -> Submitted:
    """Run ``kvmux submit BATCH --out OUT`` to the end; its wall time and peak RSS."""
    env = {k: v for k, v in os.environ.items() if k != "KVMUX_ENDPOINT"}
    with tempfile.TemporaryFile() as err:
        started = time.perf_counter()
        proc = subprocess.Popen(
            [
                *(sys.executable, "-m", "kvmux.client.cli", "submit", str(batch)),
                *("--out", str(out), "--endpoint", endpoint, "--quiet", *extra),
            ],
            stdout=subprocess.DEVNULL,
            stderr=err,
            env=env,
        )
        deadline = started + timeout
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if time.perf_counter() > deadline:
                proc.kill()
                pid, status, usage = os.wait4(proc.pid, 0)
                break
            time.sleep(0.05)
        wall = time.perf_counter() - started
        proc.returncode = os.waitstatus_to_exitcode(status)
        err.seek(0)
        text = err.read().decode(errors="replace")
    return Submitted(proc.returncode, wall, usage.ru_maxrss * 1024, text)


def vm_hwm(pid: int) -> int:
    """A process's peak resident set (``VmHWM``), bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmHWM for {pid}")


def check_results(out: Path, ids: set[str]) -> int:
    """Every id exactly once, all ok; returns the completion tokens they hold."""
    seen: dict[str, int] = {}
    tokens = 0
    with out.open(encoding="utf-8") as f:
        for line in f:
            r = json.loads(line)
            if r["status"] != "ok":
                raise AssertionError(f"{r['custom_id']}: {r['error']}")
            seen[r["custom_id"]] = seen.get(r["custom_id"], 0) + 1
            tokens += len(r["token_ids"])
    if set(seen) != ids or any(n != 1 for n in seen.values()):
        missing = len(ids - set(seen))
        raise AssertionError(f"{missing} ids missing, {sum(seen.values())} results")
    return tokens


def _side(name: str, wall: float, tokens: int, client: int, daemon: int) -> dict[str, Any]:
    return {
        "side": name,
        "wall_seconds": round(wall, 2),
        "completion_tokens": tokens,
        "tokens_per_second": round(tokens / wall, 1),
        "client_peak_rss_mib": round(client / 2**20, 1),
        "daemon_peak_rss_mib": round(daemon / 2**20, 1),
    }


async def _one_file(model: Path, work: Path, lines: int) -> dict[str, Any]:
    batch = write_lines(work / "all.jsonl", lines)
    out = work / "all.out.jsonl"
    async with kvmuxd(model, threads=1, tables=TABLES) as d:
        done = await anyio.to_thread.run_sync(lambda: submit_file(d.endpoint, batch, out))
        daemon_peak = vm_hwm(d.pid)
    if done.returncode != 0:
        raise RuntimeError(f"kvmux submit exited {done.returncode}: {done.stderr[-2000:]}")
    tokens = check_results(out, {f"r{i}" for i in range(lines)})
    return _side(f"one file of {lines}", done.wall, tokens, done.maxrss_bytes, daemon_peak)


async def _split(model: Path, work: Path, lines: int, per_file: int) -> dict[str, Any]:
    wall = 0.0
    tokens = 0
    client_peak = 0
    daemon: DaemonProcess
    async with kvmuxd(model, threads=1, tables=TABLES) as daemon:
        for k in range(lines // per_file):
            batch = write_lines(work / f"part{k}.jsonl", per_file, start=k * per_file)
            out = work / f"part{k}.out.jsonl"
            done = await anyio.to_thread.run_sync(
                functools.partial(submit_file, daemon.endpoint, batch, out)
            )
            if done.returncode != 0:
                raise RuntimeError(f"kvmux submit exited {done.returncode}: {done.stderr[-2000:]}")
            wall += done.wall
            client_peak = max(client_peak, done.maxrss_bytes)
            ids = {f"r{i}" for i in range(k * per_file, (k + 1) * per_file)}
            tokens += check_results(out, ids)
        daemon_peak = vm_hwm(daemon.pid)
    return _side(f"{lines // per_file} files of {per_file}", wall, tokens, client_peak, daemon_peak)


async def _main(lines: int, per_file: int) -> dict[str, Any]:
    model = builtin("tiny")
    with tempfile.TemporaryDirectory(prefix="kvbf-") as tmp:
        work = Path(tmp)
        one = await _one_file(model, work, lines)
        split = await _split(model, work, lines, per_file)
    return {"lines": lines, "per_file": per_file, "config": TABLES, "sides": [one, split]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lines", type=int, default=50_000)
    parser.add_argument("--per-file", type=int, default=1000)
    parser.add_argument("--quick", action="store_true", help="5,000 lines")
    args = parser.parse_args()
    lines = 5000 if args.quick else args.lines
    payload = anyio.run(_main, lines, args.per_file)
    for side in payload["sides"]:
        print(
            f"{side['side']:>20}: {side['wall_seconds']:8.1f} s  "
            f"{side['tokens_per_second']:8.1f} tok/s  client {side['client_peak_rss_mib']:6.1f} "
            f"MiB  daemon {side['daemon_peak_rss_mib']:6.1f} MiB"
        )
    print(f"written to {write_json('batchfile', payload)}")


if __name__ == "__main__":
    main()
