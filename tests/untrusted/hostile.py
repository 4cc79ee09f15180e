"""Hostile JSON for the fuzz tests: whole texts that are or almost are JSON, built as text
so that what no encoder writes (nesting thousands deep, duplicate keys, NaN, lone
surrogates, invalid UTF-8) is as likely as what one does, and spliced into any field of
a request that is otherwise good.

``KVMUX_FUZZ_EXAMPLES`` sets how many inputs each property draws (the suite's default
keeps it fast; a long run sets it high once)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from hypothesis import strategies as st

EXAMPLES = int(os.environ.get("KVMUX_FUZZ_EXAMPLES", "20"))
CORPUS = Path(__file__).parent / "corpus"
_SPLICE = "\x00splice\x00"

# Numbers at and past every limit a field has, and ones no JSON parser agrees on.
_NUMBERS = st.sampled_from(
    [
        "0", "-1", "1", "2", "-0", "0.5", "1e-400", "1e400", "-1e400", "1.7976931348623157e308",
        "2147483648", "9223372036854775807", "9223372036854775808", "18446744073709551616",
        "-9223372036854775809", "1" + "0" * 400, "NaN", "Infinity", "-Infinity", "01", "1.",
        ".5", "+1", "0x10", "1e", "-",
    ]
)  # fmt: skip
_KEYS = st.sampled_from(["custom_id", "model", "role", "content", "a", "", "__proto__"])


def _text(value: str, ascii_only: bool) -> str:
    return json.dumps(value, ensure_ascii=ascii_only)


_ODD = ["\ud800", "\udfff", "a\ud83d", "\U0010ffff", "\x00", "\u2028", "\ufeff"]
# Strings: any code point, lone surrogates included (written as JSON escapes, or raw,
# which is invalid UTF-8 once encoded), and long ones.
_STRINGS = st.one_of(
    st.builds(_text, st.text(st.characters(exclude_categories=()), max_size=40), st.booleans()),
    st.builds(_text, st.sampled_from(_ODD), st.just(True)),
    st.integers(1, 300_000).map(lambda n: '"' + "x" * n + '"'),
    st.sampled_from(['"unterminated', '"\\u12"', '"\\x41"', '"\\ud800\\u0041"', '"\t"']),
)  # fmt: skip


def _deep(levels: int, opener: str) -> str:
    if opener == "[":
        return "[" * levels + "1" + "]" * levels
    return '{"a":' * levels + "1" + "}" * levels


# Depth: around the limit and far past it, as arrays or as objects.
_DEEP = st.builds(
    _deep,
    st.one_of(st.integers(1, 140), st.integers(120, 136), st.integers(900, 5000)),
    st.sampled_from(["[", "{"]),
)
# Width: many elements, or a bracket left open.
_WIDE = st.one_of(
    st.integers(0, 100_000).map(lambda n: "[" + ",".join(["1"] * n) + "]"),
    st.integers(0, 20_000).map(lambda n: "{" + ",".join(f'"k{i}":{i}' for i in range(n)) + "}"),
    st.sampled_from(["[", "{", "]", "[1,]", '{"a"}', '{"a":1,}', "[1 2]", "", "nul", "tru"]),
)


def _object(pairs: list[tuple[str, str]]) -> str:
    return "{" + ",".join(f"{json.dumps(k)}:{v}" for k, v in pairs) + "}"


# Valid JSON of the wrong type, shape or range: what an encoder writes.
# (Lone surrogates are in _STRINGS, written as escapes.)
_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.sampled_from([2**31 - 1, 2**31, 2**63 - 1, 2**63, 2**64, -(2**63) - 1, 10**30])
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(_KEYS | st.text(), inner, max_size=4)
    ),
    max_leaves=8,
).map(json.dumps)


def fragments() -> st.SearchStrategy[str]:
    """JSON texts (and near misses) of every kind, nested."""
    leaves = st.one_of(
        st.sampled_from(["null", "true", "false"]), _NUMBERS, _STRINGS, _DEEP, _WIDE, _VALUES
    )
    return _VALUES | st.recursive(
        leaves,
        lambda inner: st.one_of(
            st.lists(inner, max_size=4).map(lambda xs: "[" + ",".join(xs) + "]"),
            # Duplicate keys are as likely as distinct ones.
            st.lists(st.tuples(_KEYS, inner), max_size=4).map(_object),
        ),
        max_leaves=6,
    )


def paths(template: dict[str, Any]) -> list[tuple[Any, ...]]:
    """Every field of ``template`` (nested ones too) and one it does not have."""
    out: list[tuple[Any, ...]] = [()]

    def walk(value: Any, at: tuple[Any, ...]) -> None:
        children = value.items() if isinstance(value, dict) else enumerate(value)
        for key, child in children:
            out.append((*at, key))
            if isinstance(child, dict | list):
                walk(child, (*at, key))
        if isinstance(value, dict):
            out.append((*at, "unknown_field"))

    walk(template, ())
    return out


def spliced(template: dict[str, Any], changes: list[tuple[tuple[Any, ...], str]]) -> str:
    """``template`` as JSON with the value at each path replaced by its fragment's text
    (a path inside one replaced already is left out)."""
    copy: Any = json.loads(json.dumps(template))
    texts = {}
    for n, (path, fragment) in enumerate(changes):
        marker = f"{_SPLICE}{n}"
        if not path:
            return fragment
        holder = copy
        try:
            for key in path[:-1]:
                holder = holder[key]
            holder[path[-1]] = marker
        except (KeyError, IndexError, TypeError):
            continue  # under a field replaced already
        texts[json.dumps(marker)] = fragment
    text = json.dumps(copy)
    for marker, fragment in texts.items():
        text = text.replace(marker, fragment)
    return text


def hostile(template: dict[str, Any]) -> st.SearchStrategy[str]:
    """``template`` with one to three fields (or the whole of it) replaced by hostile
    fragments."""
    change = st.tuples(st.sampled_from(paths(template)), fragments())
    return st.builds(spliced, st.just(template), st.lists(change, min_size=1, max_size=3))


def encode(text: str) -> bytes:
    """As a client would send it: lone surrogates become invalid UTF-8 bytes."""
    return text.encode("utf-8", "surrogatepass")


def deep_msgpack(levels: int) -> bytes:
    """A msgpack value ``[[[...1...]]]`` ``levels`` deep."""
    return b"\x91" * levels + b"\x01"


def toml_values() -> st.SearchStrategy[str]:
    """TOML values an operator might mistype, or a hostile file might hold."""
    return st.one_of(
        _NUMBERS,
        st.integers(1, 4000).map(lambda n: "[" * n + "1" + "]" * n),
        st.integers(1, 4000).map(lambda n: "{a = " * n + "1" + "}" * n),
        st.builds(_text, st.text(st.characters(exclude_categories=()), max_size=20), st.just(True)),
        st.sampled_from(['"unterminated', "nan", "inf", "1979-05-27T07:32:00Z", "[1, 'a']"]),
    )


def corpus(name: str) -> list[dict[str, Any]]:
    """What fuzzing ever found at entry point ``name``, as the arguments of the test that
    found it: kept as explicit cases."""
    found: list[dict[str, Any]] = json.loads((CORPUS / f"{name}.json").read_text())
    return found
