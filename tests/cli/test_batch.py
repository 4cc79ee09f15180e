"""Batch lines: kvmux's own format and OpenAI's, mapped onto items; bad lines named, alone."""

from __future__ import annotations

import json
from typing import Any

import pytest

from kvmux.client import Item
from kvmux.client.cli.batch import LineError, parse_line, read_batch


def line(obj: Any) -> bytes:
    return json.dumps(obj).encode()


def openai(body: Any, **fields: Any) -> bytes:
    return line(
        {"custom_id": "o", "method": "POST", "url": "/v1/completions", "body": body, **fields}
    )


def one(raw: bytes, number: int) -> Item:
    """The single item of a line that asks for one completion."""
    items = parse_line(raw, number)
    assert len(items) == 1
    return items[0]


def refused(raw: bytes, number: int = 7) -> LineError:
    with pytest.raises(LineError) as exc:
        parse_line(raw, number)
    assert exc.value.line == number
    assert str(exc.value).startswith(f"line {number}: ")
    return exc.value


def test_native_line_maps_every_field() -> None:
    item = one(
        line(
            {
                "custom_id": "a",
                "prompt": "hi",
                "max_tokens": 5,
                "temperature": 0.5,
                "top_p": 0.9,
                "top_k": 3,
                "seed": 1,
                "stop": "\n",
                "max_context": 64,
                "ignore_eos": True,
            }
        ),
        1,
    )
    assert item == Item(
        custom_id="a",
        prompt="hi",
        max_new_tokens=5,
        temperature=0.5,
        top_p=0.9,
        top_k=3,
        seed=1,
        stop=["\n"],
        max_context=64,
        ignore_eos=True,
        line=1,
    )


def test_token_prompts_and_defaults() -> None:
    assert one(line({"prompt": [1, 2, 3]}), 4) == Item(
        custom_id="line-4", prompt_tokens=[1, 2, 3], line=4
    )
    assert one(line({"prompt_tokens": [5], "seed": None}), 2).prompt_tokens == [5]
    # JSON null is "not given", for the id too: the line names it, in both formats.
    assert one(line({"prompt": "x", "custom_id": None}), 6).custom_id == "line-6"
    chat = {"messages": [{"role": "user", "content": "x"}]}
    openai_line = {"custom_id": None, "url": "/v1/chat/completions", "body": chat}
    assert one(line(openai_line), 7).custom_id == "line-7"
    assert one(line({"prompt": "x", "max_new_tokens": 3}), 1).max_new_tokens == 3


def test_openai_line_maps_body_and_applies_the_api_default_max_tokens() -> None:
    item = one(
        openai(
            {
                "model": "whatever",
                "prompt": "hello",
                "temperature": 0,
                "stop": ["a", "b"],
                "n": 1,
                "logprobs": None,
                "user": "u",
            }
        ),
        3,
    )
    assert item == Item(
        custom_id="o", prompt="hello", max_new_tokens=16, temperature=0.0, stop=["a", "b"], line=3
    )
    assert one(openai({"prompt": [[7, 8]], "max_tokens": 2}), 1).prompt_tokens == [7, 8]
    assert one(openai({"prompt": ["only one"]}), 1).prompt == "only one"


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        (b'{"prompt": "x", ', "not valid JSON"),
        (b"[1, 2]", "expected a JSON object, got an array"),
        (
            line({"prompt": "x", "max_token": 3}),
            "unknown field `max_token`: did you mean `max_tokens`?",
        ),
        (line({"prompt": "x", "max_tokens": 0}), "`max_tokens`"),
        (line({"prompt": "x", "top_p": 2}), "`top_p`"),
        (line({"prompt": "x", "stop": ["ok", ""]}), "`stop[1]`"),
        (line({"max_tokens": 3}), "exactly one of `prompt`, `prompt_tokens` and `messages`"),
        (line({"prompt": "x", "max_tokens": 1, "max_new_tokens": 1}), "not both"),
        (
            line({"prompt": [1, "a"]}),
            "`prompt[0]` must be text or a list of token ids, got a number",
        ),
        (line({"prompt": []}), "`prompt` is empty"),
        (line({"prompt": "x", "n": 0}), "`n` must be a whole number"),
        (line({"prompt": ["a"] * 1000, "n": 100}), "at most 65536"),
        (line({"prompt": "x", "min_tokens": 1, "min_new_tokens": 1}), "not both"),
        (line({"prompt": "x", "max_tokens": 2.5}), "`max_tokens`"),
        (openai({"prompt": "x"}, url="/v1/chat/completions"), "takes `messages`, not `prompt`"),
        (openai({"messages": []}), "takes `prompt`, not `messages`"),
        (openai({"input": "x"}, url="/v1/embeddings"), "computes no embeddings"),
        (openai({"prompt": "x"}, method="GET"), "method 'GET'"),
        (openai([1]), "`body` must be a JSON object"),
        (openai({"prompt": "x", "echo": True}), "`body.echo` = true is not supported"),
        (openai({"prompt": "x", "suffix": "z"}), "`body.suffix`"),
        (openai({"prompt": "x", "n": 2, "best_of": 3}), "`body.best_of` = 3"),
        (openai({"prompt": "x", "logit_bias": {"5": 1}}), "no per-token bias"),
        (openai({"prompt": "x", "logprobs": True}), "`body.logprobs`"),
        (openai({"prompt": "x", "max_tokens": -1}), "`body.max_tokens`"),
        (openai({"prompt": "x", "frobnicate": 1}), "unknown field `body.frobnicate`"),
        (
            openai({"prompt": "x", "temprature": 0}),
            "`body.temprature` for /v1/completions (did you mean `body.temperature`?)",
        ),
        (openai({"prompt": "x"}, custom="a"), "`custom` (did you mean `custom_id`?)"),
    ],
)
def test_a_bad_line_is_refused_with_its_reason(raw: bytes, reason: str) -> None:
    assert reason in refused(raw).reason


def test_a_typo_gets_its_correction_and_a_field_like_nothing_gets_the_list() -> None:
    typo = refused(line({"prompt": "x", "max_token": 3})).reason
    assert "did you mean `max_tokens`?" in typo and "`temperature`" not in typo
    unlike = refused(line({"prompt": "x", "zzzz": 3})).reason
    assert "did you mean" not in unlike and "`temperature`" in unlike


def test_refused_lines_keep_their_custom_id_and_the_rest_parse() -> None:
    batch = read_batch(
        [
            line({"custom_id": "ok", "prompt": "a"}),
            b"   ",
            line({"custom_id": "bad", "prompt": "a", "top_k": -1}),
            b"{nope",
            line({"custom_id": "ok2", "prompt": "b"}),
        ]
    )
    assert [i.custom_id for i in batch.items] == ["ok", "ok2"]
    assert batch.lines == [1, 5]
    assert [(e.line, e.custom_id) for e in batch.errors] == [(3, "bad"), (4, "line-4")]
    assert batch.total == 4
    info = batch.errors[0].to_info()
    assert info.code == "bad_request"
    assert info.details["line"] == 3 and "`top_k`" in info.details["reason"]
