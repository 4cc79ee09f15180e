"""Isolation (issue 12): a failure that hits one row leaves every other item's tokens as they were.

One job of 16 greedy items (prompts of 4-40 tokens; 15 short items that end
within bucket 64, most growing 16 -> 32 -> 64 mid-decode from ``kv.min_bucket``
16, and one long item that grows to 1024) runs through a real ``kvmuxd`` (a
subprocess, batching on as configured by default) undisturbed, then once per
fault, each on a freshly started daemon:

- *growth injected, fail*: ``KVMUX_FAILPOINTS=kv.copy_prefix=1`` and
  ``on_growth_failure = "fail"``: the first growth fails and its item with it.
  The ``kv.*`` failpoints take no key and count hits from the daemon's start,
  and a session's first allocation (0 -> its first bucket) is itself a
  growth through the same steps, so the growth that fails is the first
  session's first allocation, in the call that opens the whole batch; a
  mid-decode growth cannot be picked from outside the process.
- *growth injected, wait*: the same failure under the default ``"wait"``:
  the session is parked and retried, and every item finishes.
- *budget*: a ``kv.memory_budget`` of 1400 tokens' bytes: the short items
  (at most 15 x 64 tokens, plus one growth's transient 32) and the long one
  (<= 64 while they run: they end within 32 new tokens) fit together; the
  long item, alone by then, is refused its 512 -> 1024 growth (a transient
  peak of 1536 tokens), with ``"fail"``.
- *run injected*: ``engine.run@JOB/5`` fails every model run that holds item
  5's row (the first is the batched run of first prompts). Job ids are drawn
  by the daemon, so the job is reserved first: opened empty (``more``) on the
  undisturbed run's daemon, whose journal the faulted daemon restores it
  from, open; the items are added to it then. The batched run holding row 5
  is split (``engine.batching.run_isolated``) until row 5 fails alone. Armed
  through ``KVMUX_FAILPOINTS``, as an operator would.

Checked for each: exactly the expected item failed, with the expected code
and cause; every other item's token ids (the final result and the streamed
deltas) equal the undisturbed run's; the failed item's streamed tokens are a
prefix of its undisturbed ones; the daemon is still up and holds no KV bytes.
Wall time: each job from submit to its last event, against the undisturbed
job, each on a fresh daemon, interleaved. The daemon counts no runs where a
client could read them, so extra runs are not measured (``run_isolated``
costs about ``2 log2 n`` of them for one failing row among ``n``).

Exits non-zero if a check fails. Usage: python -m bench.bench_isolation [--quick]
(``--quick``: ``tiny`` only, one repeat; else ``tiny`` and ``small``, 3 repeats and
the undisturbed job once more after the last).
"""

from __future__ import annotations

import argparse
import functools
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import msgspec
import numpy as np

from bench.bench_daemon import greedy_items, kvmuxd
from bench.common import builtin, write_json
from kvmux.client import Client, Item, ItemResult, Job
from kvmux.client import protocol as p

N_ITEMS = 16
MIN_BUCKET = 16
LONG = 11  # the item that grows to 1024 (and is refused its last growth under the budget)
LONG_NEW = 600  # prompt 8 + 600 -> bucket 1024
RUN_TARGET = 5  # the item whose row the injected run failure names
BUDGET_TOKENS = 1400  # > the short items' peak with the long one (<= 1056), < 512 + 1024
THREADS = 1
FAILPOINTS = "KVMUX_FAILPOINTS"


def isolation_items(n: int = N_ITEMS) -> list[Item]:
    """Greedy items with mixed prompts; the short ones end within bucket 64, the long
    one (index ``LONG``) at 608 tokens. Token ids below 259: both built-ins' vocabularies."""
    prompts, new_tokens = [], []
    for i in range(n):
        if i == LONG:
            prompt_len, new = 8, LONG_NEW
        else:
            prompt_len = 4 + (7 * i) % 37  # 4..40
            new = max(16, 36 + (5 * i) % 29 - prompt_len)  # prompt + new <= 64
        rng = np.random.default_rng(1000 + i)
        prompts.append([int(t) for t in rng.integers(3, 259, size=prompt_len)])
        new_tokens.append(new)
    return [
        msgspec.structs.replace(item, max_new_tokens=new)
        for item, new in zip(greedy_items(prompts, 1), new_tokens, strict=True)
    ]


def base_tables(n: int) -> dict[str, dict[str, object]]:
    return {"kv": {"min_bucket": MIN_BUCKET}, "scheduler": {"max_active_sessions": n}}


@dataclass
class JobRun:
    """One job through one daemon: what the client saw, and the daemon afterwards."""

    wall: float
    streamed: dict[int, list[int]]
    results: dict[int, ItemResult]
    kv_bytes_after: int
    growth_failures: dict[str, int]
    parked_retries: int
    daemon_alive: bool
    startup_error: str = ""
    growths: int = 0  # the daemon's, first allocations included

    @classmethod
    def refused(cls, why: str) -> JobRun:
        """A daemon that would not start: no job ran."""
        return cls(0.0, {}, {}, 0, {}, 0, False, why)


async def run_job(client: Client, items: list[Item], job: Job | None = None) -> JobRun:
    """Submit ``items`` (or add them to the open ``job`` and close it); every event until
    the job finishes."""
    streamed: dict[int, list[int]] = {i: [] for i in range(len(items))}
    t0 = time.perf_counter()
    if job is None:
        job = await client.submit(items)
    else:
        await job.add(items, last=True)
    async for ev in job.events():
        if isinstance(ev, p.TokenDelta):
            streamed[ev.index].extend(ev.token_ids)
    wall = time.perf_counter() - t0
    results = {r.index: r for r in await job.results()}  # fetches any the stream dropped
    job.close()
    status = await client.status()
    return JobRun(
        wall,
        streamed,
        results,
        status.kv_bytes_in_use,
        dict(status.growth.failures),
        status.growth.parked_retries,
        True,
        growths=status.growth.growths,
    )


@dataclass(frozen=True)
class Expect:
    """The one item a scenario must fail (``index`` None: any one), and how."""

    code: str
    cause: str
    index: int | None = None
    details: Mapping[str, object] = field(default_factory=dict)


@dataclass(frozen=True)
class Scenario:
    name: str
    what: str
    tables: dict[str, dict[str, object]]
    env: dict[str, str] = field(default_factory=dict)
    expect: Expect | None = None  # None: every item succeeds
    growth_failures: dict[str, int] | None = None  # the daemon's counters afterwards
    run_failure: int | None = None  # engine.run@JOB/<this index>


def scenarios(n: int, bytes_per_token: int) -> list[Scenario]:
    fail = {"on_growth_failure": "fail"}
    run_failed = Expect(
        "run_failed", "injected", index=RUN_TARGET, details={"session_unchanged": True}
    )
    tables = base_tables(n)
    return [
        Scenario(
            "growth-fail",
            "kv.copy_prefix=1, on_growth_failure=fail",
            {**tables, "scheduler": {**tables["scheduler"], **fail}},
            env={FAILPOINTS: "kv.copy_prefix=1"},
            expect=Expect(
                "kv_growth_failed",
                "injected",
                details={"failed_step": "copy_prefix", "session_unchanged": True},
            ),
            growth_failures={"injected": 1},
        ),
        Scenario(
            "growth-wait",
            "kv.copy_prefix=1, on_growth_failure=wait (default)",
            tables,
            env={FAILPOINTS: "kv.copy_prefix=1"},
            growth_failures={"injected": 1},
        ),
        Scenario(
            "budget",
            f"kv.memory_budget={BUDGET_TOKENS} tokens, on_growth_failure=fail",
            {
                "kv": {"min_bucket": MIN_BUCKET, "memory_budget": BUDGET_TOKENS * bytes_per_token},
                "scheduler": {**tables["scheduler"], **fail},
            },
            expect=Expect(
                "kv_growth_failed",
                "budget",
                index=LONG,
                details={"old_capacity": 512, "new_capacity": 1024, "session_unchanged": True},
            ),
            growth_failures={"budget": 1},
        ),
        Scenario(
            "run-fail",
            f"KVMUX_FAILPOINTS=engine.run@JOB/{RUN_TARGET}",
            tables,
            expect=run_failed,
            growth_failures={},
            run_failure=RUN_TARGET,
        ),
    ]


async def run_scenario(
    model: Path, sc: Scenario, items: list[Item], journal: Path, job_id: str | None
) -> JobRun:
    """``sc``'s job on a fresh daemon started with its config and failpoints; a run
    failure's daemon restores the reserved open job ``job_id`` from ``journal``."""
    tables = {k: dict(v) for k, v in sc.tables.items()}
    env = dict(sc.env)
    if sc.run_failure is not None:
        assert job_id is not None
        tables.setdefault("jobs", {})["journal"] = str(journal)
        env[FAILPOINTS] = f"engine.run@{job_id}/{sc.run_failure}"
    try:
        async with (
            kvmuxd(model, threads=THREADS, tables=tables, env=env) as daemon,
            Client(daemon.endpoint, timeout=120.0) as client,
        ):
            job = None if sc.run_failure is None else await client.attach(job_id or "")
            run = await run_job(client, items, job)
            run.daemon_alive = daemon.alive()
    except RuntimeError as exc:
        if "at startup" not in str(exc):
            raise
        # The daemon's last words, not the whole traceback.
        return JobRun.refused(str(exc).strip().splitlines()[-1])
    return run


async def run_baseline(
    model: Path, items: list[Item], journal: Path | None = None, reserve: int = 0
) -> tuple[JobRun, int, list[str]]:
    """The undisturbed job on a fresh daemon; the model's KV bytes per token; and the ids
    of ``reserve`` empty open jobs left in ``journal``.

    Job ids are drawn by the daemon, so a run failure keyed to one item's session
    (``JOB/INDEX``) needs its job beforehand: a job journaled open comes back open on
    the next daemon on that journal, which takes the items then."""
    tables: dict[str, dict[str, object]] = base_tables(len(items))
    if journal is not None:
        # A short grace: a stop waits out all of it for open jobs, even empty ones.
        tables |= {"jobs": {"journal": str(journal)}, "shutdown": {"grace": 0.5}}
    async with (
        kvmuxd(model, threads=THREADS, tables=tables) as daemon,
        Client(daemon.endpoint, timeout=120.0) as client,
    ):
        bpt = (await client.status()).kv_bytes_per_token
        run = await run_job(client, items)
        run.daemon_alive = daemon.alive()
        reserved = [(await client.submit([], more=True, detach=True)) for _ in range(reserve)]
        for job in reserved:
            job.close()
    return run, bpt, [job.job_id for job in reserved]


def check(sc: Scenario, run: JobRun, want: dict[int, list[int]]) -> dict[str, Any]:
    """What ``sc``'s run did against the undisturbed tokens ``want``; ``problems`` lists
    every broken invariant."""
    row: dict[str, Any] = {"scenario": sc.name, "what": sc.what, "items": len(want)}
    if run.startup_error:
        problem = f"the daemon did not start: {run.startup_error}"
        return {**row, "failed": [], "others_identical": None, "problems": [problem], "ok": False}
    problems: list[str] = []
    failed = {i: r for i, r in run.results.items() if r.status != "ok"}
    if len(run.results) != len(want):
        problems.append(f"{len(run.results)} results for {len(want)} items")
    exp = sc.expect
    if exp is None:
        if failed:
            problems.append(f"items failed: {sorted(failed)}")
    elif len(failed) != 1:
        problems.append(f"{len(failed)} items failed ({sorted(failed)}), expected exactly one")
    else:
        ((index, r),) = failed.items()
        err = r.error
        assert err is not None
        if exp.index is not None and index != exp.index:
            problems.append(f"item {index} failed, expected item {exp.index}")
        if err.code != exp.code or err.details.get("cause") != exp.cause:
            problems.append(
                f"item {index} failed with {err.code}/{err.details.get('cause')}, "
                f"expected {exp.code}/{exp.cause}: {err.message}"
            )
        for key, value in exp.details.items():
            if err.details.get(key) != value:
                problems.append(f"item {index}: {key}={err.details.get(key)!r}, expected {value!r}")
    # Every item that did not fail: byte-identical; the failed one: a prefix of its own.
    differ = []
    for i, tokens in want.items():
        got_stream = run.streamed.get(i, [])
        result = run.results.get(i)
        if i in failed:
            if got_stream != tokens[: len(got_stream)]:
                differ.append(i)
                problems.append(f"failed item {i}: streamed tokens are not a prefix of its own")
        elif result is None or result.token_ids != tokens or got_stream != tokens:
            differ.append(i)
            problems.append(f"item {i}: tokens differ from the undisturbed run")
    if sc.growth_failures is not None and run.growth_failures != sc.growth_failures:
        problems.append(f"growth failures {run.growth_failures}, expected {sc.growth_failures}")
    if not run.daemon_alive:
        problems.append("the daemon died")
    if run.kv_bytes_after != 0:
        problems.append(f"{run.kv_bytes_after} KV bytes held after the job")
    failed_desc = [
        {
            "index": i,
            "code": r.error.code if r.error else None,
            "cause": r.error.details.get("cause") if r.error else None,
            "details": {
                k: r.error.details.get(k)
                for k in ("old_capacity", "new_capacity", "valid_len", "failed_step")
                if r.error and k in r.error.details
            },
            "streamed_tokens": len(run.streamed.get(i, [])),
        }
        for i, r in sorted(failed.items())
    ]
    return {
        **row,
        "failed": failed_desc,
        "others_identical": not differ,
        "differing_items": differ,
        "growth_failures": run.growth_failures,
        "parked_retries": run.parked_retries,
        "problems": problems,
        "ok": not problems,
    }


async def run_isolation(model: Path, name: str, *, repeats: int = 1) -> dict[str, Any]:
    """Every scenario on ``model`` against the undisturbed job, interleaved ``repeats``
    times, each job on a fresh daemon. ``ok`` is False if any invariant broke."""
    items = isolation_items()
    baselines: list[JobRun] = []
    walls: dict[str, list[float]] = {}
    checks: dict[str, list[dict[str, Any]]] = {}
    base_problems: list[str] = []
    scs: list[Scenario] = []
    want: dict[int, list[int]] = {}

    def undisturbed(rep: int, base: JobRun) -> None:
        bad = sorted(i for i, r in base.results.items() if r.status != "ok")
        if bad:
            base_problems.append(f"undisturbed run {rep}: items {bad} failed")
        tokens = {i: r.token_ids for i, r in sorted(base.results.items())}
        if not want:
            want.update(tokens)
        elif tokens != want:
            base_problems.append(f"undisturbed run {rep} decoded other tokens than run 0")
        baselines.append(base)

    keyed = sum(sc.run_failure is not None for sc in scenarios(len(items), 0))
    for rep in range(repeats):
        scratch = Path(tempfile.mkdtemp(prefix="kvxi-", dir="/tmp"))
        try:
            journal = scratch / "jobs.sqlite3"
            base, bpt, reserved = await run_baseline(model, items, journal, reserve=keyed)
            undisturbed(rep, base)
            scs = scenarios(len(items), bpt)
            for sc in scs:
                job_id = reserved.pop(0) if sc.run_failure is not None else None
                run = await run_scenario(model, sc, items, journal, job_id)
                if not run.startup_error:
                    walls.setdefault(sc.name, []).append(run.wall)
                checks.setdefault(sc.name, []).append(check(sc, run, want))
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    if repeats > 1:
        # Once more after the last scenario, so the walls are bracketed (not in
        # --quick, which the test suite runs: a daemon start is ~2 s here).
        undisturbed(repeats, (await run_baseline(model, items))[0])
    base_wall = statistics.median(b.wall for b in baselines)
    rows = []
    for sc in scs:
        first = checks[sc.name][0]
        # Each distinct problem once, however many repeats hit it.
        problems = list(dict.fromkeys(pr for c in checks[sc.name] for pr in c["problems"]))
        wall = statistics.median(walls[sc.name]) if sc.name in walls else None
        rows.append(
            {
                **first,
                "problems": problems,
                "ok": not problems,
                "repeats_ok": sum(c["ok"] for c in checks[sc.name]),
                "wall_s": walls.get(sc.name, []),
                "wall_vs_baseline": None if wall is None else wall / base_wall,
            }
        )
    return {
        "model": name,
        "items": len(items),
        "min_bucket": MIN_BUCKET,
        "repeats": repeats,
        "baseline_wall_s": [b.wall for b in baselines],
        "baseline_growths": [b.growths for b in baselines],
        "baseline_problems": base_problems,
        "scenarios": rows,
        "ok": not base_problems and all(r["ok"] for r in rows),
    }


IDENTICAL = {True: "yes", False: "NO", None: "- (no run)"}


def describe_failed(failed: list[dict[str, Any]]) -> str:
    if not failed:
        return "none"
    parts = []
    for f in failed:
        d = f["details"]
        growth = f" {d['old_capacity']}->{d['new_capacity']}" if "old_capacity" in d else ""
        parts.append(
            f"#{f['index']} {f['code']}/{f['cause']}{growth} after {f['streamed_tokens']} tok"
        )
    return ", ".join(parts)


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def print_table(report: dict[str, Any], out: Callable[[str], None] = print) -> None:
    out(
        f"model {report['model']}: {report['items']} items, min_bucket {report['min_bucket']}, "
        f"{report['repeats']} repeat(s); undisturbed job "
        f"{statistics.median(report['baseline_wall_s']):.2f} s (median), "
        f"{report['baseline_growths'][0]} growths (16 first allocations included)"
    )
    out(
        f"{'scenario':<12} {'items':>5}  {'failed (item code/cause)':<52} "
        f"{'others identical':<16} {'wall s':>6} {'vs base':>7}  ok runs"
    )
    for r in report["scenarios"]:
        out(
            f"{r['scenario']:<12} {r['items']:>5}  {describe_failed(r['failed']):<52} "
            f"{IDENTICAL[r['others_identical']]:<16} "
            f"{_num(statistics.median(r['wall_s']) if r['wall_s'] else None):>6} "
            f"{_num(r['wall_vs_baseline']):>7}  "
            f"{r['repeats_ok']}/{report['repeats']}"
        )
    for problem in report["baseline_problems"] + [
        f"{r['scenario']}: {pr}" for r in report["scenarios"] for pr in r["problems"]
    ]:
        out(f"  PROBLEM {problem}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="tiny only, one repeat")
    ap.add_argument("--out", default="isolation", help="JSON name under bench/results/")
    args = ap.parse_args(argv)
    models = ["tiny"] if args.quick else ["tiny", "small"]
    repeats = 1 if args.quick else 3
    reports = []
    for name in models:
        report = anyio.run(functools.partial(run_isolation, builtin(name), name, repeats=repeats))
        print_table(report)
        reports.append(report)
    ok = all(r["ok"] for r in reports)
    path = write_json(args.out, {"quick": args.quick, "models": reports, "ok": ok})
    broken = [
        f"{r['model']}/{sc['scenario']}" for r in reports for sc in r["scenarios"] if not sc["ok"]
    ]
    print(f"isolation: {'every check held' if ok else 'BROKEN in ' + ', '.join(broken)}")
    print(f"written {path}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
