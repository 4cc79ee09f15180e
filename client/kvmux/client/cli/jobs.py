"""The batch-job commands: ``submit`` a JSONL file, collect ``results`` again, ``cancel``."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import time
from collections.abc import Awaitable, Callable
from functools import partial
from pathlib import Path
from typing import TypeVar

import msgspec
from rich.console import Console
from rich.table import Table
from rich.text import Text

from .. import protocol as p
from .._client import Client, Job
from ..errors import DaemonUnreachable, KvmuxError, NotFound, NotReady
from .batch import Batch, BatchReader, LineError
from .connect import COULD_NOT_RUN, INTERRUPTED, ITEMS_FAILED, OK, CliError, open_client
from .progress import Reporter, failure_label, make_reporter
from .results import Outputs, ResultSink, done_ids, open_outputs, resolve_format

T = TypeVar("T")

# How long an interrupted command spends telling the daemon what to do with its job.
_GOODBYE_SECONDS = 2.0


def load_batch(path: str, skip: set[str]) -> tuple[Batch, int]:
    """Parse a batch file (``-`` = stdin), leaving out the custom_ids in ``skip``;
    an unreadable file ends the command. Returns the batch and the lines skipped."""
    try:
        stream = sys.stdin.buffer if path == "-" else Path(path).open("rb")  # noqa: SIM115
    except OSError as exc:
        raise CliError(f"cannot read {path}: {exc.strerror or exc}") from None
    reader = BatchReader(stream, skip)
    with stream:
        batch = Batch(openai=None)
        for entry in reader:
            if isinstance(entry, LineError):
                batch.errors.append(entry)
            else:
                batch.items.append(entry)
    batch.openai = reader.openai
    if batch.total == 0 and not reader.skipped:
        raise CliError(f"{path} holds no items (every line is blank)")
    return batch, reader.skipped


async def submit(args: argparse.Namespace) -> int:
    """``kvmux submit FILE``: run a batch, writing results as they finish."""
    skip = done_ids(args.out) if args.resume and args.out else set()
    batch, skipped = load_batch(args.file, skip)
    fmt = resolve_format(args.format, batch.openai)
    with make_reporter(quiet=args.quiet) as reporter:
        if skipped:
            reporter.note(f"--resume: {skipped} line(s) of {args.file} already have results")
        if batch.total == 0:
            reporter.note(f"every line of {args.file} has a result in {args.out}: nothing to run")
            return OK
        conn = _Connection(await open_client(args.endpoint, args.timeout), args)
        stdout = None if args.out is not None or args.detach else reporter.stdout_writer()
        outputs = open_outputs(fmt, args.out, args.errors, stdout, resume=args.resume)
        outputs.sink.model = conn.client.welcome.model if conn.client.welcome else ""
        try:
            for err in batch.errors:
                reporter.note(failure_label(err.custom_id, err.to_info(), line=err.line))
            if not batch.items:
                reporter.note(f"no line of {args.file} is a valid item: nothing submitted")
                _refused(outputs.sink, batch.errors, detached=args.detach)
                outputs.finish()
                return COULD_NOT_RUN
            job = await conn.when_ready(
                lambda: conn.client.submit(
                    batch.items, detach=args.detach, name=Path(args.file).name
                )
            )
            if args.detach:
                print(job.job_id, flush=True)
                reporter.note(
                    f"job {job.job_id} runs detached ({len(batch.items)} items); collect it with "
                    f"`kvmux results {job.job_id}`"
                )
                return ITEMS_FAILED if batch.errors else OK
            # Written once the job is accepted: a refused job leaves --out as it was.
            _refused(outputs.sink, batch.errors, detached=False)
            reporter.start(job.job_id, batch.total)
            for _ in batch.errors:
                reporter.item(ok=False)
            try:
                await conn.follow(job, reporter, outputs.sink)
            except asyncio.CancelledError:
                _uncancel()
                with contextlib.suppress(KvmuxError, TimeoutError):
                    await asyncio.wait_for(conn.client.cancel(job.job_id), _GOODBYE_SECONDS)
                return _interrupted(reporter, f"job {job.job_id} cancelled")
            outputs.finish()
        finally:
            outputs.close()
            await conn.client.close()
        return _finish(reporter, args.out)


async def results(args: argparse.Namespace) -> int:
    """``kvmux results JOB_ID``: re-attach to a job and write all of its results."""
    with make_reporter(quiet=args.quiet) as reporter:
        conn = _Connection(await open_client(args.endpoint, args.timeout), args)
        outputs: Outputs | None = None
        try:
            job = await conn.when_ready(lambda: conn.client.attach(args.job_id))
            await job.fetch_results()  # what finished before the attach
            fmt = resolve_format(args.format, job.format == "openai")
            stdout = None if args.out is not None else reporter.stdout_writer()
            outputs = open_outputs(fmt, args.out, args.errors, stdout)
            outputs.sink.model = conn.client.welcome.model if conn.client.welcome else ""
            reporter.start(job.job_id, job.total)
            try:
                await conn.follow(job, reporter, outputs.sink)
            except asyncio.CancelledError:
                _uncancel()
                # Attaching made this client the job's owner; detach so that
                # leaving does not cancel a job someone else submitted.
                with contextlib.suppress(KvmuxError, TimeoutError):
                    await asyncio.wait_for(conn.client.detach(job.job_id), _GOODBYE_SECONDS)
                return _interrupted(
                    reporter, f"job {job.job_id} keeps running; `kvmux results {job.job_id}` again"
                )
            outputs.finish()
        finally:
            if outputs is not None:
                outputs.close()
            await conn.client.close()
        return _finish(reporter, args.out)


class _Connection:
    """The client a command uses, replaced when the daemon restarts under it."""

    def __init__(self, client: Client, args: argparse.Namespace) -> None:
        self.client = client
        self.args = args

    async def when_ready(self, call: Callable[[], Awaitable[T]]) -> T:
        """``call()``, retried while the daemon is still loading (up to --wait-daemon s)."""
        deadline = time.monotonic() + self.args.wait_daemon
        while True:
            try:
                return await call()
            except NotReady:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.2)

    async def follow(self, job: Job, reporter: Reporter, sink: ResultSink) -> None:
        """Collect every result of ``job``; if kvmuxd goes away (a restart, an upgrade, a
        crash), wait up to --wait-daemon seconds for it, re-attach and go on."""
        seen: set[int] = set()
        wait = self.args.wait_daemon
        while True:
            try:
                await _collect(job, reporter, sink, seen)
                return
            except (DaemonUnreachable, NotReady) as exc:
                if wait <= 0:
                    reporter.stop()
                    raise CliError(
                        f"{exc} Job {job.job_id}: {len(seen)} of {job.total} results written "
                        "before this."
                    ) from exc
                why = exc.details.get("reason", exc)
                reporter.note(
                    f"kvmuxd went away ({why}); waiting up to {wait:g} s for it to come back, "
                    f"then re-attaching to job {job.job_id}"
                )
            with contextlib.suppress(KvmuxError, TimeoutError):
                await self.client.close()
            try:
                self.client = await open_client(self.args.endpoint, self.args.timeout, wait=wait)
                job = await self.when_ready(partial(self.client.attach, job.job_id))
            except (DaemonUnreachable, NotReady):
                raise CliError(
                    f"kvmuxd did not come back within {wait:g} s (--wait-daemon). Job "
                    f"{job.job_id}: {len(seen)} of {job.total} results written; collect the rest "
                    f"with `kvmux results {job.job_id}` once it is back."
                ) from None
            except NotFound:
                raise CliError(
                    f"kvmuxd came back without job {job.job_id} (it keeps no journal: "
                    f'jobs.journal = ""); {len(seen)} of {job.total} results were written.'
                ) from None
            await job.fetch_results()
            reporter.note(f"re-attached to job {job.job_id}")


async def list_jobs(args: argparse.Namespace) -> int:
    """``kvmux jobs``: the caller's jobs, a table on a terminal or JSON lines."""
    client = await open_client(args.endpoint, args.timeout)
    try:
        infos = await client.jobs()
    finally:
        await client.close()
    if args.json:
        for info in infos:
            sys.stdout.write(msgspec.json.encode(info).decode() + "\n")
        return OK
    table = Table(title=f"{len(infos)} job(s)", title_justify="left")
    for column in ("job", "name", "state", "done", "failed", "total", "age", "detached"):
        table.add_column(column)
    for info in infos:
        table.add_row(
            info.job_id,
            Text(info.name),
            info.state,
            str(info.ok + info.failed),
            str(info.failed),
            str(info.total),
            _age(info.age_seconds),
            "yes" if info.detached else "no",
        )
    Console().print(table)
    return OK


def _age(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f}{unit}"
    return f"{seconds:.0f}s"


async def cancel(args: argparse.Namespace) -> int:
    """``kvmux cancel JOB_ID``: its queued and running items end as ``cancelled``."""
    client = await open_client(args.endpoint, args.timeout)
    try:
        await client.cancel(args.job_id)
    finally:
        await client.close()
    print(f"kvmux: cancelled job {args.job_id}", file=sys.stderr)
    return OK


async def _collect(
    job: Job,
    reporter: Reporter,
    sink: ResultSink,
    seen: set[int],
) -> None:
    """Write every result of ``job`` not in ``seen`` once, as it finishes, and feed the
    progress display."""

    def record(result: p.ItemResult) -> None:
        if result.index in seen:
            return
        seen.add(result.index)
        sink.result(result)
        label = None
        if result.error is not None:
            label = failure_label(
                result.custom_id, result.error, line=result.line, index=result.index
            )
        reporter.item(result.status == "ok", label)

    # Results that finished before an attach (fetched after it) or were already routed.
    for index in sorted(job.results_by_index):
        record(job.results_by_index[index])
    try:
        async for event in job.events():
            match event:
                case p.TokenDelta(token_ids=ids):
                    reporter.tokens(len(ids))
                case p.ItemFinished(result=result):
                    record(result)
        if len(seen) < job.total:
            # The stream dropped an event: the results call re-attaches for the rest.
            for result in await job.results():
                record(result)
    except (DaemonUnreachable, NotReady):
        raise  # the caller waits for the daemon to come back
    except KvmuxError as exc:
        reporter.stop()
        raise CliError(
            f"{exc} Job {job.job_id}: {len(seen)} of {job.total} results written before this."
        ) from exc


def _refused(sink: ResultSink, errors: list[LineError], *, detached: bool) -> None:
    if not detached:
        for err in errors:
            sink.refused(err)


def _finish(reporter: Reporter, out: str | None) -> int:
    reporter.stop()
    where = f"; results in {out}" if out else ""
    reporter.note(f"job {reporter.job_id}: {reporter.tally.summary()}{where}")
    return ITEMS_FAILED if reporter.tally.failed else OK


def _interrupted(reporter: Reporter, what: str) -> int:
    reporter.stop()
    tally = reporter.tally
    reporter.note(f"interrupted: {what}; {tally.done} of {tally.total} results written")
    return INTERRUPTED


def _uncancel() -> None:
    # asyncio.run turns Ctrl-C into a cancellation of the main task; taking it
    # back lets the command say goodbye to the daemon and exit with 130.
    task = asyncio.current_task()
    if task is not None:
        task.uncancel()
