"""The job journal: accepted jobs, their items and results in SQLite, so they survive a crash.

One file (``jobs.journal``), opened by one daemon at a time (an exclusive
``flock`` on ``FILE.lock``), in WAL mode. What it promises depends on
``jobs.journal_sync``:

- ``"normal"`` (default): a job acknowledged ``accepted`` survives a crash of
  the daemon (SIGKILL, OOM kill, a bug), since SQLite has written it to the
  WAL file before the reply leaves; after a power loss or a kernel crash the
  last transactions before it may be gone.
- ``"full"``: every commit is fsynced as well, so it survives power loss too,
  at the price of one fsync per commit.

Writes happen on the journal's own thread: the scheduler queues what
changed (results as they finish, cancellations, detaches, finished jobs) and
the thread commits everything queued since its last commit as one
transaction, about once per scheduler turn; only a submit waits for its own
commit (nothing is acknowledged before it is written). A slow disk delays
the acknowledgement of new submits, never a decode step.

Schema, versioned with ``PRAGMA user_version`` (the migration path: a newer
daemon upgrades an older version's file in :func:`_migrate`, inside one
transaction, before anything else reads it; a file from a newer daemon is
refused with its version named):

- ``jobs(job_id, owner, name, detached, created, finished, total, format,
  open)``: wall-clock times (seconds since the epoch), so retention runs
  across restarts; ``format`` is how its results are written out; ``open``
  (version 2) marks a job still taking items;
- ``items(job_id, idx, item, result)``: the wire ``Item`` as accepted (its seed
  resolved, so a replayed sampled item draws the same tokens) and, once it
  finished, its ``ItemResult``, both msgpack. A line the client could not
  parse is a row with its ``Item`` reduced to ``custom_id`` and ``line`` and
  its ``bad_request`` result, written together;
- ``files(file_id, owner, data)`` and ``batches(batch_id, owner, data)``
  (version 3): the Files and Batch API's records, msgpack blobs that
  :mod:`kvmux.daemon.batches` reads (a file's content lives beside the
  journal, its SHA-256 in its record).

Items added to an open job are committed before ``added`` is answered, like
a submit's. A job journaled open comes back open after a restart: its
client re-attaches and adds from the total the daemon reports (it closes
after ``jobs.open_timeout`` if nobody does).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import fcntl
import os
import queue
import sqlite3
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Literal, TypeVar

import msgspec
import structlog

from kvmux.client.protocol import Item, ItemResult

log = structlog.get_logger("kvmux.journal")

SCHEMA_VERSION = 3

_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    job_id   TEXT PRIMARY KEY,
    owner    TEXT NOT NULL,
    name     TEXT NOT NULL,
    detached INTEGER NOT NULL,
    created  REAL NOT NULL,
    finished REAL,
    total    INTEGER NOT NULL,
    format   TEXT NOT NULL DEFAULT 'kvmux',
    open     INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS items (
    job_id TEXT NOT NULL REFERENCES jobs(job_id) ON DELETE CASCADE,
    idx    INTEGER NOT NULL,
    item   BLOB NOT NULL,
    result BLOB,
    PRIMARY KEY (job_id, idx)
) WITHOUT ROWID;
"""
# Version 3: the Files and Batch API's records.
_SCHEMA_V3 = """
CREATE TABLE IF NOT EXISTS files (
    file_id TEXT PRIMARY KEY,
    owner   TEXT NOT NULL,
    data    BLOB NOT NULL
);
CREATE TABLE IF NOT EXISTS batches (
    batch_id TEXT PRIMARY KEY,
    owner    TEXT NOT NULL,
    data     BLOB NOT NULL
);
"""

T = TypeVar("T")
_encode = msgspec.msgpack.Encoder().encode
_item = msgspec.msgpack.Decoder(Item)
_result = msgspec.msgpack.Decoder(ItemResult)


class JournalError(Exception):
    """The journal cannot be opened or used; the message names the file and the cause."""


class JournalFull(JournalError):
    """The disk refused a write (full, or quota): new submits are refused."""


@dataclass
class JournaledJob:
    """A job read back at start: what it was, and what of it finished."""

    job_id: str
    owner: str
    name: str
    detached: bool
    created: float
    finished: float | None
    format: str = "kvmux"
    open: bool = False
    items: list[Item] = field(default_factory=list)
    results: dict[int, ItemResult] = field(default_factory=dict)


Op = Callable[[sqlite3.Connection], object]


class Journal:
    """The open journal file and the thread that writes it."""

    def __init__(self, path: Path, *, sync: Literal["normal", "full"] = "normal") -> None:
        self.path = path
        self._lock_file = _lock(path)
        try:
            self._db = _open(path, sync)
        except BaseException:
            self._lock_file.close()
            raise
        self._queue: queue.SimpleQueue[tuple[Op, concurrent.futures.Future[None]] | None] = (
            queue.SimpleQueue()
        )
        self._thread = threading.Thread(target=self._write_loop, name="kvmux-journal", daemon=True)
        self.commits = 0
        self.write_seconds = 0.0
        self.failures = 0
        self.on_commit: Callable[[float], None] | None = None
        self._thread.start()

    # -- reading (at start, before the writer has anything to do) -----------------------
    def load(self) -> list[JournaledJob]:
        """Every journaled job, oldest first, with its items and finished results."""
        jobs: dict[str, JournaledJob] = {}
        rows = self._db.execute(
            "SELECT job_id, owner, name, detached, created, finished, format, open FROM jobs "
            "ORDER BY created"
        )
        for job_id, owner, name, detached, created, finished, fmt, is_open in rows:
            jobs[job_id] = JournaledJob(
                job_id, owner, name, bool(detached), created, finished, fmt, bool(is_open)
            )
        for job_id, idx, item, result in self._db.execute(
            "SELECT job_id, idx, item, result FROM items ORDER BY job_id, idx"
        ):
            job = jobs.get(job_id)
            if job is None:
                continue
            if idx != len(job.items):
                raise JournalError(f"{self.path}: job {job_id} is missing item {len(job.items)}")
            where = f"job {job_id} item {idx}"
            job.items.append(self.read_row(_item.decode, item, where))
            if result is not None:
                job.results[idx] = self.read_row(_result.decode, result, f"{where}'s result")
        return list(jobs.values())

    def read_row(self, decode: Callable[[bytes], T], data: bytes, where: str) -> T:
        """``decode(data)``, or :class:`JournalError` naming the row: a row written by
        another version, or altered on disk, is the operator's to repair, refused at start
        rather than replayed from half of it."""
        try:
            return decode(data)
        except (msgspec.DecodeError, RecursionError) as exc:
            raise JournalError(
                f"{self.path}: {where} cannot be read ({exc}); restore the file, or move it "
                "aside to start with an empty journal"
            ) from None

    def load_records(self, table: str) -> list[tuple[str, str, bytes]]:
        """Every row of ``files`` or ``batches``: (id, owner, data), in insertion order."""
        if table not in ("files", "batches"):
            raise ValueError(table)
        return list(self._db.execute(f"SELECT * FROM {table} ORDER BY rowid"))

    def size(self) -> int:
        """Bytes on disk: the database and its write-ahead log."""
        total = 0
        for suffix in ("", "-wal"):
            with contextlib.suppress(OSError):
                total += os.stat(f"{self.path}{suffix}").st_size
        return total

    # -- writing -------------------------------------------------------------------------
    def submit(self, op: Op) -> concurrent.futures.Future[None]:
        """Queue ``op`` for the next commit; the future resolves once it is committed."""
        fut: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._queue.put((op, fut))
        return fut

    def add_job(
        self,
        job_id: str,
        owner: str,
        name: str,
        detached: bool,
        items: list[Item],
        *,
        results: dict[int, ItemResult] | None = None,
        format: str = "kvmux",
        open: bool = False,
    ) -> concurrent.futures.Future[None]:
        """A new job with its first items; ``results`` are those already decided
        (rejected lines), keyed by index."""
        now = time.time()
        rows = _rows(job_id, 0, items, results or {})

        def op(db: sqlite3.Connection) -> None:
            db.execute(
                "INSERT INTO jobs VALUES (?, ?, ?, ?, ?, NULL, ?, ?, ?)",
                (job_id, owner, name, int(detached), now, len(items), format, int(open)),
            )
            db.executemany("INSERT INTO items VALUES (?, ?, ?, ?)", rows)

        return self.submit(op)

    def add_items(
        self,
        job_id: str,
        start: int,
        items: list[Item],
        *,
        results: dict[int, ItemResult] | None = None,
        close: bool = False,
    ) -> concurrent.futures.Future[None]:
        """More items of an open job, numbered from ``start``; ``close`` ends its intake."""
        rows = _rows(job_id, start, items, results or {})

        def op(db: sqlite3.Connection) -> None:
            db.executemany("INSERT INTO items VALUES (?, ?, ?, ?)", rows)
            db.execute(
                "UPDATE jobs SET total = ?, open = ? WHERE job_id = ?",
                (start + len(items), int(not close), job_id),
            )

        return self.submit(op)

    def set_closed(self, job_id: str) -> None:
        self.submit(lambda db: db.execute("UPDATE jobs SET open = 0 WHERE job_id = ?", (job_id,)))

    def add_result(self, job_id: str, result: ItemResult) -> int:
        """Queue a finished item's result; returns its encoded size."""
        data = _encode(result)
        self.submit(
            lambda db: db.execute(
                "UPDATE items SET result = ? WHERE job_id = ? AND idx = ?",
                (data, job_id, result.index),
            )
        )
        return len(data)

    def set_detached(self, job_id: str) -> None:
        self.submit(
            lambda db: db.execute("UPDATE jobs SET detached = 1 WHERE job_id = ?", (job_id,))
        )

    def set_finished(self, job_id: str, when: float) -> None:
        self.submit(
            lambda db: db.execute("UPDATE jobs SET finished = ? WHERE job_id = ?", (when, job_id))
        )

    def put_record(
        self, table: str, record_id: str, owner: str, data: bytes
    ) -> concurrent.futures.Future[None]:
        """Write (or overwrite) a ``files`` or ``batches`` row."""
        if table not in ("files", "batches"):
            raise ValueError(table)
        sql = f"INSERT OR REPLACE INTO {table} VALUES (?, ?, ?)"
        return self.submit(lambda db: db.execute(sql, (record_id, owner, data)))

    def delete_record(self, table: str, record_id: str) -> concurrent.futures.Future[None]:
        if table not in ("files", "batches"):
            raise ValueError(table)
        key = "file_id" if table == "files" else "batch_id"
        sql = f"DELETE FROM {table} WHERE {key} = ?"
        return self.submit(lambda db: db.execute(sql, (record_id,)))

    def delete(self, job_ids: list[str]) -> None:
        rows = [(j,) for j in job_ids]
        self.submit(lambda db: db.executemany("DELETE FROM jobs WHERE job_id = ?", rows))

    def flush(self, timeout: float | None = None) -> None:
        """Block until everything queued so far is committed (or failed)."""
        self.submit(lambda db: None).exception(timeout)

    def close(self) -> None:
        """Commit what is queued, stop the writer, close the file and its lock."""
        self._queue.put(None)
        self._thread.join(timeout=30)
        with contextlib.suppress(sqlite3.Error):
            self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        self._db.close()
        self._lock_file.close()

    def _write_loop(self) -> None:
        while True:
            first = self._queue.get()
            if first is None:
                return
            batch = [first]
            stop = False
            # Everything queued meanwhile goes into the same transaction.
            with contextlib.suppress(queue.Empty):
                while len(batch) < 10_000:
                    nxt = self._queue.get_nowait()
                    if nxt is None:
                        stop = True
                        break
                    batch.append(nxt)
            self._commit(batch)
            if stop:
                return

    def _commit(self, batch: list[tuple[Op, concurrent.futures.Future[None]]]) -> None:
        started = time.perf_counter()
        try:
            with self._db:  # one transaction: all of it or none
                for op, _ in batch:
                    op(self._db)
        except sqlite3.Error as exc:
            self.failures += 1
            error: JournalError = (
                JournalFull(f"{self.path}: {exc}")
                if _is_full(exc)
                else JournalError(f"{self.path}: {exc}")
            )
            log.error("journal_write_failed", path=str(self.path), error=str(exc), ops=len(batch))
            for _, fut in batch:
                fut.set_exception(error)
            return
        seconds = time.perf_counter() - started
        self.commits += 1
        self.write_seconds += seconds
        if self.on_commit is not None:
            self.on_commit(seconds)
        for _, fut in batch:
            fut.set_result(None)


def _rows(
    job_id: str, start: int, items: list[Item], results: dict[int, ItemResult]
) -> list[tuple[str, int, bytes, bytes | None]]:
    rows = []
    for i, item in enumerate(items, start):
        result = results.get(i)
        rows.append((job_id, i, _encode(item), None if result is None else _encode(result)))
    return rows


def default_journal_path(endpoint: str) -> Path:
    """A per-user journal for a hand-started daemon, one per endpoint (two daemons on
    two sockets are two services): ``$XDG_STATE_HOME/kvmux/`` (``~/.local/state``)."""
    import hashlib

    state = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    tag = hashlib.sha256(endpoint.encode()).hexdigest()[:12]
    return Path(state) / "kvmux" / f"jobs-{tag}.sqlite3"


def _lock(path: Path) -> IO[bytes]:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        lock = open(f"{path}.lock", "a+b")  # noqa: SIM115 - held open while the journal is
    except OSError as exc:
        raise JournalError(
            f"cannot create the job journal {path}: {exc.strerror or exc}; make its folder "
            "writable for the daemon's user, or set jobs.journal elsewhere "
            '(jobs.journal = "" keeps jobs in memory only)'
        ) from exc
    try:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        lock.close()
        raise JournalError(
            f"the job journal {path} is in use by another kvmuxd (its lock {path}.lock is "
            "held); stop that daemon, or give this one its own jobs.journal (kvmuxd --journal)"
        ) from None
    return lock


def _open(path: Path, sync: str) -> sqlite3.Connection:
    try:
        db = sqlite3.connect(path, check_same_thread=False, isolation_level="DEFERRED")
        db.execute("PRAGMA journal_mode=WAL").fetchone()
        db.execute(f"PRAGMA synchronous={sync.upper()}")
        db.execute("PRAGMA foreign_keys=ON")
        with db:
            _migrate(db, path)
        db.execute("PRAGMA quick_check").fetchone()
    except sqlite3.DatabaseError as exc:
        hint = (
            "the disk is full"
            if _is_full(exc)
            else "move the file aside (the daemon then starts a new one) or restore a backup"
        )
        raise JournalError(f"the job journal {path} cannot be used: {exc}; {hint}") from exc
    return db


def _migrate(db: sqlite3.Connection, path: Path) -> None:
    version = db.execute("PRAGMA user_version").fetchone()[0]
    if version > SCHEMA_VERSION:
        raise JournalError(
            f"the job journal {path} has schema version {version}, newer than this kvmuxd's "
            f"({SCHEMA_VERSION}): run the newer kvmuxd, or move the file aside"
        )
    if version == 0:
        db.executescript(_SCHEMA)
    elif version < 2:
        # Version 2: jobs remember their output format and whether they take more items.
        # Each step commits on its own, before user_version says so: a step a crash
        # interrupted is taken again, so each must hold when it is done already.
        columns = {row[1] for row in db.execute("PRAGMA table_info(jobs)")}
        if "format" not in columns:
            db.execute("ALTER TABLE jobs ADD COLUMN format TEXT NOT NULL DEFAULT 'kvmux'")
        if "open" not in columns:
            db.execute("ALTER TABLE jobs ADD COLUMN open INTEGER NOT NULL DEFAULT 0")
    if version < 3:
        db.executescript(_SCHEMA_V3)
    # Future versions: `if version < 4: ALTER TABLE ...` steps, in order, here.
    db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")


def _is_full(exc: sqlite3.Error) -> bool:
    text = str(exc).lower()
    return "full" in text or "quota" in text
