"""The batch-job commands: ``submit`` a JSONL file, collect ``results`` again, ``cancel``."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from functools import partial
from pathlib import Path
from typing import TypeVar

import msgspec
from rich.console import Console
from rich.table import Table
from rich.text import Text

from .. import protocol as p
from .._client import Chunk, Client, Feeder, Job
from ..errors import BadRequest, DaemonUnreachable, KvmuxError, NotFound, NotReady, ShuttingDown
from .batch import BatchReader, LineError
from .connect import COULD_NOT_RUN, INTERRUPTED, ITEMS_FAILED, OK, CliError, open_client
from .interrupt import GOODBYE_SECONDS, goodbye, goodbye_left
from .progress import Reporter, failure_label, make_reporter
from .results import ResultSink, done_ids, open_outputs, resolve_format

T = TypeVar("T")


def read_entries(
    path: str, reader: Callable[[Iterator[bytes]], BatchReader]
) -> Iterator[p.Item | LineError]:
    """The lines of a batch file (``-`` = stdin) as items or refusals, in file order, read
    lazily: a file of any size is never in memory at once. Each item carries its line."""
    try:
        stream = sys.stdin.buffer if path == "-" else Path(path).open("rb")  # noqa: SIM115
    except OSError as exc:
        raise CliError(f"cannot read {path}: {exc.strerror or exc}") from None
    try:
        yield from reader(iter(stream))
    except OSError as exc:
        raise CliError(f"cannot read {path}: {exc.strerror or exc}") from None
    finally:
        if stream is not sys.stdin.buffer:
            stream.close()


def _first_item(
    path: str, reader: Callable[[Iterator[bytes]], BatchReader]
) -> tuple[list[p.Item | LineError], Iterator[p.Item | LineError]]:
    """Read up to the first item: what came before it (refusals) and it, and the rest."""
    entries = read_entries(path, reader)
    head: list[p.Item | LineError] = []
    for entry in entries:
        head.append(entry)
        if isinstance(entry, p.Item):
            break
    return head, entries


async def submit(args: argparse.Namespace) -> int:
    """``kvmux submit FILE``: stream a batch into one job, writing results as they finish."""
    if args.resume and args.out is None:
        raise CliError("--resume continues the results in --out FILE: give --out")
    skip = done_ids(args.out) if args.resume else set()
    readers: list[BatchReader] = []

    def reader(lines: Iterator[bytes]) -> BatchReader:
        readers.append(BatchReader(lines, skip))
        return readers[-1]

    head, rest = _first_item(args.file, reader)
    skipped = readers[0].skipped if readers else 0
    if not head and not skipped:
        raise CliError(f"{args.file} holds no items (every line is blank)")
    # The first line that decodes decided the shape, so the output's is known now.
    fmt = resolve_format(args.format, readers[0].openai if readers else None)
    with contextlib.ExitStack() as stack, make_reporter(quiet=args.quiet) as reporter:
        if not head:
            reporter.note(f"every line of {args.file} has a result in {args.out}: nothing to run")
            return OK
        stdout = None if args.out is not None or args.detach else reporter.stdout_writer()
        outputs = open_outputs(fmt, args.out, args.errors, stdout, resume=args.resume)
        stack.callback(outputs.close)
        if not isinstance(head[-1], p.Item):
            # Nothing to run: say why for each line, and submit no job.
            for err in head:
                assert isinstance(err, LineError)
                if not args.detach:
                    outputs.sink.refused(err)
                reporter.note(failure_label(err.custom_id, err.to_info(), line=err.line))
            outputs.finish()
            reporter.note(f"no line of {args.file} is a valid item: nothing submitted")
            return COULD_NOT_RUN
        conn = _Connection(await open_client(args.endpoint, args.timeout), args)
        outputs.sink.model = _model(conn.client)
        name = "stdin" if args.file == "-" else Path(args.file).name
        try:
            # Detached only once every line is in: an interrupted upload is cancelled.
            job = await conn.when_ready(
                lambda: conn.client.submit(
                    [], more=True, name=name, keep_results=False, format=fmt, stream=reporter.live
                )
            )
            feed = _Feed(Feeder(itertools.chain(head, rest), conn.client), reporter)
            reporter.start(job.job_id, 0)
            try:
                if args.detach:
                    job.close()  # its events are not wanted here
                    job = await conn.follow(job, reporter, None, feed)
                    await conn.client.detach(job.job_id)
                    print(job.job_id, flush=True)
                    reporter.stop()
                    reporter.note(
                        f"job {job.job_id} runs detached ({job.total} items); collect it with "
                        f"`kvmux results {job.job_id}`"
                    )
                    return ITEMS_FAILED if feed.refused else OK
                await conn.follow(job, reporter, outputs.sink, feed)
                outputs.finish()
                if readers[0].skipped:
                    reporter.note(f"--resume: {readers[0].skipped} line(s) had results already")
            except asyncio.CancelledError:
                _uncancel()
                if await goodbye(conn.client, conn.client.cancel(job.job_id)):
                    return _interrupted(reporter, f"job {job.job_id} cancelled")
                return _interrupted(
                    reporter,
                    f"job {job.job_id}: kvmuxd did not confirm its cancel within "
                    f"{GOODBYE_SECONDS:g} s; it cancels the job once it finds this client gone "
                    "(server.client_timeout)",
                )
        finally:
            await conn.client.close(goodbye=goodbye_left())
        return _finish(reporter, args.out)


class _Feed:
    """The lines of a file going into an open job, and what the display learns of them."""

    def __init__(self, feeder: Feeder, reporter: Reporter) -> None:
        self.feeder = feeder
        self.reporter = reporter
        self.refused = 0

    def added(self, chunk: Chunk, total: int) -> None:
        self.refused += len(chunk.rejected)
        self.reporter.grow(total)

    async def run(self, job: Job) -> None:
        await self.feeder.run(job, on_wait=self.reporter.waiting, on_added=self.added)


async def results(args: argparse.Namespace) -> int:
    """``kvmux results JOB_ID``: re-attach to a job and write all of its results."""
    with contextlib.ExitStack() as stack, make_reporter(quiet=args.quiet) as reporter:
        conn = _Connection(await open_client(args.endpoint, args.timeout), args)
        job_id = args.job_id
        try:
            try:
                job = await conn.when_ready(
                    lambda: conn.client.attach(job_id, keep_results=False, stream=reporter.live)
                )
                fmt = resolve_format(args.format, job.format == "openai")
                stdout = None if args.out is not None else reporter.stdout_writer()
                outputs = open_outputs(fmt, args.out, args.errors, stdout)
                stack.callback(outputs.close)
                outputs.sink.model = _model(conn.client)
                reporter.start(job.job_id, job.total)
                await conn.follow(job, reporter, outputs.sink, None)
                outputs.finish()
            except asyncio.CancelledError:
                _uncancel()
                # Attaching (perhaps just now, its answer still on the way) made this
                # client the job's owner; detach so that leaving does not cancel a job
                # someone else submitted.
                if await goodbye(conn.client, conn.client.detach(job_id)):
                    kept = f"job {job_id} keeps running; `kvmux results {job_id}` again"
                else:
                    kept = (
                        f"job {job_id}: kvmuxd did not confirm the detach within "
                        f"{GOODBYE_SECONDS:g} s (`kvmux jobs` shows whether it still runs)"
                    )
                return _interrupted(reporter, kept)
        finally:
            await conn.client.close(goodbye=goodbye_left())
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

    async def follow(
        self, job: Job, reporter: Reporter, writer: ResultSink | None, feed: _Feed | None
    ) -> Job:
        """Send ``feed``'s lines into ``job`` (if any) while collecting every result (if
        ``writer``); if kvmuxd goes away (a restart, an upgrade, a crash), wait up to
        --wait-daemon seconds for it, re-attach and go on from where it is. Returns the
        job's handle (a new one after a re-attach)."""
        seen = bytearray()  # one byte per item index: written already
        wait = self.args.wait_daemon
        while True:
            try:
                await _run(job, reporter, writer, feed, seen)
                return job
            except (DaemonUnreachable, NotReady, ShuttingDown) as exc:
                if wait <= 0:
                    reporter.stop()
                    raise CliError(f"{exc} {_so_far(job, seen)}") from exc
                why = exc.details.get("reason", exc)
                reporter.note(
                    f"kvmuxd went away ({why}); waiting up to {wait:g} s for it to come back, "
                    f"then re-attaching to job {job.job_id}"
                )
                if isinstance(exc, ShuttingDown):
                    await asyncio.sleep(0.5)  # it is still up while it drains: do not spin
            with contextlib.suppress(KvmuxError, TimeoutError):
                await self.client.close()
            try:
                self.client = await open_client(self.args.endpoint, self.args.timeout, wait=wait)
                job = await self.when_ready(
                    partial(self.client.attach, job.job_id, keep_results=False)
                )
            except (DaemonUnreachable, NotReady):
                raise CliError(
                    f"kvmuxd did not come back within {wait:g} s (--wait-daemon). "
                    f"{_so_far(job, seen)} Collect the rest with `kvmux results {job.job_id}` "
                    "once it is back."
                ) from None
            except NotFound:
                raise CliError(
                    f"kvmuxd came back without job {job.job_id} (it keeps no journal: "
                    f'jobs.journal = ""). {_so_far(job, seen)}'
                ) from None
            if writer is None:
                job.close()
            if feed is not None:
                try:
                    feed.feeder.resume(job.total)
                except BadRequest as exc:
                    raise CliError(f"{exc} Job {job.job_id}.") from None
            reporter.note(f"re-attached to job {job.job_id}")


def _so_far(job: Job, seen: bytearray) -> str:
    return f"Job {job.job_id}: {sum(seen)} of {job.total} results written before this."


async def _run(
    job: Job,
    reporter: Reporter,
    writer: ResultSink | None,
    feed: _Feed | None,
    seen: bytearray,
) -> None:
    """Feed and collect at once; the first to fail ends the other."""
    tasks = []
    if feed is not None and not feed.feeder.closed:
        tasks.append(asyncio.create_task(feed.run(job)))
    if writer is not None:
        tasks.append(asyncio.create_task(_collect(job, reporter, writer, seen)))
    pending = set(tasks)
    try:
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_EXCEPTION)
            for task in done:
                exc = task.exception()
                if exc is not None:
                    raise exc
    except (DaemonUnreachable, NotReady, ShuttingDown):
        raise  # the caller waits for the daemon to come back
    except KvmuxError as exc:
        reporter.stop()
        raise CliError(f"{exc} {_so_far(job, seen)}") from exc
    finally:
        for task in tasks:
            task.cancel()
        # gather, not a suppressed CancelledError per task: Ctrl-C landing while this
        # waits is the command's own cancellation, and must not be swallowed here.
        await asyncio.gather(*tasks, return_exceptions=True)


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
            f"{info.state}, open" if info.open else info.state,
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
    writer: ResultSink,
    seen: bytearray,
) -> None:
    """Write every result of ``job`` not yet ``seen`` once, as it finishes, and feed the
    progress display. Results carry their input line (the daemon echoes each item's)."""

    def record(result: p.ItemResult) -> None:
        index = result.index
        if index >= len(seen):
            seen.extend(bytes(index + 1 - len(seen)))
        if seen[index]:
            return
        seen[index] = 1
        writer.result(result)
        if not reporter.live:  # no token updates: its tokens count as it ends
            reporter.tokens(len(result.token_ids))
        label = None
        if result.error is not None:
            label = failure_label(
                result.custom_id, result.error, line=result.line, index=result.index
            )
        reporter.item(result.status == "ok", label)

    # Results that finished before an attach (live ones are deduplicated by index).
    async for result in job.result_pages():
        record(result)
    async for event in job.events():
        match event:
            case p.TokenDelta(token_ids=ids):
                reporter.tokens(len(ids))
            case p.ItemFinished(result=result):
                record(result)
    if sum(seen) < job.total:
        # The stream dropped an event: the daemon has every result.
        async for result in job.result_pages():
            record(result)


def _model(client: Client) -> str:
    return client.welcome.model if client.welcome is not None else ""


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
