"""Prefix sharing: what the prefix cache buys, and what it costs when nothing is shared.

Two ``kvmuxd`` processes on the same model, one with ``kv.prefix_cache`` on and
one with it off (otherwise the same config), fed the same jobs in turn, and
onnxruntime-genai's ``Engine`` on the same folder (the built-in ``small`` by
default). All figures of a ratio come from one run:

- **shared**: N items (256) whose prompts begin with one S-token system prompt
  (1,024), then 28-36 tokens of their own, 32 new tokens each (greedy, eos held
  off until then on every side): items/s, and time to first token from the
  submit (p50, p99), with the cache, without it, and through genai's ``Engine``
  (static batching of ``--max-active``, its ``max_length`` cut to the longest
  prompt + new, its best case). Tokens checked equal on all three sides.
- **choices**: a file of L lines (64), each a P-token prompt (1,024) of its own
  with n = 4 sampled choices (seed s + j, as ``kvmux submit`` expands them),
  32 new tokens each: items/s with and without the cache; tokens checked equal.
- **unshared**: U items (128) with prompts of their own (256 tokens), 64 new
  tokens, greedy: tokens/s with and without the cache, ``--repeats`` runs
  interleaved (median; each repeat with prompts neither side has seen), i.e.
  what keys, lookups and holders cost.
- for each workload run with the cache: the prompt tokens copied instead of
  prefilled (hit rate), items that waited for another's prefill, and the KV
  bytes the cache keeps at the end.

Usage: python -m bench.bench_prefix [--quick] [--model small|tiny] [--threads N]
    [--items N] [--system S] [--lines L] [--repeats R] [--max-active K] [--no-genai]
    [--only shared,choices,unshared]
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import numpy as np

from bench.bench_daemon import Run, kvmuxd, pct, run_items
from bench.common import builtin, write_json
from kvmux.client import Client, Item
from kvmux.client import protocol as p

OWN = (28, 37)  # tokens of an item's own after the system prompt: 28-36
N_NEW = 32
CHOICES = 4
UNSHARED_NEW = 64


@dataclass
class Side:
    """One workload on one side: its runs, and the cache's tallies over them."""

    runs: list[Run] = field(default_factory=list)
    cache: dict[str, Any] = field(default_factory=dict)

    @property
    def wall(self) -> float:
        return statistics.median(r.wall for r in self.runs)

    def ttft_ms(self, q: float) -> float:
        return 1e3 * pct([x for r in self.runs for x in r.ttft], q)


def _random(rng: np.random.Generator, n: int, vocab: int) -> list[int]:
    return [int(t) for t in rng.integers(3, vocab, n)]


def shared_items(n: int, system: int, vocab: int, seed: int = 0) -> list[Item]:
    rng = np.random.default_rng(seed)
    head = _random(rng, system, vocab)
    return [
        Item(
            custom_id=f"s{i}",
            prompt_tokens=[*head, *_random(rng, int(rng.integers(*OWN)), vocab)],
            max_new_tokens=N_NEW,
            min_new_tokens=N_NEW,
            temperature=0.0,
        )
        for i in range(n)
    ]


def choice_items(lines: int, prompt: int, vocab: int, seed: int = 1) -> list[Item]:
    rng = np.random.default_rng(seed)
    items: list[Item] = []
    for line in range(lines):
        tokens = _random(rng, prompt, vocab)
        items.extend(
            Item(
                custom_id=f"c{line}",
                prompt_tokens=tokens,
                max_new_tokens=N_NEW,
                min_new_tokens=N_NEW,
                temperature=0.8,
                top_p=0.95,
                seed=1000 * line + j,
                line=line + 1,
                choice=j,
                choices=CHOICES,
                n=CHOICES,
            )
            for j in range(CHOICES)
        )
    return items


def unshared_items(n: int, prompt: int, vocab: int, seed: int = 2) -> list[Item]:
    rng = np.random.default_rng(seed)
    return [
        Item(
            custom_id=f"u{i}",
            prompt_tokens=_random(rng, prompt, vocab),
            max_new_tokens=UNSHARED_NEW,
            temperature=0.0,
            ignore_eos=True,
        )
        for i in range(n)
    ]


def _cache_delta(before: p.DaemonStatus, after: p.DaemonStatus) -> dict[str, Any]:
    a, b = after.prefix_cache, before.prefix_cache
    if a is None or b is None:
        return {}
    return {
        "prompt_tokens": a.prompt_tokens - b.prompt_tokens,
        "hit_tokens": a.hit_tokens - b.hit_tokens,
        "waits": a.waits - b.waits,
        "fork_failures": a.fork_failures - b.fork_failures,
        "kept_bytes_at_end": a.bytes,
        "kept_entries_at_end": a.entries,
        "evictions": a.evictions - b.evictions,
    }


async def measure(client: Client, items: list[Item], side: Side) -> None:
    before = await client.status()
    side.runs.append(await run_items(client, items, "kvmuxd"))
    after = await client.status()
    delta = _cache_delta(before, after)
    if not delta:
        return
    for key, value in delta.items():
        if key.endswith("_at_end"):
            side.cache[key] = value
        else:
            side.cache[key] = side.cache.get(key, 0) + value
    prompt = side.cache["prompt_tokens"]
    side.cache["hit_rate"] = side.cache["hit_tokens"] / prompt if prompt else 0.0


def _tokens(side: Side, run: int = 0) -> list[list[int]]:
    tokens = side.runs[run].tokens
    return [tokens[i] for i in sorted(tokens)]


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    model: Path = builtin(args.model)
    from kvmux.daemon.model import load_model

    spec = load_model(model)
    vocab = spec.vocab_size
    shared = shared_items(args.items, args.system, vocab)
    choices = choice_items(args.lines, args.choice_prompt, vocab)
    tables: dict[str, dict[str, object]] = {
        "scheduler": {"max_active_sessions": args.max_active, "max_queued_items": 8192},
    }
    results = {name: {"on": Side(), "off": Side()} for name in args.only}
    on_tables: dict[str, dict[str, object]] = {**tables, "kv": {"prefix_cache": True}}
    off_tables: dict[str, dict[str, object]] = {**tables, "kv": {"prefix_cache": False}}
    async with (
        kvmuxd(model, threads=args.threads, tables=on_tables) as on,
        kvmuxd(model, threads=args.threads, tables=off_tables) as off,
        Client(on.endpoint, timeout=60.0) as c_on,
        Client(off.endpoint, timeout=60.0) as c_off,
    ):
        clients = {"on": c_on, "off": c_off}
        for name, items in (("shared", shared), ("choices", choices)):
            if name not in results:
                continue
            for side in ("off", "on"):
                print(f"{name}: cache {side} ...", flush=True)
                await measure(clients[side], items, results[name][side])
        for r in range(args.repeats if "unshared" in results else 0):
            # Prompts never seen before on either side; interleaved, the order turning
            # each repeat, so drift hits both sides alike.
            unshared = unshared_items(args.unshared, args.unshared_prompt, vocab, seed=100 + r)
            for side in ("on", "off") if r % 2 else ("off", "on"):
                print(f"unshared: cache {side}, repeat {r + 1} ...", flush=True)
                await measure(clients[side], unshared, results["unshared"][side])
    genai: dict[str, Any] | None = None
    if not args.no_genai and "shared" in results:
        print("shared: onnxruntime-genai Engine ...", flush=True)
        genai = await anyio.to_thread.run_sync(_genai_shared, model, args, shared)
    return report(args, results, genai)


def _genai_shared(model: Path, args: argparse.Namespace, items: list[Item]) -> dict[str, Any]:
    from bench.bench_genai import GenaiEngine

    prompts = [list(i.prompt_tokens or []) for i in items]
    longest = max(len(pr) for pr in prompts) + N_NEW
    engine = GenaiEngine(model, args.threads, args.max_active, max_length=longest)
    tokens, wall = engine.run(prompts, N_NEW, min_new=True)
    return {"tokens": tokens, "wall": wall, "ttft": engine.ttft}


def report(
    args: argparse.Namespace, results: dict[str, dict[str, Side]], genai: dict[str, Any] | None
) -> dict[str, Any]:
    out: dict[str, Any] = {"args": vars(args)}
    # Tokens first: a ratio of different work would mean nothing.
    for name, sides in results.items():
        runs = range(len(sides["on"].runs))
        equal = all(_tokens(sides["on"], r) == _tokens(sides["off"], r) for r in runs)
        out[f"{name}_tokens_equal"] = equal
        if not equal:
            raise RuntimeError(f"{name}: tokens differ with the cache on and off")
    if "shared" in results:
        out["shared"] = _shared(args, results["shared"], genai)
    if "choices" in results:
        out["choices"] = _choices(args, results["choices"])
    if "unshared" in results:
        out["unshared"] = _unshared(args, results["unshared"])
    return out


def _shared(
    args: argparse.Namespace, sh: dict[str, Side], genai: dict[str, Any] | None
) -> dict[str, Any]:
    n = args.items
    on_ips, off_ips = n / sh["on"].wall, n / sh["off"].wall
    out: dict[str, Any] = {
        "items": n,
        "system_tokens": args.system,
        "on": {"items_per_s": on_ips, **_ttft(sh["on"]), "cache": sh["on"].cache},
        "off": {"items_per_s": off_ips, **_ttft(sh["off"])},
        "items_per_s_ratio": on_ips / off_ips,
        "ttft_p50_ratio": sh["on"].ttft_ms(50) / sh["off"].ttft_ms(50),
    }
    if genai is not None:
        g_ips = n / genai["wall"]
        out["genai_engine"] = {
            "items_per_s": g_ips,
            "ttft_p50_ms": 1e3 * pct(genai["ttft"], 50),
            "ttft_p99_ms": 1e3 * pct(genai["ttft"], 99),
            "tokens_equal": genai["tokens"] == _tokens(sh["on"]),
        }
        out["items_per_s_vs_genai"] = on_ips / g_ips
        out["uncached_vs_genai"] = off_ips / g_ips
    return out


def _choices(args: argparse.Namespace, ch: dict[str, Side]) -> dict[str, Any]:
    m = len(ch["on"].runs[0].tokens)
    return {
        "lines": args.lines,
        "n": CHOICES,
        "prompt_tokens": args.choice_prompt,
        "on": {"items_per_s": m / ch["on"].wall, **_ttft(ch["on"]), "cache": ch["on"].cache},
        "off": {"items_per_s": m / ch["off"].wall, **_ttft(ch["off"])},
        "items_per_s_ratio": ch["off"].wall / ch["on"].wall,
    }


def _unshared(args: argparse.Namespace, un: dict[str, Side]) -> dict[str, Any]:
    tokens = args.unshared * UNSHARED_NEW
    return {
        "items": args.unshared,
        "prompt_tokens": args.unshared_prompt,
        "on": {
            "tokens_per_s": tokens / un["on"].wall,
            "walls_s": [r.wall for r in un["on"].runs],
            "cache": un["on"].cache,
        },
        "off": {
            "tokens_per_s": tokens / un["off"].wall,
            "walls_s": [r.wall for r in un["off"].runs],
        },
        "tokens_per_s_ratio": un["off"].wall / un["on"].wall,
    }


def _ttft(side: Side) -> dict[str, float]:
    return {"ttft_p50_ms": side.ttft_ms(50), "ttft_p99_ms": side.ttft_ms(99)}


def print_report(out: dict[str, Any]) -> None:
    if "shared" in out:
        sh = out["shared"]
        print(
            f"\nshared ({sh['items']} items, a {sh['system_tokens']}-token system prompt, "
            f"{N_NEW} new tokens each)"
        )
        print(f"{'side':<22} {'items/s':>8} {'TTFT p50 ms':>12} {'TTFT p99 ms':>12}")
        rows = [("kvmuxd, cache on", sh["on"]), ("kvmuxd, cache off", sh["off"])]
        if "genai_engine" in sh:
            rows.append(("genai Engine", sh["genai_engine"]))
        for label, row in rows:
            print(
                f"{label:<22} {row['items_per_s']:>8.2f} {row['ttft_p50_ms']:>12.0f} "
                f"{row['ttft_p99_ms']:>12.0f}"
            )
        line = (
            f"cache on / off: {sh['items_per_s_ratio']:.2f}x items/s, TTFT p50 "
            f"{sh['ttft_p50_ratio']:.2f}x"
        )
        if "genai_engine" in sh:
            line += (
                f"; on / genai Engine: {sh['items_per_s_vs_genai']:.2f}x items/s "
                f"(tokens equal: {sh['genai_engine']['tokens_equal']})"
            )
        print(line)
        _print_cache(sh["on"]["cache"])
    if "choices" in out:
        ch = out["choices"]
        print(
            f"\nchoices ({ch['lines']} lines of {ch['prompt_tokens']} tokens, n = {ch['n']}): "
            f"on {ch['on']['items_per_s']:.2f} items/s, off {ch['off']['items_per_s']:.2f}: "
            f"{ch['items_per_s_ratio']:.2f}x"
        )
        _print_cache(ch["on"]["cache"])
    if "unshared" in out:
        un = out["unshared"]
        print(
            f"\nunshared ({un['items']} items of {un['prompt_tokens']} tokens, "
            f"{UNSHARED_NEW} new): on {un['on']['tokens_per_s']:.1f} tokens/s, "
            f"off {un['off']['tokens_per_s']:.1f}: {un['tokens_per_s_ratio']:.3f}x"
        )
        _print_cache(un["on"]["cache"])


def _print_cache(cache: dict[str, Any]) -> None:
    if not cache:
        return
    print(
        f"  cache: {cache['hit_tokens']} of {cache['prompt_tokens']} prompt tokens copied "
        f"({cache['hit_rate']:.1%}), {cache['waits']} waits, {cache['fork_failures']} failed "
        f"copies; keeps {cache['kept_bytes_at_end'] / 2**20:.1f} MiB in "
        f"{cache['kept_entries_at_end']} prefixes at the end"
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a quarter of every workload")
    ap.add_argument("--model", default="small", choices=["small", "tiny"])
    ap.add_argument("--threads", type=int, default=0, help="intra-op threads (0: onnxruntime's)")
    ap.add_argument("--items", type=int, default=256)
    ap.add_argument("--system", type=int, default=1024)
    ap.add_argument("--lines", type=int, default=64)
    ap.add_argument("--choice-prompt", type=int, default=1024)
    ap.add_argument("--unshared", type=int, default=128)
    ap.add_argument("--unshared-prompt", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-active", type=int, default=16)
    ap.add_argument("--no-genai", action="store_true", help="skip onnxruntime-genai's Engine")
    ap.add_argument(
        "--only",
        default="shared,choices,unshared",
        type=lambda v: [w for w in v.split(",") if w],
        help="workloads to run (comma-separated): shared, choices, unshared",
    )
    args = ap.parse_args(argv)
    unknown = set(args.only) - {"shared", "choices", "unshared"}
    if unknown:
        ap.error(f"--only: unknown workload(s) {', '.join(sorted(unknown))}")
    if args.quick:
        args.items, args.lines, args.unshared = args.items // 4, args.lines // 4, args.unshared // 4
        args.repeats = 1
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = anyio.run(bench, args)
    print_report(out)
    print(f"\nwritten: {write_json('bench_prefix', out)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
