"""What a decode step's cost follows: the bound KV capacity, the valid length, the rows.

One built-in ``small`` engine per capacity (``min_bucket`` = the capacity,
so a session binds exactly that buffer), one session per (capacity, valid
length) cell decoding ``--steps`` greedy tokens from a prompt of that length;
cells interleaved and repeated, median ms per token. Reading the table: down a
column the capacity changes and the valid length does not; along a row the
valid length changes and the capacity does not.

A second table decodes R rows of one cohort in one run per step (capacity
1024, each row 300 tokens in): how the aggregate tokens/s of one run grows
with its rows on this machine, which bounds what batching more sessions at
once (the memory-density comparison) can gain in tokens/s. Usage:
    python -m bench.bench_capacity [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import numpy as np

from bench.common import builtin, write_json
from kvmux.daemon.engine import Engine, EngineOptions, SamplingParams

CAPACITIES = (256, 1024, 4096)
VALID = (16, 200, 900, 3000)
ROWS = (1, 2, 4, 8, 16, 32)
ROWS_VALID = 300


def ms_per_token(engine: Engine, prompt: list[int], steps: int) -> float:
    params = SamplingParams(max_new_tokens=steps + 1, temperature=0.0, ignore_eos=True)
    session = engine.new_session(prompt, params)
    try:
        if session.needs_growth():
            session.ensure_capacity()
        while session.prefilling:  # in chunks of prefill_chunk tokens
            engine.step(session)
        t0 = time.perf_counter()
        decoded = 0
        while not session.finished:
            decoded += len(engine.step(session).token_ids)
        return (time.perf_counter() - t0) * 1000 / decoded
    finally:
        session.release()


def ms_per_step(engine: Engine, prompts: list[list[int]], steps: int) -> float:
    """One decode step of every session of ``prompts`` (one run: rows of one cohort)."""
    params = SamplingParams(max_new_tokens=steps + 1, temperature=0.0, ignore_eos=True)
    sessions = [engine.new_session(p, params) for p in prompts]
    try:
        while any(s.prefilling for s in sessions):
            engine.step_many(sessions)
        runs = engine.runner.runs
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step_many(sessions)
        elapsed = time.perf_counter() - t0
        if engine.runner.runs - runs != steps:
            raise AssertionError(f"{len(prompts)} rows did not decode in one run per step")
        return elapsed * 1000 / steps
    finally:
        for s in sessions:
            s.release()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="fewer steps and repeats")
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads (0: default)")
    args = ap.parse_args(argv)
    steps, repeats = (24, 3) if args.quick else (48, 5)
    model = builtin("small")
    engines = {
        cap: Engine(model, EngineOptions(intra_op_threads=args.threads, min_bucket=cap))
        for cap in CAPACITIES
    }
    spec = engines[CAPACITIES[0]].spec
    rng = np.random.default_rng(0)
    prompts = {v: [int(t) for t in rng.integers(4, spec.vocab_size, v)] for v in VALID}
    cells = [(c, v) for c in CAPACITIES for v in VALID if v + steps + 1 <= c]
    times: dict[tuple[int, int], list[float]] = {cell: [] for cell in cells}
    for cap, v in cells:  # warm-up: every shape once
        ms_per_token(engines[cap], prompts[v], 4)
    for rep in range(repeats):
        k = rep % len(cells)
        for cap, v in cells[k:] + cells[:k]:
            times[(cap, v)].append(ms_per_token(engines[cap], prompts[v], steps))
    med = {cell: statistics.median(t) for cell, t in times.items()}
    print(
        f"built-in small: hidden {spec.hidden_size}, {spec.num_layers} layers, "
        f"{spec.num_kv_heads} KV heads x {spec.head_size}; intra_op_num_threads="
        f"{args.threads or 'default'}; {steps} decode steps per cell, median of {repeats}"
    )
    print("\nms per decode token (rows: bound capacity; columns: valid length)")
    print(f"{'capacity':>9}" + "".join(f"{v:>9}" for v in VALID))
    for cap in CAPACITIES:
        print(
            f"{cap:>9}"
            + "".join(f"{med[(cap, v)]:>9.3f}" if (cap, v) in med else f"{'-':>9}" for v in VALID)
        )
    base = med[(CAPACITIES[0], VALID[0])]
    print(
        f"\nvalid 16: capacity 4096 / 256 = {med[(4096, 16)] / base:.3f}; "
        f"capacity 4096: valid 3000 / 16 = {med[(4096, 3000)] / med[(4096, 16)]:.3f}"
    )
    engine = engines[1024]
    batch = {
        r: [[int(t) for t in rng.integers(4, spec.vocab_size, ROWS_VALID)] for _ in range(r)]
        for r in ROWS
    }
    per_rows: dict[int, list[float]] = {r: [] for r in ROWS}
    ms_per_step(engine, batch[ROWS[-1]], 2)  # warm-up
    for rep in range(repeats):
        k = rep % len(ROWS)
        for r in ROWS[k:] + ROWS[:k]:
            per_rows[r].append(ms_per_step(engine, batch[r], steps))
    rows_ms = {r: statistics.median(t) for r, t in per_rows.items()}
    one = 1000 / rows_ms[1]
    print(f"\nR rows in one run per step (capacity 1024, {ROWS_VALID} valid tokens each)")
    print(f"{'rows':>5}{'ms/step':>10}{'tokens/s':>10}{'x 1 row':>9}")
    for r, ms in rows_ms.items():
        print(f"{r:>5}{ms:>10.3f}{r * 1000 / ms:>10.1f}{r * 1000 / ms / one:>9.2f}")
    result: dict[str, Any] = {
        "steps": steps,
        "repeats": repeats,
        "ms_per_token": [{"capacity": c, "valid": v, "ms": m} for (c, v), m in med.items()],
        "rows": [{"rows": r, "valid": ROWS_VALID, "ms_per_step": m} for r, m in rows_ms.items()],
    }
    print(f"written {write_json('capacity', result)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
