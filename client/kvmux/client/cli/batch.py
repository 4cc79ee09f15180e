"""Batch files: one request per JSONL line, in kvmux's own format or OpenAI's batch format.

A kvmux line is a flat object::

    {"custom_id": "a", "prompt": "Hello", "max_tokens": 32, "temperature": 0.7,
     "top_p": 0.9, "top_k": 40, "seed": 1, "stop": ["\\n"], "max_context": 512}

``prompt`` is text, a list of token ids (``prompt_tokens`` is the same thing
by another name) or a list of prompts; ``messages`` (a chat conversation) may
stand in its place. An OpenAI batch line (what ``vllm run-batch`` and OpenAI's
Batch API read) is::

    {"custom_id": "b", "method": "POST", "url": "/v1/chat/completions",
     "body": {"model": "any", "messages": [{"role": "user", "content": "Hi"}],
              "max_completion_tokens": 32}}

or the same with ``"url": "/v1/completions"`` and a ``prompt``. Its
``body.model`` is ignored (a daemon serves one model); an absent
``max_tokens`` means 16 for completions as in the Completions API, and the
model's own limit for chat. Both kinds of line take vLLM's sampling
parameters: ``min_p``, ``min_tokens``, ``repetition_penalty``,
``presence_penalty``, ``frequency_penalty``, ``stop_token_ids``,
``skip_special_tokens``, ``logprobs`` (completions and kvmux lines: how many
alternatives per token; chat: ``"logprobs": true`` with ``top_logprobs``),
and ``n``. A line with ``n`` > 1 or a list of prompts becomes several items
sharing its ``custom_id`` and line, numbered ``choice`` = prompt index * n +
j in OpenAI's order; with a ``seed`` s, choice j of a prompt samples with
seed s + j, so the n completions differ and a rerun repeats them. Structured
outputs: OpenAI's ``response_format``, vLLM's ``structured_outputs`` and
``guided_*`` (a bad schema fails its line alone, before it runs).

What this engine cannot do is refused per line with the reason:
``/v1/embeddings``, ``tools`` and ``functions``, a non-empty ``logit_bias``,
``echo``, ``suffix`` and ``best_of`` > n. A line without a ``custom_id`` gets ``line-N``; a
``custom_id`` used by an earlier line is refused (as OpenAI refuses the
file), naming that line. Blank lines are skipped; a UTF-8 BOM and CRLF line
ends are accepted. A line that does not parse becomes a :class:`LineError`
and the other lines are unaffected.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import msgspec

from .. import jsonin
from .. import protocol as p
from ..names import did_you_mean, nearest
from ..openai import (
    NATIVE_FIELDS,
    RequestError,
    body_items,
    json_type,
    names_of,
    to_items,
)

BOM = b"\xef\xbb\xbf"
_OPENAI_LINE_FIELDS = frozenset({"custom_id", "method", "url", "body"})


class LineError(Exception):
    """One line of a batch file could not become an item; the rest of the file is unaffected."""

    def __init__(self, line: int, reason: str, custom_id: str | None = None) -> None:
        super().__init__(f"line {line}: {reason}")
        self.line = line
        self.reason = reason
        # The id results are matched by: a line without a usable one is `line-N`.
        self.custom_id = custom_id if custom_id is not None else f"line-{line}"

    def to_info(self) -> p.ErrorInfo:
        return p.ErrorInfo(
            code="bad_request",
            message=str(self),
            details={"line": self.line, "reason": self.reason},
        )


def numbered_lines(stream: Iterable[bytes]) -> Iterator[tuple[int, bytes]]:
    """A batch file's non-blank lines, numbered from 1, without their ends (a BOM and
    CRLF ends are fine): how the CLI and kvmuxd's Batch API read one alike."""
    for number, raw in enumerate(stream, start=1):
        if number == 1 and raw.startswith(BOM):
            raw = raw[len(BOM) :]
        raw = raw.rstrip(b"\r\n")
        if raw.strip():
            yield number, raw


class DuplicateId(LineError):
    """A line reusing an earlier line's ``custom_id``: reported even when resuming."""


class BatchReader:
    """Reads a batch file a line at a time, yielding items and refused lines in file order.

    ``stream`` is a binary file or any iterable of lines; the file is never
    held: memory grows only with the ``custom_id``s seen (to refuse
    duplicates). After iterating, ``openai`` says whether the file is
    OpenAI-shaped (its first line that decodes to an object decides; None
    for a file without one), and the counters say what was read. ``skip``
    holds custom_ids already done (``--resume``): their lines are counted in
    ``skipped`` and not yielded.
    """

    def __init__(
        self, stream: Iterable[bytes], skip: frozenset[str] | set[str] = frozenset()
    ) -> None:
        self._stream = stream
        self._skip = skip
        self._first_line: dict[str, int] = {}
        self.openai: bool | None = None
        self.items = 0
        self.errors = 0
        self.skipped = 0

    @property
    def lines(self) -> int:
        """Results this file produces so far: one per choice, one per refused line."""
        return self.items + self.errors

    def __iter__(self) -> Iterator[p.Item | LineError]:
        for number, raw in numbered_lines(self._stream):
            try:
                items = self._parse(raw, number)
            except LineError as exc:
                if exc.custom_id in self._skip and not isinstance(exc, DuplicateId):
                    self.skipped += 1
                    continue
                self.errors += 1
                yield exc
                continue
            if items[0].custom_id in self._skip:
                self.skipped += 1
                continue
            self.items += len(items)
            yield from items

    def _parse(self, raw: bytes, number: int) -> list[p.Item]:
        obj = _decode(raw, number)
        if self.openai is None:
            self.openai = _is_openai(obj)
        cid = obj.get("custom_id")
        if isinstance(cid, str):
            first = self._first_line.setdefault(cid, number)
            if first != number:
                raise DuplicateId(
                    number,
                    f"custom_id {cid!r} is already used by line {first}; each line needs its own",
                    cid,
                )
        return _parse_object(obj, number)


@dataclass
class Batch:
    """A whole parsed batch in memory (for small files and tests): items and refused lines."""

    items: list[p.Item] = field(default_factory=list)
    errors: list[LineError] = field(default_factory=list)
    openai: bool | None = None

    @property
    def lines(self) -> list[int]:
        return [item.line or 0 for item in self.items]

    @property
    def total(self) -> int:
        """Results this batch produces: one per choice and one per refused line."""
        return len(self.items) + len(self.errors)


def read_batch(raw_lines: Iterable[bytes]) -> Batch:
    """Parse every line (numbered from 1) into one :class:`Batch`."""
    reader = BatchReader(raw_lines)
    batch = Batch()
    for entry in reader:
        if isinstance(entry, LineError):
            batch.errors.append(entry)
        else:
            batch.items.append(entry)
    batch.openai = reader.openai
    return batch


def parse_line(raw: bytes | str, line: int) -> list[p.Item]:
    """One JSONL line as checked items (several for ``n`` > 1 or a prompt list), or
    :class:`LineError`."""
    return _parse_object(_decode(raw, line), line)


def _decode(raw: bytes | str, line: int) -> dict[str, Any]:
    try:
        obj = jsonin.decode(raw)
    except msgspec.DecodeError as exc:
        raise LineError(line, f"not valid JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise LineError(line, f"expected a JSON object, got {json_type(obj)}")
    return obj


def _is_openai(obj: dict[str, Any]) -> bool:
    return bool({"method", "url", "body"} & obj.keys())


def _parse_object(obj: dict[str, Any], line: int) -> list[p.Item]:
    cid = obj.get("custom_id")
    custom_id = cid if isinstance(cid, str) else f"line-{line}"
    try:
        if _is_openai(obj):
            return _openai(obj, line)
        return _native(obj, line)
    except LineError as exc:
        exc.custom_id = custom_id
        raise
    except RequestError as exc:
        raise LineError(line, exc.message, custom_id) from None


def _native(obj: dict[str, Any], line: int) -> list[p.Item]:
    unknown = sorted(obj.keys() - NATIVE_FIELDS)
    if unknown:
        # A typo gets its correction; only a field nothing resembles gets the whole list.
        guesses = {name: nearest(name, NATIVE_FIELDS) for name in unknown}
        if all(guesses.values()):
            fixes = ", ".join(
                f"`{name}`: did you mean `{guess}`?" for name, guess in guesses.items()
            )
            raise LineError(line, f"unknown field {fixes}")
        raise LineError(
            line,
            f"unknown field {names_of(unknown)}; a kvmux line takes "
            f"{names_of(sorted(NATIVE_FIELDS))} (or an OpenAI batch line: custom_id, method, "
            "url, body)",
        )
    return to_items(obj, line=line)


def _openai(obj: dict[str, Any], line: int) -> list[p.Item]:
    unknown = sorted(obj.keys() - _OPENAI_LINE_FIELDS)
    if unknown:
        hints = "".join(did_you_mean(name, _OPENAI_LINE_FIELDS) for name in unknown)
        raise LineError(
            line,
            f"unknown field {names_of(unknown)}{hints} in an OpenAI batch line (custom_id, "
            "method, url, body)",
        )
    method = obj.get("method", "POST")
    if method != "POST":
        raise LineError(line, f"method {method!r} is not supported; OpenAI batch lines use POST")
    return body_items(
        obj.get("url"), obj.get("body"), prefix="body.", custom_id=obj.get("custom_id"), line=line
    )
