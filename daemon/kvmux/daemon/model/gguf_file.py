"""One GGUF file opened with ggml's own ``gguf`` reader: typed metadata access that names
the key, and the error every GGUF problem becomes."""

from __future__ import annotations

import contextlib
import hashlib
import mmap
from pathlib import Path
from typing import Any

from kvmux.daemon.model.errors import ModelFormatError

__all__ = ["GGUFFile", "GGUFImportError", "sha256_of"]


class GGUFImportError(ModelFormatError):
    """A GGUF file kvmux cannot import: unreadable, damaged, or a model it does not run."""

    def __init__(self, path: Path | str, problem: str) -> None:
        # A ModelFormatError (the daemon refuses to start on it, as on a bad folder)
        # whose message names the file rather than a folder.
        self.path = Path(path)
        self.folder = None
        self.problems = (problem,)
        Exception.__init__(self, f"GGUF file {path}: {problem}")


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


class GGUFFile:
    """One opened GGUF file: typed metadata access that names the key on errors."""

    def __init__(self, path: Path) -> None:
        import gguf

        self.path = path
        try:
            with open(path, "rb") as f:
                magic = f.read(4)
            self.reader = gguf.GGUFReader(path, "r")
        except OSError as exc:
            raise GGUFImportError(path, f"cannot be read ({exc})") from exc
        except (ValueError, IndexError, KeyError, TypeError) as exc:
            if magic != b"GGUF":
                raise GGUFImportError(
                    path, f"is not a GGUF file (it starts with {magic!r}, not b'GGUF')"
                ) from exc
            # A header that promises more than the file holds: the reader runs past
            # the end ("cannot reshape array of size ...", a short read).
            raise GGUFImportError(
                path,
                f"is truncated or damaged: the gguf reader says {exc} "
                f"(the file has {path.stat().st_size} bytes)",
            ) from exc
        self.tensors = {t.name: t for t in self.reader.tensors}

    def release(self, tensor: Any) -> None:
        """Drop the file's pages under ``tensor`` from this process: the reader maps the
        whole file, and pages read stay resident (counted in RSS) until dropped, so an
        import that goes tensor by tensor holds one tensor's pages, not the file's."""
        mapped = getattr(self.reader.data, "_mmap", None)
        if mapped is None:
            return
        start = int(tensor.data_offset) // mmap.PAGESIZE * mmap.PAGESIZE
        end = int(tensor.data_offset) + int(tensor.n_bytes)
        # Advice only: a kernel that refuses it leaves the pages where they are.
        with contextlib.suppress(OSError, ValueError):
            mapped.madvise(mmap.MADV_DONTNEED, start, end - start)

    def fail(self, problem: str) -> GGUFImportError:
        return GGUFImportError(self.path, problem)

    def get(self, key: str, default: Any = ...) -> Any:
        field = self.reader.fields.get(key)
        if field is None:
            if default is ...:
                raise self.fail(f"metadata key {key!r} is missing")
            return default
        return field.contents()

    def int_(self, key: str, default: Any = ...) -> int:
        value = self.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise self.fail(f"metadata {key} is {value!r}, expected a non-negative integer")
        return value

    def float_(self, key: str, default: float | None = None) -> float:
        value = self.get(key, ... if default is None else default)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise self.fail(f"metadata {key} is {value!r}, expected a number")
        return float(value)
