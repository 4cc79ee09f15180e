"""Structured outputs through kvmuxd's HTTP front with the real ``openai`` SDK: OpenAI's
``response_format``, vLLM's ``structured_outputs`` and ``guided_*``, streamed and not;
bad specs answered 400 ``invalid_request_error``; Batch API and ``kvmux submit`` lines."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import msgspec
import pytest

from bench.bench_daemon import DaemonProcess

from .conftest import MODEL, openai
from .test_batches import answers, batch_line, kvmux, lines_of, run_batch

pytestmark = pytest.mark.anyio

ITEM = {
    "type": "object",
    "properties": {
        "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
        "qty": {"type": "integer", "minimum": 1, "maximum": 99},
        "colour": {"enum": ["red", "green", "blue"]},
        "sizes": {"type": "array", "items": {"enum": ["S", "M", "L"]}, "maxItems": 3},
        "dims": {
            "type": "object",
            "properties": {"w": {"type": "integer", "maximum": 999}},
            "required": ["w"],
            "additionalProperties": False,
        },
    },
    "required": ["sku", "qty", "colour", "dims"],
    "additionalProperties": False,
}
RESPONSE_FORMAT = {
    "type": "json_schema",
    "json_schema": {"name": "item", "schema": ITEM, "strict": True},
}
MESSAGES = [{"role": "user", "content": "Describe the item as JSON."}]


def valid(text: str) -> None:
    jsonschema.validate(json.loads(text), ITEM)


async def test_chat_response_format_json_schema_streamed_and_not(sdk: Any) -> None:
    for seed in range(3):
        args: dict[str, Any] = {
            "model": MODEL,
            "messages": MESSAGES,
            "max_tokens": 150,
            "temperature": 0.9,
            "seed": seed,
            "response_format": RESPONSE_FORMAT,
        }
        done = await sdk.chat.completions.create(**args)
        (choice,) = done.choices
        assert choice.finish_reason == "stop"
        valid(choice.message.content)
        parts, reason = [], None
        async for chunk in await sdk.chat.completions.create(stream=True, **args):
            for c in chunk.choices:
                parts.append(c.delta.content or "")
                reason = c.finish_reason or reason
        assert "".join(parts) == choice.message.content and reason == "stop"


async def test_completions_json_object_and_n(sdk: Any) -> None:
    done = await sdk.completions.create(
        model=MODEL,
        prompt="JSON:",
        max_tokens=150,
        n=3,
        temperature=1.0,
        seed=3,
        # vLLM's completions take response_format; the SDK's completions do not name it.
        extra_body={
            "response_format": {"type": "json_schema", "json_schema": {"name": "i", "schema": ITEM}}
        },
    )
    assert len(done.choices) == 3
    for c in done.choices:
        assert c.finish_reason == "stop"
        valid(c.text)
    loose = await sdk.completions.create(
        model=MODEL, prompt="x", max_tokens=60, temperature=1.0, seed=0,
        extra_body={"response_format": {"type": "json_object"}},
    )  # fmt: skip
    assert loose.choices[0].text.startswith("{")


@pytest.mark.parametrize(
    ("extra", "check"),
    [
        ({"structured_outputs": {"json": ITEM}}, valid),
        ({"structured_outputs": {"regex": "[a-z]{4}-[0-9]{2}"}}, "[a-z]{4}-[0-9]{2}"),
        ({"structured_outputs": {"choice": ["left", "right"]}}, "left|right"),
        ({"structured_outputs": {"grammar": 'root ::= "n" [0-9]'}}, "n[0-9]"),
        ({"guided_json": ITEM}, valid),
        ({"guided_json": json.dumps(ITEM)}, valid),
        ({"guided_regex": "[0-9]{3}"}, "[0-9]{3}"),
        ({"guided_choice": ["yes", "no"]}, "yes|no"),
        ({"guided_grammar": 'start: "g" /[ab]{2}/'}, "g[ab]{2}"),
    ],
)
async def test_vllms_structured_outputs_and_guided_fields(
    sdk: Any, extra: dict[str, Any], check: Any
) -> None:
    done = await sdk.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=150, temperature=0.7, seed=1, extra_body=extra
    )
    (choice,) = done.choices
    assert choice.finish_reason == "stop"
    if callable(check):
        check(choice.message.content)
    else:
        assert re.fullmatch(check, choice.message.content), choice.message.content


@pytest.mark.parametrize(
    ("extra", "wrong", "param"),
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
            "type": "objekt"}}}}, "Invalid type: objekt", None),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": ITEM}}},
         "needs `json_schema`", "response_format"),
        ({"response_format": {"type": "xml"}}, "text, json_object or json_schema",
         "response_format"),
        ({"structured_outputs": {"regex": "(("}}, "unclosed group", None),
        ({"structured_outputs": {"grammar": "start: nope"}}, 'unknown name: "nope"', None),
        ({"structured_outputs": {"choice": []}}, "choice", "structured_outputs"),
        ({"structured_outputs": {"regexp": "a"}}, "unknown field `regexp`", "structured_outputs"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "one constraint", "guided_regex"),
        ({"guided_json": "{not json"}, "not valid JSON", None),
    ],
)  # fmt: skip
@pytest.mark.parametrize("stream", [False, True])
async def test_a_bad_spec_is_a_400_invalid_request_error(
    sdk: Any, extra: dict[str, Any], wrong: str, param: str | None, stream: bool
) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        got = await sdk.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=8, stream=stream, extra_body=extra
        )
        if stream:
            async for _ in got:
                pass
    assert info.value.status_code == 400
    body = info.value.body
    assert body["type"] == "invalid_request_error" and wrong in body["message"], body
    if param is not None:
        assert body["param"] == param


async def test_batch_lines_answer_valid_json_and_a_bad_schema_fails_its_line_alone(
    sdk: Any, daemon: DaemonProcess, tmp_path: Path
) -> None:
    lines = []
    for i in range(12):
        body: dict[str, Any] = {
            "model": MODEL,
            "messages": [{"role": "user", "content": f"item {i}"}],
            "max_tokens": 150,
            "temperature": 0.8,
            "seed": i,
            "response_format": RESPONSE_FORMAT,
        }
        if i == 5:
            body["response_format"] = {
                "type": "json_schema",
                "json_schema": {"name": "bad", "schema": {"type": "string", "pattern": "(("}},
            }
        lines.append(batch_line(f"req-{i}", body))
    path = tmp_path / "requests.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    batch = await run_batch(sdk, path)
    assert batch.status == "completed"
    out = answers(await lines_of(sdk, batch.output_file_id))
    errors = await lines_of(sdk, batch.error_file_id)
    failed = {e["custom_id"]: e for e in errors}
    assert set(failed) == {"req-5"}
    fail_body = failed["req-5"]["response"]["body"]["error"]
    assert fail_body["code"] == "bad_request" and "unclosed group" in fail_body["message"]
    for i in range(12):
        if i != 5:
            (text,) = out[f"req-{i}"]
            valid(text)
    # The same file through `kvmux submit`: the same answers, line for line.
    submitted = tmp_path / "submitted.jsonl"
    await kvmux(daemon, "submit", str(path), "--out", str(submitted))
    cli = answers([msgspec.json.decode(x) for x in submitted.read_bytes().splitlines()])
    for i in range(12):
        if i != 5:
            assert cli[f"req-{i}"] == out[f"req-{i}"]


async def test_kvmux_lines_take_structured_outputs_too(
    daemon: DaemonProcess, tmp_path: Path
) -> None:
    path = tmp_path / "native.jsonl"
    rows = [
        {"custom_id": "a", "prompt": "x", "max_tokens": 150, "structured_outputs": {"json": ITEM}},
        {"custom_id": "b", "prompt": "y", "max_tokens": 150, "guided_choice": ["on", "off"]},
        {"custom_id": "c", "prompt": "z", "max_tokens": 150, "response_format": RESPONSE_FORMAT},
        {"custom_id": "d", "prompt": "w", "structured_outputs": {"regex": "a(b"}},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out.jsonl"
    await kvmux(daemon, "submit", str(path), "--out", str(out))
    got = {r["custom_id"]: r for r in map(json.loads, out.read_text().splitlines())}
    valid(got["a"]["text"])
    assert got["b"]["text"] in ("on", "off")
    valid(got["c"]["text"])
    assert got["d"]["status"] == "error" and "unclosed group" in got["d"]["error"]["message"]
