"""Batch files: one item per JSONL line, in kvmux's own format or OpenAI's batch format.

A kvmux line is a flat object::

    {"custom_id": "a", "prompt": "Hello", "max_tokens": 32, "temperature": 0.7,
     "top_p": 0.9, "top_k": 40, "seed": 1, "stop": ["\\n"], "max_context": 512}

``prompt`` is text or a list of token ids (``prompt_tokens`` is the same
thing by another name); ``max_new_tokens`` and ``ignore_eos`` are accepted
too. An OpenAI batch line (what ``vllm run-batch`` and OpenAI's Batch API
read) is::

    {"custom_id": "b", "method": "POST", "url": "/v1/completions",
     "body": {"model": "any", "prompt": "Hello", "max_tokens": 32}}

Its ``body.model`` is ignored (a daemon serves one model), an absent
``max_tokens`` means 16 as it does for the Completions API (other sampling
parameters default to the model's own, as vLLM's do), and body fields
that would change what comes back (``n``, ``logprobs``, ``echo``, penalties,
...) are refused unless they hold their neutral value. A line without a
``custom_id`` gets ``line-N``. Blank lines are skipped. A line that does not
parse becomes a :class:`LineError` naming the line and the reason, and the
other lines are unaffected.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from .. import protocol as p

OPENAI_URL = "/v1/completions"
OPENAI_DEFAULT_MAX_TOKENS = 16

_NATIVE_FIELDS = frozenset(
    {
        "custom_id",
        "prompt",
        "prompt_tokens",
        "max_tokens",
        "max_new_tokens",
        "temperature",
        "top_p",
        "top_k",
        "seed",
        "stop",
        "max_context",
        "ignore_eos",
    }
)
_OPENAI_LINE_FIELDS = frozenset({"custom_id", "method", "url", "body"})
# OpenAI's and vLLM's completion parameters that kvmux honours (vLLM takes
# top_k and ignore_eos as extensions; max_context is kvmux's own).
_OPENAI_BODY_FIELDS = _NATIVE_FIELDS - {"custom_id", "max_new_tokens"}
# Parameters that do not change the completion; files carry them routinely.
_OPENAI_IGNORED = frozenset({"model", "user", "stream", "stream_options"})
# Parameters kvmux cannot honour, accepted only at the value that means "off".
_OPENAI_NEUTRAL: dict[str, tuple[object, ...]] = {
    "n": (1,),
    "best_of": (1,),
    "echo": (False,),
    "logprobs": (False,),
    "suffix": ("",),
    "presence_penalty": (0, 0.0),
    "frequency_penalty": (0, 0.0),
    "repetition_penalty": (1, 1.0),
    "logit_bias": ({},),
    "min_tokens": (0,),
}
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


@dataclass
class Batch:
    """A parsed batch file: the items to submit, the line of each, and the lines refused."""

    items: list[p.Item] = field(default_factory=list)
    lines: list[int] = field(default_factory=list)
    errors: list[LineError] = field(default_factory=list)

    @property
    def total(self) -> int:
        """Results this batch produces: one per non-blank line."""
        return len(self.items) + len(self.errors)


def read_batch(raw_lines: Iterable[bytes]) -> Batch:
    """Parse every line (numbered from 1); blank lines are skipped, bad ones recorded."""
    batch = Batch()
    for number, raw in enumerate(raw_lines, start=1):
        if not raw.strip():
            continue
        try:
            item = parse_line(raw, number)
        except LineError as exc:
            batch.errors.append(exc)
            continue
        batch.items.append(item)
        batch.lines.append(number)
    return batch


def parse_line(raw: bytes | str, line: int) -> p.Item:
    """One JSONL line as a checked :class:`~kvmux.client.protocol.Item`, or :class:`LineError`."""
    try:
        obj = msgspec.json.decode(raw)
    except msgspec.DecodeError as exc:
        raise LineError(line, f"not valid JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise LineError(line, f"expected a JSON object, got {_json_type(obj)}")
    cid = obj.get("custom_id")
    custom_id = cid if isinstance(cid, str) else f"line-{line}"
    try:
        if {"method", "url", "body"} & obj.keys():
            return _openai(obj, line)
        return _native(obj, line)
    except LineError as exc:
        exc.custom_id = custom_id
        raise


def _native(obj: dict[str, Any], line: int) -> p.Item:
    unknown = sorted(obj.keys() - _NATIVE_FIELDS)
    if unknown:
        raise LineError(
            line,
            f"unknown field {_names(unknown)}; a kvmux line takes {_names(sorted(_NATIVE_FIELDS))} "
            "(or an OpenAI batch line: custom_id, method, url, body)",
        )
    return _to_item(obj, line, prefix="", default_max_tokens=None)


def _openai(obj: dict[str, Any], line: int) -> p.Item:
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
    if url != OPENAI_URL:
        hint = " (kvmux serves completions only: no chat template)" if url else ""
        raise LineError(line, f"url {url!r} is not supported: use {OPENAI_URL!r}{hint}")
    body = obj.get("body")
    if not isinstance(body, dict):
        raise LineError(line, f"`body` must be a JSON object, got {_json_type(body)}")
    fields: dict[str, Any] = {}
    for key, value in body.items():
        if key in _OPENAI_BODY_FIELDS:
            fields[key] = value
        elif key in _OPENAI_IGNORED or value is None:
            continue
        elif key in _OPENAI_NEUTRAL:
            if value not in _OPENAI_NEUTRAL[key]:
                raise LineError(
                    line,
                    f"`body.{key}` = {msgspec.json.encode(value).decode()} is not supported by "
                    "kvmux; leave it out (one completion per line, text and token ids only)",
                )
        else:
            raise LineError(line, f"unknown field `body.{key}` for {OPENAI_URL}")
    if "custom_id" in obj:
        fields["custom_id"] = obj["custom_id"]
    return _to_item(fields, line, prefix="body.", default_max_tokens=OPENAI_DEFAULT_MAX_TOKENS)


def _to_item(
    fields: dict[str, Any], line: int, *, prefix: str, default_max_tokens: int | None
) -> p.Item:
    # JSON null means "not given" in both formats (OpenAI files write "stop": null).
    given = {k: v for k, v in fields.items() if v is not None}
    names: dict[str, str] = {k: k if k == "custom_id" else prefix + k for k in given}

    if "max_tokens" in given and "max_new_tokens" in given:
        raise LineError(line, "give `max_tokens` or `max_new_tokens`, not both")
    if "max_tokens" in given:
        given["max_new_tokens"] = given.pop("max_tokens")
        names["max_new_tokens"] = names.pop("max_tokens")
    elif "max_new_tokens" not in given and default_max_tokens is not None:
        given["max_new_tokens"] = default_max_tokens

    prompt = given.get("prompt")
    if isinstance(prompt, list):
        prompt = _single_prompt(prompt, line, names["prompt"])
        if isinstance(prompt, list):
            if "prompt_tokens" in given:
                raise LineError(line, "give `prompt` or `prompt_tokens`, not both")
            del given["prompt"]
            given["prompt_tokens"] = prompt
            names["prompt_tokens"] = names.pop("prompt")
        else:
            given["prompt"] = prompt

    stop = given.get("stop")
    if isinstance(stop, str):
        given["stop"] = [stop]

    given.setdefault("custom_id", f"line-{line}")
    try:
        item = p.check_item(msgspec.convert(given, p.Item))
    except msgspec.ValidationError as exc:
        raise LineError(line, _rename_paths(str(exc), names)) from None
    except ValueError as exc:  # check_item: prompt XOR prompt_tokens
        raise LineError(line, str(exc).replace("`prompt`", f"`{prefix}prompt`")) from None
    return item


def _single_prompt(prompt: list[Any], line: int, name: str) -> str | list[Any]:
    """A list prompt: token ids, or a one-element list of text or token ids."""
    if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return prompt
    if len(prompt) == 1:
        first = prompt[0]
        if isinstance(first, str | list):
            return first
    raise LineError(
        line,
        f"`{name}` holds {len(prompt)} prompts; kvmux takes one prompt per line "
        "(write one line per prompt)",
    )


def _rename_paths(message: str, names: dict[str, str]) -> str:
    """msgspec's ``$.max_new_tokens`` as the name the line used (``body.max_tokens``)."""
    return _PATH.sub(lambda m: f"`{names.get(m.group(1), m.group(1))}{m.group(2)}`", message)


def _names(keys: list[str]) -> str:
    return ", ".join(f"`{k}`" for k in keys)


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
    return type(value).__name__
