"""What a failure or a departure does through HTTP, against kvmuxd processes: a growth
failure ends its own stream with the diagnostics and no one else's; a client that
leaves mid-stream, or before its answer, has its item cancelled and its KV freed."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest

from bench.bench_daemon import DaemonProcess
from kvmux.client import Client

from .conftest import MODEL, httpx, openai, started

pytestmark = pytest.mark.anyio

BYTES_PER_TOKEN = 520  # the built-in tiny model's KV bytes per token


async def _freed_within(daemon: DaemonProcess, seconds: float) -> float:
    """How long until no session is active and no KV byte is held (fails past ``seconds``)."""
    started_at = anyio.current_time()
    async with Client(daemon.endpoint, timeout=10.0) as client:
        with anyio.fail_after(seconds):
            while True:
                st = await client.status()
                if st.sessions_active == 0 and st.kv_bytes_in_use == 0 and st.jobs_active == 0:
                    return anyio.current_time() - started_at
                await anyio.sleep(0.02)


async def _busy(daemon: DaemonProcess) -> None:
    async with Client(daemon.endpoint, timeout=10.0) as client:
        with anyio.fail_after(10):
            while (await client.status()).kv_bytes_in_use == 0:
                await anyio.sleep(0.01)


LONG = {"model": MODEL, "prompt": "go on and on", "max_tokens": 1900, "ignore_eos": True}


async def test_a_dropped_stream_frees_its_session_within_a_second(daemon: DaemonProcess) -> None:
    async with (
        httpx.AsyncClient(base_url=daemon.http_url, timeout=30.0) as client,
        client.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as resp,
    ):
        assert resp.status_code == 200
        chunks = resp.aiter_bytes()
        assert (await anext(chunks)).startswith(b"data: ")
        await _busy(daemon)
    # The connection is closed: the item is cancelled at the scheduler's next turn.
    assert await _freed_within(daemon, 1.0) < 1.0


async def test_a_client_leaving_before_its_answer_frees_its_session(
    daemon: DaemonProcess,
) -> None:
    async with (
        httpx.AsyncClient(base_url=daemon.http_url) as client,
        anyio.create_task_group() as tg,
    ):

        async def ask() -> None:
            await client.post("/v1/completions", json=LONG, timeout=60.0)

        tg.start_soon(ask)
        await _busy(daemon)
        tg.cancel_scope.cancel()  # the request is abandoned, its connection closed
    assert await _freed_within(daemon, 1.0) < 1.0


async def test_a_growth_failure_ends_its_stream_with_diagnostics_and_no_other(
    tiny_model: Path,
) -> None:
    # 1,400 tokens of KV: the long item's growth 512 -> 1024 (1,536 at its peak) is
    # refused by the budget; the short ones, 128 each beside it, fit.
    tables: dict[str, dict[str, Any]] = {
        "kv": {"min_bucket": 16, "memory_budget": 1400 * BYTES_PER_TOKEN},
        "scheduler": {"on_growth_failure": "fail", "max_active_sessions": 8},
    }
    shorts = [
        {"prompt": f"short request {i}", "max_tokens": 80, "extra_body": {"ignore_eos": True}}
        for i in range(4)
    ]
    long = {"prompt": "long", "max_tokens": 900, "extra_body": {"ignore_eos": True}}
    with started(tiny_model, tables) as daemon:
        url = daemon.http_url + "/v1"
        async with openai.AsyncOpenAI(base_url=url, api_key="none", max_retries=0) as sdk:
            streamed: dict[int, str] = {}
            failures: dict[int, Any] = {}

            async def stream(i: int, body: dict[str, Any]) -> None:
                text = ""
                try:
                    async for chunk in await sdk.completions.create(
                        model=MODEL, stream=True, **body
                    ):
                        text += chunk.choices[0].text
                    streamed[i] = text
                except openai.APIError as exc:
                    failures[i] = (exc, text)

            async with anyio.create_task_group() as tg:
                tg.start_soon(stream, -1, long)
                for i, body in enumerate(shorts):
                    tg.start_soon(stream, i, body)
            assert set(failures) == {-1}, failures
            exc, got_before = failures[-1]
            assert got_before, "the failure came mid-stream, after some tokens"
            assert exc.code == "kv_growth_failed"
            details = exc.body["details"]
            assert (details["old_capacity"], details["new_capacity"]) == (512, 1024)
            assert details["cause"] == "budget" and details["session_unchanged"] is True
            assert details["transient_peak_bytes"] == 1536 * BYTES_PER_TOKEN
            assert details["levers"] and "1024" in exc.message
            # Every other stream's tokens are those of its request alone.
            for i, body in enumerate(shorts):
                alone = await sdk.completions.create(model=MODEL, **body)
                assert streamed[i] == alone.choices[0].text


async def test_a_reader_that_takes_nothing_is_dropped_after_send_timeout(
    tiny_model: Path,
) -> None:
    with started(tiny_model, {"http": {"send_timeout": 1.0}}) as daemon:
        host, port = daemon.http_url.removeprefix("http://").split(":")
        # 32 choices' logprobs (~6 MB): more than the socket buffers between them hold.
        ask = {**LONG, "max_tokens": 1000, "n": 32, "logprobs": 5, "stream": True}
        body = msgspec.json.encode(ask)
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect((host, int(port)))
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
        )
        try:
            await _busy(daemon)
            # Decoding does not wait for the reader: the items end and their KV is freed
            # (tokens not yet taken are merged, not queued one by one) ...
            await _freed_within(daemon, 30.0)
            # ... and a send that is not taken within http.send_timeout drops the stream.
            with anyio.fail_after(10):
                while not any(daemon.events("http_stream_dropped")):
                    await anyio.sleep(0.1)
        finally:
            sock.close()
