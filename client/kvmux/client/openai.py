"""OpenAI's API in kvmux's terms: one translation each way, shared by the CLI, the
daemon's HTTP front and the Batch API's output files.

Requests: the body of a ``/v1/chat/completions`` or ``/v1/completions`` request
(an HTTP request, or a batch line's ``body``) becomes kvmux items —
:func:`body_items`. The same parameters a kvmux line takes (vLLM's sampling
extras included) are read by :func:`to_items`. ``n`` > 1 and a list of prompts
give several items numbered ``choice`` = prompt index * n + j in OpenAI's
order; with a ``seed`` s, choice j of a prompt samples with seed s + j.

Structured outputs come in every shape people send them: OpenAI's
``response_format`` (``json_object``, ``json_schema``), vLLM's
``structured_outputs`` and its older ``guided_json``, ``guided_regex``,
``guided_choice``, ``guided_grammar``; each becomes the item's one
``structured_outputs`` (:func:`structured_outputs`).

Tool calling (``tools``, ``tool_choice``, ``parallel_tool_calls``, past calls in
``messages``) is :mod:`kvmux.client.tools`'s: a grammar in ``structured_outputs``
and the item's ``tool_mode``; a chat result with a ``tool_mode`` has its calls
read out of its text into ``message.tool_calls``.

What this engine cannot do is refused with the reason: the legacy ``functions``,
a non-empty ``logit_bias``, ``echo``, ``suffix``, ``best_of`` > n. A refusal is
a :class:`RequestError` naming the parameter.

Responses: kvmux results become OpenAI's bodies — ``chat.completion`` /
``text_completion`` (:func:`completion_body`), their streamed chunks
(:func:`chat_chunk`, :func:`completion_chunk`), a Batch API output line
(:func:`batch_output_line`, :func:`batch_refused_line`), an error object
(:func:`error_body`) with the HTTP status OpenAI gives the kvmux error code
(:func:`http_status`).

This module imports nothing of the daemon; it is plain data in, plain data out.
"""

from __future__ import annotations

import re
import time
import uuid
from typing import Any

import msgspec

from . import protocol as p
from . import tools as tc
from .names import did_you_mean

COMPLETIONS_URL = "/v1/completions"
CHAT_URL = "/v1/chat/completions"
ENDPOINTS = (CHAT_URL, COMPLETIONS_URL)
# The Completions API's default max_tokens; chat's default is the model's own limit.
DEFAULT_MAX_TOKENS = 16

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
        "response_format",
        "structured_outputs",
        "guided_json",
        "guided_regex",
        "guided_choice",
        "guided_grammar",
    }
)
NATIVE_FIELDS = _SAMPLING | {
    "custom_id",
    "prompt",
    "prompt_tokens",
    "messages",
    "max_new_tokens",
    "min_new_tokens",
    "logprobs",
}
_COMPLETIONS_FIELDS = _SAMPLING | {"prompt", "logprobs"}
_CHAT_FIELDS = _SAMPLING | {"messages", "max_completion_tokens", "logprobs", "top_logprobs"}
# Parameters that do not change the completion; requests carry them routinely.
# ``model``, ``stream`` and ``stream_options`` are the HTTP front's to read.
_IGNORED = frozenset(
    {"model", "user", "stream", "stream_options", "metadata", "store", "service_tier"}
)
# Parameters this engine cannot honour, accepted only at a value that means "off".
_NEUTRAL: dict[str, tuple[object, ...]] = {
    "echo": (False,),
    "suffix": ("",),
    "logit_bias": ({},),
}
_WHY_NOT = {
    "echo": "the prompt is not returned",
    "suffix": "no insertion mode",
    "logit_bias": "no per-token bias",
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
_MAX_CHOICES = 1 << 16  # what one request's results can number (Item.choices)
_PATH = re.compile(r"`\$\.(\w+)([^`]*)`")


class RequestError(ValueError):
    """A request (or a batch line's body) kvmux cannot run: the reason, and the
    parameter it is about when there is one (OpenAI's ``param``)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


# -- requests --------------------------------------------------------------------------


def body_items(
    url: object,
    body: object,
    *,
    prefix: str = "",
    custom_id: object = None,
    line: int | None = None,
) -> list[p.Item]:
    """The items a request to ``url`` with ``body`` asks for. ``prefix`` is how
    parameters are named in errors (``"body."`` for a batch line's); ``custom_id``
    and ``line`` are a batch line's, echoed in each item."""
    if url not in ENDPOINTS:
        embeddings = url == "/v1/embeddings"
        why = " (kvmux generates text; it computes no embeddings)" if embeddings else ""
        raise RequestError(
            f"url {short(url)} is not supported{why}: use {CHAT_URL!r} or {COMPLETIONS_URL!r}"
        )
    if not isinstance(body, dict):
        name = prefix.rstrip(".") or "body"
        raise RequestError(f"`{name}` must be a JSON object, got {json_type(body)}")
    chat = url == CHAT_URL
    accepted = _CHAT_FIELDS if chat else _COMPLETIONS_FIELDS
    fields: dict[str, Any] = {}
    tools = _tools(body, prefix) if chat else None
    for key, value in body.items():
        if chat and key in tc.FIELDS:
            continue
        if key in accepted:
            fields[key] = value
        elif key in _IGNORED or value is None:
            continue
        elif key in _NEUTRAL:
            if value not in _NEUTRAL[key]:
                raise RequestError(
                    f"`{prefix}{key}` = {short(value)} is not supported by kvmux "
                    f"({_WHY_NOT.get(key, 'not supported')}); leave it out",
                    key,
                )
        elif key == "best_of":
            fields[key] = value  # checked against n below
        elif key == "prompt" and chat:
            raise RequestError(f"a {CHAT_URL} body takes `messages`, not `prompt`", key)
        elif key == "messages":
            raise RequestError(f"a {COMPLETIONS_URL} body takes `prompt`, not `messages`", key)
        else:
            hint = did_you_mean(key, accepted, prefix=prefix)
            raise RequestError(f"unknown field `{prefix}{key}` for {url}{hint}", key)
    if chat:
        if "max_tokens" in fields and "max_completion_tokens" in fields:
            raise RequestError(
                f"give `{prefix}max_tokens` or `{prefix}max_completion_tokens`, not both",
                "max_tokens",
            )
        if "max_completion_tokens" in fields:
            fields["max_tokens"] = fields.pop("max_completion_tokens")
        _chat_logprobs(fields, prefix)
        if "messages" not in fields:
            raise RequestError(f"a {CHAT_URL} body needs `messages`", "messages")
        _with_tools(fields, tools, prefix)
    elif "prompt" not in fields:
        raise RequestError(f"a {COMPLETIONS_URL} body needs `prompt`", "prompt")
    best_of = fields.pop("best_of", None)
    if best_of is not None:
        n = whole(fields.get("n", 1))
        if whole(best_of) != n:
            raise RequestError(
                f"`{prefix}best_of` = {short(best_of)} is not supported: kvmux returns every "
                "sequence it samples (leave it out, or equal to `n`)",
                "best_of",
            )
    if custom_id is not None:
        fields["custom_id"] = custom_id
    default = None if chat else DEFAULT_MAX_TOKENS
    return to_items(fields, prefix=prefix, default_max_tokens=default, line=line)


def _tools(body: dict[str, Any], prefix: str) -> tc.Tools | None:
    try:
        return tc.parse(body, prefix)
    except tc.ToolError as exc:
        raise RequestError(exc.message, exc.param) from None


def _with_tools(fields: dict[str, Any], tools: tc.Tools | None, prefix: str) -> None:
    """A chat request's tools as its messages (the generic format), its grammar and its
    ``tool_mode``."""
    try:
        fields["messages"] = tc.plain_messages(fields["messages"], tools, prefix)
    except tc.ToolError as exc:
        raise RequestError(exc.message, exc.param) from None
    if tools is None or tools.mode is None:
        return
    for key in ("response_format", "structured_outputs", *_GUIDED):
        value = fields.get(key)
        if value is None or (key == "response_format" and _is_text(value)):
            continue
        which = "a named tool" if tools.mode == "named" else f"tool_choice {tools.mode!r}"
        raise RequestError(
            f"`{prefix}{key}` cannot be combined with {which}: the calls are the output's "
            f"constraint (give `{prefix}tool_choice`: none to constrain the text instead)",
            key,
        )
    fields.pop("response_format", None)
    fields["structured_outputs"] = {"grammar": tools.grammar()}
    fields["tool_mode"] = tools.mode


def _is_text(fmt: Any) -> bool:
    return isinstance(fmt, dict) and fmt.get("type") == "text"


def _chat_logprobs(fields: dict[str, Any], prefix: str) -> None:
    """Chat's ``logprobs: true`` + ``top_logprobs: k`` as the item's one ``logprobs: k``."""
    want = fields.pop("logprobs", None)
    top = fields.pop("top_logprobs", None)
    if want not in (None, True, False):
        raise RequestError(f"`{prefix}logprobs` of a chat request is true or false", "logprobs")
    if want:
        fields["logprobs"] = 0 if top is None else top
    elif top is not None:
        raise RequestError(f"`{prefix}top_logprobs` needs `{prefix}logprobs`: true", "top_logprobs")


def to_items(
    fields: dict[str, Any],
    *,
    prefix: str = "",
    default_max_tokens: int | None = None,
    line: int | None = None,
) -> list[p.Item]:
    """Items from a request's parameters (a kvmux line's, or an OpenAI body's), one per
    choice; ``line`` is echoed in each."""
    # JSON null means "not given" (OpenAI files write "stop": null).
    given = {k: whole(v) if k in _INTEGERS else v for k, v in fields.items() if v is not None}
    if line is not None:  # a batch line without a custom_id (or with null) is named by its line
        given.setdefault("custom_id", f"line-{line}")
    names: dict[str, str] = {k: k if k == "custom_id" else prefix + k for k in given}

    def rename(old: str, new: str) -> None:
        given[new] = given.pop(old)
        names[new] = names.pop(old)

    if "max_tokens" in given and "max_new_tokens" in given:
        raise RequestError("give `max_tokens` or `max_new_tokens`, not both", "max_tokens")
    if "max_tokens" in given:
        rename("max_tokens", "max_new_tokens")
    elif "max_new_tokens" not in given and default_max_tokens is not None:
        given["max_new_tokens"] = default_max_tokens
    if "min_tokens" in given and "min_new_tokens" in given:
        raise RequestError("give `min_tokens` or `min_new_tokens`, not both", "min_tokens")
    if "min_tokens" in given:
        rename("min_tokens", "min_new_tokens")
    stop = given.get("stop")
    if isinstance(stop, str):
        given["stop"] = [stop]
    if "messages" in given:
        given["messages"] = _messages(given["messages"], names["messages"])
    constraint = structured_outputs(given, prefix)
    if constraint is not None:
        given["structured_outputs"] = constraint
        names["structured_outputs"] = prefix + "structured_outputs"

    n = given.pop("n", 1)
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= 128:
        raise RequestError(f"`{prefix}n` must be a whole number from 1 to 128, got {short(n)}", "n")
    prompts: list[Any] = [None]
    if isinstance(given.get("prompt"), list):
        if "prompt_tokens" in given:
            raise RequestError("give `prompt` or `prompt_tokens`, not both", "prompt")
        prompts = _prompts(given.pop("prompt"), names.pop("prompt"))
    seed = given.get("seed")
    choices = len(prompts) * n
    if choices > _MAX_CHOICES:
        raise RequestError(
            f"{len(prompts)} prompts x n={n} is {choices} completions; at most {_MAX_CHOICES}", "n"
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
            one.update(choice=i * n + j, choices=choices, n=n)
            if line is not None:
                one["line"] = line
            items.append(_check(one, prefix, names))
    return items


# vLLM's older spellings of its structured_outputs fields.
_GUIDED = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}


def structured_outputs(given: dict[str, Any], prefix: str = "") -> dict[str, Any] | None:
    """Takes OpenAI's ``response_format``, vLLM's ``structured_outputs`` and ``guided_*``
    out of ``given``: the one ``structured_outputs`` they ask for (None: none). More
    than one is refused, as vLLM refuses more than one kind of constraint."""
    asked: dict[str, dict[str, Any]] = {}
    fmt = given.pop("response_format", None)
    if fmt is not None:
        wanted = _response_format(fmt, prefix)
        if wanted is not None:
            asked["response_format"] = wanted
    native = given.pop("structured_outputs", None)
    if native is not None:
        if not isinstance(native, dict):
            raise RequestError(
                f"`{prefix}structured_outputs` must be an object, got {json_type(native)}",
                "structured_outputs",
            )
        asked["structured_outputs"] = native
    for old, new in _GUIDED.items():
        value = given.pop(old, None)
        if value is not None:
            asked[old] = {new: value}
    if len(asked) > 1:
        raise RequestError(
            f"give one of {names_of([prefix + k for k in asked])}: one constraint per request",
            next(iter(asked)),
        )
    return next(iter(asked.values()), None)


def _response_format(fmt: Any, prefix: str) -> dict[str, Any] | None:
    """OpenAI's ``response_format`` as vLLM's ``structured_outputs`` (None: plain text)."""
    name = f"`{prefix}response_format`"
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind != "json_schema":
        raise RequestError(
            f"{name} must be an object whose `type` is text, json_object or json_schema; "
            f"got {short(fmt)}",
            "response_format",
        )
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
        raise RequestError(
            f'{name} of type json_schema needs `json_schema`: {{"name": ..., "schema": {{...}}}}',
            "response_format",
        )
    schema = spec.get("schema")
    if not isinstance(schema, dict):
        raise RequestError(
            f"`{prefix}response_format.json_schema.schema` must be a JSON schema object, "
            f"got {json_type(schema)}",
            "response_format",
        )
    # `strict` asks for what kvmux always does: the output follows the schema.
    return {"json": schema}


def _check(given: dict[str, Any], prefix: str, names: dict[str, str]) -> p.Item:
    # convert checks every wire constraint, as check_item would (at half the cost).
    try:
        item = msgspec.convert(given, p.Item)
    except msgspec.ValidationError as exc:
        text = str(exc)
        match = _PATH.search(text)
        param = names.get(match.group(1), match.group(1)).removeprefix(prefix) if match else None
        raise RequestError(_rename_paths(text, names), param) from None
    if sum(x is not None for x in (item.prompt, item.prompt_tokens, item.messages)) != 1:
        raise RequestError(
            f"exactly one of `{prefix}prompt`, `prompt_tokens` and `{prefix}messages` "
            "must be given",
            "prompt",
        )
    return item


def _prompts(prompt: list[Any], name: str) -> list[Any]:
    """A list prompt: token ids (one prompt), or a list of texts or of token-id lists."""
    if not prompt:
        raise RequestError(f"`{name}` is empty", "prompt")
    if all(_is_token(t) for t in prompt):
        return [prompt]
    if len(prompt) > 1024:
        raise RequestError(f"`{name}` must hold 1 to 1024 prompts", "prompt")
    for k, one in enumerate(prompt):
        if not isinstance(one, str) and not (
            isinstance(one, list) and one and all(_is_token(t) for t in one)
        ):
            raise RequestError(
                f"`{name}[{k}]` must be text or a list of token ids, got {json_type(one)}",
                "prompt",
            )
    return prompt


def _messages(messages: Any, name: str) -> list[dict[str, Any]]:
    """OpenAI's messages as ChatMessage fields: text parts flattened, other parts refused."""
    if not isinstance(messages, list):
        raise RequestError(
            f"`{name}` must be a list of messages, got {json_type(messages)}", "messages"
        )
    out = []
    for k, msg in enumerate(messages):
        where = f"`{name}[{k}]`"
        if not isinstance(msg, dict):
            raise RequestError(f"{where} must be an object, got {json_type(msg)}", "messages")
        unknown = sorted(msg.keys() - {"role", "content", "name"})
        if unknown:
            raise RequestError(
                f"{where} has {names_of(unknown)}, which a chat message does not take",
                "messages",
            )
        role = msg.get("role")
        if not isinstance(role, str) or role not in _ROLES:  # a list is not hashable
            raise RequestError(
                f"{where}.role must be one of {', '.join(sorted(_ROLES))}; got {short(role)}",
                "messages",
            )
        content = msg.get("content")
        if content is None:
            content = ""
        elif isinstance(content, list):
            content = _flatten(content, where)
        elif not isinstance(content, str):
            raise RequestError(f"{where}.content must be text or a list of text parts", "messages")
        entry: dict[str, Any] = {"role": role, "content": content}
        if msg.get("name") is not None:
            entry["name"] = msg["name"]
        out.append(entry)
    return out


def _flatten(parts: list[Any], where: str) -> str:
    # vLLM joins the text parts of one message with newlines; so does kvmux.
    texts = []
    for k, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text" or not isinstance(part.get("text"), str):
            raise RequestError(
                f"{where}.content[{k}] is a {kind or json_type(part)!s} part; kvmux takes "
                'text only ({"type": "text", "text": ...})',
                "messages",
            )
        texts.append(part["text"])
    return "\n".join(texts)


def whole(value: Any) -> Any:
    """10.0 as 10; anything else unchanged (and refused later if it is not a number)."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def _is_token(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _rename_paths(message: str, names: dict[str, str]) -> str:
    """msgspec's ``$.max_new_tokens`` as the name the request used (``body.max_tokens``)."""
    return _PATH.sub(lambda m: f"`{names.get(m.group(1), m.group(1))}{m.group(2)}`", message)


def names_of(keys: list[str]) -> str:
    return ", ".join(f"`{k}`" for k in keys)


def short(value: object) -> str:
    text = msgspec.json.encode(value).decode()
    return text if len(text) <= 60 else text[:57] + "..."


def json_type(value: object) -> str:
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


# -- responses --------------------------------------------------------------------------

# The HTTP status OpenAI would answer a request with, for each kvmux error code.
_STATUS = {
    "bad_request": 400,
    "unauthorized": 401,
    "not_found": 404,
    "model_not_found": 404,
    "overloaded": 429,
    "kv_capacity_exceeded": 400,
    "shutdown": 503,
    "not_ready": 503,
    "storage_full": 507,
    "version_mismatch": 400,
}
_ERROR_TYPE = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
}
# Items stopped before they finished, not failed by what they asked.
_STOPPED = frozenset({"cancelled", "shutdown"})
# kvmux's codes under the names OpenAI gives the same failures.
_CODES = {"kv_capacity_exceeded": "context_length_exceeded", "unauthorized": "invalid_api_key"}


def http_status(code: str) -> int:
    """The HTTP status of a response failing with kvmux error ``code``."""
    return _STATUS.get(code, 500)


def error_body(
    message: str, *, status: int, code: str | None, param: str | None = None
) -> dict[str, Any]:
    """OpenAI's error object, as the SDK maps it to an exception."""
    return {
        "error": {
            "message": message,
            "type": _ERROR_TYPE.get(status, "server_error"),
            "param": param,
            "code": _CODES.get(code, code) if code is not None else None,
        }
    }


def info_body(info: p.ErrorInfo) -> dict[str, Any]:
    """A kvmux error as OpenAI's error object (its diagnostics stay in ``details``)."""
    body = error_body(info.message, status=http_status(info.code), code=info.code)
    if info.details:
        body["error"]["details"] = info.details
    return body


def completion_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex


def usage(results: list[p.ItemResult], chat: bool) -> dict[str, Any]:
    """OpenAI's usage of one request's choices: each prompt counted once, however
    many choices (``n``) it has, as OpenAI counts them."""
    completion = 0
    # A chat request has one conversation; a completions request may hold several
    # prompts, ``n`` choices each. A prompt's cached tokens are those none of its
    # choices prefilled: with n > 1 the first choice prefills what the others copy,
    # and that was computed.
    prompts: dict[int, int] = {}
    cached: dict[int, int] = {}
    for r in results:
        u = r.usage
        if u is None:
            continue
        completion += u.completion_tokens
        k = 0 if chat else r.choice // r.n
        prompts[k] = u.prompt_tokens
        cached[k] = min(cached.get(k, u.cached_tokens), u.cached_tokens)
    prompt = sum(prompts.values())
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(cached.values())},
    }


def finish_reason(reason: str | None) -> str | None:
    # The engine says "stop" (end of sequence, a stop string or token) and
    # "length" (max_tokens or the context): OpenAI's words already, as is the
    # "tool_calls" of tool_finish.
    if reason is None or reason in ("stop", "length", "tool_calls"):
        return reason
    return "stop"


def chat_logprobs(steps: list[p.TokenLogprob]) -> dict[str, Any]:
    return {
        "content": [
            {
                "token": t.token,
                "logprob": t.logprob,
                "bytes": list(t.token.encode()),
                "top_logprobs": [
                    {"token": c.token, "logprob": c.logprob, "bytes": list(c.token.encode())}
                    for c in t.top
                ],
            }
            for t in steps
        ]
    }


def completion_logprobs(steps: list[p.TokenLogprob], at: int = 0) -> dict[str, Any]:
    offsets = []
    for t in steps:
        offsets.append(at)
        at += len(t.token)
    return {
        "tokens": [t.token for t in steps],
        "token_logprobs": [t.logprob for t in steps],
        "top_logprobs": [{c.token: c.logprob for c in t.top} if t.top else None for t in steps],
        "text_offset": offsets,
    }


def tool_finish(reason: str | None, mode: p.ToolMode | None, called: bool) -> str | None:
    """OpenAI's finish_reason of a tool-calling choice: ``tool_calls`` when calls were
    made under auto or required, ``stop`` under a named function; ``length`` wins."""
    reason = finish_reason(reason)
    if called and reason == "stop" and mode in ("auto", "required"):
        return "tool_calls"
    return reason


def chat_message(result: p.ItemResult) -> dict[str, Any]:
    """The assistant message of a chat result: its text, or its calls and what is left."""
    if result.tool_mode is None:
        return {"role": "assistant", "content": result.text}
    content, calls = tc.split(result.text)
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = calls
    return message


def choice(result: p.ItemResult, chat: bool) -> dict[str, Any]:
    reason = finish_reason(result.finish_reason)
    if chat:
        message = chat_message(result)
        if result.tool_mode is not None:
            reason = tool_finish(result.finish_reason, result.tool_mode, "tool_calls" in message)
        return {
            "index": result.choice,
            "message": message,
            "logprobs": None if result.logprobs is None else chat_logprobs(result.logprobs),
            "finish_reason": reason,
        }
    return {
        "index": result.choice,
        "text": result.text,
        "logprobs": None if result.logprobs is None else completion_logprobs(result.logprobs),
        "finish_reason": reason,
    }


def completion_body(
    results: list[p.ItemResult],
    model: str,
    *,
    id: str | None = None,
    created: int | None = None,
) -> dict[str, Any]:
    """OpenAI's ``chat.completion`` or ``text_completion`` for every choice of one request."""
    results = sorted(results, key=lambda r: r.choice)
    chat = results[0].chat
    return {
        "id": id or completion_id(chat),
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()) if created is None else created,
        "model": model,
        "choices": [choice(r, chat) for r in results],
        "usage": usage(results, chat),
    }


def chat_chunk(
    id: str,
    created: int,
    model: str,
    index: int,
    *,
    content: str | None = None,
    role: str | None = None,
    finish: str | None = None,
    logprobs: list[p.TokenLogprob] | None = None,
    tool_calls: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """One ``chat.completion.chunk`` of a streamed chat completion: choice ``index``'s
    new text or tool-call delta (its first chunk names the role), or how it finished."""
    delta: dict[str, Any] = {}
    if role is not None:
        delta["role"] = role
    if content is not None:
        delta["content"] = content
    if tool_calls is not None:
        delta["tool_calls"] = tool_calls
    return {
        "id": id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": index,
                "delta": delta,
                "logprobs": None if logprobs is None else chat_logprobs(logprobs),
                "finish_reason": finish_reason(finish),
            }
        ],
    }


def completion_chunk(
    id: str,
    created: int,
    model: str,
    index: int,
    *,
    text: str = "",
    finish: str | None = None,
    logprobs: list[p.TokenLogprob] | None = None,
) -> dict[str, Any]:
    """One streamed ``text_completion`` chunk: choice ``index``'s new text, or its end."""
    return {
        "id": id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": index,
                "text": text,
                "logprobs": None if logprobs is None else completion_logprobs(logprobs),
                "finish_reason": finish_reason(finish),
            }
        ],
    }


def usage_chunk(
    id: str, created: int, model: str, results: list[p.ItemResult], chat: bool
) -> dict[str, Any]:
    """The last chunk of a stream with ``stream_options.include_usage``: no choices, usage."""
    return {
        "id": id,
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": created,
        "model": model,
        "choices": [],
        "usage": usage(results, chat),
    }


def batch_output_line(results: list[p.ItemResult], model: str) -> dict[str, Any]:
    """The Batch API's output object for every choice of one input line."""
    results = sorted(results, key=lambda r: r.choice)
    first = results[0]
    failed = next((r for r in results if r.status != "ok"), None)
    response: dict[str, Any] = {"status_code": 200, "request_id": uuid.uuid4().hex}
    if failed is not None and failed.error is not None and failed.error.code in _STOPPED:
        # As the Batch API reports the requests of a cancelled (or expired) batch;
        # the partial text stays in kvmux's format.
        code = failed.error.details.get("batch_code", "batch_cancelled")
        return batch_refused_line(first.custom_id, failed.error.message, str(code))
    if failed is not None:
        info = failed.error or p.ErrorInfo(code="internal", message="failed")
        status = http_status(info.code)
        response["status_code"] = status
        # kvmux's own code, where a script reading batch output files looks for it.
        response["body"] = {
            "error": {
                "message": info.message,
                "type": _ERROR_TYPE.get(status, "server_error"),
                "param": None,
                "code": info.code,
            }
        }
    else:
        response["body"] = completion_body(results, model)
    return {
        "id": f"batch_req_{uuid.uuid4().hex}",
        "custom_id": first.custom_id,
        "response": response,
        "error": None,
    }


def batch_refused_line(
    custom_id: str, message: str, code: str = "invalid_request"
) -> dict[str, Any]:
    """The Batch API's output object for a line that never ran (or was stopped)."""
    return {
        "id": f"batch_req_{uuid.uuid4().hex}",
        "custom_id": custom_id,
        "response": None,
        "error": {"code": code, "message": message},
    }


def is_rejected(result: p.ItemResult) -> bool:
    """Whether a job's error result stands for an input line the client refused
    (sent as :class:`~kvmux.client.protocol.Rejected`), not an item that ran."""
    error = result.error
    return (
        error is not None
        and error.code == "bad_request"
        and result.usage is None
        and "reason" in error.details
        and error.details.get("line") == result.line
    )
