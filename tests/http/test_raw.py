"""What the SDK never sends, with ``httpx`` against a kvmuxd process: bad JSON, wrong
types, bodies over their limit, unknown routes and methods, half-sent requests, a
full queue; every refusal in OpenAI's error shape, and the daemon serving on."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import anyio
import pytest

from kvmux.client import Client, Item
from kvmux.daemon.config import toml_config

from .conftest import MODEL, free_port, http_tables, httpx, started

pytestmark = pytest.mark.anyio

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


def error_of(resp: Any) -> dict[str, Any]:
    body = resp.json()
    assert set(body) == {"error"}, body
    assert {"message", "type", "param", "code"} <= set(body["error"]), body
    return dict(body["error"])


async def test_bad_json_and_wrong_types_are_400_naming_the_field(raw: Any) -> None:
    resp = await raw.post("/v1/chat/completions", content=b'{"model": "tiny", "messages": [}')
    assert resp.status_code == 400 and error_of(resp)["code"] == "invalid_json"
    resp = await raw.post("/v1/chat/completions", content=b"[1, 2]")
    assert resp.status_code == 400 and "JSON object" in error_of(resp)["message"]
    for field, value in (("temperature", "hot"), ("max_tokens", 1.5), ("n", 0), ("stream", "yes")):
        resp = await raw.post("/v1/chat/completions", json={**CHAT, field: value})
        assert resp.status_code == 400, (field, resp.text)
        error = error_of(resp)
        assert error["type"] == "invalid_request_error" and field in (error["param"] or ""), error
    resp = await raw.post("/v1/chat/completions", json={"messages": CHAT["messages"], "model": 7})
    assert resp.status_code == 400 and error_of(resp)["param"] == "model"
    resp = await raw.post("/v1/batches", json={"endpoint": "/v1/chat/completions"})
    assert resp.status_code == 400 and "input_file_id" in error_of(resp)["message"]


async def test_bodies_over_their_limit_are_413_declared_or_not(raw: Any) -> None:
    huge = b"x" * (16 * 1024 * 1024 + 1)
    resp = await raw.post("/v1/chat/completions", content=huge)
    assert resp.status_code == 413 and error_of(resp)["code"] == "request_too_large"

    async def chunked() -> Any:  # no Content-Length: counted as it comes
        for _ in range(17):
            yield b" " * (1024 * 1024)

    resp = await raw.post("/v1/completions", content=chunked())
    assert resp.status_code == 413
    assert (await raw.get("/health")).status_code == 200


async def test_unknown_routes_and_wrong_methods_answer_in_openai_shape(raw: Any) -> None:
    resp = await raw.get("/v1/embeddings")
    assert resp.status_code == 404 and error_of(resp)["code"] == "not_found"
    resp = await raw.get("/v1/chat/completions")
    assert resp.status_code == 405 and error_of(resp)["code"] == "method_not_allowed"
    assert error_of(resp)["type"] == "invalid_request_error"  # the client's mistake
    resp = await raw.delete("/v1/models")
    assert resp.status_code == 405
    resp = await raw.get("/v1/files/file-none/content")
    assert resp.status_code == 404 and error_of(resp)["type"] == "invalid_request_error"


async def test_half_sent_requests_are_closed_and_others_served(tiny_model: Path) -> None:
    with started(tiny_model, {"http": {"header_timeout": 0.5, "body_timeout": 0.5}}) as daemon:
        host, port = daemon.http_url.removeprefix("http://").split(":")
        headers_only = socket.create_connection((host, int(port)))
        headers_only.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # never ends
        body_short = socket.create_connection((host, int(port)))
        body_short.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 1000\r\n\r\n{"
        )
        idle = socket.create_connection((host, int(port)))  # says nothing at all
        started_at = time.monotonic()
        for conn, what in ((headers_only, b""), (idle, b"")):
            conn.settimeout(5.0)
            assert conn.recv(100) == what  # closed by the daemon, unanswered
        body_short.settimeout(5.0)
        answer = body_short.recv(1000)
        assert answer.startswith(b"HTTP/1.1 408"), answer
        assert time.monotonic() - started_at < 3.0
        for conn in (headers_only, body_short, idle):
            conn.close()
        async with httpx.AsyncClient(base_url=daemon.http_url) as client:
            assert (
                await client.post("/v1/completions", json={**CHAT, "prompt": "x"})
            ).status_code == 400
            resp = await client.post(
                "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2}
            )
            assert resp.status_code == 200


async def test_a_full_queue_is_429_with_retry_after(tiny_model: Path) -> None:
    tables = {"scheduler": {"max_active_sessions": 1, "max_queued_items": 4, "max_job_items": 2}}
    with started(tiny_model, tables) as daemon:
        async with Client(daemon.endpoint, timeout=30.0) as filler:
            long = Item(prompt="x", max_new_tokens=2000, ignore_eos=True)
            # One item decodes, two wait: this owner's whole share of the queue (4 / 2).
            jobs = [await filler.submit([long, long]), await filler.submit([long])]
            async with httpx.AsyncClient(base_url=daemon.http_url) as client:
                resp = await client.post(
                    "/v1/completions", json={"model": MODEL, "prompt": "y", "max_tokens": 2}
                )
            assert resp.status_code == 429, resp.text
            assert error_of(resp)["type"] == "rate_limit_error"
            assert int(resp.headers["retry-after"]) >= 1 and int(resp.headers["retry-after-ms"]) > 0
            for job in jobs:
                await filler.cancel(job.job_id)


async def test_health_is_503_while_draining(tiny_model: Path) -> None:
    with started(tiny_model, {"shutdown": {"grace": 5.0}}) as daemon:
        async with Client(daemon.endpoint, timeout=30.0) as client:
            await client.submit(
                [Item(prompt="x", max_new_tokens=1900, ignore_eos=True)], detach=True
            )
        async with httpx.AsyncClient(base_url=daemon.http_url) as http:
            assert (await http.get("/health")).status_code == 200
            daemon.proc.terminate()  # drains: the item has shutdown.grace to finish
            with anyio.fail_after(5):
                while (resp := await http.get("/health")).status_code == 200:
                    await anyio.sleep(0.02)
            assert resp.status_code == 503 and resp.json() == {"status": "draining"}
            resp = await http.post("/v1/completions", json={"model": MODEL, "prompt": "y"})
            assert resp.status_code == 503 and "retry-after" in resp.headers


def test_health_is_503_while_the_model_loads(tiny_model: Path, tmp_path: Path) -> None:
    cfg = tmp_path / "kvmuxd.toml"
    tables = http_tables({"server": {"endpoint": f"tcp://127.0.0.1:{free_port()}"}})
    port = free_port()
    tables["http"]["listen"] = f"127.0.0.1:{port}"
    cfg.write_text(toml_config({"model": {"path": str(tiny_model)}, **tables}))
    env = {**os.environ, "KVMUX_SLOW_FAILPOINTS": "daemon.load=3"}
    with subprocess.Popen(
        [sys.executable, "-m", "kvmux.daemon", "--config", str(cfg)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    ) as proc:
        try:
            seen = []
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and 200 not in seen:
                try:
                    ask = httpx.post(
                        f"http://127.0.0.1:{port}/v1/completions",
                        json={"model": MODEL, "prompt": "x", "max_tokens": 1},
                    )
                    resp = httpx.get(f"http://127.0.0.1:{port}/health", timeout=1.0)
                except httpx.TransportError:
                    time.sleep(0.05)
                    continue
                seen.append(resp.status_code)
                if resp.status_code == 503:  # still loading: so it was when asked
                    assert resp.json() == {"status": "loading"}
                    assert ask.status_code == 503 and "retry-after" in ask.headers
                time.sleep(0.1)
            assert seen[0] == 503 and seen[-1] == 200, seen
        finally:
            proc.terminate()
            proc.wait(timeout=30)
