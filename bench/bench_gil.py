"""What another thread's Python costs the model thread (issue 28, item 5).

The Engine decodes one job of N greedy items (prompt 32 + 128 new, `tiny`, one
onnxruntime thread, as ``bench.bench_busy``) on a thread, while something else runs:

- **alone**: nothing else;
- **process hog**: a ``while 1: pass`` in another process (the other core busy);
- **thread, no GIL**: a thread of this process hashing 200 KB blocks (C code that
  lets the GIL go while it hashes: the other core busy, the GIL free);
- **thread, Python X ms / 10 ms**: a thread of this process running Python for X ms
  then sleeping the rest of 10 ms, as kvmuxd's event loop does beside the model
  thread (streaming a chunk, announcing starts, building results).

Conditions interleave, round after round; each line is the median over the rounds
of the job's wall and the model thread's CPU time, and the wall against "alone".
onnxruntime lets the GIL go while it runs; each step the model thread takes it back
for its own Python, and waits whenever the other thread holds it.

    python -m bench.bench_gil [--n 16] [--rounds 5] [--jobs 10]
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from bench.bench_busy import engine_for, prompts_for, run_engine
from bench.common import MODELS, write_json
from kvmux.daemon.model import ensure_builtin


def _hash(stop: threading.Event) -> None:
    block = b"x" * 200_000
    while not stop.is_set():
        hashlib.sha256(block).digest()


def _python(busy: float) -> Callable[[threading.Event], None]:
    def duty(stop: threading.Event) -> None:
        while not stop.is_set():
            end = time.perf_counter() + busy
            while time.perf_counter() < end:
                pass
            time.sleep(0.010 - busy)

    return duty


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=16, help="items of the job")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--jobs", type=int, default=10, help="jobs per condition and round")
    args = ap.parse_args(argv)

    model = ensure_builtin("tiny", MODELS, dtype="float32")
    opts = argparse.Namespace(provider="cpu", threads=1)
    engine = engine_for(opts, model, False, args.n)
    prompts = prompts_for(args.n, engine.spec.vocab_size, seed=args.n)
    conditions: dict[str, Callable[[threading.Event], None] | str | None] = {
        "alone": None,
        "process hog": "process",
        "thread, no GIL": _hash,
        "thread, Python 0.5 ms / 10 ms": _python(0.0005),
        "thread, Python 1 ms / 10 ms": _python(0.001),
        "thread, Python 2 ms / 10 ms": _python(0.002),
    }
    walls: dict[str, list[float]] = {k: [] for k in conditions}
    cpus: dict[str, list[float]] = {k: [] for k in conditions}
    want: list[list[int]] | None = None

    def jobs(out: list[tuple[float, float]]) -> None:
        nonlocal want
        cpu0, wall = time.thread_time(), 0.0
        for _ in range(args.jobs):
            w, tokens = run_engine(engine, prompts, 16)
            wall += w
            if want is None:
                want = tokens
            elif tokens != want:
                raise AssertionError("the Engine decoded other tokens beside the load")
        out.append((wall / args.jobs, (time.thread_time() - cpu0) / args.jobs))

    for _ in range(3):
        run_engine(engine, prompts, 16)
    print(
        f"tiny on cpu, N={args.n}, prompt 32 + 128 new, greedy, 1 intra-op thread; "
        f"{args.rounds} rounds of {args.jobs} jobs per condition"
    )
    for _ in range(args.rounds):
        for name, load in conditions.items():
            stop = threading.Event()
            hog: subprocess.Popen[bytes] | None = None
            thread: threading.Thread | None = None
            if load == "process":
                hog = subprocess.Popen([sys.executable, "-c", "while 1: pass"])
            elif callable(load):
                thread = threading.Thread(target=load, args=(stop,), daemon=True)
                thread.start()
            time.sleep(0.1)
            out: list[tuple[float, float]] = []
            model_thread = threading.Thread(target=jobs, args=(out,))
            model_thread.start()
            model_thread.join()
            stop.set()
            if thread is not None:
                thread.join()
            if hog is not None:
                hog.kill()
                hog.wait()
            if not out:
                raise RuntimeError("the model thread failed")
            walls[name].append(out[0][0])
            cpus[name].append(out[0][1])
    alone = statistics.median(walls["alone"])
    rows: list[dict[str, Any]] = []
    for name in conditions:
        wall, cpu = statistics.median(walls[name]), statistics.median(cpus[name])
        rows.append({"condition": name, "wall_s": wall, "cpu_s": cpu, "vs_alone": wall / alone})
        print(
            f"{name:32s} job {wall * 1e3:7.2f} ms  model thread CPU {cpu * 1e3:7.2f} ms  "
            f"wall / alone {wall / alone:5.2f}"
        )
    path = write_json("gil", {"args": vars(args), "rows": rows})
    print(f"tokens equal under every condition; written {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
