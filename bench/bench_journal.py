"""What the job journal costs: tokens/s with it vs without, bytes per item, replay time.

- **Throughput**: two ``kvmuxd`` processes side by side, one with a journal
  (``jobs.journal_sync`` as configured, "normal" by default) and one with
  ``jobs.journal = ""``, the same greedy jobs submitted to each in turn
  (the order rotates each repeat), N = 1 and N = 16 items per job on the
  built-in ``small`` model. The ratio journal / memory-only is the cost.
- **Bytes per finished item**: the journal file's size after those jobs,
  over the items they held.
- **Replay**: a journal holding 100,000 finished results (written through the
  journal's own API), read back and restored into a scheduler, as kvmuxd
  does at start.

Usage: python -m bench.bench_journal [--quick] [--sync normal|full] [--repeats R]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio

from bench.bench_daemon import kvmuxd, prompts_for
from bench.common import builtin, write_json
from kvmux.client import Client, Item, ItemResult
from kvmux.client.protocol import Usage


async def _run(client: Client, prompts: list[list[int]], n_new: int) -> float:
    items = [
        Item(custom_id=str(i), prompt_tokens=pr, max_new_tokens=n_new, ignore_eos=True)
        for i, pr in enumerate(prompts)
    ]
    t0 = time.perf_counter()
    results = await (await client.submit(items)).results()
    wall = time.perf_counter() - t0
    assert all(r.status == "ok" for r in results)
    return sum(len(r.token_ids) for r in results) / wall


async def throughput(sizes: list[int], repeats: int, n_new: int, sync: str) -> dict[str, Any]:
    model = builtin("small")
    folder = Path(tempfile.mkdtemp(prefix="kvx-jb-"))
    journal = folder / "jobs.sqlite3"
    base: dict[str, dict[str, object]] = {
        "kv": {"min_bucket": 256},
        "scheduler": {"max_active_sessions": max(sizes)},
    }
    with_journal: dict[str, dict[str, object]] = {
        **base,
        "jobs": {"journal": str(journal), "journal_sync": sync},
    }
    without: dict[str, dict[str, object]] = {**base, "jobs": {"journal": ""}}
    rows = []
    try:
        async with (
            kvmuxd(model, threads=1, tables=with_journal) as dj,
            kvmuxd(model, threads=1, tables=without) as dm,
            Client(dj.endpoint, timeout=120.0) as cj,
            Client(dm.endpoint, timeout=120.0) as cm,
        ):
            sides = {"journal": cj, "memory": cm}
            for client in sides.values():
                await _run(client, prompts_for(2, 4096, seed=99), 8)  # warm-up
            items_run = 2
            for n in sizes:
                prompts = prompts_for(n, 4096, seed=n)
                tps: dict[str, list[float]] = {"journal": [], "memory": []}
                for rep in range(repeats):
                    order = ["journal", "memory"] if rep % 2 == 0 else ["memory", "journal"]
                    for side in order:
                        tps[side].append(await _run(sides[side], prompts, n_new))
                items_run += n * repeats
                j, m = statistics.median(tps["journal"]), statistics.median(tps["memory"])
                rows.append(
                    {"n": n, "journal_tok_s": j, "memory_tok_s": m, "ratio": j / m, "runs": tps}
                )
                print(f"N={n:>3}: journal {j:7.1f} tok/s, memory-only {m:7.1f} tok/s, {j / m:.3f}")
        size = journal.stat().st_size + (
            (folder / "jobs.sqlite3-wal").stat().st_size
            if (folder / "jobs.sqlite3-wal").exists()
            else 0
        )
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    per_item = size / items_run
    print(
        f"journal: {size} bytes for {items_run} items ({n_new} tokens each): {per_item:.0f} B/item"
    )
    return {"sync": sync, "new_tokens": n_new, "rows": rows, "bytes_per_item": per_item}


async def replay(n: int) -> dict[str, Any]:
    """Restore ``n`` finished results from a journal, as kvmuxd does at start."""
    from kvmux.daemon.config import Config
    from kvmux.daemon.coordinator import GrowthCoordinator
    from kvmux.daemon.engine import Engine, EngineOptions
    from kvmux.daemon.journal import Journal
    from kvmux.daemon.scheduler import Scheduler
    from kvmux.daemon.worker import EngineWorker

    folder = Path(tempfile.mkdtemp(prefix="kvx-jr-"))
    try:
        journal = Journal(folder / "jobs.sqlite3")
        per_job = 50_000
        for j in range(0, n, per_job):
            job_id = f"job{j}"
            count = min(per_job, n - j)
            items = [Item(custom_id=f"{j + i}", prompt="hello there", max_new_tokens=32)
                     for i in range(count)]  # fmt: skip
            journal.add_job(job_id, "uid:1000", "bench", True, items).result()
            for i in range(count):
                ids = list(range(100, 132))
                journal.add_result(
                    job_id,
                    ItemResult(
                        index=i, custom_id=f"{j + i}", status="ok", text="x" * 60, token_ids=ids,
                        finish_reason="length", usage=Usage(3, 32, 35), seed=7,
                    ),
                )  # fmt: skip
            journal.set_finished(job_id, time.time())
        journal.flush()
        size = journal.size()
        journal.close()
        cfg = Config()
        engine = Engine(builtin("tiny"), EngineOptions(intra_op_threads=1))
        worker = EngineWorker()
        t0 = time.perf_counter()
        journal = Journal(folder / "jobs.sqlite3")
        jobs = journal.load()
        t_load = time.perf_counter() - t0
        jobs_cfg = cfg.jobs.__class__(max_retained_tokens=10**9)
        sched = Scheduler(engine, worker, GrowthCoordinator(), cfg.scheduler, jobs_cfg)
        await sched.restore(jobs)
        t_all = time.perf_counter() - t0
        journal.close()
        worker.close()
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    print(f"replay of {n} finished results ({size / 2**20:.1f} MiB): read {t_load:.2f} s, "
          f"read + restore {t_all:.2f} s")  # fmt: skip
    return {"results": n, "journal_bytes": size, "load_s": t_load, "load_and_restore_s": t_all}


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    repeats, n_new = (3, 32) if args.quick else (5, 64)
    repeats = args.repeats or repeats
    out = {"throughput": await throughput([1, 16], repeats, n_new, args.sync)}
    out["replay"] = await replay(20_000 if args.quick else 100_000)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.bench_journal", description=__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--sync", choices=["normal", "full"], default="normal")
    parser.add_argument("--repeats", type=int, default=0, help="runs per side (default 5)")
    args = parser.parse_args(argv)
    result = anyio.run(main_async, args)
    print(f"written to {write_json('bench_journal', result)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
