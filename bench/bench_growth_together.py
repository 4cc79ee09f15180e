"""The growth lock at 256 sessions (issue 28 item 6): waits and holds, read in-process.

A ``kvmuxd`` (the :class:`~kvmux.daemon.app.Daemon`) runs in this process on the
tiny model, so its coordinator is read directly: lock holds, growths, the lock's
total and longest wait. One job of N items, greedy, EOS ignored, ``kv.min_bucket``
16, so every item grows several times; two shapes:

- **lockstep**: equal prompt lengths: all N cross each bucket at the same step.
- **mixed**: prompt lengths 8..64 drawn at random: they cross at different steps.

Run it against a tree without grouped growth (``PYTHONPATH`` of an older checkout)
for the "before" figures; ``lock_holds`` then comes from the coordinator if it has one.

    python -m bench.bench_growth_together [--sessions 256] [--new 200] [--repeats 2]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio
import msgspec
import numpy as np

from bench.common import builtin, machine, write_json
from kvmux.client import Client, Item
from kvmux.daemon.app import Daemon
from kvmux.daemon.config import Config


def _items(n: int, new: int, shape: str, seed: int) -> list[Item]:
    rng = np.random.default_rng(seed)
    lengths = [24] * n if shape == "lockstep" else [int(x) for x in rng.integers(8, 65, n)]
    return [
        Item(
            custom_id=str(i),
            prompt_tokens=[int(t) for t in rng.integers(3, 259, k)],
            max_new_tokens=new,
            temperature=0.0,
            ignore_eos=True,
        )
        for i, k in enumerate(lengths)
    ]


async def one_run(model: Path, n: int, new: int, shape: str, seed: int) -> dict[str, Any]:
    sock = Path(tempfile.mkdtemp(prefix="kvg-", dir="/tmp"))
    try:
        cfg = msgspec.convert(
            {
                "model": {"path": str(model), "intra_op_threads": 1},
                "server": {"endpoint": f"ipc://{sock}/kvmuxd.sock"},
                "kv": {"min_bucket": 16},
                "scheduler": {"max_active_sessions": n},
                "jobs": {"journal": ""},
                "log": {"level": "warning"},
            },
            Config,
        )
        daemon = Daemon(cfg)
        async with anyio.create_task_group() as tg:
            await tg.start(daemon.serve)
            try:
                async with Client(daemon.endpoint, timeout=120.0) as client:
                    t0 = time.perf_counter()
                    job = await client.submit(_items(n, new, shape, seed))
                    results = await job.results()
                    wall = time.perf_counter() - t0
            finally:
                daemon.stop()
    finally:
        shutil.rmtree(sock, ignore_errors=True)
    failed = [r for r in results if r.status != "ok"]
    if failed:
        raise AssertionError(f"{len(failed)} items failed: {failed[0].error}")
    c = daemon.coordinator
    return {
        "wall_s": wall,
        "tokens": sum(len(r.token_ids) for r in results),
        "growths": c.growths,
        "lock_holds": getattr(c, "lock_holds", None),
        "lock_wait_total_s": c.lock_wait_total,
        "lock_wait_max_s": c.lock_wait_max,
    }


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    model = builtin("tiny")
    out: dict[str, Any] = {"machine": machine(), "sessions": args.sessions, "new": args.new}
    for shape in ("lockstep", "mixed"):
        runs = [
            await one_run(model, args.sessions, args.new, shape, seed=r)
            for r in range(args.repeats)
        ]
        out[shape] = {
            "runs": runs,
            "median": {
                k: statistics.median(r[k] for r in runs) for k in runs[0] if runs[0][k] is not None
            },
        }
        m = out[shape]["median"]
        print(
            f"{shape:9s} N={args.sessions}: wall {m['wall_s']:.2f} s, growths "
            f"{m['growths']:.0f}, lock holds {m.get('lock_holds', 'n/a')}, lock wait total "
            f"{m['lock_wait_total_s']:.3f} s, max {m['lock_wait_max_s'] * 1e3:.1f} ms"
        )
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--sessions", type=int, default=256)
    ap.add_argument("--new", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default="growth_together")
    args = ap.parse_args(argv)
    result = anyio.run(bench, args)
    if args.out:
        print(write_json(args.out, result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
