"""Memory density: sessions decoding at once and tokens/s in one fixed KV budget.

A static KV cache reserves ``max_length`` tokens for every sequence, whatever
it will use; kvmux's buckets reserve a power of two a little over what a
session holds now. Same model (genai-builder, see ``bench_genai``), same
budget of KV bytes, the same mixed workload (``--items`` prompts of 8-400
tokens, 16-600 new tokens each, all submitted at once):

- onnxruntime-genai's ``Engine`` at its defaults (``max_length`` from
  ``genai_config.json``): the budget holds ``budget / (max_length x bytes
  per token)`` sequences, its static batch size;
- ``kvmuxd`` with ``kv.memory_budget`` = the same bytes,
  ``on_growth_failure = "wait"`` (a session that cannot grow waits; the newest
  is preempted if all wait) and no session cap below the item count.

Printed: sessions decoding at once (mean over model runs and peak), the
aggregate tokens/s, the ratios, and kvmux's preemptions. Both decode greedily
with every item's new-token count as both its minimum and maximum (eos masked
until then on both sides), and tokens are checked equal. Usage:
    python -m bench.bench_density [--quick] [--size fixture|small] [--sequences K]
"""

from __future__ import annotations

import argparse
import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import numpy as np

from bench.bench_daemon import kvmuxd
from bench.bench_genai import SIZES, build_model
from bench.common import write_json
from kvmux.client import Client, Item
from tests.genai import genai_fixture as gf


def workload(n: int, vocab: int, seed: int) -> list[tuple[list[int], int]]:
    rng = np.random.default_rng(seed)
    return [
        (
            [gf.BOS_ID, *(int(t) for t in rng.integers(4, vocab, int(rng.integers(8, 401)) - 1))],
            int(rng.integers(16, 601)),
        )
        for _ in range(n)
    ]


class StaticEngine:
    """onnxruntime-genai's Engine with ``max_batch`` sequences of ``max_length`` each."""

    def __init__(self, model_dir: Path, threads: int, max_batch: int) -> None:
        # The Engine answers only the thread that created it.
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="genai-engine")
        self._thread.submit(self._load, model_dir, threads, max_batch).result()

    def _load(self, model_dir: Path, threads: int, max_batch: int) -> None:
        import onnxruntime_genai as og

        self.og = og
        config = og.Config(str(model_dir))
        overlay: dict[str, Any] = {"engine": {"static_batching": {"max_batch_size": max_batch}}}
        if threads:
            overlay["model"] = {"decoder": {"session_options": {"intra_op_num_threads": threads}}}
        config.overlay(json.dumps(overlay))
        self.engine = og.Engine(og.Model(config))

    def run(self, work: list[tuple[list[int], int]]) -> dict[str, Any]:
        return self._thread.submit(self._run, work).result()

    def _run(self, work: list[tuple[list[int], int]]) -> dict[str, Any]:
        og = self.og
        out: list[list[int]] = [[] for _ in work]
        index: dict[int, int] = {}
        requests = []
        t0 = time.perf_counter()
        for i, (prompt, n_new) in enumerate(work):
            request = self.engine.create_request()
            turn = og.TurnOptions(request)
            turn.set_do_sample(False)
            turn.set_min_generated_tokens(n_new)
            turn.set_max_generated_tokens(n_new)
            request.begin_turn(np.asarray(prompt, dtype=np.int32), turn)
            index[id(request)] = i
            requests.append(request)
        events = self.engine.create_event_buffer(4 * len(work))
        rows: list[int] = []
        while self.engine.has_pending_requests():
            decoded = 0
            for ev in self.engine.run(events):
                if ev.error_code != og.EngineErrorCode.NONE:
                    raise RuntimeError(f"genai Engine: {ev.error_code}")
                out[index[id(ev.request)]].append(int(ev.token))
                decoded += 1
            if decoded:
                rows.append(decoded)
        wall = time.perf_counter() - t0
        for request in requests:
            request.close()
        return {
            "tokens": out,
            "wall": wall,
            "mean_rows": float(np.mean(rows)),
            "peak_rows": max(rows),
        }


async def kvmux_side(client: Client, work: list[tuple[list[int], int]]) -> dict[str, Any]:
    items = [
        Item(
            custom_id=str(i),
            prompt_tokens=prompt,
            max_new_tokens=n_new,
            min_new_tokens=n_new,
            temperature=0.0,
        )
        for i, (prompt, n_new) in enumerate(work)
    ]
    samples: list[int] = []
    done = anyio.Event()

    async def sample() -> None:
        # Sessions holding KV and not parked: what decodes at once.
        while not done.is_set():
            st = await client.status()
            samples.append(st.sessions_active - st.sessions_parked)
            await anyio.sleep(0.05)

    before = (await client.status()).growth.preemptions
    t0 = time.perf_counter()
    async with anyio.create_task_group() as tg:
        tg.start_soon(sample)
        results = await (await client.submit(items)).results()
        done.set()
    wall = time.perf_counter() - t0
    failed = [r for r in results if r.status != "ok"]
    if failed:
        raise RuntimeError(f"{len(failed)} kvmux items failed, first: {failed[0].error}")
    status = await client.status()
    busy = [s for s in samples if s > 0] or [0]
    return {
        "tokens": [r.token_ids for r in results],
        "wall": wall,
        "mean_rows": float(np.mean(busy)),
        "peak_rows": max(busy),
        "preemptions": status.growth.preemptions - before,
        "kv_peak_bytes": status.kv_peak_bytes,
    }


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    model = build_model(args.size)
    cfg = json.loads((model / "genai_config.json").read_text())["model"]
    dec = cfg["decoder"]
    max_length = int(cfg["context_length"])
    bpt = 2 * dec["num_hidden_layers"] * dec["num_key_value_heads"] * dec["head_size"] * 4
    budget = args.sequences * max_length * bpt
    n_items = args.items or (16 if args.quick else 48)
    work = workload(n_items, int(cfg["vocab_size"]), seed=3)
    total = sum(n for _, n in work)
    print(
        f"genai-builder model '{args.size}': {dec['num_hidden_layers']} layers, "
        f"{dec['num_key_value_heads']} KV heads x {dec['head_size']}, fp32: {bpt} B/token; "
        f"max_length {max_length}"
    )
    print(
        f"KV budget {budget / 2**20:.1f} MiB = {args.sequences} sequences of max_length; "
        f"{n_items} items, prompts 8-400, {total} new tokens in all"
    )
    static = StaticEngine(model, args.threads, args.sequences)
    tables = {
        "kv": {"memory_budget": budget, "min_bucket": args.min_bucket},
        "scheduler": {"max_active_sessions": n_items, "on_growth_failure": "wait"},
    }
    async with (
        kvmuxd(model, threads=args.threads, tables=tables) as daemon,
        Client(daemon.endpoint, timeout=120.0) as client,
    ):
        await kvmux_side(client, work[:2])  # warm-up
        await anyio.to_thread.run_sync(static.run, work[:2])
        runs: dict[str, list[dict[str, Any]]] = {"kvmux": [], "genai": []}
        for rep in range(args.repeats):
            order = ["kvmux", "genai"] if rep % 2 == 0 else ["genai", "kvmux"]
            for side in order:
                if side == "kvmux":
                    r = await kvmux_side(client, work)
                else:
                    r = await anyio.to_thread.run_sync(static.run, work)
                runs[side].append(r)
                print(
                    f"  {side}: {total / r['wall']:.1f} tokens/s, {r['mean_rows']:.1f} "
                    f"decoding at once (peak {r['peak_rows']})"
                )
    want = runs["genai"][0]["tokens"]
    mismatched = [
        i for r in runs["kvmux"] + runs["genai"] for i, t in enumerate(r["tokens"]) if t != want[i]
    ]
    if mismatched:
        raise AssertionError(f"tokens differ for items {sorted(set(mismatched))[:10]}")

    def med(side: str, key: str) -> float:
        return float(np.median([r[key] for r in runs[side]]))

    k_tps, g_tps = total / med("kvmux", "wall"), total / med("genai", "wall")
    k_rows, g_rows = med("kvmux", "mean_rows"), med("genai", "mean_rows")
    g_peak, k_peak = med("genai", "peak_rows"), med("kvmux", "peak_rows")
    print(
        f"\n{'':<28}{'at once (mean)':>16}{'peak':>7}{'tokens/s':>11}"
        f"\n{'genai Engine (static)':<28}{g_rows:>16.1f}{g_peak:>7.0f}{g_tps:>11.1f}"
        f"\n{'kvmuxd (buckets)':<28}{k_rows:>16.1f}{k_peak:>7.0f}{k_tps:>11.1f}"
        f"\nkvmux / genai: {k_rows / g_rows:.2f}x sessions at once, {k_tps / g_tps:.2f}x tokens/s; "
        f"kvmux preemptions {med('kvmux', 'preemptions'):.0f}; tokens equal in every run"
    )
    return {
        "size": args.size,
        "budget_bytes": budget,
        "items": n_items,
        "new_tokens": total,
        "kvmux": {"tokens_per_s": k_tps, "mean_rows": k_rows},
        "genai": {"tokens_per_s": g_tps, "mean_rows": g_rows},
        "runs": {
            side: [{k: v for k, v in r.items() if k != "tokens"} for r in rs]
            for side, rs in runs.items()
        },
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="16 items, one repeat each way")
    ap.add_argument("--size", default="fixture", choices=sorted(SIZES))
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads (0: each default)")
    ap.add_argument("--sequences", type=int, default=4, help="the budget, in max_length sequences")
    ap.add_argument("--items", type=int, default=0, help="workload size (0: 48, --quick 16)")
    ap.add_argument("--min-bucket", type=int, default=32, help="kvmux's smallest bucket")
    ap.add_argument("--repeats", type=int, default=0, help="runs per side (0: 2, --quick 1)")
    args = ap.parse_args(argv)
    args.repeats = args.repeats or (1 if args.quick else 2)
    result = anyio.run(bench, args)
    print(f"written {write_json(f'density-{args.size}', result)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
