"""Tool calling through kvmuxd's HTTP front with the openai SDK, on ``tiny``: its weights
are random, so only the grammar can make its calls valid JSON of their tools' schemas."""

from __future__ import annotations

import json
from typing import Any

import pytest

from .conftest import MODEL, openai

pytestmark = pytest.mark.anyio

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"enum": ["Paris", "Rome"]}, "days": {"type": "integer"}},
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
NOW = {"type": "function", "function": {"name": "now"}}
ASK = [{"role": "user", "content": "weather in Paris?"}]


def valid(call: Any) -> None:
    args = json.loads(call.function.arguments)
    if call.function.name == "get_weather":
        assert args["city"] in ("Paris", "Rome") and isinstance(args["days"], int)
        assert set(args) == {"city", "days"}
    else:
        assert call.function.name == "now" and args == {}
    assert call.id.startswith("call_") and call.type == "function"


async def test_required_calls_follow_their_schemas(sdk: Any) -> None:
    chat = await sdk.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=[WEATHER, NOW],
        tool_choice="required",
        max_tokens=200,
        seed=1,
        n=3,
        temperature=1.0,
    )
    ids = []
    for choice in chat.choices:
        # Random weights may go on calling until the budget cuts a call: length wins,
        # and the cut call stays content.
        assert choice.finish_reason in ("tool_calls", "length"), choice
        if choice.finish_reason == "length":
            assert choice.message.content and "<tool_call>" in choice.message.content
        assert choice.message.tool_calls
        for call in choice.message.tool_calls:
            valid(call)
            ids.append(call.id)
    assert len(ids) == len(set(ids))


async def test_named_gives_one_call_of_that_function_and_stop(sdk: Any) -> None:
    chat = await sdk.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=[WEATHER, NOW],
        max_tokens=200,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    choice = chat.choices[0]
    assert choice.finish_reason == "stop" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather"
    valid(call)


async def test_parallel_off_is_one_call(sdk: Any) -> None:
    chat = await sdk.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=[WEATHER, NOW],
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=200,
        seed=3,
        temperature=1.0,
        n=4,
    )
    for choice in chat.choices:
        assert len(choice.message.tool_calls) == 1
        valid(choice.message.tool_calls[0])


async def test_streamed_calls_equal_the_non_streamed(sdk: Any) -> None:
    args: dict[str, Any] = dict(
        model=MODEL,
        messages=ASK,
        tools=[WEATHER, NOW],
        tool_choice="required",
        max_tokens=200,
        parallel_tool_calls=False,
    )
    whole = (await sdk.chat.completions.create(**args)).choices[0]
    calls: dict[int, dict[str, Any]] = {}
    finish = None
    async for chunk in await sdk.chat.completions.create(stream=True, **args):
        for c in chunk.choices:
            finish = c.finish_reason or finish
            for d in c.delta.tool_calls or []:
                if d.id is not None:
                    assert d.index not in calls  # id and name once per index
                    calls[d.index] = {"name": d.function.name, "args": d.function.arguments}
                else:
                    assert d.function.name is None
                    calls[d.index]["args"] += d.function.arguments
    assert finish == whole.finish_reason
    assert [(c["name"], c["args"]) for _, c in sorted(calls.items())] == [
        (c.function.name, c.function.arguments) for c in whole.message.tool_calls
    ]


async def test_a_full_loop_renders_the_call_and_its_result(sdk: Any) -> None:
    first = (
        (
            await sdk.chat.completions.create(
                model=MODEL, messages=ASK, tools=[NOW], tool_choice="required", max_tokens=100
            )
        )
        .choices[0]
        .message
    )
    call = first.tool_calls[0]
    history = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "12:00"},
    ]
    final = await sdk.chat.completions.create(
        model=MODEL, messages=history, tools=[NOW], tool_choice="none", max_tokens=5
    )
    assert final.choices[0].message.tool_calls is None


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"tools": []}, "tools"),
        ({"tools": [{"type": "code", "function": {"name": "x"}}]}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools"),
        ({"tools": [NOW, NOW]}, "tools"),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {"name": "x", "parameters": {"type": "string"}},
                    }
                ]
            },
            "tools",
        ),
        (
            {"tools": [NOW], "tool_choice": {"type": "function", "function": {"name": "zz"}}},
            "tool_choice",
        ),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [NOW], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
        ({"functions": [{"name": "x"}]}, "functions"),
        (
            {
                "tools": [NOW],
                "tool_choice": {"type": "function", "function": {"name": "now"}},
                "response_format": {"type": "json_object"},
            },
            "response_format",
        ),
        (
            {"messages": [*ASK, {"role": "tool", "tool_call_id": "call_nope", "content": "x"}]},
            "messages",
        ),
        (
            {
                "messages": [
                    *ASK,
                    {
                        "role": "assistant",
                        "content": None,
                        "tool_calls": [
                            {
                                "id": "c",
                                "type": "function",
                                "function": {"name": "now", "arguments": "{no"},
                            }
                        ],
                    },
                ]
            },
            "messages",
        ),
    ],
)
async def test_bad_tool_input_is_a_400_naming_the_parameter(
    sdk: Any, extra: dict[str, Any], param: str
) -> None:
    body = {"messages": ASK, **extra}
    with pytest.raises(openai.BadRequestError) as info:
        await sdk.chat.completions.create(model=MODEL, max_tokens=4, **body)
    assert info.value.param == param, info.value.message
    assert info.value.type == "invalid_request_error"
