"""A bounded load and soak run of kvmuxd: many clients, tight memory, kills, garbage frames.

One ``kvmuxd`` subprocess (the ``tiny`` model, an ipc socket: nothing leaves
the machine) serves client *processes* that submit jobs of random size with
random prompt and output lengths, under a ``kv.memory_budget`` tight enough
that growths are refused now and then (they park and retry; some fail with
``kv_growth_failed``). Meanwhile the run

- SIGKILLs some client processes mid-stream (their attached jobs must end
  ``cancelled``; their detached jobs must finish), starting fresh clients in
  their place, and some live clients cancel some of their own jobs;
- mixes in a few invalid items (``bad_request``, ``kv_capacity_exceeded``);
- sends malformed frames from a raw ZeroMQ DEALER, each of which must get a
  typed ``bad_request`` reply echoing the request id where one is readable;
- polls ``status`` and the daemon's RSS (``/proc/PID/status``).

Invariants (the exit status is non-zero if one breaks): the daemon process
never dies (restarts 0); every item a surviving client submitted gets exactly
one result or error (lost 0, duplicated 0); every job of a killed client ends
with a result for each item; KV bytes in use return to 0; a sample of greedy
results equals the same items decoded alone in-process; the daemon stops
with exit status 0 on SIGTERM. The daemon's RSS is reported at start, after a
warm-up, every second and at the end (a warning, not a failure, if it grows
more than 10 % over the second half of the run).

The run stops at ``--items`` submitted or ``--time-limit`` seconds, whichever
comes first. Usage:
    python -m bench.soak [--short] [--items N] [--time-limit S] [--clients K]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import anyio.abc
import msgspec
import zmq
import zmq.asyncio

from kvmux.client import Client, Item, KvmuxError
from kvmux.client import protocol as p

if TYPE_CHECKING:
    # A client process imports this module too: it needs neither onnxruntime nor the daemon.
    from bench.bench_daemon import DaemonProcess

ROOT = Path(__file__).resolve().parent.parent

# -- the client process ----------------------------------------------------------------


@dataclass
class ClientTally:
    """What one client process saw; printed as its last line."""

    items_submitted: int = 0
    items_ok: int = 0
    items_failed: dict[str, int] = field(default_factory=dict)
    items_refused: dict[str, int] = field(default_factory=dict)  # whole-job refusals
    lost: int = 0
    duplicated: int = 0
    bad_tally: int = 0
    jobs: int = 0
    jobs_cancelled_by_us: int = 0


def random_item(rng: random.Random, vocab: int, cid: str) -> Item:
    """A random item; about 1 in 60 is invalid on purpose."""
    n_prompt = rng.randint(1, 160)
    prompt = [rng.randrange(3, vocab) for _ in range(n_prompt)]
    roll = rng.random()
    max_context = None
    if roll < 0.01:
        prompt[rng.randrange(n_prompt)] = vocab + 1000  # outside the vocabulary: bad_request
    elif roll < 0.02:
        prompt = prompt + [5] * 40
        max_context = rng.randint(1, 39)  # prompt over its own cap: kv_capacity_exceeded
    elif roll < 0.06:
        max_context = len(prompt) + rng.randint(1, 40)  # ends on "length" at its cap
    greedy = rng.random() < 0.7
    return Item(
        custom_id=cid,
        prompt_tokens=prompt,
        max_new_tokens=rng.randint(1, 240),
        temperature=0.0 if greedy else 0.8,
        seed=None if greedy else rng.randrange(2**31),
        ignore_eos=rng.random() < 0.8,
        max_context=max_context,
    )


def _emit(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


async def _client_job(
    client: Client,
    rng: random.Random,
    tally: ClientTally,
    job_no: int,
    n_items: int,
    vocab: int,
    verify_share: float,
) -> None:
    items = [random_item(rng, vocab, f"{job_no}/{i}") for i in range(n_items)]
    detach = rng.random() < 0.1
    cancel = rng.random() < 0.05
    tally.items_submitted += n_items
    try:
        job = await client.submit(items, detach=detach)
    except KvmuxError as exc:  # a whole-job refusal: one error for every item
        tally.items_refused[exc.code] = tally.items_refused.get(exc.code, 0) + n_items
        return
    _emit({"accepted": job.job_id, "items": n_items, "detach": detach})
    tally.jobs += 1
    seen: Counter[int] = Counter()
    finished: p.JobFinished | None = None
    asked_cancel = False
    async for ev in job.events():
        if isinstance(ev, p.TokenDelta) and cancel and not asked_cancel:
            asked_cancel = True
            tally.jobs_cancelled_by_us += 1
            await client.cancel(job.job_id)
        elif isinstance(ev, p.ItemFinished):
            r = ev.result
            seen[r.index] += 1
            if seen[r.index] > 1:
                continue
            if r.status == "ok":
                tally.items_ok += 1
                item = items[r.index]
                if item.temperature == 0.0 and rng.random() < verify_share:
                    _emit({"verify": {"item": msgspec.to_builtins(item), "tokens": r.token_ids}})
            else:
                code = r.error.code if r.error is not None else "missing_error"
                tally.items_failed[code] = tally.items_failed.get(code, 0) + 1
        elif isinstance(ev, p.JobFinished):
            finished = ev
    tally.lost += sum(1 for i in range(n_items) if seen[i] == 0)
    tally.duplicated += sum(c - 1 for c in seen.values() if c > 1)
    ok = sum(1 for r in await job.results() if r.status == "ok")
    if (
        finished is None
        or finished.total != n_items
        or finished.ok + finished.failed != n_items
        or finished.ok != ok
    ):
        tally.bad_tally += 1
    job.close()


async def client_main(args: argparse.Namespace) -> None:
    rng = random.Random(args.seed)
    tally = ClientTally()
    deadline = time.monotonic() + args.time_limit
    async with Client(args.client, timeout=60.0, name=f"soak-{args.seed}") as client:
        job_no = 0

        async def lane() -> None:
            nonlocal job_no
            while tally.items_submitted < args.items and time.monotonic() < deadline:
                job_no += 1
                n = min(rng.randint(1, 24), args.items - tally.items_submitted)
                try:
                    await _client_job(client, rng, tally, job_no, n, args.vocab, args.verify_share)
                except KvmuxError as exc:  # the connection itself failed: all lost
                    tally.items_failed[f"client:{exc.code}"] = n
                    tally.lost += n
                    return

        async with anyio.create_task_group() as tg:
            for _ in range(args.lanes):
                tg.start_soon(lane)
    _emit({"summary": asdict(tally)})


# -- the controller ----------------------------------------------------------------------


@dataclass
class SoakConfig:
    """What one soak run does; ``short()`` is the test suite's version."""

    items: int = 4000
    time_limit: float = 240.0
    clients: int = 4
    lanes: int = 3  # jobs in flight per client
    kill_share: float = 0.5  # share of client processes that get SIGKILLed
    replace_killed: bool = True
    budget_tokens: int = 4000  # kv.memory_budget in tokens of the model
    max_active: int = 16
    frame_interval: float = 0.02
    verify_share: float = 0.05
    seed: int = 20261202
    threads: int = 1
    # Finished jobs stay retained this long (s): long enough to attach to a killed
    # client's jobs, short enough that RSS reaches its plateau within a run.
    retention: float = 15.0

    @classmethod
    def short(cls) -> SoakConfig:
        return cls(
            items=400,
            time_limit=9.0,
            clients=3,
            lanes=2,
            kill_share=0.34,  # one of the three
            replace_killed=False,
            verify_share=0.2,
            frame_interval=0.01,
        )


@dataclass
class SoakReport:
    """The run's figures; :meth:`problems` lists the invariants that broke."""

    seconds: float = 0.0
    clients_started: int = 0
    clients_killed: int = 0
    items_submitted: int = 0
    items_completed: int = 0
    items_failed: dict[str, int] = field(default_factory=dict)
    items_refused: dict[str, int] = field(default_factory=dict)
    results_lost: int = 0
    results_duplicated: int = 0
    bad_job_tallies: int = 0
    killed_jobs: int = 0
    killed_items: int = 0
    killed_items_unresolved: int = 0
    killed_detached_cancelled: int = 0
    killed_results: dict[str, int] = field(default_factory=dict)
    frames_sent: int = 0
    frames_typed_replies: int = 0
    frames_wrong_replies: int = 0
    verified: int = 0
    verify_mismatches: int = 0
    daemon_restarts: int = 0
    daemon_exit_code: int | None = None
    kv_bytes_in_use_end: int = -1
    kv_peak_bytes: int = 0
    kv_budget_bytes: int = 0
    growths: int = 0
    growth_failures: dict[str, int] = field(default_factory=dict)
    parked_retries: int = 0
    preemptions: int = 0
    sessions_active_end: int = -1
    jobs_active_end: int = -1
    rss_start: int = 0
    rss_warm: int = 0
    rss_end: int = 0
    rss_max: int = 0
    rss_samples: list[tuple[float, int]] = field(default_factory=list)  # (s, bytes) each second
    client_errors: list[str] = field(default_factory=list)

    def problems(self) -> list[str]:
        out = []
        if self.daemon_restarts:
            out.append(f"the daemon died {self.daemon_restarts} time(s)")
        if self.results_lost:
            out.append(f"{self.results_lost} submitted item(s) got no result")
        if self.results_duplicated:
            out.append(f"{self.results_duplicated} item(s) got more than one result")
        if self.bad_job_tallies:
            out.append(f"{self.bad_job_tallies} job(s) ended with a wrong tally")
        if self.killed_items_unresolved:
            out.append(f"{self.killed_items_unresolved} item(s) of killed clients got no result")
        if self.killed_detached_cancelled:
            out.append(
                f"{self.killed_detached_cancelled} detached item(s) cancelled as client_gone"
            )
        if self.kv_bytes_in_use_end != 0:
            out.append(f"KV bytes in use at the end: {self.kv_bytes_in_use_end}")
        if self.sessions_active_end != 0 or self.jobs_active_end != 0:
            out.append(
                f"not idle at the end: {self.sessions_active_end} sessions, "
                f"{self.jobs_active_end} jobs"
            )
        if self.frames_wrong_replies or self.frames_typed_replies != self.frames_sent:
            out.append(
                f"malformed frames: {self.frames_sent} sent, {self.frames_typed_replies} typed "
                f"bad_request replies, {self.frames_wrong_replies} wrong"
            )
        if self.verify_mismatches:
            out.append(f"{self.verify_mismatches} greedy result(s) differ from decoding alone")
        if self.daemon_exit_code not in (0, None):
            out.append(f"the daemon exited with {self.daemon_exit_code} on SIGTERM")
        out.extend(self.client_errors)
        return out

    def rss_warning(self) -> str | None:
        """RSS climbs while retained jobs and allocator arenas fill; past the run's middle
        it should stay flat. More than +10 % over the second half is worth a look."""
        if len(self.rss_samples) < 4:
            return None
        mid = self.rss_samples[len(self.rss_samples) // 2][1]
        if self.rss_end > mid * 1.10:
            return (
                f"daemon RSS grew {mid / 2**20:.1f} -> {self.rss_end / 2**20:.1f} MiB over "
                "the second half of the run"
            )
        return None


_pack = msgspec.msgpack.encode


def malformed_frame(rng: random.Random, rid: int) -> tuple[list[bytes], int | None]:
    """A broken request and the id its error reply must echo (None: unreadable)."""
    item = {"prompt": "hi"}
    shapes: list[tuple[list[bytes], int | None]] = [
        ([rng.randbytes(rng.randint(0, 48))], None),
        ([b""], None),
        ([_pack([1, 2, 3])], None),
        ([_pack({"op": "nope", "id": rid})], rid),
        ([_pack({"op": "submit", "id": rid})], rid),
        ([_pack({"op": "submit", "id": rid, "items": []})], rid),
        ([_pack({"op": "submit", "id": rid, "items": [{**item, "evil": 1}]})], rid),
        ([_pack({"op": "submit", "id": rid, "items": [{"prompt_tokens": [-1]}]})], rid),
        ([_pack({"op": "submit", "id": rid, "items": [{**item, "top_p": 7}]})], rid),
        ([_pack({"op": "cancel", "id": rid, "job_id": 12})], rid),
        ([_pack({"op": "status", "id": "seven"})], None),
        ([_pack({"op": "status", "id": rid}), b"extra"], None),
        ([_pack({"op": "status", "id": rid})[:-1]], None),
    ]
    return rng.choice(shapes)


async def garbage(endpoint: str, rng: random.Random, report: SoakReport, interval: float) -> None:
    """Send malformed frames one at a time; each must get a typed bad_request reply."""
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    try:
        rid = 0
        while True:
            rid += 1
            frames, want = malformed_frame(rng, rid)
            await sock.send_multipart(frames)
            with anyio.move_on_after(30):
                reply = p.decode_reply(await sock.recv())
                report.frames_sent += 1
            if report.frames_sent < rid:  # no reply within 30 s
                report.frames_sent = rid
                report.frames_wrong_replies += 1
                continue
            if (
                isinstance(reply, p.ErrorReply)
                and reply.error.code == "bad_request"
                and reply.id == want
            ):
                report.frames_typed_replies += 1
            else:
                report.frames_wrong_replies += 1
            await anyio.sleep(interval)
    finally:
        sock.close(linger=0)
        ctx.term()


@dataclass
class _ClientProc:
    proc: subprocess.Popen[bytes]
    out: Path
    seed: int
    kill_after_jobs: int  # 0: never killed
    killed: bool = False

    def accepted_jobs(self) -> int:
        return self.out.read_bytes().count(b'"accepted"')

    def lines(self) -> list[dict[str, Any]]:
        out = []
        for line in self.out.read_text(errors="replace").splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a line cut by SIGKILL
        return out


def _config_tables(cfg: SoakConfig, bytes_per_token: int) -> dict[str, dict[str, object]]:
    return {
        # Every garbage frame must get its typed reply here; the budget that
        # stops answering a flood is bench.hostile's subject.
        "server": {"heartbeat_interval": 0.2, "client_timeout": 1.0, "bad_frame_burst": 1000000},
        "kv": {"min_bucket": 16, "memory_budget": cfg.budget_tokens * bytes_per_token},
        "scheduler": {
            "max_active_sessions": cfg.max_active,
            "prefill_chunk": 64,
            "on_growth_failure": "wait",
            "growth_retries": 4,
        },
        "jobs": {"retention": cfg.retention, "max_retained": 100000},
        "log": {"level": "warning"},
    }


class _Soak:
    """The controller: starts and kills clients, checks what they report, watches the daemon."""

    def __init__(
        self, cfg: SoakConfig, daemon: DaemonProcess, ctl: Client, vocab: int, python: str
    ) -> None:
        self.cfg = cfg
        self.daemon = daemon
        self.ctl = ctl
        self.vocab = vocab
        self.python = python
        self.report = SoakReport()
        self.rng = random.Random(cfg.seed)
        self.folder = Path(tempfile.mkdtemp(prefix="kvx-soak-"))
        self.clients: list[_ClientProc] = []
        self.t0 = time.monotonic()
        self.per_client = max(1, cfg.items // cfg.clients)
        self.next_seed = cfg.seed

    def start_client(self, items: int, time_left: float, victim: bool) -> None:
        seed, self.next_seed = self.next_seed, self.next_seed + 1
        out = self.folder / f"client-{seed}.jsonl"
        cmd = [
            *(self.python, "-m", "bench.soak", "--client", self.daemon.endpoint),
            *("--seed", str(seed), "--items", str(items), "--time-limit", str(time_left)),
            *("--lanes", str(self.cfg.lanes), "--vocab", str(self.vocab)),
            *("--verify-share", str(self.cfg.verify_share)),
        ]
        with out.open("wb") as f:
            proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT)
        kill_after = self.rng.randint(1, 5) if victim else 0
        self.clients.append(_ClientProc(proc, out, seed, kill_after))
        self.report.clients_started += 1

    async def run(self) -> None:
        cfg, report = self.cfg, self.report
        victims = set(self.rng.sample(range(cfg.clients), round(cfg.clients * cfg.kill_share)))
        for i in range(cfg.clients):
            self.start_client(self.per_client, cfg.time_limit, i in victims)
        async with anyio.create_task_group() as tg:
            rng = random.Random(cfg.seed)
            tg.start_soon(garbage, self.daemon.endpoint, rng, report, cfg.frame_interval)
            async with anyio.create_task_group() as checks:
                with anyio.fail_after(cfg.time_limit + 60):
                    await self.watch(checks)
            tg.cancel_scope.cancel()

    async def watch(self, checks: anyio.abc.TaskGroup) -> None:
        """Kill victims mid-stream, replace them, sample RSS, check the daemon stays up."""
        cfg, report = self.cfg, self.report
        next_sample = 0.0
        while True:
            now = time.monotonic()
            for c in list(self.clients):
                if (
                    c.kill_after_jobs
                    and not c.killed
                    and c.proc.poll() is None
                    and c.accepted_jobs() >= c.kill_after_jobs
                ):
                    os.kill(c.proc.pid, signal.SIGKILL)
                    c.killed = True
                    report.clients_killed += 1
                    checks.start_soon(self.check_killed, c)
                    time_left = cfg.time_limit - (now - self.t0)
                    if cfg.replace_killed and time_left > 5:
                        victim = self.rng.random() < cfg.kill_share
                        self.start_client(self.per_client // 2, time_left, victim)
            if not self.daemon.alive():
                report.daemon_restarts += 1
                raise RuntimeError(f"kvmuxd died:\n{self.daemon.stderr_tail()}")
            if now >= next_sample:
                rss = self.daemon.rss()
                report.rss_max = max(report.rss_max, rss)
                report.rss_samples.append((round(now - self.t0, 1), rss))
                next_sample = now + 1.0
            if all(c.proc.poll() is not None for c in self.clients):
                return
            await anyio.sleep(0.05)

    async def check_killed(self, c: _ClientProc) -> None:
        """Once the daemon has noticed the kill, every job the client had accepted must end
        with one result per item (cancelled unless detached)."""
        report = self.report
        c.proc.wait()
        await anyio.sleep(2 * 1.0)  # server.client_timeout, twice
        with anyio.fail_after(60):
            for line in c.lines():
                if "accepted" not in line:
                    continue
                report.killed_jobs += 1
                n, detach = int(line["items"]), bool(line["detach"])
                report.killed_items += n
                job = await self.ctl.attach(line["accepted"])
                results = await job.results()
                job.close()
                report.killed_items_unresolved += n - len({r.index for r in results})
                for r in results:
                    code = "ok" if r.error is None else r.error.code
                    report.killed_results[code] = report.killed_results.get(code, 0) + 1
                    gone = r.error is not None and r.error.details.get("reason") == "client_gone"
                    if detach and gone:
                        report.killed_detached_cancelled += 1

    async def settle(self) -> None:
        """Every client is done or dead: the daemon must come back to idle, holding no KV."""
        report = self.report
        with anyio.move_on_after(30):
            while True:
                st = await self.ctl.status()
                if st.jobs_active == 0 and st.sessions_queued == 0 and not st.sessions:
                    break
                await anyio.sleep(0.1)
        st = await self.ctl.status()
        if st.pid != self.daemon.pid or not self.daemon.alive():
            report.daemon_restarts += 1
        report.kv_bytes_in_use_end = st.kv_bytes_in_use
        report.kv_peak_bytes = st.kv_peak_bytes
        report.kv_budget_bytes = st.kv_budget_bytes or 0
        report.growths = st.growth.growths
        report.growth_failures = dict(st.growth.failures)
        report.parked_retries = st.growth.parked_retries
        report.preemptions = st.growth.preemptions
        report.sessions_active_end = st.sessions_active + st.sessions_parked
        report.jobs_active_end = st.jobs_active
        report.rss_end = self.daemon.rss()

    def collect(self) -> list[dict[str, Any]]:
        """Add up the surviving clients' tallies; return their results to verify."""
        report = self.report
        verify: list[dict[str, Any]] = []
        for c in self.clients:
            lines = c.lines()
            verify.extend(line["verify"] for line in lines if "verify" in line)
            if c.killed:
                continue
            summary = next((line["summary"] for line in lines if "summary" in line), None)
            if summary is None or c.proc.returncode != 0:
                tail = c.out.read_text(errors="replace")[-1500:]
                report.client_errors.append(
                    f"client {c.seed} exited {c.proc.returncode} without a summary: {tail}"
                )
                continue
            tally = ClientTally(**summary)
            report.items_submitted += tally.items_submitted
            report.items_completed += tally.items_ok
            for code, n in tally.items_failed.items():
                report.items_failed[code] = report.items_failed.get(code, 0) + n
            for code, n in tally.items_refused.items():
                report.items_refused[code] = report.items_refused.get(code, 0) + n
            report.results_lost += tally.lost
            report.results_duplicated += tally.duplicated
            report.bad_job_tallies += tally.bad_tally
        return verify


async def run_soak(cfg: SoakConfig, model: Path, *, python: str = sys.executable) -> SoakReport:
    """Run the soak against a fresh kvmuxd subprocess; the report says what held."""
    from bench.bench_daemon import kvmuxd
    from kvmux.daemon.engine import Engine, EngineOptions, SamplingParams

    engine = Engine(model, EngineOptions(intra_op_threads=1, min_bucket=256))
    tables = _config_tables(cfg, engine.kv_spec.bytes_per_token)
    async with (
        kvmuxd(model, threads=cfg.threads, tables=tables) as daemon,
        Client(daemon.endpoint, timeout=60.0, name="soak-controller") as ctl,
    ):
        soak = _Soak(cfg, daemon, ctl, engine.spec.vocab_size, python)
        report = soak.report
        try:
            report.rss_start = report.rss_max = daemon.rss()
            warm = [
                Item(prompt_tokens=[5 + i] * (20 * i + 1), max_new_tokens=200, ignore_eos=True)
                for i in range(8)
            ]
            await (await ctl.submit(warm)).results()
            report.rss_warm = daemon.rss()
            await soak.run()
            await soak.settle()
            verify = soak.collect()
        finally:
            for c in soak.clients:
                if c.proc.poll() is None:  # the run failed: leave no client behind
                    c.proc.kill()
                    c.proc.wait()
            shutil.rmtree(soak.folder, ignore_errors=True)
    report.daemon_exit_code = daemon.proc.returncode
    for v in verify:
        item = msgspec.convert(v["item"], Item)
        params = SamplingParams(
            max_new_tokens=item.max_new_tokens, temperature=0.0, ignore_eos=item.ignore_eos
        )
        got = engine.generate(list(item.prompt_tokens or []), params, max_context=item.max_context)
        report.verified += 1
        if got.token_ids != v["tokens"]:
            report.verify_mismatches += 1
    report.seconds = time.monotonic() - soak.t0
    return report


def _rss_trace(samples: list[tuple[float, int]], points: int = 6) -> str:
    if not samples:
        return "-"
    picks = sorted({round(i * (len(samples) - 1) / (points - 1)) for i in range(points)})
    return ", ".join(f"{samples[i][0]:g}: {samples[i][1] / 2**20:.1f}" for i in picks)


def print_report(r: SoakReport) -> None:
    mib = 2**20
    rows = [
        ("run time", f"{r.seconds:.1f} s"),
        ("client processes", f"{r.clients_started} started, {r.clients_killed} SIGKILLed"),
        ("items submitted in all", r.items_submitted + r.killed_items),
        ("items submitted (surviving clients)", r.items_submitted),
        ("items completed", r.items_completed),
        ("items failed, by code", json.dumps(r.items_failed, sort_keys=True)),
        ("jobs refused whole, items by code", json.dumps(r.items_refused, sort_keys=True)),
        ("results lost / duplicated", f"{r.results_lost} / {r.results_duplicated}"),
        ("killed clients' jobs / items", f"{r.killed_jobs} / {r.killed_items}"),
        ("  their results, by code", json.dumps(r.killed_results, sort_keys=True)),
        ("  items without a result", r.killed_items_unresolved),
        ("malformed frames sent / typed replies", f"{r.frames_sent} / {r.frames_typed_replies}"),
        ("greedy results verified / mismatched", f"{r.verified} / {r.verify_mismatches}"),
        ("growths / refused by cause", f"{r.growths} / {json.dumps(r.growth_failures)}"),
        ("parked retries / preemptions", f"{r.parked_retries} / {r.preemptions}"),
        ("KV peak / budget", f"{r.kv_peak_bytes / mib:.2f} / {r.kv_budget_bytes / mib:.2f} MiB"),
        ("daemon restarts", r.daemon_restarts),
        ("KV bytes in use at the end", r.kv_bytes_in_use_end),
        (
            "daemon RSS start / warm / end / max",
            f"{r.rss_start / mib:.1f} / {r.rss_warm / mib:.1f} / {r.rss_end / mib:.1f} / "
            f"{r.rss_max / mib:.1f} MiB",
        ),
        ("daemon RSS over time (s: MiB)", _rss_trace(r.rss_samples)),
        ("daemon exit on SIGTERM", r.daemon_exit_code),
    ]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--short", action="store_true", help="the test suite's few-second version")
    ap.add_argument("--items", type=int, help="items to submit in all (default 4000)")
    ap.add_argument("--time-limit", type=float, help="seconds of load (default 240)")
    ap.add_argument("--clients", type=int, help="client processes at a time (default 4)")
    ap.add_argument("--model", default="tiny", help="built-in model name or a model folder")
    ap.add_argument("--seed", type=int, default=None)
    # The client process's own flags (started by the controller).
    ap.add_argument("--client", metavar="ENDPOINT", help=argparse.SUPPRESS)
    ap.add_argument("--lanes", type=int, default=3, help=argparse.SUPPRESS)
    ap.add_argument("--vocab", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--verify-share", type=float, default=0.0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.client:
        args.items = args.items or 1000
        args.time_limit = args.time_limit or 60.0
        args.seed = args.seed or 0
        anyio.run(client_main, args)
        return 0

    from bench.common import builtin, write_json

    cfg = SoakConfig.short() if args.short else SoakConfig()
    for name in ("items", "time_limit", "clients", "seed"):
        if getattr(args, name) is not None:
            setattr(cfg, name, getattr(args, name))
    model = Path(args.model) if os.sep in args.model else builtin(args.model)
    print(
        f"soak: {cfg.items} items or {cfg.time_limit:g} s, {cfg.clients} client processes "
        f"x {cfg.lanes} jobs in flight, model {args.model}, KV budget {cfg.budget_tokens} "
        f"tokens, {cfg.max_active} sessions at a time"
    )
    report = anyio.run(run_soak, cfg, model)
    print_report(report)
    path = write_json(
        "soak-short" if args.short else "soak",
        {"config": asdict(cfg), "report": asdict(report), "problems": report.problems()},
    )
    print(f"written {path}")
    warning = report.rss_warning()
    if warning:
        print(f"warning: {warning}")
    problems = report.problems()
    for problem in problems:
        print(f"INVARIANT BROKEN: {problem}")
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
