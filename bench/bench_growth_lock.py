"""Growth through the daemon: the growth lock's wait times, and KV memory allocated vs used.

Both parts run ``kvmuxd`` as a subprocess and read it from outside: the lock
waits from its ``kv_grew`` log events (``lock_wait_seconds``, ``seconds``),
the memory from ``status().sessions`` sampled while it works.

- **Lock waits**: 32 sessions with the same prompt length and
  ``max_new_tokens`` decode in lockstep, so each bucket boundary makes all 32
  ask to grow at once and queue on the one growth lock (``small`` model,
  ``kv.min_bucket`` 16).
- **Memory**: a run with varied prompt and output lengths (16 sessions at a
  time); every sample adds up the sessions' allocated KV bytes and the bytes
  their valid tokens use (``valid_len`` times bytes per token), for the default
  floor (256) and for a small one (16); also what preallocating each item's
  final bucket, or the model's whole context, would have held.
Usage: python -m bench.bench_growth_lock [--quick] [--threads N]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import Counter
from typing import Any

import anyio
import numpy as np

from bench.bench_daemon import kvmuxd, pct
from bench.common import builtin, write_json
from kvmux.client import Client, Item
from kvmux.daemon.model import load_model
from kvmux.kv import capacity_bucket

LOCK_SESSIONS = 32


def _ms(values: list[float]) -> dict[str, float]:
    return {
        "p50_ms": 1e3 * pct(values, 50),
        "p90_ms": 1e3 * pct(values, 90),
        "p99_ms": 1e3 * pct(values, 99),
        "max_ms": 1e3 * max(values) if values else float("nan"),
        "mean_ms": 1e3 * statistics.fmean(values) if values else float("nan"),
    }


async def lock_waits(threads: int, n_new: int) -> dict[str, Any]:
    model = builtin("small")
    tables = {
        "kv": {"min_bucket": 16},
        "scheduler": {"max_active_sessions": LOCK_SESSIONS},
    }
    rng = np.random.default_rng(7)
    items = [
        Item(
            custom_id=str(i),
            prompt_tokens=[int(t) for t in rng.integers(3, 4000, 8)],
            max_new_tokens=n_new,
            temperature=0.0,
            ignore_eos=True,
        )
        for i in range(LOCK_SESSIONS)
    ]
    async with (
        kvmuxd(model, threads=threads, tables=tables) as daemon,
        Client(daemon.endpoint, timeout=60.0) as client,
    ):
        t0 = time.perf_counter()
        job = await client.submit(items)
        results = await job.results()
        wall = time.perf_counter() - t0
        status = await client.status()
        await anyio.sleep(0.2)  # let the last log lines land
        grew = [e for e in daemon.events("kv_grew") if e.get("job_id") == job.job_id]
    if any(r.status != "ok" for r in results):
        raise AssertionError("an item failed in the lock-wait run")
    waits = [float(e["lock_wait_seconds"]) for e in grew]
    held = [float(e["seconds"]) for e in grew]
    by_bucket: dict[str, list[float]] = {}
    for e in grew:
        by_bucket.setdefault(f"{e['old']}->{e['new']}", []).append(float(e["lock_wait_seconds"]))
    return {
        "sessions": LOCK_SESSIONS,
        "new_tokens": n_new,
        "wall_s": wall,
        "growths": len(grew),
        "status_growths": status.growth.growths,
        "lock_wait": _ms(waits),
        "growth_held": _ms(held),
        "lock_wait_total_s": sum(waits),
        "growth_total_s": sum(held),
        "status_lock_wait_total_s": status.growth.lock_wait_seconds_total,
        "status_lock_wait_max_s": status.growth.lock_wait_seconds_max,
        "by_bucket": {
            k: {"count": len(v), "p50_ms": 1e3 * pct(v, 50), "max_ms": 1e3 * max(v)}
            for k, v in by_bucket.items()
        },
        "kv_bytes_in_use_end": status.kv_bytes_in_use,
    }


async def memory_run(threads: int, min_bucket: int, n_items: int, size: str) -> dict[str, Any]:
    model = builtin(size)
    spec = load_model(model)
    context = spec.context_length
    if context is None:
        raise ValueError(f"model {size} declares no context length to compare with")
    rng = np.random.default_rng(11)
    items = []
    lengths = []
    for i in range(n_items):
        prompt = int(rng.integers(8, 400))
        new = int(rng.integers(16, 600))
        lengths.append((prompt, new))
        items.append(
            Item(
                custom_id=str(i),
                prompt_tokens=[int(t) for t in rng.integers(3, spec.vocab_size - 1, prompt)],
                max_new_tokens=new,
                temperature=0.0,
                ignore_eos=True,
            )
        )
    final_bucket = [capacity_bucket(pr + new, context, min_bucket) for pr, new in lengths]
    tables = {"kv": {"min_bucket": min_bucket}, "scheduler": {"max_active_sessions": 16}}
    # Per sample: allocated, used, the daemon's own in-use figure, sessions, and
    # what the same sessions would hold preallocated (final bucket; whole context).
    samples: list[tuple[int, int, int, int, int, int]] = []
    async with (
        kvmuxd(model, threads=threads, tables=tables) as daemon,
        Client(daemon.endpoint, timeout=60.0) as client,
    ):
        job = await client.submit(items)
        done = anyio.Event()

        async def finish() -> None:
            await job.results()
            done.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(finish)
            while not done.is_set():
                st = await client.status()
                sessions = [s for s in st.sessions if s.valid_len > 0]
                if sessions:
                    bpt = st.kv_bytes_per_token
                    samples.append(
                        (
                            sum(s.kv_bytes for s in sessions),
                            sum(s.valid_len for s in sessions) * bpt,
                            st.kv_bytes_in_use,
                            len(sessions),
                            sum(final_bucket[s.index] for s in sessions) * bpt,
                            len(sessions) * context * bpt,
                        )
                    )
                await anyio.sleep(0.01)
        st = await client.status()
        bpt = st.kv_bytes_per_token
    allocated = sum(s[0] for s in samples)
    used = sum(s[1] for s in samples)
    return {
        "model": size,
        "min_bucket": min_bucket,
        "items": n_items,
        "samples": len(samples),
        "bytes_per_token": bpt,
        "mean_sessions": statistics.fmean(s[3] for s in samples),
        "mean_allocated_bytes": allocated / len(samples),
        "mean_used_bytes": used / len(samples),
        "used_over_allocated": used / allocated,
        "allocated_over_used": allocated / used,
        "status_in_use_over_allocated": sum(s[2] for s in samples) / allocated,
        "prealloc_final_bucket_used_ratio": used / sum(s[4] for s in samples),
        "prealloc_context_used_ratio": used / sum(s[5] for s in samples),
        "kv_bytes_in_use_end": st.kv_bytes_in_use,
        "failures": dict(Counter(st.growth.failures)),
    }


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    n_new = 120 if args.quick else 500
    n_items = 48 if args.quick else 160
    threads = args.threads or "default"
    print(f"intra_op_num_threads={threads}; kvmuxd a subprocess; log and status read from outside")
    lw = await lock_waits(args.threads, n_new)
    print(
        f"\nGrowth lock, {lw['sessions']} sessions growing together (small, min_bucket 16, "
        f"{lw['new_tokens']} new tokens each, {lw['wall_s']:.1f} s): {lw['growths']} growths"
    )
    print(f"{'':<22}{'p50':>8}{'p90':>8}{'p99':>8}{'max':>8}{'mean':>8}  (ms)")
    for label, key in (("lock wait", "lock_wait"), ("growth (lock held)", "growth_held")):
        d = lw[key]
        print(
            f"{label:<22}{d['p50_ms']:>8.2f}{d['p90_ms']:>8.2f}{d['p99_ms']:>8.2f}"
            f"{d['max_ms']:>8.2f}{d['mean_ms']:>8.2f}"
        )
    print(
        f"lock wait total {lw['lock_wait_total_s']:.3f} s, growth total "
        f"{lw['growth_total_s']:.3f} s over {lw['wall_s']:.1f} s of decoding"
    )
    print(
        "per bucket:",
        {k: f"{v['count']}x p50 {v['p50_ms']:.1f} ms" for k, v in lw["by_bucket"].items()},
    )

    mem = []
    for mb in (256, 16):
        m = await memory_run(args.threads, mb, n_items, args.memory_model)
        mem.append(m)
    print(
        f"\nKV memory, {n_items} items (prompt 8-400, new 16-600 tokens), 16 at a time, "
        f"model {args.memory_model}, sampled every 10 ms"
    )
    print(
        f"{'min_bucket':>10}{'samples':>9}{'used/alloc':>12}{'alloc/used':>12}"
        f"{'prealloc bucket':>17}{'prealloc context':>18}"
    )
    for m in mem:
        print(
            f"{m['min_bucket']:>10}{m['samples']:>9}{m['used_over_allocated']:>12.3f}"
            f"{m['allocated_over_used']:>12.3f}{m['prealloc_final_bucket_used_ratio']:>17.3f}"
            f"{m['prealloc_context_used_ratio']:>18.3f}"
        )
    for m in (lw, *mem):
        if m["kv_bytes_in_use_end"] != 0:
            raise AssertionError("the daemon holds KV bytes after the run")
    return {"threads": args.threads, "lock": lw, "memory": mem}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="shorter decodes, fewer items")
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads (0: ORT default)")
    ap.add_argument("--memory-model", default="tiny", choices=("tiny", "small"))
    args = ap.parse_args(argv)
    result = anyio.run(bench, args)
    path = write_json("growth_lock", result)
    print(f"written {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
