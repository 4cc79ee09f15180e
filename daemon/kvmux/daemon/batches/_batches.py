"""The Batch API's batches: each one a kvmux job, run from its input file to its output
and error files, in OpenAI's states.

``validating``: the input file is read once, as OpenAI validates it: every line
JSON with a ``custom_id`` of its own, ``method`` POST, ``url`` the batch's
``endpoint`` and a ``body`` object, at most ``http.max_batch_lines`` lines. A
file that fails is ``failed`` with ``errors.data`` naming each line and its
cause; nothing runs. ``in_progress``: the lines become the items of one job of
the batch's owner (a body kvmux cannot run is that line's error result, as
``kvmux submit`` makes it), fed a bounded message at a time as the queue takes
them; ``request_counts`` follow its results. ``finalizing``: the output and
error files are written by the CLI's own writer
(:class:`~kvmux.client.cli.results.ResultSink`), in input-line order, each line
exactly once; then ``completed``. A cancel (``cancelling``) or the end of the
``completion_window`` cancels the job; what finished is in the output file,
the rest in the error file as ``batch_cancelled`` / ``batch_expired``; then
``cancelled`` / ``expired``.

Everything is journaled: after a crash a batch goes on where its job is (the
job journals its items and results), feeding from the first line its job does
not hold, and writes its files once the job is done. The job stays pinned
(never pruned by retention) until its files are written.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import anyio
import anyio.abc
import anyio.to_thread
import msgspec
import structlog

from kvmux.client import jsonin
from kvmux.client import protocol as p
from kvmux.client.cli.batch import LineError, numbered_lines
from kvmux.client.cli.results import ResultSink
from kvmux.client.errors import (
    BadRequest,
    Cancelled,
    KvmuxError,
    NotFound,
    Overloaded,
    ShuttingDown,
)
from kvmux.client.openai import (
    ENDPOINTS,
    RequestError,
    body_items,
    json_type,
    usage,
)

from ..access import OPERATOR, Caller
from ..config import HttpConfig, SchedulerConfig
from ..journal import Journal
from ..service import Service
from ._files import FileStore, Staged, page_after

log = structlog.get_logger("kvmux.batches")

Status = Literal[
    "validating",
    "failed",
    "in_progress",
    "finalizing",
    "completed",
    "expired",
    "cancelling",
    "cancelled",
]
_ACTIVE = frozenset({"validating", "in_progress", "finalizing", "cancelling"})
WINDOWS = {"24h": 24 * 3600}
# Lines per message into the batch's job at most (fewer where their items and
# refusals would pass scheduler.max_job_items: see _messages).
_FEED_LINES = 256
_MAX_ERRORS = 1000  # errors.data entries a failed validation lists


class BatchError(msgspec.Struct, frozen=True):
    """One reason a batch failed validation (OpenAI's ``errors.data`` entry)."""

    code: str
    message: str
    param: str | None = None
    line: int | None = None


class Counts(msgspec.Struct):
    total: int = 0
    completed: int = 0
    failed: int = 0


class BatchRecord(msgspec.Struct, kw_only=True):
    """One batch, as the journal keeps it (counts are rebuilt from its job's results)."""

    id: str
    owner: str
    endpoint: str
    input_file_id: str
    completion_window: str
    metadata: dict[str, str] | None
    model: str
    status: Status
    created_at: int
    expires_at: int
    in_progress_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    output_file_id: str | None = None
    error_file_id: str | None = None
    errors: list[BatchError] | None = None
    request_counts: Counts = msgspec.field(default_factory=Counts)
    usage: dict[str, Any] | None = None
    job_id: str | None = None
    output_expires_after: int | None = None
    # Why it is being stopped: "" (it is not), "cancel" or "expire".
    stop: Literal["", "cancel", "expire"] = ""
    # Creation in ns: lists are ordered by it (created_at has one-second steps).
    created_ns: int = 0

    def object(self) -> dict[str, Any]:
        """OpenAI's ``batch`` object."""
        out = {
            f: getattr(self, f)
            for f in (
                "id",
                "endpoint",
                "input_file_id",
                "completion_window",
                "status",
                "output_file_id",
                "error_file_id",
                "created_at",
                "in_progress_at",
                "expires_at",
                "finalizing_at",
                "completed_at",
                "failed_at",
                "expired_at",
                "cancelling_at",
                "cancelled_at",
                "metadata",
                "model",
                "usage",
            )
        }
        out["object"] = "batch"
        out["errors"] = (
            None
            if self.errors is None
            else {"object": "list", "data": [msgspec.to_builtins(e) for e in self.errors]}
        )
        out["request_counts"] = msgspec.to_builtins(self.request_counts)
        return out


class _Structural(Exception):
    """A line that fails the batch's validation (OpenAI refuses the whole file)."""

    def __init__(self, code: str, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.error = BatchError(code, message, param)


def _line_request(raw: bytes, endpoint: str) -> tuple[str, Any]:
    """A batch line's ``custom_id`` and ``body``, or why the line fails the file."""
    try:
        obj = jsonin.decode(raw)
    except msgspec.DecodeError as exc:
        raise _Structural("invalid_json_line", f"not valid JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise _Structural("invalid_json_line", f"expected a JSON object, got {json_type(obj)}")
    cid = obj.get("custom_id")
    if not isinstance(cid, str) or not cid:
        raise _Structural("missing_custom_id", "each line needs a `custom_id` string", "custom_id")
    method = obj.get("method")
    if method != "POST":
        raise _Structural("invalid_method", f"`method` must be POST, got {method!r}", "method")
    url = obj.get("url")
    if url != endpoint:
        raise _Structural(
            "mismatched_endpoint", f"`url` {url!r} is not the batch's endpoint {endpoint!r}", "url"
        )
    body = obj.get("body")
    if not isinstance(body, dict):
        why = f"`body` must be an object, got {json_type(body)}"
        raise _Structural("invalid_body", why, "body")
    return cid, body


def _lines(path: Path) -> Iterator[tuple[int, bytes]]:
    """The file's non-blank lines, numbered from 1 (a BOM and CRLF ends are fine)."""
    with path.open("rb") as f:
        yield from numbered_lines(f)


def validate(path: Path, endpoint: str, max_lines: int) -> tuple[int, list[BatchError]]:
    """The number of requests in the input file, and every line that fails it."""
    errors: list[BatchError] = []
    seen: dict[str, int] = {}
    count = 0
    for number, raw in _lines(path):
        count += 1
        try:
            cid, _ = _line_request(raw, endpoint)
            first = seen.setdefault(cid, number)
            if first != number:
                raise _Structural(
                    "duplicate_custom_id",
                    f"custom_id {cid!r} is already used by line {first}",
                    "custom_id",
                )
        except _Structural as exc:
            if len(errors) < _MAX_ERRORS:
                errors.append(msgspec.structs.replace(exc.error, line=number))
    if count > max_lines:
        errors.insert(
            0,
            BatchError(
                "batch_too_large",
                f"the file holds {count} requests; a batch takes at most {max_lines} "
                "(http.max_batch_lines)",
            ),
        )
    if count == 0:
        errors.append(BatchError("empty_file", "the input file holds no requests"))
    return count, errors


def entries(
    path: Path, endpoint: str, start_line: int, max_choices: int
) -> Iterator[tuple[int, str, list[p.Item] | p.Rejected]]:
    """The validated file's lines from ``start_line`` on: each as its items, or as the
    reason kvmux cannot run it (that line's error result)."""
    for number, raw in _lines(path):
        if number < start_line:
            continue
        cid, body = _line_request(raw, endpoint)
        try:
            items = body_items(endpoint, body, prefix="body.", custom_id=cid, line=number)
        except RequestError as exc:
            reason = exc.message[:4096]
            yield number, cid, p.Rejected(custom_id=cid[:512], reason=reason, line=number)
            continue
        if len(items) > max_choices:
            reason = (
                f"this line asks for {len(items)} completions; a batch line may ask for at "
                f"most {max_choices} (scheduler.max_job_items)"
            )
            yield number, cid, p.Rejected(custom_id=cid[:512], reason=reason, line=number)
            continue
        yield number, cid, items


class _Sink:
    """A batch's audience on its job: counts its lines as their results come."""

    def __init__(self, record: BatchRecord) -> None:
        self.record = record
        self.done = anyio.Event()
        self._lines: dict[int, list[int]] = {}  # line -> [choices done, failed]

    def count(self, result: p.ItemResult) -> None:
        line = result.line or 0
        state = self._lines.setdefault(line, [0, 0])
        state[0] += 1
        state[1] |= result.status != "ok"
        if state[0] >= result.choices:
            del self._lines[line]
            counts = self.record.request_counts
            if state[1]:
                counts.failed += 1
            else:
                counts.completed += 1

    def recount(self, results: list[p.ItemResult]) -> None:
        """Counts rebuilt from the results the job holds (after a restart)."""
        record = self.record
        record.request_counts = Counts(total=record.request_counts.total)
        self._lines.clear()
        for result in results:
            self.count(result)

    def deliver(self, events: list[p.Event]) -> None:
        for event in events:
            if isinstance(event, p.ItemFinished):
                self.count(event.result)
            elif isinstance(event, p.JobFinished):
                self.done.set()


class Batches:
    """Every owner's batches, and the task that runs each to its end."""

    def __init__(
        self,
        service: Service,
        files: FileStore,
        journal: Journal | None,
        cfg: HttpConfig,
        scheduler_cfg: SchedulerConfig,
        model: str,
    ) -> None:
        self.service = service
        self.files = files
        self.journal = journal
        self.cfg = cfg
        self.max_choices = scheduler_cfg.max_job_items
        self.model = model
        self.records: dict[str, BatchRecord] = {}
        self._sinks: dict[str, _Sink] = {}
        self._tg: anyio.abc.TaskGroup | None = None

    # -- start --------------------------------------------------------------------------
    def load(self) -> set[str]:
        """Read the journal's batches; the ids of the jobs the unfinished ones run (to be
        pinned before the scheduler prunes what it restores)."""
        if self.journal is not None:
            decode = msgspec.msgpack.Decoder(BatchRecord).decode
            for batch_id, _owner, data in self.journal.load_records("batches"):
                self.records[batch_id] = self.journal.read_row(decode, data, f"batch {batch_id}")
        return {
            r.job_id for r in self.records.values() if r.status in _ACTIVE and r.job_id is not None
        }

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Run the unfinished batches, new ones as they come, and expire what is due."""
        async with anyio.create_task_group() as tg:
            self._tg = tg
            for record in self.records.values():
                if record.status in _ACTIVE:
                    tg.start_soon(self._run, record)
            task_status.started()
            while True:
                await anyio.sleep(1.0)
                self._expire()
                await self.files.expire()

    # -- the API ------------------------------------------------------------------------
    async def create(
        self,
        caller: Caller,
        *,
        input_file_id: str,
        endpoint: str,
        completion_window: str,
        metadata: dict[str, str] | None,
        output_expires_after: int | None,
    ) -> BatchRecord:
        if self.service.scheduler.draining:
            raise ShuttingDown("kvmuxd is shutting down and takes no new batches")
        if endpoint not in ENDPOINTS:
            raise BadRequest(
                f"endpoint {endpoint!r} is not supported: kvmux runs {', '.join(ENDPOINTS)}",
                {"param": "endpoint"},
            )
        if completion_window not in WINDOWS:
            raise BadRequest(
                f"completion_window {completion_window!r} is not supported: use '24h'",
                {"param": "completion_window"},
            )
        source = self.files.find(input_file_id, caller)
        if source.purpose != "batch":
            raise BadRequest(
                f"file {input_file_id!r} has purpose {source.purpose!r}; a batch reads a file "
                "uploaded with purpose 'batch'",
                {"param": "input_file_id"},
            )
        now_ns = time.time_ns()
        now = now_ns // 10**9
        record = BatchRecord(
            id=f"batch_{secrets.token_hex(12)}",
            owner=caller.owner,
            endpoint=endpoint,
            input_file_id=input_file_id,
            completion_window=completion_window,
            metadata=metadata,
            model=self.model,
            status="validating",
            created_at=now,
            expires_at=now + WINDOWS[completion_window],
            output_expires_after=output_expires_after,
            created_ns=now_ns,
        )
        await self._save(record)
        self.records[record.id] = record
        assert self._tg is not None
        self._tg.start_soon(self._run, record)
        log.info("batch_created", batch_id=record.id, owner=caller.owner, endpoint=endpoint)
        return record

    def find(self, batch_id: str, caller: Caller) -> BatchRecord:
        record = self.records.get(batch_id)
        if record is None or not caller.may_see(record.owner):
            raise NotFound(f"no batch {batch_id!r}", {"batch_id": batch_id})
        return record

    def listing(
        self, caller: Caller, *, after: str | None, limit: int
    ) -> tuple[list[BatchRecord], bool]:
        """``caller``'s batches, newest first, after the batch ``after``; more to come?"""
        mine = [r for r in self.records.values() if caller.may_see(r.owner)]
        return page_after(mine, after, limit, newest_first=True)

    async def cancel(self, batch_id: str, caller: Caller) -> BatchRecord:
        record = self.find(batch_id, caller)
        if record.status in ("cancelling", "cancelled"):
            return record
        if record.status not in ("validating", "in_progress"):
            raise BadRequest(
                f"batch {batch_id} is {record.status}: only a validating or in-progress "
                "batch can be cancelled",
                {"batch_id": batch_id, "status": record.status},
            )
        record.stop = "cancel"
        record.status = "cancelling"
        record.cancelling_at = int(time.time())
        await self._save(record)
        self._stop_job(record)
        log.info("batch_cancelling", batch_id=batch_id)
        return record

    # -- running ------------------------------------------------------------------------
    async def _run(self, record: BatchRecord) -> None:
        with structlog.contextvars.bound_contextvars(batch_id=record.id):
            try:
                if record.status == "validating":
                    await self._validate(record)
                if record.status == "failed":
                    return
                if record.status in ("in_progress", "cancelling"):
                    await self._feed(record)
                await self._finalize(record)
            except ShuttingDown:
                return  # the daemon stops: the journal keeps where the batch is
            except Exception as exc:
                log.exception("batch_internal_error", batch_id=record.id)
                await self._fail(record, [BatchError("internal", f"kvmuxd failed: {exc}")])

    async def _validate(self, record: BatchRecord) -> None:
        source = self.files.records.get(record.input_file_id)
        if source is None:
            await self._fail(
                record, [BatchError("file_not_found", f"input file {record.input_file_id} is gone")]
            )
            return
        total, errors = await anyio.to_thread.run_sync(
            validate, self.files.path(source), record.endpoint, self.cfg.max_batch_lines
        )
        if errors:
            await self._fail(record, errors)
            return
        record.status = "cancelling" if record.stop == "cancel" else "in_progress"
        record.in_progress_at = int(time.time())
        record.request_counts = Counts(total=total)
        await self._save(record)

    async def _feed(self, record: BatchRecord) -> None:
        """Put the file's lines into the batch's job, from the first it does not hold."""
        sink = self._sinks.setdefault(record.id, _Sink(record))
        owner = Caller(record.owner)
        job = None
        if record.job_id is not None:
            try:
                job = self.service.find(record.job_id, caller=OPERATOR)
            except NotFound:
                await self._fail(
                    record, [BatchError("job_lost", f"its job {record.job_id} is gone")]
                )
                return
            self.service.attach(sink, job.job_id, caller=OPERATOR, stream=False)
            sink.recount(job.results())
        elif not record.stop:
            job = await self.service.submit(
                sink,
                [],
                caller=owner,
                more=True,
                detach=True,
                name=f"batch {record.id}",
                format="openai",
                stream=False,  # it counts results: no token updates built for it
            )
            assert job is not None
            record.job_id = job.job_id
            await self._save(record)
        if job is None:
            return
        self.service.scheduler.jobs.pinned.add(job.job_id)
        if not job.open:
            return
        source = self.files.find(record.input_file_id, OPERATOR)
        start = 1 + max((s.line or 0 for s in job.items), default=0)
        lines = entries(self.files.path(source), record.endpoint, start, self.max_choices)
        messages = _messages(lines, self.max_choices)
        while not record.stop and job.open:
            chunk, last = await anyio.to_thread.run_sync(next, messages)
            items = [i for _, _, e in chunk if isinstance(e, list) for i in e]
            rejected = [e for _, _, e in chunk if isinstance(e, p.Rejected)]
            await self._add(record, job.job_id, items, rejected, last=last)
        if record.stop and job.open:
            self.service.scheduler.jobs.close(job)

    async def _add(
        self,
        record: BatchRecord,
        job_id: str,
        items: list[p.Item],
        rejected: list[p.Rejected],
        *,
        last: bool,
    ) -> None:
        """One message into the job, waiting out a full queue as a client would."""
        while not record.stop:
            try:
                await self.service.add_items(
                    self._sinks[record.id],
                    job_id,
                    items,
                    caller=OPERATOR,
                    rejected=rejected,
                    last=last,
                )
                return
            except Overloaded as exc:
                hint = exc.details.get("retry_after")
                await anyio.sleep(hint if isinstance(hint, int | float) and hint > 0 else 0.1)
            except BadRequest:
                if _stopping(record):
                    return  # closed by the cancel meanwhile
                raise

    async def _finalize(self, record: BatchRecord) -> None:
        sink = self._sinks.setdefault(record.id, _Sink(record))
        job = None
        if record.job_id is not None:
            job = self.service.find(record.job_id, caller=OPERATOR)
            if not job.done:
                await sink.done.wait()
        if record.status != "finalizing":
            record.status = "finalizing"
            record.finalizing_at = int(time.time())
            await self._save(record)
        results = [] if job is None else job.results()
        if job is not None:
            sink.recount(results)
        fed = max((r.line or 0 for r in results), default=0)
        out, errors = await anyio.to_thread.run_sync(self._write, record, results, fed)
        retention = record.output_expires_after
        for written, kind in ((out, "output"), (errors, "error")):
            if written is None:
                continue
            file = await self.files.add(
                written,
                owner=record.owner,
                purpose="batch_output",
                filename=f"{record.id}_{kind}.jsonl",
                expires_after=retention,
                quota=False,
            )
            if kind == "output":
                record.output_file_id = file.id
            else:
                record.error_file_id = file.id
        now = int(time.time())
        record.usage = _usage(results)
        if record.stop == "expire":
            record.status, record.expired_at = "expired", now
        elif record.stop == "cancel":
            record.status, record.cancelled_at = "cancelled", now
        else:
            record.status, record.completed_at = "completed", now
        await self._save(record)
        if job is not None:
            self.service.scheduler.jobs.pinned.discard(job.job_id)
        self._sinks.pop(record.id, None)
        log.info(
            "batch_finished",
            batch_id=record.id,
            status=record.status,
            completed=record.request_counts.completed,
            failed=record.request_counts.failed,
        )

    def _write(
        self, record: BatchRecord, results: list[p.ItemResult], fed: int
    ) -> tuple[Staged | None, Staged | None]:
        """The output and error files (on the files folder's staging names; None for
        one without lines), by the CLI's own writer, in input-line order; the lines
        never fed as stopped."""
        out, err = self.files.stage(limit=1 << 62), self.files.stage(limit=1 << 62)
        try:
            sink = ResultSink("openai", out.write, err.write, model=record.model)
            for result in sorted(results, key=lambda r: (r.line or 0, r.choice)):
                sink.result(result)
            sink.flush()
            if record.stop:
                code = "batch_expired" if record.stop == "expire" else "batch_cancelled"
                why = "expired" if record.stop == "expire" else "was cancelled"
                source = self.files.records.get(record.input_file_id)
                if source is not None:
                    # Validated: every line has its id; nothing else of it is wanted.
                    for number, raw in _lines(self.files.path(source)):
                        if number > fed:
                            cid, _ = _line_request(raw, record.endpoint)
                            message = f"the batch {why} before this request ran"
                            sink.refused(LineError(number, message, cid), code=code)
        except BaseException:
            out.discard()
            err.discard()
            raise
        staged: list[Staged | None] = []
        for file in (out, err):
            file.close()
            if file.size:
                staged.append(file)
            else:
                file.path.unlink(missing_ok=True)
                staged.append(None)
        return staged[0], staged[1]

    async def _fail(self, record: BatchRecord, errors: list[BatchError]) -> None:
        record.status = "failed"
        record.failed_at = int(time.time())
        record.errors = errors
        await self._save(record)
        if record.job_id is not None:
            with contextlib.suppress(KvmuxError):
                self.service.scheduler.jobs.pinned.discard(record.job_id)
        log.warning(
            "batch_failed",
            batch_id=record.id,
            errors=len(errors),
            first=errors[0].code if errors else None,
        )

    def _stop_job(self, record: BatchRecord) -> None:
        if record.job_id is None:
            return
        code = "batch_expired" if record.stop == "expire" else "batch_cancelled"
        why = "the batch expired" if record.stop == "expire" else "the batch was cancelled"
        with contextlib.suppress(KvmuxError):
            self.service.cancel(
                record.job_id,
                caller=OPERATOR,
                reason=Cancelled(why, {"batch_id": record.id, "batch_code": code}),
            )

    def _expire(self) -> None:
        now = time.time()
        for record in self.records.values():
            if record.status in ("validating", "in_progress") and record.expires_at <= now:
                if record.stop:
                    continue
                record.stop = "expire"
                log.warning("batch_expiring", batch_id=record.id)
                self._stop_job(record)

    async def _save(self, record: BatchRecord) -> None:
        if self.journal is not None:
            data = msgspec.msgpack.encode(record)
            await asyncio.wrap_future(
                self.journal.put_record("batches", record.id, record.owner, data)
            )


def _stopping(record: BatchRecord) -> bool:
    """Whether the batch is being stopped (read afresh: a cancel may have come meanwhile)."""
    return record.stop != ""


def _messages(
    lines: Iterator[tuple[int, str, list[p.Item] | p.Rejected]], cap: int
) -> Iterator[tuple[list[tuple[int, str, list[p.Item] | p.Rejected]], bool]]:
    """The lines in messages of at most _FEED_LINES lines and ``cap`` items and
    refusals (scheduler.max_job_items: a line of n choices is n items), each with
    whether it is the last (which may be empty: it closes the job)."""
    chunk: list[tuple[int, str, list[p.Item] | p.Rejected]] = []
    size = 0
    for entry in lines:
        n = len(entry[2]) if isinstance(entry[2], list) else 1
        if chunk and (size + n > cap or len(chunk) == _FEED_LINES):
            yield chunk, False
            chunk, size = [], 0
        chunk.append(entry)
        size += n
    yield chunk, True


def _usage(results: list[p.ItemResult]) -> dict[str, Any]:
    """The batch's token usage: each line's, as OpenAI counts it, summed."""
    by_line: dict[int, list[p.ItemResult]] = {}
    for result in results:
        if result.usage is not None:
            by_line.setdefault(result.line or 0, []).append(result)
    prompt = completion = cached = 0
    for group in by_line.values():
        u = usage(group, group[0].chat)
        prompt += u["prompt_tokens"]
        completion += u["completion_tokens"]
        cached += u["prompt_tokens_details"]["cached_tokens"]
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": cached},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + completion,
    }
