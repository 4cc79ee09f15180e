"""The checks a lent GPU runs for issue 28, each against a real ``kvmuxd`` with the CUDA provider.

- ``soak``: CUDA graphs on (the default), first bucket 16 so sessions grow and graphs
  are captured again and again while growths, releases and prefix forks run on other
  threads; 1,024+ items (greedy and sampled, some sharing a prompt prefix, 32-256 new
  tokens) as one job. Every item must end ``ok``, a sample of greedy items must give
  the tokens the engine gives them alone, and no KV may stay charged at the end.
- ``refusal``: a real allocator refusal. A second process takes all but ``--headroom``
  MiB of the device; 4 long items must then be refused at some growth (``fail``: a
  ``kv_growth_failed`` naming ``out_of_memory``; ``wait``: they park and go on once the
  other process lets go), and the 16 short items beside them give their unpressured
  tokens; the daemon stays up.

    python -m bench.device_checks soak [--items 1024] [--model small --dtype float16]
    python -m bench.device_checks refusal [--headroom 80]

Exits non-zero on any failed check; prints one line of figures per check.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from collections import Counter
from typing import Any

import anyio
import numpy as np

from bench.bench_daemon import kvmuxd
from kvmux.client import Client, Item
from kvmux.daemon.engine import Engine, EngineOptions
from kvmux.daemon.model import ensure_builtin
from kvmux.daemon.scheduler import item_params, item_prompt

from .common import MODELS


def _tables(policy: str, min_bucket: int, provider: str = "cuda") -> dict[str, dict[str, object]]:
    return {
        "model": {"provider": provider},  # cuda_graph: the default (on)
        "kv": {"min_bucket": min_bucket},
        "scheduler": {"on_growth_failure": policy, "max_new_tokens": 8192},
        "jobs": {"journal": ""},
    }


def soak_items(n: int, vocab: int) -> list[Item]:
    rng = np.random.default_rng(2026)
    shared = [int(t) for t in rng.integers(3, vocab, 48)]
    items = []
    for i in range(n):
        own = [int(t) for t in rng.integers(3, vocab, int(rng.integers(4, 60)))]
        prompt = shared + own if i % 3 == 0 else own
        greedy = i % 4 != 0
        items.append(
            Item(
                custom_id=f"s{i}",
                prompt_tokens=prompt,
                max_new_tokens=int(rng.integers(32, 257)),
                temperature=0.0 if greedy else 0.8,
                seed=i,
                ignore_eos=True,
            )
        )
    return items


async def soak(args: argparse.Namespace) -> int:
    model = ensure_builtin(args.model, MODELS, dtype=args.dtype)
    reference = Engine(
        model, EngineOptions(provider=args.provider, min_bucket=16, cuda_graph=False)
    )
    items = soak_items(args.items, reference.spec.vocab_size)
    async with (
        kvmuxd(model, threads=1, tables=_tables("fail", 16, args.provider)) as daemon,
        Client(daemon.endpoint, timeout=300.0) as client,
    ):
        t0 = time.perf_counter()
        results = await (await client.submit(items)).results()
        wall = time.perf_counter() - t0
        status = await client.status()
        grew = sum(1 for _ in daemon.events("kv_grew"))
    codes = Counter(r.status if r.error is None else r.error.code for r in results)
    tokens = sum(len(r.token_ids) for r in results)
    failures = []
    if codes != Counter({"ok": len(items)}):
        failures.append(f"items did not all end ok: {dict(codes)}")
    if status.kv_bytes_in_use != 0:
        failures.append(f"{status.kv_bytes_in_use} KV bytes still charged")
    by_id = {r.custom_id: r.token_ids for r in results}
    sample = [it for it in items if it.temperature == 0.0][: args.sample]
    mismatched = 0
    for item in sample:
        alone = reference.generate(item_prompt(reference, item), item_params(item)).token_ids
        mismatched += by_id.get(item.custom_id) != alone
    if mismatched:
        failures.append(f"{mismatched} of {len(sample)} greedy items differ from alone")
    print(
        f"soak: {len(items)} items, graphs on, first bucket 16: {dict(codes)}; {tokens} tokens "
        f"in {wall:.1f} s ({tokens / wall:.0f} tokens/s); {grew} growths; KV charged at the "
        f"end {status.kv_bytes_in_use}; {len(sample) - mismatched}/{len(sample)} greedy "
        "items equal to the engine alone"
    )
    for f in failures:
        print(f"soak FAILED: {f}")
    return 1 if failures else 0


_HOG = r"""
import sys, time, cupy
headroom = int(sys.argv[1]) << 20
free, total = cupy.cuda.runtime.memGetInfo()
held = []
# Raw cudaMalloc, no pool: what it holds is the device's, not a cache of its own.
cupy.cuda.set_allocator(None)
step = 1 << 30
while step >= (1 << 20):
    free, total = cupy.cuda.runtime.memGetInfo()
    if free - step < headroom:
        step //= 2
        continue
    try:
        held.append(cupy.cuda.Memory(step))
    except cupy.cuda.memory.OutOfMemoryError:
        step //= 2
free, total = cupy.cuda.runtime.memGetInfo()
mib = sum(m.size for m in held) >> 20
print(f"hog: holding {mib} MiB, device free {free >> 20} MiB", flush=True)
sys.stdin.read()  # until the parent closes it
"""


def refusal_items(vocab: int) -> list[Item]:
    rng = np.random.default_rng(7)
    items = [
        Item(
            custom_id=f"short{i}",
            prompt_tokens=[int(t) for t in rng.integers(3, vocab, 16)],
            max_new_tokens=64,
            temperature=0.0,
            ignore_eos=True,
        )
        for i in range(16)
    ]
    items += [
        Item(
            custom_id=f"long{i}",
            prompt_tokens=[int(t) for t in rng.integers(3, vocab, 16)],
            max_new_tokens=3000,
            temperature=0.0,
            ignore_eos=True,
        )
        for i in range(4)
    ]
    return items


async def _job(model: Any, policy: str, items: list[Item], hog_mib: int | None) -> dict[str, Any]:
    """One fresh daemon: a warm-up of the short items (onnxruntime's own memory settles),
    then, with another process holding all but ``hog_mib`` MiB when given, the job."""
    async with (
        kvmuxd(model, threads=1, tables=_tables(policy, 256)) as daemon,
        Client(daemon.endpoint, timeout=300.0) as client,
    ):
        await (await client.submit([i for i in items if i.custom_id.startswith("short")])).results()
        hog = None
        if hog_mib is not None:
            hog = subprocess.Popen(
                [sys.executable, "-c", _HOG, str(hog_mib)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            assert hog.stdout is not None
            print(hog.stdout.readline().strip(), flush=True)
        try:
            job = await client.submit(items)
            if hog is not None and policy == "wait":
                await anyio.sleep(8.0)  # the long items park meanwhile
                parked = (await client.status()).sessions_parked
                print(f"wait: {parked} sessions parked under pressure; letting go", flush=True)
                assert hog.stdin is not None
                hog.stdin.close()
                hog.wait(30)
                hog = None
            results = await job.results()
        finally:
            if hog is not None:
                assert hog.stdin is not None
                hog.stdin.close()
                hog.wait(30)
        alive = daemon.alive()
        status = await client.status()
    return {"results": {r.custom_id: r for r in results}, "alive": alive, "status": status}


async def refusal(args: argparse.Namespace) -> int:
    model = ensure_builtin(args.model, MODELS, dtype=args.dtype)
    vocab = Engine(model, EngineOptions(provider="cuda")).spec.vocab_size
    items = refusal_items(vocab)
    base = await _job(model, "fail", items, None)
    want = {k: r.token_ids for k, r in base["results"].items()}
    failures = [f"unpressured {k}: {r.error}" for k, r in base["results"].items() if r.error]
    for policy in ("fail", "wait"):
        got = await _job(model, policy, items, args.headroom)
        res = got["results"]
        long_errors = Counter(
            (r.error.code, r.error.details.get("cause")) if r.error else ("ok", None)
            for k, r in res.items()
            if k.startswith("long")
        )
        short_equal = sum(
            res[k].status == "ok" and res[k].token_ids == want[k] for k in want if "short" in k
        )
        detail = next((r.error.message for r in res.values() if r.error), "")
        print(
            f"refusal/{policy}: long items {dict(long_errors)}; short items equal to "
            f"unpressured {short_equal}/16; daemon alive {got['alive']}; KV charged at the "
            f"end {got['status'].kv_bytes_in_use}"
        )
        if detail:
            print(f"refusal/{policy}: first error: {detail}")
        if short_equal != 16 or not got["alive"] or got["status"].kv_bytes_in_use:
            failures.append(f"{policy}: short items or the daemon were hurt")
        if policy == "fail" and ("kv_growth_failed", "out_of_memory") not in long_errors:
            failures.append("fail: no long item was refused with out_of_memory")
        if policy == "wait" and any(
            res[k].token_ids != want[k] for k in want if k.startswith("long")
        ):
            failures.append("wait: a long item did not give its unpressured tokens")
    for f in failures:
        print(f"refusal FAILED: {f}")
    return 1 if failures else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("check", choices=["soak", "refusal"])
    ap.add_argument("--model", default="small", choices=["tiny", "small"])
    ap.add_argument("--dtype", default="float16", choices=["float32", "float16"])
    ap.add_argument("--items", type=int, default=1024)
    ap.add_argument("--sample", type=int, default=24, help="greedy items re-decoded alone")
    ap.add_argument("--headroom", type=int, default=80, help="MiB the other process leaves")
    ap.add_argument("--provider", default="cuda", help="cpu: a dry run of soak's checks")
    args = ap.parse_args(argv)
    return anyio.run(soak if args.check == "soak" else refusal, args)


if __name__ == "__main__":
    raise SystemExit(main())
