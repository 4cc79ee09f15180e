"""OpenAI's tool calling in kvmux's terms: the request's ``tools``, ``tool_choice`` and
``parallel_tool_calls`` checked, the conversation's past calls and results written as
plain chat messages, the grammar that holds the model's calls to their schemas, and
the calls read back out of a completion's text.

The format (Hermes' and Qwen2.5's, which many models were tuned on) is written
out in docs/tool-calling.md. The tools go into the system turn; a call is::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

and a tool's result goes back as a user turn holding ``<tool_response>...</tool_response>``
(every chat template knows a user turn; not all know a ``tool`` role).

Enforcement is llguidance's (a Lark grammar in the item's ``structured_outputs``, run
in the same batched steps as any structured output): ``required`` and a named
function admit calls only; ``auto`` admits free text, and from the opening tag on
(a lazy rule: it matches as soon as ``<tool_call>`` has been written) only a call
whose name is a tool's and whose arguments follow that tool's ``parameters``.
``parallel_tool_calls: false`` admits at most one call; ``none`` no grammar at all.

This module imports nothing of the daemon; it is plain data in, plain data out.
"""

from __future__ import annotations

import re
import secrets
import string
from dataclasses import dataclass
from typing import Any

import msgspec

from .protocol import ToolMode

OPEN = "<tool_call>"
CLOSE = "</tool_call>"
#: What the openai SDK and OpenAI accept as a function's name.
NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
#: The request fields this module reads out of a chat body.
FIELDS = ("tools", "tool_choice", "parallel_tool_calls", "functions", "function_call")
_TOOL_KEYS = frozenset({"type", "function"})
_FUNCTION_KEYS = frozenset({"name", "description", "parameters", "strict"})
_CALL_KEYS = frozenset({"id", "type", "function"})
# The JSON written inside a call: OpenAI's separators, so the arguments a client sees
# are the bytes the model wrote.
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_CALL = re.compile(re.escape(OPEN) + r"\n(.*?)\n" + re.escape(CLOSE), re.DOTALL)
_ID_CHARS = string.ascii_letters + string.digits


class ToolError(ValueError):
    """A tool-calling parameter that cannot be run: the reason and OpenAI's ``param``."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


@dataclass(frozen=True, slots=True)
class Tools:
    """What a chat request asks for: its functions (name, description, parameters),
    the mode and the names a call may use, and whether several calls may come."""

    functions: tuple[tuple[str, str | None, dict[str, Any]], ...]
    mode: ToolMode | None  # None: tool_choice "none"
    allowed: tuple[str, ...]
    parallel: bool

    def grammar(self) -> str | None:
        """The Lark grammar (llguidance's) the completion must follow; None under ``none``."""
        if self.mode is None:
            return None
        params = {name: schema for name, _, schema in self.functions}
        rules = []
        alts = []
        for k, name in enumerate(self.allowed):
            schema = dict(params[name])
            schema["x-guidance"] = _JSON_OPTIONS
            source = msgspec.json.encode(schema).decode()
            rules.append(f'fn_{k}: "{name}\\", \\"arguments\\": " %json {source}')
            alts.append(f"fn_{k}")
        body = 'body: "\\n{\\"name\\": \\"" (' + " | ".join(alts) + ') "}\\n</tool_call>"'
        call = f'call: "{OPEN}" body'
        if self.mode == "auto":
            # The lazy rule ends at the first opening tag the free text writes: from
            # there on only a call is allowed.
            start = "start: (trig body)* TEXT" if self.parallel else "start: TEXT | trig body"
            head = [start, f'trig[lazy]: TEXT "{OPEN}"', "TEXT: /(.|\\n)*/"]
        elif self.mode == "required" and self.parallel:
            head = ['start: call ("\\n" call)*', call]
        else:  # one call: a named function, or required without parallel calls
            head = ["start: call", call]
        return "\n".join(["%llguidance {}", *head, body, *rules]) + "\n"


def parse(body: dict[str, Any], prefix: str = "") -> Tools | None:
    """The tool fields of a chat ``body`` checked (None: no tools asked for). A bad one
    is a :class:`ToolError` naming the parameter."""
    for old, new in (("functions", "tools"), ("function_call", "tool_choice")):
        if body.get(old) is not None:
            raise ToolError(
                f"`{prefix}{old}` is OpenAI's deprecated form; kvmux takes `{prefix}{new}` "
                f"instead (the same functions, each as {{'type': 'function', 'function': ...}})",
                old,
            )
    tools = body.get("tools")
    choice = body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise ToolError(
            f"`{prefix}parallel_tool_calls` must be true or false", "parallel_tool_calls"
        )
    if tools is None:
        if choice is not None and choice != "none":
            raise ToolError(
                f"`{prefix}tool_choice` is given without `{prefix}tools`", "tool_choice"
            )
        return None
    functions = _functions(tools, prefix)
    names = tuple(name for name, _, _ in functions)
    mode, allowed = _choice(choice, names, prefix)
    return Tools(functions, mode, allowed, True if parallel is None else parallel)


def _functions(tools: Any, prefix: str) -> tuple[tuple[str, str | None, dict[str, Any]], ...]:
    if not isinstance(tools, list) or not tools:
        raise ToolError(
            f"`{prefix}tools` must be a non-empty list of tools (leave it out for none)", "tools"
        )
    out: list[tuple[str, str | None, dict[str, Any]]] = []
    seen: set[str] = set()
    for k, tool in enumerate(tools):
        where = f"`{prefix}tools[{k}]`"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise ToolError(
                f"{where} must be {{'type': 'function', 'function': {{...}}}}; kvmux calls "
                "functions only",
                "tools",
            )
        unknown = sorted(tool.keys() - _TOOL_KEYS)
        if unknown:
            raise ToolError(f"{where} has unknown field(s) {unknown}", "tools")
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise ToolError(f"{where}.function must be an object", "tools")
        unknown = sorted(fn.keys() - _FUNCTION_KEYS)
        if unknown:
            raise ToolError(f"{where}.function has unknown field(s) {unknown}", "tools")
        name = fn.get("name")
        if not isinstance(name, str) or not NAME.match(name):
            raise ToolError(
                f"{where}.function.name must match {NAME.pattern} (letters, digits, _ and -; "
                f"at most 64), got {_short(name)}",
                "tools",
            )
        if name in seen:
            raise ToolError(f"{where}.function.name {name!r} is used by two tools", "tools")
        seen.add(name)
        description = fn.get("description")
        if description is not None and not isinstance(description, str):
            raise ToolError(f"{where}.function.description must be text", "tools")
        strict = fn.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise ToolError(f"{where}.function.strict must be true or false", "tools")
        params = fn.get("parameters")
        if params is None:
            params = {"type": "object", "properties": {}, "additionalProperties": False}
        if not isinstance(params, dict) or params.get("type", "object") != "object":
            raise ToolError(
                f"{where}.function.parameters must be a JSON schema of type object, "
                f"got {_short(params)}",
                "tools",
            )
        out.append((name, description, params))
    return tuple(out)


def _choice(
    choice: Any, names: tuple[str, ...], prefix: str
) -> tuple[ToolMode | None, tuple[str, ...]]:
    where = f"`{prefix}tool_choice`"
    if choice is None or choice == "auto":
        return "auto", names
    if choice == "none":
        return None, ()
    if choice == "required":
        return "required", names
    if isinstance(choice, dict) and choice.get("type") == "function":
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if name not in names:
            raise ToolError(
                f"{where} names function {_short(name)}, which is not in `{prefix}tools`",
                "tool_choice",
            )
        return "named", (name,)
    if isinstance(choice, dict) and choice.get("type") == "allowed_tools":
        spec = choice.get("allowed_tools")
        mode = spec.get("mode") if isinstance(spec, dict) else None
        listed = spec.get("tools") if isinstance(spec, dict) else None
        if mode not in ("auto", "required") or not isinstance(listed, list) or not listed:
            raise ToolError(
                f"{where} of type allowed_tools needs `allowed_tools`: {{'mode': 'auto' or "
                "'required', 'tools': [{'type': 'function', 'function': {'name': ...}}, ...]}",
                "tool_choice",
            )
        allowed = []
        for t in listed:
            fn = t.get("function") if isinstance(t, dict) else None
            name = fn.get("name") if isinstance(fn, dict) else None
            if not isinstance(t, dict) or t.get("type") != "function" or name not in names:
                raise ToolError(
                    f"{where}.allowed_tools.tools lists {_short(t)}, which is not a function "
                    f"of `{prefix}tools`",
                    "tool_choice",
                )
            if name not in allowed:
                allowed.append(name)
        return mode, tuple(allowed)
    raise ToolError(
        f"{where} must be none, auto, required, {{'type': 'function', 'function': "
        f"{{'name': ...}}}} or {{'type': 'allowed_tools', ...}}; got {_short(choice)}",
        "tool_choice",
    )


# -- the prompt --------------------------------------------------------------------------


def system_text(tools: Tools) -> str:
    """The instructions and tool list the system turn gets (the generic format)."""
    lines = [
        "# Tools",
        "",
        "You may call one or more functions to assist with the user query.",
        "",
        "You are provided with function signatures within <tools></tools> XML tags:",
        "<tools>",
    ]
    for name, description, params in tools.functions:
        fn: dict[str, Any] = {"name": name}
        if description is not None:
            fn["description"] = description
        fn["parameters"] = params
        lines.append(msgspec.json.encode({"type": "function", "function": fn}).decode())
    lines += [
        "</tools>",
        "",
        "For each function call, return a json object with function name and arguments "
        "within <tool_call></tool_call> XML tags:",
        OPEN,
        '{"name": <function-name>, "arguments": <args-json-object>}',
        CLOSE,
    ]
    return "\n".join(lines)


def render_call(name: str, arguments: Any) -> str:
    """One call as the model writes it."""
    args = msgspec.json.encode(arguments).decode()
    return f'{OPEN}\n{{"name": {msgspec.json.encode(name).decode()}, "arguments": {args}}}\n{CLOSE}'


def plain_messages(messages: Any, tools: Tools | None, prefix: str = "") -> Any:
    """``messages`` with past calls and tool results written in the generic format, and
    the tools in the system turn; anything that is not a list of objects is returned
    as it is (the caller refuses it). A ``tool`` message must answer an earlier call
    (its ``tool_call_id``), and a past call's ``arguments`` must be JSON."""
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        return messages
    out: list[dict[str, Any]] = []
    calls: set[str] = set()
    for k, msg in enumerate(messages):
        where = f"`{prefix}messages[{k}]`"
        role = msg.get("role")
        if role == "assistant" and msg.get("tool_calls") is not None:
            out.append(_assistant(msg, where, calls))
        elif role == "tool":
            call_id = msg.get("tool_call_id")
            if not isinstance(call_id, str) or call_id not in calls:
                raise ToolError(
                    f"{where} is a tool message whose `tool_call_id` {_short(call_id)} answers "
                    "no earlier assistant tool call",
                    "messages",
                )
            rest = {k2: v for k2, v in msg.items() if k2 not in ("role", "tool_call_id")}
            content = rest.get("content")
            out.append(
                {
                    **rest,
                    "role": "user",
                    "content": _wrap(content, "<tool_response>\n", "\n</tool_response>"),
                }
            )
        else:
            out.append(msg)
    if tools is not None and tools.mode is not None:
        text = system_text(tools)
        first = out[0] if out else None
        if first is not None and first.get("role") in ("system", "developer"):
            out[0] = {**first, "content": _wrap(first.get("content"), "", "\n\n" + text)}
        else:
            out.insert(0, {"role": "system", "content": text})
    return out


def _assistant(msg: dict[str, Any], where: str, calls: set[str]) -> dict[str, Any]:
    tool_calls = msg["tool_calls"]
    if not isinstance(tool_calls, list):
        raise ToolError(f"{where}.tool_calls must be a list of calls", "messages")
    rendered = []
    for j, call in enumerate(tool_calls):
        at = f"{where}.tool_calls[{j}]"
        if not isinstance(call, dict) or call.get("type", "function") != "function":
            raise ToolError(f"{at} must be a function call", "messages")
        unknown = sorted(call.keys() - _CALL_KEYS)
        if unknown:
            raise ToolError(f"{at} has unknown field(s) {unknown}", "messages")
        fn = call.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        args = fn.get("arguments") if isinstance(fn, dict) else None
        if not isinstance(name, str) or not isinstance(args, str):
            raise ToolError(
                f"{at}.function needs `name` and `arguments` (a JSON string)", "messages"
            )
        try:
            parsed = msgspec.json.decode(args)
        except msgspec.DecodeError:
            raise ToolError(
                f"{at}.function.arguments is not JSON: {_short(args)}", "messages"
            ) from None
        if isinstance(call.get("id"), str):
            calls.add(call["id"])
        rendered.append(render_call(name, parsed))
    rest = {k: v for k, v in msg.items() if k != "tool_calls"}
    content = rest.get("content")
    text = "\n".join(rendered)
    rest["content"] = _wrap(content, "", ("\n" if content else "") + text) if content else text
    return rest


def _wrap(content: Any, before: str, after: str) -> Any:
    """Text content with ``before`` and ``after`` around it (a list of text parts gets
    them as parts of its own); anything else is left for the caller to refuse."""
    if content is None:
        return before + after
    if isinstance(content, str):
        return before + content + after
    if isinstance(content, list):
        head = [{"type": "text", "text": before}] if before else []
        return [*head, *content, {"type": "text", "text": after}]
    return content


# -- the response ------------------------------------------------------------------------


def call_id() -> str:
    """OpenAI's ``call_`` and 24 random characters."""
    return "call_" + "".join(secrets.choice(_ID_CHARS) for _ in range(24))


def split(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """A completion's text as its content (None when nothing is left) and its calls, in
    OpenAI's shape. A block that does not parse (a call the budget cut) stays content."""
    calls: list[dict[str, Any]] = []
    kept: list[str] = []
    at = 0
    for m in _CALL.finditer(text):
        try:
            obj = msgspec.json.decode(m.group(1))
        except msgspec.DecodeError:
            continue
        if (
            not isinstance(obj, dict)
            or not isinstance(obj.get("name"), str)
            or not isinstance(obj.get("arguments"), dict)
        ):
            continue
        kept.append(text[at : m.start()])
        at = m.end()
        calls.append(
            {
                "id": call_id(),
                "type": "function",
                "function": {"name": obj["name"], "arguments": _arguments(m.group(1))},
            }
        )
    kept.append(text[at:])
    content = "".join(kept).strip() if calls else text
    return (content or None), calls


def _arguments(block: str) -> str:
    """The arguments' JSON text exactly as the model wrote it (the grammar wrote
    ``{"name": "...", "arguments": {...}}``); re-encoded when the layout differs."""
    head = block.find('"arguments": ')
    if head >= 0 and block.endswith("}"):
        raw = block[head + len('"arguments": ') : -1]
        try:
            msgspec.json.decode(raw)
            return raw
        except msgspec.DecodeError:
            pass
    obj = msgspec.json.decode(block)
    return msgspec.json.encode(obj["arguments"]).decode()


def _short(value: object) -> str:
    try:
        text = msgspec.json.encode(value).decode()
    except TypeError:
        text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


_HEAD = '\n{"name": "'
_ARGS = '", "arguments": '
_TAIL = "}\n" + CLOSE


class CallStream:
    """One streamed choice's text as OpenAI's deltas: content (a partial opening tag held
    back until it is known not to be one), and per call one delta with its ``index``,
    ``id``, ``type``, ``name`` and ``arguments: ""``, then fragments of its arguments.
    The grammar wrote the calls, so their layout is the one :meth:`Tools.grammar` fixes;
    the fragments join to the non-streamed ``arguments``."""

    def __init__(self) -> None:
        self._buf = ""
        self._in_call = False
        self._name: str | None = None
        self.calls = 0

    def feed(self, text: str) -> list[dict[str, Any]]:
        """The deltas ``text`` (the choice's next piece) completes: each ``{"content": ...}``
        or ``{"tool_calls": [...]}``."""
        self._buf += text
        out: list[dict[str, Any]] = []
        while True:
            if not self._in_call:
                at = self._buf.find(OPEN)
                if at < 0:
                    keep = _partial(self._buf, OPEN)
                    if len(self._buf) > keep:
                        out.append({"content": self._buf[: len(self._buf) - keep]})
                        self._buf = self._buf[len(self._buf) - keep :]
                    return out
                if at:
                    out.append({"content": self._buf[:at]})
                self._buf = self._buf[at + len(OPEN) :]
                self._in_call, self._name = True, None
            if self._name is None:
                end = self._buf.find(_ARGS)
                if not self._buf.startswith(_HEAD[: len(self._buf)]) or end < 0:
                    return out
                self._name = self._buf[len(_HEAD) : end]
                self._buf = self._buf[end + len(_ARGS) :]
                fn = {"name": self._name, "arguments": ""}
                call = {"index": self.calls, "id": call_id(), "type": "function", "function": fn}
                out.append({"tool_calls": [call]})
            close = self._buf.find(_TAIL)
            upto = close if close >= 0 else max(len(self._buf) - len(_TAIL) + 1, 0)
            if upto:
                out.append(self._fragment(self._buf[:upto]))
                self._buf = self._buf[upto:]
            if close < 0:
                return out
            self._buf = self._buf[len(_TAIL) :]
            self._in_call = False
            self.calls += 1

    def _fragment(self, text: str) -> dict[str, Any]:
        return {"tool_calls": [{"index": self.calls, "function": {"arguments": text}}]}

    def flush(self) -> list[dict[str, Any]]:
        """What is held back when the choice ends (text that was not a call after all;
        the rest of a call the budget cut)."""
        rest, self._buf = self._buf, ""
        if not rest:
            return []
        if self._in_call and self._name is not None:
            return [self._fragment(rest)]
        return [{"content": (OPEN if self._in_call else "") + rest}]

    @property
    def called(self) -> bool:
        return self.calls > 0 or (self._in_call and self._name is not None)


def _partial(text: str, tag: str) -> int:
    """How many characters at the end of ``text`` could begin ``tag``."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0
