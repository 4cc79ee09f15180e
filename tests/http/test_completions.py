"""Chat and text completions through the real ``openai`` SDK against a kvmuxd process:
answers and streams, their tokens against ``kvmux submit`` of the same requests."""

from __future__ import annotations

import os
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest

from bench.bench_daemon import DaemonProcess

from .conftest import MODEL, openai

pytestmark = pytest.mark.anyio

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"

# Greedy and seeded requests, with kvmux's (vLLM's) extras and several choices.
REQUESTS: list[tuple[str, dict[str, Any]]] = [
    (CHAT, {"messages": [{"role": "user", "content": "Tell me a story"}], "max_tokens": 24}),
    (
        CHAT,
        {
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Hello"}]},
            ],
            "max_completion_tokens": 20,
            "temperature": 0.9,
            "seed": 11,
            "n": 2,
            "top_k": 40,
        },
    ),
    (
        COMPLETIONS,
        {"prompt": ["one two", "three"], "max_tokens": 16, "temperature": 0.7, "seed": 5, "n": 2},
    ),
    (COMPLETIONS, {"prompt": [5, 6, 7, 8], "max_tokens": 12, "repetition_penalty": 1.3}),
]


# vLLM's (and kvmux's) parameters go in the SDK's extra_body, as vLLM's docs show.
_EXTRAS = ("top_k", "min_p", "repetition_penalty", "min_tokens", "ignore_eos", "max_context")


def sdk_args(body: dict[str, Any]) -> dict[str, Any]:
    args = {k: v for k, v in body.items() if k not in _EXTRAS}
    extra = {k: v for k, v in body.items() if k in _EXTRAS}
    return {**args, "extra_body": extra} if extra else args


async def _answer(sdk: Any, url: str, body: dict[str, Any]) -> tuple[dict[int, str], Any]:
    body = sdk_args(body)
    if url == CHAT:
        resp = await sdk.chat.completions.create(model=MODEL, **body)
        return {c.index: c.message.content for c in resp.choices}, resp.usage
    resp = await sdk.completions.create(model=MODEL, **body)
    return {c.index: c.text for c in resp.choices}, resp.usage


async def _stream(sdk: Any, url: str, body: dict[str, Any]) -> tuple[dict[int, str], Any]:
    create = sdk.chat.completions.create if url == CHAT else sdk.completions.create
    options = {"include_usage": True}
    stream = await create(model=MODEL, stream=True, stream_options=options, **sdk_args(body))
    texts: dict[int, str] = defaultdict(str)
    finished: dict[int, str] = {}
    usage = None
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            texts[choice.index] += (
                (choice.delta.content or "") if url == CHAT else (choice.text or "")
            )
            if choice.finish_reason is not None:
                finished[choice.index] = choice.finish_reason
    assert set(finished) == set(texts), (finished, texts)
    return dict(texts), usage


async def _submitted(daemon: DaemonProcess, tmp_path: Path) -> dict[str, dict[int, str]]:
    """The same requests as an OpenAI batch file through ``kvmux submit``."""
    lines = [
        msgspec.json.encode({"custom_id": str(i), "method": "POST", "url": url, "body": body})
        for i, (url, body) in enumerate(REQUESTS)
    ]
    file = tmp_path / "requests.jsonl"
    file.write_bytes(b"\n".join(lines) + b"\n")
    out = tmp_path / "out.jsonl"
    done = await anyio.run_process(
        [sys.executable, "-m", "kvmux.client.cli", "submit", str(file), "--out", str(out), "-q"],
        env={**os.environ, "KVMUX_ENDPOINT": daemon.endpoint},
        check=False,
    )
    assert done.returncode == 0, done.stderr.decode()
    got = {}
    for line in out.read_bytes().splitlines():
        obj = msgspec.json.decode(line)
        body = obj["response"]["body"]
        got[obj["custom_id"]] = {
            c["index"]: c["message"]["content"] if "message" in c else c["text"]
            for c in body["choices"]
        }
    return got


async def test_answers_and_streams_give_the_tokens_kvmux_submit_gives(
    sdk: Any, daemon: DaemonProcess, tmp_path: Path
) -> None:
    want = await _submitted(daemon, tmp_path)
    for i, (url, body) in enumerate(REQUESTS):
        answered, usage = await _answer(sdk, url, body)
        streamed, streamed_usage = await _stream(sdk, url, body)
        assert answered == want[str(i)], (url, body)
        assert streamed == want[str(i)], (url, body)
        assert usage.completion_tokens > 0
        assert (streamed_usage.prompt_tokens, streamed_usage.completion_tokens) == (
            usage.prompt_tokens,
            usage.completion_tokens,
        )
        # One owner (anonymous: loopback tcp and HTTP without keys) asked for this
        # prompt twice before, through kvmux submit and the answer, so the answer's
        # prompt KV was kept: the stream copies every whole block of it
        # (kv.prefix_block, 16 by default) that ends before the prompt's last token.
        cached = streamed_usage.prompt_tokens_details.cached_tokens
        assert cached == (usage.prompt_tokens - 1) // 16 * 16, (url, body, streamed_usage)
        assert cached >= usage.prompt_tokens_details.cached_tokens


async def test_models_are_listed_and_another_name_is_404_model_not_found(sdk: Any) -> None:
    assert [m.id for m in (await sdk.models.list()).data] == [MODEL]
    assert (await sdk.models.retrieve(MODEL)).id == MODEL
    with pytest.raises(openai.NotFoundError) as info:
        await sdk.chat.completions.create(
            model="gpt-4o", messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
    assert info.value.code == "model_not_found" and "gpt-4o" in info.value.message
    with pytest.raises(openai.NotFoundError):
        await sdk.models.retrieve("gpt-4o")


async def test_usage_counts_each_prompt_once_and_logprobs_come_back(sdk: Any) -> None:
    resp = await sdk.completions.create(
        model=MODEL, prompt=[1, 2, 3, 4, 5], max_tokens=6, n=3, temperature=0, logprobs=2
    )
    assert resp.usage.prompt_tokens == 5 and resp.usage.completion_tokens == 18
    for choice in resp.choices:
        assert len(choice.logprobs.tokens) == 6
        # OpenAI keys alternatives by their text: two that decode alike are one entry.
        assert all(1 <= len(top) <= 2 for top in choice.logprobs.top_logprobs)
    chat = await sdk.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=5,
        logprobs=True,
        top_logprobs=3,
    )
    steps = chat.choices[0].logprobs.content
    assert len(steps) == 5 and all(len(s.top_logprobs) == 3 for s in steps)
    assert "".join(s.token for s in steps) == chat.choices[0].message.content


async def test_a_prompt_over_its_maximum_is_context_length_exceeded(sdk: Any) -> None:
    body = {"prompt": "a much longer prompt than eight tokens", "max_tokens": 4, "max_context": 8}
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as info:
            await sdk.completions.create(model=MODEL, stream=stream, **sdk_args(body))
        assert info.value.code == "context_length_exceeded"
        # kvmux's own translation: the limit, where it comes from, the levers.
        assert "8" in info.value.message and "max_context" in info.value.message


async def test_what_kvmux_cannot_do_is_refused_naming_the_parameter(sdk: Any) -> None:
    functions = [{"name": "f", "parameters": {}}]
    with pytest.raises(openai.BadRequestError) as info:
        await sdk.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], functions=functions
        )
    assert info.value.param == "functions" and "`tools`" in info.value.message
    with pytest.raises(openai.BadRequestError) as info:
        await sdk.completions.create(model=MODEL, prompt="x", max_tokens=-3)
    assert info.value.param == "max_tokens"


async def test_kvmux_status_shows_where_the_http_api_answers(daemon: DaemonProcess) -> None:
    done = await anyio.run_process(
        [sys.executable, "-m", "kvmux.client.cli", "status"],
        env={**os.environ, "KVMUX_ENDPOINT": daemon.endpoint, "COLUMNS": "200"},
        check=False,
    )
    assert done.returncode == 0, done.stderr.decode()
    assert f"{daemon.http_url}/v1" in done.stdout.decode()
