"""Daemon overhead: N concurrent sessions through kvmuxd vs the engine in-process vs a bare loop.

Same model (built-in ``small``), same greedy items, same intra-op thread
setting on every side, measured interleaved in one run (the order rotates
each repeat, so drift hits every side alike):

- **daemon**: one job of N items submitted with :class:`kvmux.client.Client`
  to ``kvmuxd`` running as a subprocess (its own GIL, as in production), the
  client timing events as they arrive;
- **in-process**: the same N sessions driven by the engine in this process
  with no daemon: grow what needs growing, then ``engine.step_many`` over the
  ready set, as the scheduler's turn does;
- **bare**: N hand-written IOBinding loops (the one of ``bench_engine``), one
  preallocated buffer each, stepped round-robin: no kvmux code at all.

Tokens are checked equal across the three sides. Every session stays within
the first bucket (256), so no side pays for growth or for a bigger buffer.
Usage: python -m bench.bench_daemon [--quick] [--threads N] [--sizes 1,4,16,64]

The module also holds :func:`kvmuxd`, the daemon-as-a-subprocess helper the
other daemon benchmarks and the soak run use.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import numpy as np

from bench.common import builtin, write_json
from kvmux.client import Client, DaemonUnreachable, Item
from kvmux.client import protocol as p
from kvmux.daemon.config import toml_config
from kvmux.daemon.engine import Engine, EngineOptions, SamplingParams
from kvmux.kv import capacity_bucket

MIN_BUCKET = 256
PROMPT_LEN = 16

# -- kvmuxd as a subprocess ------------------------------------------------------------


def rss_bytes(pid: int) -> int:
    """Resident set size of ``pid`` (VmRSS in /proc/PID/status)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def _limit_nofile(n: int) -> None:
    import resource

    resource.setrlimit(resource.RLIMIT_NOFILE, (n, n))


@dataclass
class DaemonProcess:
    """A running ``kvmuxd`` subprocess: its endpoint, pid and JSON-lines log."""

    proc: subprocess.Popen[bytes]
    endpoint: str
    folder: Path
    config: dict[str, dict[str, object]]
    # Where its HTTP front listens (as its status says once ready); "" if off.
    http_url: str = ""

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def log_path(self) -> Path:
        return self.folder / "kvmuxd.out"

    def alive(self) -> bool:
        return self.proc.poll() is None

    def rss(self) -> int:
        return rss_bytes(self.pid)

    def events(self, name: str | None = None) -> Iterator[dict[str, Any]]:
        """The daemon's log events so far (``name``: only those)."""
        with self.log_path.open(encoding="utf-8") as f:
            for line in f:
                try:
                    event = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a line being written
                if isinstance(event, dict) and (name is None or event.get("event") == name):
                    yield event

    def stderr_tail(self, n: int = 4000) -> str:
        path = self.folder / "kvmuxd.err"
        return path.read_text(errors="replace")[-n:] if path.exists() else ""


@asynccontextmanager
async def kvmuxd(
    model: Path,
    *,
    threads: int,
    tables: Mapping[str, Mapping[str, object]] | None = None,
    env: Mapping[str, str] | None = None,
    python: str = sys.executable,
    startup_timeout: float = 120.0,
    nofile: int | None = None,
    endpoint: str | None = None,
) -> AsyncIterator[DaemonProcess]:
    """Run ``python -m kvmux.daemon --config FILE`` on an ipc socket until the block ends.

    ``tables`` override the config (``{"scheduler": {"max_active_sessions": 64}}``);
    logs are JSON lines in ``DaemonProcess.log_path``. ``nofile`` sets the
    process's descriptor limit (soft and hard); ``endpoint`` replaces the ipc
    socket in a temporary folder. Yields once a client can connect; on exit
    sends SIGTERM and waits (SIGKILL after 30 s).
    """
    folder = Path(tempfile.mkdtemp(prefix="kvxb-", dir="/tmp"))  # ipc paths must be short
    endpoint = endpoint or f"ipc://{folder}/kvmuxd.sock"
    config: dict[str, dict[str, object]] = {
        "model": {"path": str(model), "intra_op_threads": threads},
        "server": {"endpoint": endpoint},
        "log": {"format": "json", "level": "info"},
        "shutdown": {"grace": 5.0},
        # In the run's folder, so it goes with it (tables may point elsewhere).
        "jobs": {"journal": str(folder / "jobs.sqlite3")},
    }
    for table, values in (tables or {}).items():
        config.setdefault(table, {}).update(values)
    cfg_path = folder / "kvmuxd.toml"
    cfg_path.write_text(toml_config(config))
    with (folder / "kvmuxd.out").open("wb") as out, (folder / "kvmuxd.err").open("wb") as err:
        proc = subprocess.Popen(
            [python, "-m", "kvmux.daemon", "--config", str(cfg_path)],
            stdout=out,
            stderr=err,
            env={**os.environ, **(env or {})},
            preexec_fn=None if nofile is None else lambda: _limit_nofile(nofile),
        )
    daemon = DaemonProcess(proc, endpoint, folder, config)
    try:
        with anyio.fail_after(startup_timeout):
            while True:
                if not daemon.alive():
                    raise RuntimeError(
                        f"kvmuxd exited with {proc.returncode} at startup:\n{daemon.stderr_tail()}"
                    )
                try:
                    async with Client(endpoint, timeout=1.0) as probe:
                        # The socket answers while the model loads; wait for ready.
                        status = await probe.status()
                        if status.state == "ready":
                            daemon.http_url = status.http_url
                            break
                except DaemonUnreachable:
                    pass
                await anyio.sleep(0.05)
        yield daemon
    finally:
        if daemon.alive():
            proc.send_signal(signal.SIGTERM)
            try:
                await anyio.to_thread.run_sync(lambda: proc.wait(timeout=30))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        shutil.rmtree(folder, ignore_errors=True)


# -- one measured run of N sessions ------------------------------------------------------


@dataclass
class Run:
    """One side's run of N sessions: wall time, per-session tokens and latencies."""

    side: str
    wall: float
    tokens: dict[int, list[int]]
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)

    @property
    def n_tokens(self) -> int:
        return sum(len(t) for t in self.tokens.values())


class _Clock:
    """Per-session first-token and inter-token times, from one start time."""

    def __init__(self, start: float, run: Run) -> None:
        self.start = start
        self.run = run
        self.last: dict[int, float] = {}

    def tokens(self, index: int, k: int, now: float) -> None:
        prev = self.last.get(index)
        if prev is None:
            self.run.ttft.append(now - self.start)
            k -= 1  # the first token's wait is its TTFT
            prev = now
        if k > 0:
            self.run.itl.extend([(now - prev) / k] * k)
        self.last[index] = now


def run_inprocess(engine: Engine, prompts: list[list[int]], n_new: int) -> Run:
    """The scheduler's turn without the daemon: grow who needs it, then step_many the rest."""
    params = SamplingParams(max_new_tokens=n_new, temperature=0.0, ignore_eos=True)
    run = Run("in-process", 0.0, {i: [] for i in range(len(prompts))})
    t0 = time.perf_counter()
    clock = _Clock(t0, run)
    sessions = {
        i: engine.new_session(pr, params, session_id=str(i)) for i, pr in enumerate(prompts)
    }
    while sessions:
        ready = []
        for s in sessions.values():
            if s.needs_growth():
                s.ensure_capacity()
            ready.append(s)
        outputs = engine.step_many(ready)
        now = time.perf_counter()
        for s, out in zip(ready, outputs, strict=True):
            if isinstance(out, Exception):
                raise out
            index = int(s.session_id)
            if out.token_ids:
                clock.tokens(index, len(out.token_ids), now)
                run.tokens[index].extend(out.token_ids)
            if out.finished:
                s.release()
                del sessions[index]
    run.wall = time.perf_counter() - t0
    return run


class BareSession:
    """``bench_engine.bare_loop`` as a steppable object: one final-bucket buffer, bound once,
    and the decode step's input_ids/logits buffers bound once too (as kvmux does)."""

    def __init__(self, engine: Engine, prompt: list[int], n_new: int) -> None:
        spec = engine.spec
        if spec.position_ids_name is not None:
            raise ValueError("the bare loop binds no position_ids; use a model without them")
        self.sess = engine.ort.session
        self.spec = spec
        self.prompt = prompt
        self.n_new = n_new
        self.out: list[int] = []
        cap = capacity_bucket(len(prompt) + n_new, spec.context_length, MIN_BUCKET)
        shape = (1, spec.num_kv_heads, cap, spec.head_size)
        self.kv = [np.zeros(shape, spec.kv_dtype) for _ in range(2 * spec.num_layers)]
        self.mask = np.zeros((1, cap), np.int64)
        self.io = self.sess.io_binding()
        names_in = spec.past_key_names + spec.past_value_names
        names_out = spec.present_key_names + spec.present_value_names
        for buf, i_name, o_name in zip(self.kv, names_in, names_out, strict=True):
            self.io.bind_input(i_name, "cpu", 0, buf.dtype, shape, buf.ctypes.data)
            self.io.bind_output(o_name, "cpu", 0, buf.dtype, shape, buf.ctypes.data)
        m = self.mask
        self.io.bind_input(spec.attention_mask_name, "cpu", 0, np.int64, m.shape, m.ctypes.data)
        self.ids = np.empty((1, 1), np.int64)
        self.logits = np.empty((1, 1, spec.vocab_size), np.float32)
        self.pos = 0

    @property
    def finished(self) -> bool:
        return len(self.out) >= self.n_new

    def _bind(self, ids: np.ndarray[Any, Any], logits: np.ndarray[Any, Any]) -> None:
        spec, io = self.spec, self.io
        io.bind_input(spec.input_ids_name, "cpu", 0, np.int64, ids.shape, ids.ctypes.data)
        io.bind_output(spec.logits_name, "cpu", 0, np.float32, logits.shape, logits.ctypes.data)

    def step(self) -> int:
        if not self.out:  # prefill: the whole prompt in one run
            n = len(self.prompt)
            self.mask[0, :n] = 1
            self.pos = n
            ids = np.asarray([self.prompt], np.int64)
            logits = np.empty((1, n, self.spec.vocab_size), np.float32)
            self._bind(ids, logits)
            self.sess.run_with_iobinding(self.io)
            self._bind(self.ids, self.logits)  # decode steps reuse these: bound once
        else:
            self.ids[0, 0] = self.out[-1]
            self.mask[0, self.pos] = 1
            self.pos += 1
            self.sess.run_with_iobinding(self.io)
            logits = self.logits
        tok = int(np.argmax(logits[0, -1]))
        self.out.append(tok)
        return tok


def run_bare(engine: Engine, prompts: list[list[int]], n_new: int) -> Run:
    run = Run("bare", 0.0, {})
    t0 = time.perf_counter()
    clock = _Clock(t0, run)
    sessions = {i: BareSession(engine, pr, n_new) for i, pr in enumerate(prompts)}
    while sessions:
        for index, s in list(sessions.items()):
            s.step()
            clock.tokens(index, 1, time.perf_counter())
            if s.finished:
                run.tokens[index] = s.out
                del sessions[index]
    run.wall = time.perf_counter() - t0
    return run


def greedy_items(prompts: list[list[int]], n_new: int) -> list[Item]:
    return [
        Item(
            custom_id=str(i),
            prompt_tokens=pr,
            max_new_tokens=n_new,
            temperature=0.0,
            ignore_eos=True,
        )
        for i, pr in enumerate(prompts)
    ]


async def run_daemon(
    client: Client, prompts: list[list[int]], n_new: int, *, stream: bool = True
) -> Run:
    """One job of N greedy items through the client; latencies as the client sees them."""
    return await run_items(client, greedy_items(prompts, n_new), "daemon", stream=stream)


async def run_items(client: Client, items: list[Item], name: str, *, stream: bool = True) -> Run:
    """One job of ``items`` through the client; TTFT and per-token latencies as the
    client sees them, from the submit (none without ``stream``: results only)."""
    run = Run(name, 0.0, {})
    t0 = time.perf_counter()
    clock = _Clock(t0, run)
    job = await client.submit(items, stream=stream)
    async for ev in job.events():
        now = time.perf_counter()
        if isinstance(ev, p.TokenDelta):
            if ev.token_ids:
                clock.tokens(ev.index, len(ev.token_ids), now)
        elif isinstance(ev, p.ItemFinished):
            r = ev.result
            if r.status != "ok":
                raise RuntimeError(f"{name} item {r.custom_id} failed: {r.error}")
            run.tokens[r.index] = r.token_ids
    run.wall = time.perf_counter() - t0
    job.close()  # the client keeps every job it routes events to until closed
    return run


# -- the benchmark -----------------------------------------------------------------------


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def prompts_for(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(3, vocab, PROMPT_LEN)] for _ in range(n)]


def new_tokens_for(n: int, budget: int) -> int:
    """Tokens per session: ~``budget`` tokens per run in all, inside the first bucket."""
    return max(16, min(MIN_BUCKET - PROMPT_LEN, budget // n))


def summarize(n: int, n_new: int, runs: dict[str, list[Run]]) -> dict[str, Any]:
    row: dict[str, Any] = {"n": n, "new_tokens_per_session": n_new}
    for side, rs in runs.items():
        tokens = rs[0].n_tokens
        row[side] = {
            "tokens_per_s": tokens / statistics.median(r.wall for r in rs),
            "walls_s": [r.wall for r in rs],
            "ttft_p50_ms": 1e3 * pct([x for r in rs for x in r.ttft], 50),
            "ttft_p99_ms": 1e3 * pct([x for r in rs for x in r.ttft], 99),
            "itl_p50_ms": 1e3 * pct([x for r in rs for x in r.itl], 50),
            "itl_p99_ms": 1e3 * pct([x for r in rs for x in r.itl], 99),
        }
    row["daemon_over_inprocess"] = row["daemon"]["tokens_per_s"] / row["in-process"]["tokens_per_s"]
    row["inprocess_over_bare"] = row["in-process"]["tokens_per_s"] / row["bare"]["tokens_per_s"]
    row["daemon_over_bare"] = row["daemon"]["tokens_per_s"] / row["bare"]["tokens_per_s"]
    return row


def print_header() -> None:
    print(
        f"{'N':>3} {'tok/sess':>8} {'bare':>7} {'in-proc':>8} {'daemon':>7} "
        f"{'d/in':>6} {'in/bare':>7} | {'TTFT p50/p99 ms: in-proc':>24} {'daemon':>13} | "
        f"{'ITL p50/p99 ms: in-proc':>23} {'daemon':>11}"
    )


def print_row(r: dict[str, Any]) -> None:
    ip, dm = r["in-process"], r["daemon"]
    print(
        f"{r['n']:>3} {r['new_tokens_per_session']:>8} {r['bare']['tokens_per_s']:>7.1f} "
        f"{ip['tokens_per_s']:>8.1f} {dm['tokens_per_s']:>7.1f} "
        f"{r['daemon_over_inprocess']:>6.3f} {r['inprocess_over_bare']:>7.3f} | "
        f"{ip['ttft_p50_ms']:>12.1f}/{ip['ttft_p99_ms']:<11.1f} "
        f"{dm['ttft_p50_ms']:>6.1f}/{dm['ttft_p99_ms']:<6.1f} | "
        f"{ip['itl_p50_ms']:>11.2f}/{ip['itl_p99_ms']:<11.2f} "
        f"{dm['itl_p50_ms']:>5.2f}/{dm['itl_p99_ms']:<5.2f}"
    )


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    sizes = [int(s) for s in args.sizes.split(",")]
    budget, repeats = (256, 3) if args.quick else (640, 5)
    repeats = args.repeats or repeats
    model = builtin(args.model)
    opts = EngineOptions(intra_op_threads=args.threads, min_bucket=MIN_BUCKET, prefill_chunk=256)
    engine = Engine(model, opts)
    vocab = engine.spec.vocab_size
    threads = args.threads or "default (ORT: one per physical core)"
    print(f"model {args.model}: {engine.spec.num_layers} layers, hidden {engine.spec.hidden_size}")
    print(
        f"intra_op_num_threads={threads} on every side; greedy; prompt {PROMPT_LEN}; "
        f"min_bucket {MIN_BUCKET}; {repeats} repeats per side, interleaved; "
        f"{os.cpu_count()} CPUs"
    )
    tables = {
        "kv": {"min_bucket": MIN_BUCKET},
        "scheduler": {"max_active_sessions": max(sizes), "prefill_chunk": 256},
    }
    rows = []
    async with (
        kvmuxd(model, threads=args.threads, tables=tables) as daemon,
        Client(daemon.endpoint, timeout=60.0) as client,
    ):
        warm = prompts_for(2, vocab, seed=99)
        await run_daemon(client, warm, 8)
        await anyio.to_thread.run_sync(run_inprocess, engine, warm, 8)
        await anyio.to_thread.run_sync(run_bare, engine, warm, 8)
        for n in sizes:
            n_new = args.tokens or new_tokens_for(n, budget)
            prompts = prompts_for(n, vocab, seed=n)
            runs: dict[str, list[Run]] = {"bare": [], "in-process": [], "daemon": []}
            order = ["daemon", "in-process", "bare"]
            for rep in range(repeats):
                for side in order[rep % 3 :] + order[: rep % 3]:
                    if side == "daemon":
                        r = await run_daemon(client, prompts, n_new)
                    elif side == "in-process":
                        r = await anyio.to_thread.run_sync(run_inprocess, engine, prompts, n_new)
                    else:
                        r = await anyio.to_thread.run_sync(run_bare, engine, prompts, n_new)
                    runs[side].append(r)
            want = runs["bare"][0].tokens
            for side, rs in runs.items():
                for r in rs:
                    if r.tokens != want:
                        raise AssertionError(f"N={n}: {side} decoded other tokens than bare")
            rows.append(summarize(n, n_new, runs))
            if len(rows) == 1:
                print_header()
            print_row(rows[-1])
        status = await client.status()
        if status.kv_bytes_in_use != 0:
            raise AssertionError(f"daemon holds {status.kv_bytes_in_use} KV bytes after the runs")
    return {
        "threads": args.threads,
        "repeats": repeats,
        "prompt_len": PROMPT_LEN,
        "min_bucket": MIN_BUCKET,
        "rows": rows,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="fewer tokens and repeats")
    ap.add_argument(
        "--model",
        default="small",
        choices=["tiny", "small"],
        help="built-in model; `tiny` is the short-step regime (a step ~0.1 ms, like a GPU's)",
    )
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads (0: ORT default)")
    ap.add_argument(
        "--tokens",
        type=int,
        default=0,
        help="new tokens per session at every N (default: ~640 per run in all, so "
        "at N=16 a session's fixed costs, admission and its result, weigh heavily)",
    )
    ap.add_argument("--sizes", default="1,4,16,64", help="session counts N, comma-separated")
    ap.add_argument(
        "--repeats", type=int, default=0, help="runs per side and N (default 5; 3 quick)"
    )
    ap.add_argument("--out", default="daemon", help="JSON name under bench/results/")
    args = ap.parse_args(argv)
    if not 0 <= args.tokens <= MIN_BUCKET - PROMPT_LEN:
        ap.error(f"--tokens must be 1..{MIN_BUCKET - PROMPT_LEN} (every side stays in one bucket)")
    result = anyio.run(bench, args)
    for r in result["rows"]:
        goal = {1: 0.95, 16: 0.90}.get(r["n"])
        if goal is not None:
            met = "met" if r["daemon_over_inprocess"] >= goal else "NOT met"
            ratio = r["daemon_over_inprocess"]
            print(f"N={r['n']}: daemon/in-process {ratio:.3f} (goal >= {goal}: {met})")
    path = write_json(args.out, result)
    print("tokens equal across bare, in-process and daemon (greedy); daemon KV bytes 0 at the end")
    print(f"written {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
