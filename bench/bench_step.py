"""The engine's own Python per decode step: what a step costs around onnxruntime's run.

N greedy sessions of the built-in model decode in one cohort, one ``step_many``
step per call, twice in one process: once as they are, timing onnxruntime's
run inside each step, and once with the run replaced by a no-op (the logits
buffer then keeps its last values, so every step still samples, detokenizes
and advances). On short steps (``tiny``; a GPU's regime) this Python, not the
model, sets the pace. Usage:
    python -m bench.bench_step [--model tiny|small] [--sizes 1,16,64] [--steps 600]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from typing import Any

import numpy as np

from bench.common import builtin, write_json
from kvmux.daemon.engine import DecodeSession, Engine, EngineOptions, SamplingParams


class _TimedRun:
    """onnxruntime's session as the runner calls it, its run timed (or skipped)."""

    def __init__(self, session: Any, *, skip: bool) -> None:
        self._session = session
        self._skip = skip
        self.seconds = 0.0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._session, name)

    def run_with_iobinding(self, io: Any, run_options: Any = None) -> None:
        if self._skip:
            return
        t0 = time.perf_counter()
        self._session.run_with_iobinding(io, run_options)
        self.seconds += time.perf_counter() - t0


def _sessions(engine: Engine, n: int, steps: int) -> list[DecodeSession]:
    rng = np.random.default_rng(0)
    vocab = engine.spec.vocab_size
    params = SamplingParams(max_new_tokens=steps + 8, temperature=0.0, ignore_eos=True)
    return [
        engine.new_session([int(t) for t in rng.integers(3, vocab, 16)], params) for _ in range(n)
    ]


def measure(engine: Engine, n: int, steps: int, *, skip: bool) -> dict[str, float]:
    """Median per step: the whole step, the run inside it and the rest (microseconds)."""
    real = engine.runner.ort
    timed = _TimedRun(real.session, skip=skip)
    sessions = _sessions(engine, n, steps)
    try:
        engine.step_many(sessions, 2)  # the prompts and a first decode step, run for real
        engine.runner.ort = dataclasses.replace(real, session=timed)
        whole, runs = [], []
        for _ in range(steps):
            timed.seconds = 0.0
            t0 = time.perf_counter()
            outs = engine.step_many(sessions, 1)
            whole.append(time.perf_counter() - t0)
            runs.append(timed.seconds)
            if any(isinstance(o, Exception) or o.finished for o in outs):
                raise RuntimeError(f"a session ended early: {outs}")
    finally:
        engine.runner.ort = real
        for s in sessions:
            s.release()
    step = statistics.median(whole) * 1e6
    run = statistics.median(runs) * 1e6
    outside = statistics.median(w - r for w, r in zip(whole, runs, strict=True)) * 1e6
    return {"step_us": step, "run_us": run, "python_us": outside}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="tiny", choices=["tiny", "small"])
    ap.add_argument("--sizes", default="1,16,64", help="rows N, comma-separated")
    ap.add_argument("--steps", type=int, default=600, help="timed steps per measurement")
    args = ap.parse_args(argv)
    engine = Engine(builtin(args.model), EngineOptions(min_bucket=1024, intra_op_threads=1))
    print(f"model {args.model}; one cohort of bucket 1024; median of {args.steps} steps")
    print(f"{'N':>4} {'step us':>10} {'run us':>10} {'python us':>10} {'python, no-op run':>18}")
    rows = []
    for n in [int(x) for x in args.sizes.split(",")]:
        real = measure(engine, n, args.steps, skip=False)
        noop = measure(engine, n, args.steps, skip=True)
        rows.append({"n": n, "real": real, "noop_python_us": noop["step_us"]})
        print(
            f"{n:>4} {real['step_us']:>10.0f} {real['run_us']:>10.0f} "
            f"{real['python_us']:>10.0f} {noop['step_us']:>18.0f}"
        )
    path = write_json(f"step-{args.model}", {"model": args.model, "rows": rows})
    print(f"written {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
