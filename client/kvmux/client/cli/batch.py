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
seed s + j, so the n completions differ and a rerun repeats them.

What this engine cannot do is refused per line with the reason:
``/v1/embeddings``, ``response_format`` other than text, ``tools`` and
``functions``, a non-empty ``logit_bias``, ``echo``, ``suffix`` and
``best_of`` > n. A line without a ``custom_id`` gets ``line-N``; a
``custom_id`` used by an earlier line is refused (as OpenAI refuses the
file), naming that line. Blank lines are skipped; a UTF-8 BOM and CRLF line
ends are accepted. A line that does not parse becomes a :class:`LineError`
and the other lines are unaffected.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import msgspec

from .. import protocol as p

COMPLETIONS_URL = "/v1/completions"
CHAT_URL = "/v1/chat/completions"
OPENAI_URL = COMPLETIONS_URL  # the name older callers import
OPENAI_DEFAULT_MAX_TOKENS = 16
BOM = b"\xef\xbb\xbf"

_SAMPLING = frozenset(
    {
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "seed",
        "stop",
        "stop_token_ids",
        "repetition_penalty",
        "presence_penalty",
        "frequency_penalty",
        "min_tokens",
        "skip_special_tokens",
        "max_context",
        "ignore_eos",
        "n",
        "max_tokens",
    }
)
_NATIVE_FIELDS = _SAMPLING | {
    "custom_id",
    "prompt",
    "prompt_tokens",
    "messages",
    "max_new_tokens",
    "min_new_tokens",
    "logprobs",
}
_OPENAI_LINE_FIELDS = frozenset({"custom_id", "method", "url", "body"})
_COMPLETIONS_FIELDS = _SAMPLING | {"prompt", "logprobs"}
_CHAT_FIELDS = _SAMPLING | {"messages", "max_completion_tokens", "logprobs", "top_logprobs"}
# Parameters that do not change the completion; files carry them routinely.
_OPENAI_IGNORED = frozenset(
    {"model", "user", "stream", "stream_options", "metadata", "store", "service_tier"}
)
# Parameters this engine cannot honour, accepted only at a value that means "off".
_OPENAI_NEUTRAL: dict[str, tuple[object, ...]] = {
    "echo": (False,),
    "suffix": ("",),
    "logit_bias": ({},),
    "tools": ([],),
    "functions": ([],),
    "tool_choice": ("none",),
    "function_call": ("none",),
    "parallel_tool_calls": (False, True),
    "response_format": ({"type": "text"},),
}
_WHY_NOT = {
    "echo": "the prompt is not returned",
    "suffix": "no insertion mode",
    "logit_bias": "no per-token bias",
    "tools": "no tool calling",
    "functions": "no tool calling",
    "tool_choice": "no tool calling",
    "function_call": "no tool calling",
    "response_format": "no structured output",
}
_ROLES = frozenset({"system", "user", "assistant", "developer", "tool"})
# Fields that are whole numbers; JSON writers sometimes emit them as 10.0.
_INTEGERS = frozenset(
    {
        "max_tokens",
        "max_new_tokens",
        "max_completion_tokens",
        "min_tokens",
        "min_new_tokens",
        "top_k",
        "seed",
        "n",
        "best_of",
        "logprobs",
        "top_logprobs",
        "max_context",
    }
)
_MAX_CHOICES = 1 << 16  # what one line's results can number (Item.choices)
_PATH = re.compile(r"`\$\.(\w+)([^`]*)`")


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
        for number, raw in enumerate(self._stream, start=1):
            if number == 1 and raw.startswith(BOM):
                raw = raw[len(BOM) :]
            raw = raw.rstrip(b"\r\n")
            if not raw.strip():
                continue
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
        obj = msgspec.json.decode(raw)
    except msgspec.DecodeError as exc:
        raise LineError(line, f"not valid JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise LineError(line, f"expected a JSON object, got {_json_type(obj)}")
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


def _native(obj: dict[str, Any], line: int) -> list[p.Item]:
    unknown = sorted(obj.keys() - _NATIVE_FIELDS)
    if unknown:
        raise LineError(
            line,
            f"unknown field {_names(unknown)}; a kvmux line takes {_names(sorted(_NATIVE_FIELDS))} "
            "(or an OpenAI batch line: custom_id, method, url, body)",
        )
    return _to_items(dict(obj), line, prefix="", default_max_tokens=None)


def _openai(obj: dict[str, Any], line: int) -> list[p.Item]:
    unknown = sorted(obj.keys() - _OPENAI_LINE_FIELDS)
    if unknown:
        raise LineError(
            line,
            f"unknown field {_names(unknown)} in an OpenAI batch line (custom_id, method, "
            "url, body)",
        )
    method = obj.get("method", "POST")
    if method != "POST":
        raise LineError(line, f"method {method!r} is not supported; OpenAI batch lines use POST")
    url = obj.get("url")
    if url not in (COMPLETIONS_URL, CHAT_URL):
        why = (
            " (kvmux generates text; it computes no embeddings)" if url == "/v1/embeddings" else ""
        )
        raise LineError(
            line, f"url {url!r} is not supported{why}: use {CHAT_URL!r} or {COMPLETIONS_URL!r}"
        )
    body = obj.get("body")
    if not isinstance(body, dict):
        raise LineError(line, f"`body` must be a JSON object, got {_json_type(body)}")
    chat = url == CHAT_URL
    accepted = _CHAT_FIELDS if chat else _COMPLETIONS_FIELDS
    fields: dict[str, Any] = {}
    for key, value in body.items():
        if key in accepted:
            fields[key] = value
        elif key in _OPENAI_IGNORED or value is None:
            continue
        elif key in _OPENAI_NEUTRAL:
            if value not in _OPENAI_NEUTRAL[key]:
                raise LineError(
                    line,
                    f"`body.{key}` = {_short(value)} is not supported by kvmux "
                    f"({_WHY_NOT.get(key, 'not supported')}); leave it out",
                )
        elif key == "best_of":
            fields[key] = value  # checked against n below
        elif key == "prompt" and chat:
            raise LineError(line, f"a {CHAT_URL} body takes `messages`, not `prompt`")
        elif key == "messages":
            raise LineError(line, f"a {COMPLETIONS_URL} body takes `prompt`, not `messages`")
        else:
            raise LineError(line, f"unknown field `body.{key}` for {url}")
    if chat:
        if "max_tokens" in fields and "max_completion_tokens" in fields:
            raise LineError(
                line, "give `body.max_tokens` or `body.max_completion_tokens`, not both"
            )
        if "max_completion_tokens" in fields:
            fields["max_tokens"] = fields.pop("max_completion_tokens")
        _chat_logprobs(fields, line)
        if "messages" not in fields:
            raise LineError(line, f"a {CHAT_URL} body needs `messages`")
    elif "prompt" not in fields:
        raise LineError(line, f"a {COMPLETIONS_URL} body needs `prompt`")
    best_of = fields.pop("best_of", None)
    if best_of is not None:
        n = _whole(fields.get("n", 1))
        if _whole(best_of) != n:
            raise LineError(
                line,
                f"`body.best_of` = {_short(best_of)} is not supported: kvmux returns every "
                "sequence it samples (leave it out, or equal to `n`)",
            )
    if "custom_id" in obj:
        fields["custom_id"] = obj["custom_id"]
    default = None if chat else OPENAI_DEFAULT_MAX_TOKENS
    return _to_items(fields, line, prefix="body.", default_max_tokens=default)


def _chat_logprobs(fields: dict[str, Any], line: int) -> None:
    """Chat's ``logprobs: true`` + ``top_logprobs: k`` as the item's one ``logprobs: k``."""
    want = fields.pop("logprobs", None)
    top = fields.pop("top_logprobs", None)
    if want not in (None, True, False):
        raise LineError(line, "`body.logprobs` of a chat request is true or false")
    if want:
        fields["logprobs"] = 0 if top is None else top
    elif top is not None:
        raise LineError(line, "`body.top_logprobs` needs `body.logprobs`: true")


def _to_items(
    fields: dict[str, Any], line: int, *, prefix: str, default_max_tokens: int | None
) -> list[p.Item]:
    # JSON null means "not given" in both formats (OpenAI files write "stop": null).
    given = {k: _whole(v) if k in _INTEGERS else v for k, v in fields.items() if v is not None}
    names: dict[str, str] = {k: k if k == "custom_id" else prefix + k for k in given}

    def rename(old: str, new: str) -> None:
        given[new] = given.pop(old)
        names[new] = names.pop(old)

    if "max_tokens" in given and "max_new_tokens" in given:
        raise LineError(line, "give `max_tokens` or `max_new_tokens`, not both")
    if "max_tokens" in given:
        rename("max_tokens", "max_new_tokens")
    elif "max_new_tokens" not in given and default_max_tokens is not None:
        given["max_new_tokens"] = default_max_tokens
    if "min_tokens" in given and "min_new_tokens" in given:
        raise LineError(line, "give `min_tokens` or `min_new_tokens`, not both")
    if "min_tokens" in given:
        rename("min_tokens", "min_new_tokens")
    stop = given.get("stop")
    if isinstance(stop, str):
        given["stop"] = [stop]
    if "messages" in given:
        given["messages"] = _messages(given["messages"], line, names["messages"])

    n = given.pop("n", 1)
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= 128:
        raise LineError(line, f"`{prefix}n` must be a whole number from 1 to 128, got {_short(n)}")
    prompts: list[Any] = [None]
    if isinstance(given.get("prompt"), list):
        if "prompt_tokens" in given:
            raise LineError(line, "give `prompt` or `prompt_tokens`, not both")
        prompts = _prompts(given.pop("prompt"), line, names.pop("prompt"))
    given.setdefault("custom_id", f"line-{line}")
    seed = given.get("seed")
    choices = len(prompts) * n
    if choices > _MAX_CHOICES:
        raise LineError(
            line, f"{len(prompts)} prompts x n={n} is {choices} completions; at most {_MAX_CHOICES}"
        )
    items = []
    for i, prompt in enumerate(prompts):
        for j in range(n):
            one = dict(given)
            if isinstance(prompt, str):
                one["prompt"] = prompt
                names.setdefault("prompt", prefix + "prompt")
            elif prompt is not None:
                one["prompt_tokens"] = prompt
                names.setdefault("prompt_tokens", prefix + "prompt")
            if isinstance(seed, int) and not isinstance(seed, bool):
                one["seed"] = seed + j
            one.update(line=line, choice=i * n + j, choices=choices, n=n)
            items.append(_check(one, line, prefix, names))
    return items


def _check(given: dict[str, Any], line: int, prefix: str, names: dict[str, str]) -> p.Item:
    # convert checks every wire constraint, as check_item would (at half the cost).
    try:
        item = msgspec.convert(given, p.Item)
    except msgspec.ValidationError as exc:
        raise LineError(line, _rename_paths(str(exc), names)) from None
    if sum(x is not None for x in (item.prompt, item.prompt_tokens, item.messages)) != 1:
        raise LineError(
            line,
            f"exactly one of `{prefix}prompt`, `prompt_tokens` and `{prefix}messages` "
            "must be given",
        )
    return item


def _prompts(prompt: list[Any], line: int, name: str) -> list[Any]:
    """A list prompt: token ids (one prompt), or a list of texts or of token-id lists."""
    if not prompt:
        raise LineError(line, f"`{name}` is empty")
    if all(_is_token(t) for t in prompt):
        return [prompt]
    if len(prompt) > 1024:
        raise LineError(line, f"`{name}` must hold 1 to 1024 prompts")
    for k, one in enumerate(prompt):
        if not isinstance(one, str) and not (
            isinstance(one, list) and one and all(_is_token(t) for t in one)
        ):
            raise LineError(
                line,
                f"`{name}[{k}]` must be text or a list of token ids, got {_json_type(one)}",
            )
    return prompt


def _messages(messages: Any, line: int, name: str) -> list[dict[str, Any]]:
    """OpenAI's messages as ChatMessage fields: text parts flattened, other parts refused."""
    if not isinstance(messages, list):
        raise LineError(line, f"`{name}` must be a list of messages, got {_json_type(messages)}")
    out = []
    for k, msg in enumerate(messages):
        where = f"`{name}[{k}]`"
        if not isinstance(msg, dict):
            raise LineError(line, f"{where} must be an object, got {_json_type(msg)}")
        unknown = sorted(msg.keys() - {"role", "content", "name"})
        if unknown:
            raise LineError(
                line, f"{where} has {_names(unknown)}, which kvmux does not support (no tools)"
            )
        role = msg.get("role")
        if role not in _ROLES:
            raise LineError(
                line, f"{where}.role must be one of {', '.join(sorted(_ROLES))}; got {role!r}"
            )
        content = msg.get("content")
        if content is None:
            content = ""
        elif isinstance(content, list):
            content = _flatten(content, line, where)
        elif not isinstance(content, str):
            raise LineError(line, f"{where}.content must be text or a list of text parts")
        entry: dict[str, Any] = {"role": role, "content": content}
        if msg.get("name") is not None:
            entry["name"] = msg["name"]
        out.append(entry)
    return out


def _flatten(parts: list[Any], line: int, where: str) -> str:
    # vLLM joins the text parts of one message with newlines; so does kvmux.
    texts = []
    for k, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text" or not isinstance(part.get("text"), str):
            raise LineError(
                line,
                f"{where}.content[{k}] is a {kind or _json_type(part)!s} part; kvmux takes "
                'text only ({"type": "text", "text": ...})',
            )
        texts.append(part["text"])
    return "\n".join(texts)


def _whole(value: Any) -> Any:
    """10.0 as 10; anything else unchanged (and refused later if it is not a number)."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def _is_token(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _rename_paths(message: str, names: dict[str, str]) -> str:
    """msgspec's ``$.max_new_tokens`` as the name the line used (``body.max_tokens``)."""
    return _PATH.sub(lambda m: f"`{names.get(m.group(1), m.group(1))}{m.group(2)}`", message)


def _names(keys: list[str]) -> str:
    return ", ".join(f"`{k}`" for k in keys)


def _short(value: object) -> str:
    text = msgspec.json.encode(value).decode()
    return text if len(text) <= 60 else text[:57] + "..."


def _json_type(value: object) -> str:
    match value:
        case None:
            return "null"
        case bool():
            return "a boolean"
        case int() | float():
            return "a number"
        case str():
            return "a string"
        case list():
            return "an array"
        case dict():
            return "an object"
    return type(value).__name__
