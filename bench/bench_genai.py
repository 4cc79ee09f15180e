"""kvmux against onnxruntime-genai's Generator on the same builder-produced model.

The model is exported offline by onnxruntime-genai's own model builder (the
recipe of ``tests/genai/genai_fixture.py``: a seeded random-weight Llama and
a locally trained tokenizer), cached under ``models/``. Both sides decode
greedily with the same ``intra_op_num_threads`` (set for the Generator
through ``Config.overlay``), measured interleaved in one run:

- one session: kvmux's engine (``DecodeSession``) vs a Generator of batch 1;
- N sessions: kvmux's engine stepping all N (``step_many``, as the daemon's
  scheduler does: the rows of one cohort in one run), the same engine with
  ``max_batch=1`` (every session its own run: the time-sliced engine before
  batched decode), kvmux through ``kvmuxd`` (a subprocess), vs the Generator
  running the N prompts one after another (N <= 16), as one static batch
  of N, and onnxruntime-genai's ``Engine`` (its request-level API; on CPU the
  static-batching scheduler, ``engine.static_batching.max_batch_size = N``);
- N sessions arriving one after another (``--gap``: a fixed time apart, the
  whole arrival span about half of one session's decode): ``kvmuxd`` (one job
  per arrival) vs the genai ``Engine`` fed the same arrivals, vs the Generator
  as one static batch started once the last has arrived (the best a static
  batch can do with arrivals).

Prompts are screened so that every one decodes its full ``max_new_tokens``
without reaching eos: both systems do exactly the same work, and tokens are
checked equal. The Generator's KV buffer is sized ``prompt + new`` (its
``max_length``) and kvmux's first bucket is 256, which ``prompt + new`` is
set to, so both bind the same capacity. Needs the [genai] extra. Usage:
    python -m bench.bench_genai [--quick] [--threads N] [--size fixture|small|long|small-long]
        [--sizes 16,64] [--repeats R] [--gap S]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import numpy as np

from bench.bench_daemon import Run, greedy_items, kvmuxd, run_daemon, run_inprocess
from bench.common import MODELS, write_json
from kvmux.client import Client
from kvmux.daemon.engine import Engine, EngineOptions, SamplingParams
from tests.genai import genai_fixture as gf

PROMPT_LEN = 16
MAX_BATCH = 32  # the Generator refuses batch_size > 32 ("must be in [1, 32]")
N_NEW = 240  # prompt + new = 256: the Generator's buffer and kvmux's first bucket agree

# "fixture" is the test suite's model as is; "small" widens it toward the
# built-in small model (the vocabulary stays clear of every Linear width).
SIZES: dict[str, dict[str, int]] = {
    "fixture": {},
    "small": {"HIDDEN_SIZE": 512, "INTERMEDIATE_SIZE": 1408, "NUM_LAYERS": 8, "HEAD_DIM": 64},
    # The fixture with a 4096-token context (Llama 2's, Phi-3-mini-4k's): what
    # a static cache reserves per sequence at its defaults (bench_density).
    "long": {"MAX_POSITIONS": 4096},
    "small-long": {
        "HIDDEN_SIZE": 512,
        "INTERMEDIATE_SIZE": 1408,
        "NUM_LAYERS": 8,
        "HEAD_DIM": 64,
        "MAX_POSITIONS": 4096,
    },
}


def build_model(size: str) -> Path:
    """Export (once) the genai-builder model of ``size``; returns its folder."""
    root = MODELS / f"genai-bench-{size}"
    out = root / "onnx"
    if (out / "genai_config.json").is_file():
        return out
    for name, value in SIZES[size].items():
        setattr(gf, name, value)
    hf = gf.build_hf_llama(root / "hf", seed=0)
    return gf.export_with_genai_builder(hf, out)


class GenaiPeer:
    """onnxruntime-genai's Generator on one loaded model, threads set by overlay."""

    def __init__(self, model_dir: Path, threads: int) -> None:
        import onnxruntime_genai as og

        self.og = og
        config = og.Config(str(model_dir))
        if threads:
            opts = f'{{"intra_op_num_threads": {threads}}}'
            config.overlay(f'{{"model": {{"decoder": {{"session_options": {opts}}}}}}}')
        self.model = og.Model(config)

    def batch(
        self, prompts: list[list[int]], n_new: int, *, default_length: bool = False
    ) -> tuple[list[list[int]], float]:
        """One static batch of equal-length prompts; new tokens per row, and the wall time.

        Its ``max_length`` (the KV buffer it reserves) is cut to prompt + new, its
        best case, unless ``default_length``: then ``genai_config.json``'s."""
        og = self.og
        t0 = time.perf_counter()
        params = og.GeneratorParams(self.model)
        length = {} if default_length else {"max_length": len(prompts[0]) + n_new}
        params.set_search_options(do_sample=False, batch_size=len(prompts), **length)
        gen = og.Generator(self.model, params)
        gen.append_tokens(np.asarray(prompts, dtype=np.int32))
        out: list[list[int]] = [[] for _ in prompts]
        steps = 0
        while not gen.is_done() and steps < n_new:
            gen.generate_next_token()
            for row, tok in zip(out, gen.get_next_tokens(), strict=True):
                row.append(int(tok))
            steps += 1
        return out, time.perf_counter() - t0

    def batches(self, prompts: list[list[int]], n_new: int) -> tuple[list[list[int]], float]:
        """Static batches of at most ``MAX_BATCH`` rows (the Generator's own limit), one
        after another."""
        t0 = time.perf_counter()
        out: list[list[int]] = []
        for i in range(0, len(prompts), MAX_BATCH):
            out.extend(self.batch(prompts[i : i + MAX_BATCH], n_new)[0])
        return out, time.perf_counter() - t0

    def sequential(self, prompts: list[list[int]], n_new: int) -> tuple[list[list[int]], float]:
        t0 = time.perf_counter()
        out = [self.batch([pr], n_new)[0][0] for pr in prompts]
        return out, time.perf_counter() - t0


class GenaiEngine:
    """onnxruntime-genai's ``Engine``: requests added as they arrive, stepped by ``run``.

    The Engine answers only the thread that created it, so everything it does
    happens on one thread of its own. ``max_length`` cuts the KV buffer it
    reserves per sequence (default: ``genai_config.json``'s). After a run,
    ``ttft`` holds each prompt's time to its first token (s)."""

    def __init__(
        self, model_dir: Path, threads: int, max_batch: int, max_length: int | None = None
    ) -> None:
        self.ttft: list[float] = []
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="genai-engine")
        self._thread.submit(self._load, model_dir, threads, max_batch, max_length).result()

    def _load(self, model_dir: Path, threads: int, max_batch: int, max_length: int | None) -> None:
        import onnxruntime_genai as og

        self.og = og
        config = og.Config(str(model_dir))
        overlay: dict[str, Any] = {
            "engine": {"static_batching": {"max_batch_size": max_batch}},
        }
        if threads:
            overlay["model"] = {"decoder": {"session_options": {"intra_op_num_threads": threads}}}
        if max_length is not None:
            overlay["search"] = {"max_length": max_length}
        config.overlay(json.dumps(overlay))
        self.engine = og.Engine(og.Model(config))
        got = self.engine.get_capabilities().configured_max_batch_size
        if got != max_batch:
            raise RuntimeError(f"genai Engine took max_batch_size {got}, not {max_batch}")

    def run(
        self,
        prompts: list[list[int]],
        n_new: int,
        arrivals: list[float] | None = None,
        *,
        min_new: bool = False,
    ) -> tuple[list[list[int]], float]:
        """Every prompt decoded greedily; prompt i is added ``arrivals[i]`` s after the
        start (all at once without); ``min_new``: eos held off until ``n_new`` tokens.
        New tokens per prompt, and the wall time."""
        return self._thread.submit(self._run, prompts, n_new, arrivals, min_new).result()

    def _run(
        self, prompts: list[list[int]], n_new: int, arrivals: list[float] | None, min_new: bool
    ) -> tuple[list[list[int]], float]:
        og = self.og
        arrivals = arrivals or [0.0] * len(prompts)
        out: list[list[int]] = [[] for _ in prompts]
        first: list[float] = [0.0] * len(prompts)
        index: dict[int, int] = {}
        requests = []
        events = self.engine.create_event_buffer(4 * len(prompts))
        t0 = time.perf_counter()
        nxt = 0
        while nxt < len(prompts) or self.engine.has_pending_requests():
            now = time.perf_counter() - t0
            while nxt < len(prompts) and arrivals[nxt] <= now:
                request = self.engine.create_request()
                turn = og.TurnOptions(request)
                turn.set_do_sample(False)
                if min_new:
                    turn.set_min_generated_tokens(n_new)
                turn.set_max_generated_tokens(n_new)
                request.begin_turn(np.asarray(prompts[nxt], dtype=np.int32), turn)
                index[id(request)] = nxt
                requests.append(request)  # the Engine holds them only while pending
                nxt += 1
            if not self.engine.has_pending_requests():
                time.sleep(max(0.0, arrivals[nxt] - (time.perf_counter() - t0)))
                continue
            for ev in self.engine.run(events):
                if ev.error_code != og.EngineErrorCode.NONE:
                    raise RuntimeError(f"genai Engine: {ev.error_code} {ev.finish_reason}")
                i = index[id(ev.request)]
                if not out[i]:
                    first[i] = time.perf_counter() - t0
                out[i].append(int(ev.token))
        wall = time.perf_counter() - t0
        self.ttft = first
        for request in requests:
            request.close()
        return out, wall


async def daemon_arrivals(
    client: Client, prompts: list[list[int]], n_new: int, arrivals: list[float]
) -> tuple[list[list[int]], float]:
    """Prompt i submitted as its own job ``arrivals[i]`` s after the start."""
    out: list[list[int]] = [[] for _ in prompts]
    t0 = time.perf_counter()

    async def one(i: int) -> None:
        await anyio.sleep(max(0.0, arrivals[i] - (time.perf_counter() - t0)))
        (result,) = await (await client.submit(greedy_items([prompts[i]], n_new))).results()
        if result.status != "ok":
            raise RuntimeError(f"daemon item {i} failed: {result.error}")
        out[i] = result.token_ids

    async with anyio.create_task_group() as tg:
        for i in range(len(prompts)):
            tg.start_soon(one, i)
    return out, time.perf_counter() - t0


def screened_prompts(engine: Engine, n: int, vocab: int, seed: int) -> list[list[int]]:
    """``n`` prompts (BOS + random ids) that each decode ``N_NEW`` tokens without eos."""
    rng = np.random.default_rng(seed)
    params = SamplingParams(max_new_tokens=N_NEW, temperature=0.0)
    out: list[list[int]] = []
    while len(out) < n:
        prompt = [gf.BOS_ID, *(int(t) for t in rng.integers(4, vocab, PROMPT_LEN - 1))]
        if engine.generate(prompt, params).finish_reason == "length":
            out.append(prompt)
    return out


def tps(tokens: int, walls: list[float]) -> float:
    return tokens / statistics.median(walls)


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    model = build_model(args.size)
    repeats = args.repeats or (3 if args.quick else 5)
    sizes = [4] if args.quick else [int(x) for x in args.sizes.split(",")]
    engine = Engine(model, EngineOptions(intra_op_threads=args.threads, min_bucket=256))
    sliced = Engine(
        model, EngineOptions(intra_op_threads=args.threads, min_bucket=256, max_batch=1)
    )
    peer = GenaiPeer(model, args.threads)
    engine_peers = {n: GenaiEngine(model, args.threads, n) for n in sizes}
    spec = engine.spec
    print(
        f"genai-builder model '{args.size}': hidden {spec.hidden_size}, {spec.num_layers} layers, "
        f"vocab {spec.vocab_size}; onnxruntime-genai {getattr(peer.og, '__version__', '?')}"
    )
    print(
        f"intra_op_num_threads={args.threads or 'default'} on both sides; greedy; prompt "
        f"{PROMPT_LEN}; {N_NEW} new tokens per session (screened: no eos); {repeats} repeats"
    )
    prompts_all = screened_prompts(engine, max(sizes), spec.vocab_size, seed=1)
    result: dict[str, Any] = {"size": args.size, "threads": args.threads, "repeats": repeats}

    # One session.
    one = prompts_all[:1]
    params = SamplingParams(max_new_tokens=N_NEW, temperature=0.0)
    engine.generate(one[0], SamplingParams(max_new_tokens=8, temperature=0.0))  # warm-up
    peer.batch(one, 8)
    peer.batch(one, 8, default_length=True)
    kv_w, gen_w, default_w = [], [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        c = engine.generate(one[0], params)
        kv_w.append(time.perf_counter() - t0)
        toks, w = peer.batch(one, N_NEW)
        gen_w.append(w)
        toks_default, w = peer.batch(one, N_NEW, default_length=True)
        default_w.append(w)
        if toks[0] != c.token_ids or toks_default[0] != c.token_ids:
            raise AssertionError("kvmux and the Generator decoded different tokens")
    single = {
        "kvmux_tokens_per_s": tps(N_NEW, kv_w),
        "generator_tokens_per_s": tps(N_NEW, gen_w),
        "generator_default_length_tokens_per_s": tps(N_NEW, default_w),
    }
    single["ratio"] = single["kvmux_tokens_per_s"] / single["generator_tokens_per_s"]
    single["ratio_default_length"] = (
        single["kvmux_tokens_per_s"] / single["generator_default_length_tokens_per_s"]
    )
    result["single"] = single
    print(f"\n{'one session':<44}{'tokens/s':>10}")
    print(f"{'kvmux DecodeSession':<44}{single['kvmux_tokens_per_s']:>10.1f}")
    print(
        f"{'genai Generator, max_length prompt + new':<44}{single['generator_tokens_per_s']:>10.1f}"
    )
    print(
        f"{'genai Generator, max_length its default':<44}"
        f"{single['generator_default_length_tokens_per_s']:>10.1f}"
    )
    print(
        f"kvmux / Generator = {single['ratio']:.3f} (cut), "
        f"{single['ratio_default_length']:.3f} (its default)"
    )

    rows = []
    arrival_rows: list[dict[str, Any]] = []
    tables = {"kv": {"min_bucket": 256}, "scheduler": {"max_active_sessions": max(sizes)}}
    async with (
        kvmuxd(model, threads=args.threads, tables=tables) as daemon,
        Client(daemon.endpoint, timeout=60.0) as client,
    ):
        await run_daemon(client, one, 8)
        for n in sizes:
            prompts = prompts_all[:n]
            order = ["engine", "sliced", "daemon", "seq", "batch", "oga_engine"]
            if n > 16:
                order.remove("seq")  # minutes per repeat, and known to be slowest
            walls: dict[str, list[float]] = {k: [] for k in order}
            want: list[list[int]] | None = None
            for rep in range(repeats):
                k = rep % len(order)
                for side in order[k:] + order[:k]:
                    if side in ("engine", "sliced"):
                        r: Run = await anyio.to_thread.run_sync(
                            run_inprocess, engine if side == "engine" else sliced, prompts, N_NEW
                        )
                        toks, w = [r.tokens[i] for i in range(n)], r.wall
                    elif side == "daemon":
                        r = await run_daemon(client, prompts, N_NEW)
                        toks, w = [r.tokens[i] for i in range(n)], r.wall
                    elif side == "oga_engine":
                        toks, w = await anyio.to_thread.run_sync(
                            engine_peers[n].run, prompts, N_NEW
                        )
                    elif side == "seq":
                        toks, w = await anyio.to_thread.run_sync(peer.sequential, prompts, N_NEW)
                    else:
                        toks, w = await anyio.to_thread.run_sync(peer.batches, prompts, N_NEW)
                    want = want or toks
                    if toks != want:
                        raise AssertionError(f"N={n}: {side} decoded other tokens")
                    walls[side].append(w)
            total = n * N_NEW
            row = {"n": n, **{f"{k}_tokens_per_s": tps(total, v) for k, v in walls.items()}}
            rows.append(row)
            print(f"N={n}: " + ", ".join(f"{k} {v:.1f}" for k, v in row.items() if k != "n"))

        # Staggered arrivals: what a static batch cannot serve as they come.
        one_session = N_NEW / single["kvmux_tokens_per_s"]
        for n in sizes:
            prompts = prompts_all[:n]
            gap = args.gap if args.gap is not None else 0.5 * one_session / n
            arrivals = [i * gap for i in range(n)]
            order = ["daemon", "oga_engine", "batch_after_last"]
            walls = {k: [] for k in order}
            want = None
            for rep in range(repeats):
                k = rep % len(order)
                for side in order[k:] + order[:k]:
                    if side == "daemon":
                        toks, w = await daemon_arrivals(client, prompts, N_NEW, arrivals)
                    elif side == "oga_engine":
                        toks, w = await anyio.to_thread.run_sync(
                            engine_peers[n].run, prompts, N_NEW, arrivals
                        )
                    else:
                        toks, w = await anyio.to_thread.run_sync(peer.batches, prompts, N_NEW)
                        w += arrivals[-1]
                    want = want or toks
                    if toks != want:
                        raise AssertionError(f"N={n} arrivals: {side} decoded other tokens")
                    walls[side].append(w)
            total = n * N_NEW
            arow = {
                "n": n,
                "gap_s": gap,
                **{f"{k}_tokens_per_s": tps(total, v) for k, v in walls.items()},
            }
            arrival_rows.append(arow)
            print(
                f"N={n} arriving {gap * 1000:.0f} ms apart: "
                + ", ".join(f"{k} {v:.1f}" for k, v in arow.items() if k.endswith("_per_s"))
            )
    result["rows"] = rows
    result["arrivals"] = arrival_rows
    print(
        f"\n{'N':>3}{'kvmux engine':>14}{'time-sliced':>13}{'kvmux daemon':>14}{'genai seq':>11}"
        f"{'genai batch':>13}{'genai Engine':>14}{'engine/batch':>14}{'sliced/batch':>14}"
        f"{'daemon/batch':>14}{'daemon/Engine':>15}   (tokens/s)"
    )
    for row in rows:
        batch = row["batch_tokens_per_s"]
        seq = row.get("seq_tokens_per_s")
        print(
            f"{row['n']:>3}{row['engine_tokens_per_s']:>14.1f}{row['sliced_tokens_per_s']:>13.1f}"
            f"{row['daemon_tokens_per_s']:>14.1f}{'-' if seq is None else f'{seq:.1f}':>11}"
            f"{batch:>13.1f}{row['oga_engine_tokens_per_s']:>14.1f}"
            f"{row['engine_tokens_per_s'] / batch:>14.3f}"
            f"{row['sliced_tokens_per_s'] / batch:>14.3f}"
            f"{row['daemon_tokens_per_s'] / batch:>14.3f}"
            f"{row['daemon_tokens_per_s'] / row['oga_engine_tokens_per_s']:>15.3f}"
        )
    print(
        f"\n{'N':>3}{'gap ms':>8}{'kvmux daemon':>14}{'genai Engine':>14}"
        f"{'batch after last':>18}{'daemon/Engine':>15}{'daemon/batch':>14}   (arrivals, tokens/s)"
    )
    for arow in arrival_rows:
        d = arow["daemon_tokens_per_s"]
        print(
            f"{arow['n']:>3}{arow['gap_s'] * 1000:>8.0f}{d:>14.1f}"
            f"{arow['oga_engine_tokens_per_s']:>14.1f}{arow['batch_after_last_tokens_per_s']:>18.1f}"
            f"{d / arow['oga_engine_tokens_per_s']:>15.3f}"
            f"{d / arow['batch_after_last_tokens_per_s']:>14.3f}"
        )
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="N = 4 only, fewer repeats")
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads (0: each default)")
    ap.add_argument("--size", default="fixture", choices=sorted(SIZES))
    ap.add_argument("--sizes", default="4,16", help="session counts N, comma-separated")
    ap.add_argument("--repeats", type=int, default=0, help="runs per side (0: 5, --quick 3)")
    ap.add_argument(
        "--gap",
        type=float,
        default=None,
        help="seconds between arrivals (default: N arrivals over half of one session's decode)",
    )
    args = ap.parse_args(argv)
    result = anyio.run(bench, args)
    path = write_json(f"genai-{args.size}", result)
    print("tokens equal between kvmux and the Generator (greedy) in every run")
    print(f"written {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
