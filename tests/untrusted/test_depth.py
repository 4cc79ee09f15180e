"""kvmux.client.jsonin: the nesting limit every front shares, measured without recursion."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmux.client import jsonin

from .hostile import EXAMPLES, fragments

# Strings full of what the scan must not count: brackets, quotes, escapes.
_TRICKY = st.text(st.sampled_from('[]{}"\\ab'), max_size=12)
_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | _TRICKY,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_TRICKY, inner, max_size=3),
    max_leaves=30,
)


def nesting(value: Any) -> int:
    if isinstance(value, list):
        return 1 + max(map(nesting, value), default=0)
    if isinstance(value, dict):
        return 1 + max(map(nesting, value.values()), default=0)
    return 0


@settings(max_examples=EXAMPLES * 20)
@given(_JSON, st.booleans())
def test_depth_is_the_nesting_of_the_value(value: Any, ascii_only: bool) -> None:
    text = json.dumps(value, ensure_ascii=ascii_only)
    assert jsonin.depth(text) == jsonin.depth(text.encode()) == nesting(value)


@pytest.mark.parametrize("opener", ["[", '{"a":'])
def test_the_limit_is_128_levels_of_arrays_or_objects(opener: str) -> None:
    def nested(levels: int) -> bytes:
        close = "]" if opener == "[" else "}"
        return (opener * levels + "1" + close * levels).encode()

    assert nesting(jsonin.decode(nested(jsonin.MAX_DEPTH))) == jsonin.MAX_DEPTH
    with pytest.raises(jsonin.TooDeep, match="nested deeper than 128 levels"):
        jsonin.decode(nested(jsonin.MAX_DEPTH + 1))
    # Brackets inside a string are text, however many.
    assert jsonin.decode(b'["' + b"[" * 5000 + b'"]') == ["[" * 5000]


def test_a_too_deep_text_is_refused_before_decoding_however_long() -> None:
    # Megabytes of brackets, opened in a row or nested with others between: refused by
    # the scan (msgspec would raise RecursionError, after the stack it had left).
    for text in (b"[" * 8_000_000, b"[[]" * 2_000_000, b'[{"a":"]"},' * 500_000):
        with pytest.raises(jsonin.TooDeep):
            jsonin.decode(text)


@settings(max_examples=EXAMPLES * 10)
@given(st.one_of(fragments().map(lambda t: t.encode("utf-8", "surrogatepass")), st.binary()))
def test_decode_returns_a_value_or_raises_decode_error_only(data: bytes) -> None:
    try:
        value = jsonin.decode(data)
    except jsonin.TooDeep:
        assert jsonin.depth(data) > jsonin.MAX_DEPTH
    except msgspec.DecodeError:
        pass  # not JSON: refused the way any invalid text is
    else:
        # (Less deep than the text when a duplicate key's later value replaced a deeper one.)
        assert nesting(value) <= jsonin.depth(data) <= jsonin.MAX_DEPTH
