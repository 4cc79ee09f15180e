"""Scale-out on Ray: two replicas against one, and one replica against ``kvmux submit``.

One run, the sides interleaved (the order rotates each repeat, so drift
hits every side alike), the same greedy file (``--lines`` lines of distinct
prompts, ``--tokens`` new tokens each, ``ignore_eos``) and the same kvmuxd
config (the built-in ``small`` model, ``model.intra_op_threads = 1``):

- **submit**: ``kvmux submit FILE --out OUT`` to one ``kvmuxd`` subprocess;
- **submit x2**: two ``kvmuxd`` and two ``kvmux submit`` at once, half the
  lines each (``kvmuxd@N`` units by hand): the machine's ceiling for two;
- **ray xN**: ``kvmux-ray submit FILE --out OUT --replicas N
  --cpus-per-replica 1 --address ADDR``, N = 1 and 2, on a local Ray this
  script starts once (``ray.init(num_cpus=2)``) so no side pays Ray's start.

Every side is the real command as a process; a thread timestamps each
result line as it lands in ``OUT``. A replica returns a batch's results
together (64 lines), so its rate is not read from the results' spacing:
a second thread notes when every replica's kvmuxd answers ``ready`` (their
sockets under ``KVMUX_RAY_TMPDIR``; no batch goes out before). Reported
per side: the rate (completion tokens / seconds from decoding's start to
the last result: for ``submit`` from the command's start, its daemon
being ready already; for Ray from the last replica's daemon being ready,
so a replica's start and its model load are left out, the last batches'
tail is not), the wall time of the command, and when its daemons were
ready. Tokens are checked equal across the sides. Ratios: ray x2 / ray x1
(scale-out, goal >= 1.7 on 2 cores) and ray x1 / submit (Ray's overhead,
goal >= 0.90).

Ray starts its workers at nice 15 and a replica's daemon inherits it; the
submit side's daemon runs at 0. Here every daemon runs at 0
(``RAY_worker_niceness``): on a machine others share, niceness alone would
otherwise decide the comparison.
Usage: python -m bench.bench_ray [--quick] [--lines N] [--tokens T] [--repeats R]
[--ray-niceness N]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio

from bench.bench_daemon import kvmuxd
from bench.common import builtin, write_json
from kvmux.client import Client, DaemonUnreachable
from kvmux.daemon.config import toml_config

TABLES: dict[str, dict[str, object]] = {
    "kv": {"min_bucket": 256},
    "scheduler": {"max_active_sessions": 16, "prefill_chunk": 64},
    "log": {"level": "warning"},
}


def write_lines(path: Path, lines: int, tokens: int) -> Path:
    with path.open("w", encoding="utf-8") as f:
        for i in range(lines):
            line = {
                "custom_id": f"r{i}",
                "prompt": f"request {i}: once upon a time",
                "max_tokens": tokens,
                "temperature": 0,
                "ignore_eos": True,
            }
            f.write(json.dumps(line) + "\n")
    return path


@dataclass
class Run:
    """One command's run: when each result line landed, and what it said."""

    name: str
    wall: float = 0.0
    ready: float = 0.0  # when decoding could start, seconds after the command started
    stamps: list[float] = field(default_factory=list)  # seconds since the command started
    tokens: list[int] = field(default_factory=list)  # completion tokens of each result
    token_ids: dict[str, list[int]] = field(default_factory=dict)

    def rate(self) -> float:
        """Completion tokens/s from decoding's start to the last result."""
        return sum(self.tokens) / (self.stamps[-1] - self.ready)

    def summary(self) -> dict[str, Any]:
        return {
            "tokens_per_s": round(self.rate(), 1),
            "wall_s": round(self.wall, 2),
            "ready_s": round(self.ready, 2),
            "last_result_s": round(self.stamps[-1], 2),
            "tokens": sum(self.tokens),
        }


async def _all_ready(folder: Path, n: int, stop: threading.Event) -> float | None:
    """When ``n`` replicas' kvmuxd under ``folder`` answer ``ready``: batches go out
    once the whole pool is up (``build_processor`` waits for it)."""
    ready: set[Path] = set()
    while not stop.is_set():
        for sock in set(folder.glob("kvmux-ray-*/kvmuxd.sock")) - ready:
            with contextlib.suppress(DaemonUnreachable, TimeoutError):
                async with Client(f"ipc://{sock}", timeout=0.5) as probe:
                    if (await probe.status()).state == "ready":
                        ready.add(sock)
        if len(ready) >= n:
            return time.perf_counter()
        await asyncio.sleep(0.02)
    return None


def run_command(
    name: str,
    argv: list[str],
    out: Path,
    env: dict[str, str],
    replicas: tuple[Path, int] | None = None,
) -> Run:
    """Run ``argv`` to the end, timestamping each line it writes to ``out`` and, given
    ``replicas`` (where their daemons' folders appear, and how many), when they are all
    ready."""
    run = Run(name)
    # A file left by an earlier repeat would be read as this run's results.
    out.unlink(missing_ok=True)
    stop = threading.Event()
    started = time.perf_counter()
    ready: list[float | None] = []

    def tail() -> None:
        while not out.exists() and not stop.is_set():
            time.sleep(0.005)
        if not out.exists():
            return
        with out.open("rb") as f:
            pending = b""
            while True:
                chunk = f.read()
                if chunk:
                    now = time.perf_counter() - started
                    pending += chunk
                    *whole, pending = pending.split(b"\n")
                    for raw in whole:
                        obj = json.loads(raw)
                        run.stamps.append(now)
                        run.tokens.append(obj["usage"]["completion_tokens"])
                        run.token_ids[obj["custom_id"]] = obj["token_ids"]
                elif stop.is_set():
                    return
                else:
                    time.sleep(0.005)

    threads = [threading.Thread(target=tail)]
    if replicas is not None:
        folder, n = replicas
        threads.append(
            threading.Thread(target=lambda: ready.append(asyncio.run(_all_ready(folder, n, stop))))
        )
    for t in threads:
        t.start()
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=1800)
    run.wall = time.perf_counter() - started
    stop.set()
    for t in threads:
        t.join()
    if done.returncode != 0:
        raise RuntimeError(f"{name} exited {done.returncode}:\n{done.stderr[-4000:]}")
    if replicas is not None:
        at = ready[0] if ready else None
        if at is None:
            raise RuntimeError(f"{name}: its replicas' kvmuxd were not all seen ready")
        run.ready = at - started
    return run


async def _submit(model: Path, src: Path, work: Path, env: dict[str, str]) -> Run:
    async with kvmuxd(model, threads=1, tables=TABLES) as daemon:
        out = work / "submit.jsonl"
        argv = [sys.executable, "-m", "kvmux.client.cli", "submit", str(src), "--out", str(out)]
        argv += ["--endpoint", daemon.endpoint, "-q"]
        return await anyio.to_thread.run_sync(lambda: run_command("submit", argv, out, env))


async def _submit_pair(model: Path, src: Path, work: Path, env: dict[str, str]) -> Run:
    """Two kvmuxd, two ``kvmux submit`` at once, half the lines each: what two daemons
    give on this machine without Ray (``kvmuxd@N`` units), the ceiling for ray x2."""
    lines = src.read_text().splitlines(keepends=True)
    halves = [work / "half0.jsonl", work / "half1.jsonl"]
    for k, half in enumerate(halves):
        half.write_text("".join(lines[k::2]))
    runs: list[Run] = []

    async def one(k: int, endpoint: str) -> None:
        out = work / f"pair{k}.jsonl"
        argv = [sys.executable, "-m", "kvmux.client.cli", "submit", str(halves[k])]
        argv += ["--out", str(out), "--endpoint", endpoint, "-q"]
        done = await anyio.to_thread.run_sync(lambda: run_command(f"half {k}", argv, out, env))
        runs.append(done)

    async with (
        kvmuxd(model, threads=1, tables=TABLES) as a,
        kvmuxd(model, threads=1, tables=TABLES) as b,
        anyio.create_task_group() as tg,
    ):
        tg.start_soon(one, 0, a.endpoint)
        tg.start_soon(one, 1, b.endpoint)
    both = Run("submit x2", wall=max(r.wall for r in runs))
    results = (pair for r in runs for pair in zip(r.stamps, r.tokens, strict=True))
    for stamp, tokens in sorted(results):
        both.stamps.append(stamp)
        both.tokens.append(tokens)
    for r in runs:
        both.token_ids.update(r.token_ids)
    return both


def _ray(n: int, config: Path, src: Path, work: Path, address: str, env: dict[str, str]) -> Run:
    out = work / f"ray{n}.jsonl"
    argv = [sys.executable, "-m", "kvmux.ray", "submit", str(src), "--out", str(out)]
    argv += ["--replicas", str(n), "--cpus-per-replica", "1", "--config", str(config)]
    argv += ["--address", address, "-q"]
    return run_command(f"ray x{n}", argv, out, env, replicas=(work, n))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer lines, one repeat")
    parser.add_argument("--lines", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--ray-niceness", type=int, default=0, help="Ray's worker niceness (Ray's own: 15)"
    )
    parser.add_argument("--model", choices=["tiny", "small"], default="small")
    args = parser.parse_args()
    lines, repeats = (128, 1) if args.quick else (args.lines, args.repeats)

    import ray

    load = os.getloadavg()
    model = builtin(args.model)
    work = Path(tempfile.mkdtemp(prefix="kvx-bench-ray-", dir="/tmp"))
    src = write_lines(work / "in.jsonl", lines, args.tokens)
    config = work / "kvmuxd.toml"
    config.write_text(toml_config({"model": {"path": str(model)}, **TABLES}))
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    # The replicas are this Ray's workers: they take their environment from here.
    os.environ["KVMUX_RAY_TMPDIR"] = str(work)
    # Ray runs its workers, and so the replicas' daemons, at nice 15; the submit
    # side's daemon runs at 0. On a machine others share that alone would decide
    # the comparison, so here every daemon runs at 0 (--ray-niceness to change).
    os.environ["RAY_worker_niceness"] = str(args.ray_niceness)  # noqa: SIM112 - Ray's spelling
    # Two CPUs, as the machine: two one-CPU replicas fill it.
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=256 << 20)
    address = ray.get_runtime_context().gcs_address
    env = {k: v for k, v in os.environ.items() if k != "KVMUX_ENDPOINT"}
    sides = ["submit", "submit x2", "ray x1", "ray x2"]
    runs: dict[str, list[Run]] = {name: [] for name in sides}
    try:
        for r in range(repeats):
            for name in sides[r % len(sides) :] + sides[: r % len(sides)]:
                if name == "submit":
                    one = anyio.run(_submit, model, src, work, env)
                elif name == "submit x2":
                    one = anyio.run(_submit_pair, model, src, work, env)
                else:
                    one = _ray(int(name[-1]), config, src, work, address, env)
                runs[name].append(one)
                print(f"  {name}: {one.summary()}", flush=True)
    finally:
        ray.shutdown()
        shutil.rmtree(work, ignore_errors=True)
    reference = runs["submit"][0].token_ids
    assert len(reference) == lines
    for name, done in runs.items():
        for one in done:
            assert one.token_ids == reference, f"{name}: tokens differ from kvmux submit's"
    median = {name: statistics.median(r.rate() for r in done) for name, done in runs.items()}
    scale = median["ray x2"] / median["ray x1"]
    overhead = median["ray x1"] / median["submit"]
    ceiling = median["submit x2"] / median["submit"]
    print(f"\n{lines} lines x {args.tokens} tokens, {args.model}, 1 thread per daemon")
    print(f"{'side':<10} {'tok/s':>8} {'wall s':>8} {'ready s':>8}")
    for name, done in runs.items():
        wall = statistics.median(r.wall for r in done)
        ready = statistics.median(r.ready for r in done)
        print(f"{name:<10} {median[name]:>8,.0f} {wall:>8.1f} {ready:>8.1f}")
    # Per repeat too: the sides of one repeat ran minutes apart at most, so others'
    # load on a shared machine moves both alike.
    paired = [b.rate() / a.rate() for a, b in zip(runs["ray x1"], runs["ray x2"], strict=True)]
    of_hand = [b.rate() / a.rate() for a, b in zip(runs["submit x2"], runs["ray x2"], strict=True)]
    print(f"ray x2 / ray x1 by repeat: {', '.join(f'{x:.2f}' for x in paired)}")
    print(f"ray x2 / submit x2 by repeat: {', '.join(f'{x:.2f}' for x in of_hand)}")
    print(f"ray x2 / ray x1: {scale:.2f}x (goal >= 1.7)")
    print(f"submit x2 / submit: {ceiling:.2f}x (two daemons without Ray: this machine's ceiling)")
    print(f"ray x1 / submit: {overhead:.2f} (goal >= 0.90: Ray costs {1 - overhead:.1%})")
    payload = {
        "lines": lines,
        "tokens": args.tokens,
        "model": args.model,
        "ray_worker_niceness": args.ray_niceness,
        "loadavg_at_start": load,
        "runs": {name: [r.summary() for r in done] for name, done in runs.items()},
        "ratio_2_over_1": round(scale, 3),
        "ratio_1_over_submit": round(overhead, 3),
        "ratio_submit2_over_submit": round(ceiling, 3),
        "ratio_2_over_1_by_repeat": [round(x, 3) for x in paired],
        "ratio_ray2_over_submit2_by_repeat": [round(x, 3) for x in of_hand],
    }
    print(f"written to {write_json('ray', payload)}")


if __name__ == "__main__":
    main()
