"""Chat templates: a model's Jinja template, rendered as transformers' ``apply_chat_template`` does.

The environment copies transformers' ``_compile_jinja_template``
(``utils/chat_template_utils.py``): Jinja2's ``ImmutableSandboxedEnvironment``
with ``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols`` extension, a
``{% generation %}`` tag that renders its body, transformers' ``tojson``
(no HTML escaping), ``raise_exception``, ``strftime_now``, and its restricted
``dict`` and ``namespace``. A template sees ``messages``, ``tools`` and
``documents`` (None), ``add_generation_prompt`` and the model's named special
tokens (``bos_token``, ``eos_token``, ...) as strings, as transformers passes
``special_tokens_map``. Templates come from model folders people download, so
they are untrusted code: the sandbox refuses attribute access to internals,
and every failure is a :class:`ChatTemplateError` for that one request.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Final

from kvmux.client import jsonin
from kvmux.daemon.model.errors import ModelFormatError

__all__ = [
    "CHAT_TEMPLATE_FILENAME",
    "ChatTemplate",
    "ChatTemplateError",
    "find_chat_template",
    "load_chat_template",
    "special_token_strings",
]

CHAT_TEMPLATE_FILENAME: Final = "chat_template.jinja"
TOKENIZER_CONFIG_FILENAME: Final = "tokenizer_config.json"

# The names transformers' special_tokens_map holds (SPECIAL_TOKENS_ATTRIBUTES).
_SPECIAL_TOKEN_KEYS: Final = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


class ChatTemplateError(ValueError):
    """A chat could not be rendered: the template raised, or it is not a valid template."""


@dataclass(frozen=True, slots=True)
class TemplateSource:
    """A template's text and where it was found (named in errors and logs)."""

    text: str
    origin: str


def _compile(source: str) -> Any:
    """transformers' environment; jinja2 is imported here, as the daemon's extra brings it."""
    import jinja2
    import jinja2.ext
    import jinja2.nodes
    import jinja2.utils
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTag(jinja2.ext.Extension):
        # transformers marks assistant spans with {% generation %}; rendering
        # only needs the body, which is what its tracker returns too.
        tags = {"generation"}  # noqa: RUF012 - as Jinja declares it

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_render", []), [], [], body).set_lineno(
                lineno
            )

        def _render(self, caller: Any) -> str:
            return str(caller())

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(
        x: Any,
        ensure_ascii: bool = False,
        indent: int | None = None,
        separators: tuple[str, str] | None = None,
        sort_keys: bool = False,
    ) -> str:
        # Jinja's own tojson escapes HTML characters; chat templates want plain JSON.
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    def strftime_now(format: str) -> str:
        return datetime.now().strftime(format)

    class TemplateDict:
        # dict() for templates without the class itself, so no attribute path
        # leads from it to Python's internals.
        def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
            return dict(*args, **kwargs)

        def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(jinja2.utils.Namespace):
        # Jinja's namespace, refusing underscore names that could reach internals.
        def __init__(*args: Any, **kwargs: Any) -> None:
            self, rest = args[0], args[1:]
            attrs = dict(*rest, **kwargs)
            for name in attrs:
                TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name: str, value: Any) -> None:
            TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check_name(name: object) -> None:
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(
                    "Chat templates cannot store underscore-prefixed attributes on a "
                    f"namespace, but got {name!r}."
                )

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[GenerationTag, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    env.globals["dict"] = TemplateDict()
    env.globals["namespace"] = TemplateNamespace
    return env.from_string(source)


class ChatTemplate:
    """A compiled chat template with the model's special-token strings; render per request.

    Compiled once (at model load); rendering is pure and thread-safe, so it runs on
    whichever side thread tokenizes prompts.
    """

    def __init__(self, source: str, *, special_tokens: Mapping[str, str], origin: str) -> None:
        import jinja2

        self.source = source
        self.origin = origin
        self.special_tokens = dict(special_tokens)
        try:
            self._template = _compile(source)
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"chat template {origin} does not compile: {exc}") from exc

    def render(
        self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True
    ) -> str:
        """The prompt for ``messages`` (dicts of role/content[/name]), ending with the
        assistant's turn opened when ``add_generation_prompt``."""
        import jinja2

        if not messages:
            raise ChatTemplateError("a chat needs at least one message")
        # Keys whose value is None are dropped, as transformers normalizes messages.
        chat = [{k: v for k, v in m.items() if v is not None} for m in messages]
        try:
            return str(
                self._template.render(
                    {
                        **self.special_tokens,
                        "messages": chat,
                        "tools": None,
                        "documents": None,
                        "add_generation_prompt": add_generation_prompt,
                    }
                )
            )
        except jinja2.TemplateError as exc:
            # raise_exception's message, or the sandbox refusing an unsafe access.
            raise ChatTemplateError(f"chat template {self.origin}: {exc}") from exc
        except (
            TypeError,
            ValueError,
            LookupError,
            ArithmeticError,
            AttributeError,
            RecursionError,
        ) as exc:
            # A template that does something its inputs do not support (say,
            # slicing content that is absent, or a macro that never returns)
            # fails this request, not the daemon.
            raise ChatTemplateError(
                f"chat template {self.origin} failed: {type(exc).__name__}: {exc}"
            ) from exc


def _token_string(value: Any) -> str | None:
    """A special token as tokenizer_config.json holds it: a string or an AddedToken dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def _read_tokenizer_config(folder: Path) -> dict[str, Any]:
    path = folder / TOKENIZER_CONFIG_FILENAME
    if not path.is_file():
        return {}
    try:
        text = path.read_text(encoding="utf-8")
        jsonin.check_depth(text)
        data = json.loads(text)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, jsonin.TooDeep) as exc:
        raise ModelFormatError(
            folder, f"{TOKENIZER_CONFIG_FILENAME} is not readable JSON ({exc})"
        ) from exc
    return data if isinstance(data, dict) else {}


def special_token_strings(tokenizer_config: Mapping[str, Any]) -> dict[str, str]:
    """``bos_token``, ``eos_token``, ... as strings, for the template (absent ones left out)."""
    out: dict[str, str] = {}
    for key in _SPECIAL_TOKEN_KEYS:
        text = _token_string(tokenizer_config.get(key))
        if text is not None:
            out[key] = text
    return out


def find_chat_template(folder: Path, configured: Path | None = None) -> TemplateSource | None:
    """The model's template, first found: ``configured`` (config ``model.chat_template``),
    ``chat_template.jinja`` beside the tokenizer, ``chat_template`` in
    ``tokenizer_config.json`` (a string, or a list of named templates: ``default``)."""
    folder = Path(folder)
    if configured is not None:
        try:
            return TemplateSource(configured.read_text(encoding="utf-8"), str(configured))
        except (OSError, UnicodeDecodeError) as exc:
            raise ModelFormatError(
                folder, f"model.chat_template {str(configured)!r} cannot be read ({exc})"
            ) from exc
    beside = folder / CHAT_TEMPLATE_FILENAME
    if beside.is_file():
        try:
            return TemplateSource(beside.read_text(encoding="utf-8"), str(beside))
        except (OSError, UnicodeDecodeError) as exc:
            raise ModelFormatError(
                folder, f"{CHAT_TEMPLATE_FILENAME} cannot be read ({exc})"
            ) from exc
    value = _read_tokenizer_config(folder).get("chat_template")
    origin = f"{folder / TOKENIZER_CONFIG_FILENAME} chat_template"
    if isinstance(value, str):
        return TemplateSource(value, origin)
    if isinstance(value, list):
        named = {
            t.get("name"): t.get("template")
            for t in value
            if isinstance(t, Mapping) and isinstance(t.get("template"), str)
        }
        if isinstance(named.get("default"), str):
            return TemplateSource(str(named["default"]), f"{origin} 'default'")
    return None


def load_chat_template(folder: Path, configured: Path | None = None) -> ChatTemplate | None:
    """The model's compiled template (None if it has none); a template that does not
    compile is a :class:`ModelFormatError`: the daemon refuses to start on it."""
    folder = Path(folder)
    found = find_chat_template(folder, configured)
    if found is None:
        return None
    specials = special_token_strings(_read_tokenizer_config(folder))
    try:
        return ChatTemplate(found.text, special_tokens=specials, origin=found.origin)
    except ChatTemplateError as exc:
        raise ModelFormatError(folder, str(exc)) from exc
