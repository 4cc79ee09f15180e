"""kvmux decode session vs a bare hand-written IOBinding loop, and growth's share of a long decode.

Same model (built-in ``small``), same greedy decode, same thread settings,
interleaved in one run: the ratio is the figure. Usage:
    python -m bench.bench_engine [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import numpy as np

from bench.common import builtin, write_json
from kvmux.daemon.engine import Engine, EngineOptions, SamplingParams
from kvmux.kv import capacity_bucket


def bare_loop(engine: Engine, prompt: list[int], n_new: int) -> tuple[list[int], float]:
    """The baseline: one preallocated buffer of the final bucket, bound once, no kvmux code."""
    spec, sess = engine.spec, engine.ort.session
    cap = capacity_bucket(len(prompt) + n_new, spec.context_length, 256)
    shape = (1, spec.num_kv_heads, cap, spec.head_size)
    kv = [np.zeros(shape, spec.kv_dtype) for _ in range(2 * spec.num_layers)]
    mask = np.zeros((1, cap), np.int64)
    io = sess.io_binding()
    names_in = spec.past_key_names + spec.past_value_names
    names_out = spec.present_key_names + spec.present_value_names
    for buf, i_name, o_name in zip(kv, names_in, names_out, strict=True):
        io.bind_input(i_name, "cpu", 0, buf.dtype, shape, buf.ctypes.data)
        io.bind_output(o_name, "cpu", 0, buf.dtype, shape, buf.ctypes.data)
    io.bind_input(spec.attention_mask_name, "cpu", 0, np.int64, mask.shape, mask.ctypes.data)

    def run(ids: np.ndarray[Any, Any]) -> int:
        logits = np.empty((1, ids.shape[1], spec.vocab_size), np.float32)
        io.bind_input(spec.input_ids_name, "cpu", 0, np.int64, ids.shape, ids.ctypes.data)
        io.bind_output(spec.logits_name, "cpu", 0, np.float32, logits.shape, logits.ctypes.data)
        sess.run_with_iobinding(io)
        return int(np.argmax(logits[0, -1]))

    t0 = time.perf_counter()
    mask[0, : len(prompt)] = 1
    tok = run(np.asarray([prompt], np.int64))
    out = [tok]
    ids = np.empty((1, 1), np.int64)
    pos = len(prompt)
    while len(out) < n_new:
        ids[0, 0] = tok
        mask[0, pos] = 1
        pos += 1
        tok = run(ids)
        out.append(tok)
    return out, time.perf_counter() - t0


def kvmux_session(engine: Engine, prompt: list[int], n_new: int) -> tuple[list[int], float]:
    params = SamplingParams(max_new_tokens=n_new, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    c = engine.generate(prompt, params)
    return c.token_ids, time.perf_counter() - t0


def growth_share(engine: Engine, prompt: list[int], n_new: int) -> dict[str, Any]:
    params = SamplingParams(max_new_tokens=n_new, temperature=0.0, ignore_eos=True)
    s = engine.new_session(prompt, params)
    growth_s, copied, grows = 0.0, 0, []
    t0 = time.perf_counter()
    while not s.finished:
        if s.needs_growth():
            r = s.ensure_capacity()
            growth_s += r.seconds
            copied += r.bytes_copied
            grows.append(r.new_capacity)
        engine.step(s)
    total = time.perf_counter() - t0
    final_bytes = s.cache.valid_len * engine.kv_spec.kv_bytes_per_token
    s.release()
    return {
        "tokens": n_new,
        "total_s": total,
        "growth_s": growth_s,
        "growth_share": growth_s / total,
        "buckets": grows,
        "bytes_copied": copied,
        "final_kv_bytes": final_bytes,
        "copied_over_final": copied / final_bytes,
    }


def capacity_cost(
    small_bucket: Engine, big_bucket: Engine, prompt: list[int], repeats: int
) -> dict[str, Any]:
    """ms/token of the same 16 + 240-token decode bound at capacity 256 and at 4096."""
    n_new = 240
    times: dict[str, list[float]] = {"256": [], "4096": []}
    seen = []
    for _ in range(repeats):
        for label, engine in (("256", small_bucket), ("4096", big_bucket)):
            toks, t = kvmux_session(engine, prompt, n_new)
            times[label].append(t / n_new)
            seen.append(toks)
    assert all(t == seen[0] for t in seen), "the two capacities decoded different tokens"
    out = {f"ms_per_token_{k}": 1e3 * statistics.median(v) for k, v in times.items()}
    out["ratio_4096_over_256"] = out["ms_per_token_4096"] / out["ms_per_token_256"]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="shorter decodes, fewer repeats")
    ap.add_argument("--threads", type=int, default=0, help="intra-op threads (0: ORT default)")
    args = ap.parse_args(argv)
    n_new, repeats, long_n = (128, 3, 1024) if args.quick else (384, 5, 4096)

    engine = Engine(builtin("small"), EngineOptions(intra_op_threads=args.threads))
    rng = np.random.default_rng(0)
    prompt = [int(t) for t in rng.integers(3, engine.spec.vocab_size, 16)]
    print(f"model small ({engine.spec.describe()})")
    print(
        f"intra_op_num_threads={args.threads or 'default'}; greedy; prompt 16; {n_new} new tokens"
    )

    bare_loop(engine, prompt, 8)  # warm-up both paths
    kvmux_session(engine, prompt, 8)
    bare_t, kv_t = [], []
    for _ in range(repeats):
        toks_a, ta = bare_loop(engine, prompt, n_new)
        toks_b, tb = kvmux_session(engine, prompt, n_new)
        assert toks_a == toks_b, "kvmux and the bare loop decoded different tokens"
        bare_t.append(ta)
        kv_t.append(tb)
    bare_tps = n_new / statistics.median(bare_t)
    kv_tps = n_new / statistics.median(kv_t)
    print(f"{'path':<28}{'tokens/s':>10}")
    print(f"{'bare IOBinding loop':<28}{bare_tps:>10.1f}")
    print(f"{'kvmux DecodeSession':<28}{kv_tps:>10.1f}")
    print(f"ratio kvmux / bare = {kv_tps / bare_tps:.3f}  (goal >= 0.95; same tokens checked)")

    big = Engine(builtin("small"), EngineOptions(intra_op_threads=args.threads, min_bucket=4096))
    cap = capacity_cost(engine, big, prompt, repeats)
    print(
        f"16 + 240 tokens bound at capacity 256: {cap['ms_per_token_256']:.2f} ms/token; at 4096: "
        f"{cap['ms_per_token_4096']:.2f} ms/token (x{cap['ratio_4096_over_256']:.3f})"
    )

    g = growth_share(engine, prompt, long_n)
    print(
        f"growth over a {long_n}-token decode: {g['growth_s'] * 1e3:.1f} ms of "
        f"{g['total_s']:.1f} s = {100 * g['growth_share']:.3f}% ; buckets {g['buckets']}; "
        f"copied {g['bytes_copied'] / 2**20:.1f} MiB = {g['copied_over_final']:.2f}x final KV"
    )
    path = write_json(
        "engine",
        {
            "threads": args.threads,
            "new_tokens": n_new,
            "repeats": repeats,
            "bare_tokens_per_s": bare_tps,
            "kvmux_tokens_per_s": kv_tps,
            "ratio": kv_tps / bare_tps,
            "growth": g,
            "capacity_cost": cap,
        },
    )
    print(f"written {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
