"""Result lines: kvmux's own shape or OpenAI's batch output, written so nothing is lost.

kvmux's shape has the same keys on every line, so ``jq`` and dataframes
need no special cases::

    {"custom_id": "a", "line": 3, "choice": 0, "choices": 1, "index": 1, "status": "ok",
     "text": "...", "token_ids": [...], "finish_reason": "length", "usage": {...},
     "seed": 7, "error": null}

plus ``message`` (``{"role": "assistant", "content": ...}``) for a chat
result and ``logprobs`` when they were asked for. ``line`` is the input
line, ``choice`` which of its ``choices`` completions this is (OpenAI's ``n``
times its prompts), ``index`` the item's position in the job (null for a
line that never reached the daemon). Results come in the order they finish;
sort by ``line`` for input order. A cancelled item keeps the text it had.

OpenAI's shape is the Batch API's output line, one per input line (its
choices gathered)::

    {"id": "batch_req_...", "custom_id": "a", "response": {"status_code": 200,
     "request_id": "...", "body": {"id": "chatcmpl-...", "object": "chat.completion",
     "created": ..., "model": ..., "choices": [...], "usage": {...}}}, "error": null}

A line that never ran has ``"response": null`` and ``"error": {"code",
"message"}``; an item that failed in the daemon a ``status_code`` 4xx/5xx
and an ``{"error": {...}}`` body, as OpenAI writes them.

:class:`ResultSink` builds each line whole and hands it to an output that
writes it in one ``write(2)``; :class:`OutFile` is such an output that is
not created (nor an existing file touched) before its first line.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any, Literal

import msgspec

from .. import jsonin
from .. import protocol as p
from ..openai import batch_output_line, batch_refused_line, is_rejected
from .batch import LineError
from .connect import CliError

Format = Literal["kvmux", "openai"]
PARTIAL_SUFFIX = ".partial"


def resolve_format(option: str, openai_input: bool | None) -> Format:
    """``--format``: kvmux or openai as given; ``auto`` follows the input's shape."""
    if option == "openai" or (option == "auto" and openai_input):
        return "openai"
    return "kvmux"


def result_line(result: p.ItemResult) -> dict[str, Any]:
    """kvmux's output object for a result the daemon sent."""
    obj: dict[str, Any] = {
        "custom_id": result.custom_id,
        "line": result.line,
        "choice": result.choice,
        "choices": result.choices,
        "index": result.index,
        "status": result.status,
        "text": result.text,
        "token_ids": result.token_ids,
        "finish_reason": result.finish_reason,
        "usage": None if result.usage is None else msgspec.to_builtins(result.usage),
        "seed": result.seed,
        "error": None if result.error is None else msgspec.to_builtins(result.error),
    }
    if result.chat:
        obj["message"] = {"role": "assistant", "content": result.text}
    if result.logprobs is not None:
        obj["logprobs"] = [
            {
                "token_id": t.token_id,
                "token": t.token,
                "logprob": t.logprob,
                "top": [
                    {"token_id": c.token_id, "token": c.token, "logprob": c.logprob} for c in t.top
                ],
            }
            for t in result.logprobs
        ]
    return obj


def refused_line(err: LineError) -> dict[str, Any]:
    """kvmux's output object for a line that never became an item."""
    return {
        "custom_id": err.custom_id,
        "line": err.line,
        "choice": 0,
        "choices": 1,
        "index": None,
        "status": "error",
        "text": "",
        "token_ids": [],
        "finish_reason": None,
        "usage": None,
        "seed": None,
        "error": msgspec.to_builtins(err.to_info()),
    }


class OutFile:
    """A results file that exists only once there is a line to write in it.

    Each line goes out in one ``write(2)`` on an ``O_APPEND`` descriptor, so a
    killed client leaves whole lines only. ``append`` (``--resume``) adds to
    the file; otherwise a file already there is left alone and the new
    results go to ``FILE.partial`` beside it, renamed over it by
    :meth:`finish` once the run is complete — an interrupted run leaves the
    old file as it was plus the ``.partial`` that ``--resume`` continues.
    """

    def __init__(self, path: str | Path, *, append: bool = False) -> None:
        self.path = Path(path)
        self.append = append
        self._fd: int | None = None
        self._target: Path | None = None

    def write(self, data: bytes) -> None:
        if self._fd is None:
            self._open()
        assert self._fd is not None
        view = memoryview(data)
        while view:
            view = view[os.write(self._fd, view) :]

    def _open(self) -> None:
        partial = partial_path(self.path)
        flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT
        if self.append:
            # Resuming an interrupted replacement run continues its .partial.
            target = partial if partial.exists() else self.path
        elif self.path.exists():
            target, flags = partial, flags | os.O_TRUNC
        else:
            target = self.path
        try:
            self._fd = os.open(target, flags, 0o644)
        except OSError as exc:
            raise CliError(f"cannot write {target}: {exc.strerror or exc}") from None
        self._target = target

    def finish(self) -> None:
        """The run is complete: close, and put the new results in place of the old."""
        self.close()
        if self._target is not None and self._target != self.path:
            os.replace(self._target, self.path)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def partial_path(path: Path) -> Path:
    return path.with_name(path.name + PARTIAL_SUFFIX)


class ResultSink:
    """Where every result and refused line of a command goes, in the chosen format.

    In OpenAI's format a line with several choices is written once all of
    them arrived (only lines in flight are held). Failed lines go to
    ``errors`` when it is given (the Batch API's error file), else to ``out``.
    """

    def __init__(
        self,
        fmt: Format,
        out: Callable[[bytes], object],
        errors: Callable[[bytes], object] | None = None,
        *,
        model: str = "",
    ) -> None:
        self.format: Format = fmt
        self.model = model
        self._out = out
        self._errors = errors or out
        self._groups: dict[tuple[str, int | None], list[p.ItemResult]] = {}
        self.written = 0

    def result(self, result: p.ItemResult) -> None:
        if self.format == "kvmux":
            self._emit(result_line(result), ok=result.status == "ok")
            return
        if is_rejected(result):
            assert result.error is not None
            self._emit(batch_refused_line(result.custom_id, result.error.message), ok=False)
            return
        key = (result.custom_id, result.line)
        group = self._groups.setdefault(key, [])
        group.append(result)
        if len(group) >= result.choices:
            del self._groups[key]
            self._line(group)

    def refused(self, err: LineError, code: str = "invalid_request") -> None:
        """A line that never ran; ``code`` is OpenAI's for why (a batch stopped before
        it ran it: ``batch_cancelled``, ``batch_expired``)."""
        if self.format == "kvmux":
            self._emit(refused_line(err), ok=False)
        else:
            self._emit(batch_refused_line(err.custom_id, str(err), code), ok=False)

    def flush(self) -> None:
        """Write the lines still missing some choices with those they have (the job is
        over: the rest will not come)."""
        groups, self._groups = self._groups, {}
        for group in groups.values():
            self._line(group)

    def _line(self, group: list[p.ItemResult]) -> None:
        self._emit(batch_output_line(group, self.model), ok=all(r.status == "ok" for r in group))

    @property
    def pending(self) -> int:
        """Lines still waiting for some of their choices."""
        return len(self._groups)

    def _emit(self, obj: dict[str, Any], *, ok: bool) -> None:
        data = msgspec.json.encode(obj) + b"\n"
        (self._out if ok else self._errors)(data)
        self.written += 1


def done_ids(path: str | Path) -> set[str]:
    """The custom_ids with a complete ok result in a results file of either format
    (``--resume``); a line with several choices counts once all of them are ok.
    Failed lines are not done: they run again."""
    path = Path(path)
    partial = partial_path(path)
    source = partial if partial.exists() else path
    done: set[str] = set()
    # kvmux lines carry one choice each: count the ok ones per custom_id.
    counts: dict[str, tuple[int, int]] = {}
    for obj in _objects(source):
        cid = obj.get("custom_id")
        if not isinstance(cid, str):
            continue
        if "response" in obj:
            response = obj.get("response")
            if (
                obj.get("error") is None
                and isinstance(response, dict)
                and response.get("status_code") == 200
            ):
                done.add(cid)
        elif obj.get("status") == "ok":
            got, need = counts.get(cid, (0, 1))
            choices = obj.get("choices", 1)
            counts[cid] = (got + 1, choices if isinstance(choices, int) else need)
    done.update(cid for cid, (got, need) in counts.items() if got >= need)
    return done


def _objects(path: Path) -> Iterator[dict[str, Any]]:
    try:
        stream = path.open("rb")
    except FileNotFoundError:
        return
    with stream:
        for raw in stream:
            try:
                obj = jsonin.decode(raw)
            except msgspec.DecodeError:
                continue  # a line cut short by a crash of the machine: run it again
            if isinstance(obj, dict):
                yield obj


class ResultWriter:
    """Writes result lines to a text stream (stdout), flushing each so a reader sees it now."""

    def __init__(self, write: Callable[[str], object], flush: Callable[[], object]) -> None:
        self._write = write
        self._flush = flush
        self.written = 0

    @classmethod
    def to_stream(cls, stream: IO[str]) -> ResultWriter:
        return cls(stream.write, stream.flush)

    def write(self, obj: dict[str, Any]) -> None:
        self.raw(msgspec.json.encode(obj) + b"\n")

    def raw(self, data: bytes) -> None:
        """One encoded line (ending in a newline)."""
        self._write(data.decode())
        self._flush()
        self.written += 1


def _nowhere(data: bytes) -> None:
    del data


class Outputs:
    """A command's result sink and the files behind it (``--out``, ``--errors``)."""

    def __init__(self, sink: ResultSink, files: list[OutFile]) -> None:
        self.sink = sink
        self.files = files

    def finish(self) -> None:
        """Every result is written: put each file in place (a ``.partial`` over the old)."""
        self.sink.flush()
        for f in self.files:
            f.finish()

    def close(self) -> None:
        """Stop without finishing: an existing file stays, the ``.partial`` beside it."""
        for f in self.files:
            f.close()


def open_outputs(
    fmt: Format,
    out: str | None,
    errors: str | None,
    stdout: ResultWriter | None,
    *,
    resume: bool = False,
) -> Outputs:
    """The sink a command writes to: ``--out`` (else ``stdout``), failed lines to
    ``--errors`` if given. No file is opened until its first line."""
    for path in (out, errors):
        # Found out now rather than at the first result, minutes into a run.
        folder = Path(path).resolve().parent if path is not None else None
        if folder is not None and not os.access(folder, os.W_OK | os.X_OK):
            raise CliError(f"cannot write {path}: {folder} is missing or not writable")
    files: list[OutFile] = []
    out_write: Callable[[bytes], object]
    if out is not None:
        out_file = OutFile(out, append=resume)
        files.append(out_file)
        out_write = out_file.write
    elif stdout is not None:
        out_write = stdout.raw
    else:  # a detached submit: its results stay with the daemon
        out_write = _nowhere
    err_write: Callable[[bytes], object] | None = None
    if errors is not None:
        # Failures run again on --resume, so the error file holds this run's only.
        err_file = OutFile(errors)
        files.append(err_file)
        err_write = err_file.write
    return Outputs(ResultSink(fmt, out_write, err_write), files)
