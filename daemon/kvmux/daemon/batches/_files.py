"""The Files API's store: each file's content in the daemon's files folder, its record
(owner, purpose, size, SHA-256, expiry) in the job journal.

A file belongs to its owner: anyone else gets ``not_found`` for it, exactly as
for an id that never existed. Content is written to a staging name, hashed as it
is written, renamed into place and only then recorded, so a crash leaves either
a whole file with its record or a stray staging file that the next start
removes. Files expire (``expires_after``, default ``http.file_retention``) and
count against their owner's quota (``http.max_owner_file_bytes``,
``http.max_owner_files``).
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import secrets
import time
from pathlib import Path
from typing import IO, Any, Literal, Protocol, TypeVar

import msgspec
import structlog

from kvmux.client.errors import BadRequest, NotFound

from ..access import Caller
from ..config import HttpConfig
from ..journal import Journal

log = structlog.get_logger("kvmux.files")

Purpose = Literal["batch", "batch_output"]
_STAGING = ".staging-"


class FileRecord(msgspec.Struct, frozen=True, kw_only=True):
    """One stored file, as the journal keeps it."""

    id: str
    owner: str
    purpose: str
    filename: str
    bytes: int
    created_at: int
    expires_at: int | None
    sha256: str
    # Creation in ns: lists are ordered by it (created_at has one-second steps).
    created_ns: int = 0

    def object(self) -> dict[str, Any]:
        """OpenAI's ``file`` object."""
        return {
            "id": self.id,
            "object": "file",
            "bytes": self.bytes,
            "created_at": self.created_at,
            "expires_at": self.expires_at,
            "filename": self.filename,
            "purpose": self.purpose,
            "status": "processed",
            "status_details": None,
        }


_decode_record = msgspec.msgpack.Decoder(FileRecord).decode


class Staged:
    """Content being written: hashed and counted as it goes, refused past ``limit``."""

    def __init__(self, path: Path, limit: int) -> None:
        self.path = path
        self.limit = limit
        self.size = 0
        self.sha256 = ""  # the content's, once closed
        self._hash = hashlib.sha256()
        self._file: IO[bytes] = path.open("wb")

    def write(self, data: bytes) -> None:
        self.size += len(data)
        if self.size > self.limit:
            raise BadRequest(
                f"the file is over {self.limit} bytes (http.max_file_bytes)",
                {"limit": self.limit},
            )
        self._hash.update(data)
        self._file.write(data)

    def close(self) -> None:
        """Flush to disk; ``sha256`` is the content's from now on."""
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        self.sha256 = self._hash.hexdigest()

    def discard(self) -> None:
        if not self._file.closed:
            self._file.close()
        self.path.unlink(missing_ok=True)


class _Listed(Protocol):
    @property
    def id(self) -> str: ...

    @property
    def created_ns(self) -> int: ...


L = TypeVar("L", bound=_Listed)


def page_after(
    records: list[L], after: str | None, limit: int, *, newest_first: bool
) -> tuple[list[L], bool]:
    """OpenAI's cursor paging: ``limit`` records in order of creation after the one
    whose id is ``after`` (none when it is not there); and whether more follow."""
    records = sorted(records, key=lambda r: r.created_ns, reverse=newest_first)
    start = 0
    if after is not None:
        ids = [r.id for r in records]
        start = ids.index(after) + 1 if after in ids else len(records)
    return records[start : start + limit], start + limit < len(records)


class FileStore:
    """Every owner's files: records in memory and the journal, content in ``folder``."""

    def __init__(self, folder: Path, journal: Journal | None, cfg: HttpConfig) -> None:
        self.folder = folder
        self.journal = journal
        self.cfg = cfg
        self.records: dict[str, FileRecord] = {}

    # -- start ------------------------------------------------------------------------
    def restore(self) -> None:
        """Take back the journal's records; a record whose content is missing or of
        another size is dropped (said in the log), stray content is removed."""
        self.folder.mkdir(parents=True, exist_ok=True)
        if self.journal is not None:
            for file_id, _owner, data in self.journal.load_records("files"):
                record = self.journal.read_row(_decode_record, data, f"file {file_id}")
                path = self.path(record)
                size = path.stat().st_size if path.exists() else -1
                if size != record.bytes:
                    log.error(
                        "file_lost",
                        file_id=file_id,
                        path=str(path),
                        expected_bytes=record.bytes,
                        found_bytes=size,
                    )
                    self.journal.delete_record("files", file_id)
                    continue
                self.records[file_id] = record
        for entry in self.folder.iterdir():
            if entry.name not in self.records:
                entry.unlink(missing_ok=True)  # staging left by a crash, or a dropped file

    # -- writing ----------------------------------------------------------------------
    def stage(self, limit: int | None = None) -> Staged:
        """A new staging file for content on its way in."""
        path = self.folder / f"{_STAGING}{secrets.token_hex(8)}"
        return Staged(path, self.cfg.max_file_bytes if limit is None else limit)

    def check_quota(self, owner: str, size: int) -> None:
        used, count = self.usage(owner)
        cfg = self.cfg
        if count + 1 > cfg.max_owner_files or used + size > cfg.max_owner_file_bytes:
            raise BadRequest(
                f"your files would take {used + size} bytes in {count + 1} files; one owner "
                f"may keep {cfg.max_owner_file_bytes} bytes (http.max_owner_file_bytes) in "
                f"{cfg.max_owner_files} files (http.max_owner_files): delete some first",
                {"bytes": used + size, "files": count + 1},
            )

    async def add(
        self,
        staged: Staged,
        *,
        owner: str,
        purpose: str,
        filename: str,
        expires_after: float | None,
        quota: bool = True,
    ) -> FileRecord:
        """Record ``staged`` (closed) as a new file of ``owner``'s. ``quota``: refuse it
        past the owner's quota (a batch's own output is kept regardless)."""
        try:
            if quota:
                self.check_quota(owner, staged.size)
            now_ns = time.time_ns()
            now = now_ns // 10**9
            seconds = self.cfg.file_retention if expires_after is None else expires_after
            record = FileRecord(
                id=f"file-{secrets.token_hex(12)}",
                owner=owner,
                purpose=purpose,
                filename=filename,
                bytes=staged.size,
                created_at=now,
                expires_at=now + int(seconds),
                sha256=staged.sha256,
                created_ns=now_ns,
            )
            os.replace(staged.path, self.path(record))
        except BaseException:
            staged.discard()
            raise
        if self.journal is not None:
            fut = self.journal.put_record("files", record.id, owner, msgspec.msgpack.encode(record))
            await asyncio.wrap_future(fut)
        self.records[record.id] = record
        log.info("file_added", file_id=record.id, purpose=purpose, bytes=record.bytes, owner=owner)
        return record

    # -- reading ----------------------------------------------------------------------
    def path(self, record: FileRecord) -> Path:
        return self.folder / record.id

    def find(self, file_id: str, caller: Caller) -> FileRecord:
        """The file, if ``caller`` may see it; ``not_found`` as for an id that never was."""
        record = self.records.get(file_id)
        if record is None or not caller.may_see(record.owner):
            raise NotFound(f"no file {file_id!r}", {"file_id": file_id})
        return record

    def listing(
        self,
        caller: Caller,
        *,
        after: str | None,
        limit: int,
        order: Literal["asc", "desc"],
        purpose: str | None,
    ) -> tuple[list[FileRecord], bool]:
        """A page of ``caller``'s files in ``order`` of creation after the file ``after``;
        and whether more follow."""
        mine = [
            r
            for r in self.records.values()
            if caller.may_see(r.owner) and (purpose is None or r.purpose == purpose)
        ]
        return page_after(mine, after, limit, newest_first=order == "desc")

    def usage(self, owner: str) -> tuple[int, int]:
        """(bytes, files) ``owner`` keeps."""
        mine = [r.bytes for r in self.records.values() if r.owner == owner]
        return sum(mine), len(mine)

    # -- removing ---------------------------------------------------------------------
    async def delete(self, file_id: str, caller: Caller) -> FileRecord:
        record = self.find(file_id, caller)
        await self._drop(record)
        return record

    async def _drop(self, record: FileRecord) -> None:
        self.records.pop(record.id, None)
        if self.journal is not None:
            await asyncio.wrap_future(self.journal.delete_record("files", record.id))
        self.path(record).unlink(missing_ok=True)

    async def expire(self) -> list[str]:
        """Remove the files past their ``expires_at``."""
        now = time.time()
        gone = [
            r for r in self.records.values() if r.expires_at is not None and r.expires_at <= now
        ]
        for record in gone:
            await self._drop(record)
            log.info("file_expired", file_id=record.id, owner=record.owner)
        return [r.id for r in gone]
