"""OpenAI's HTTP API against kvmux's own client, side by side on one ``kvmuxd`` (``small``).

Measured in one run, alternating the sides each repeat so drift hits both alike:

- **streams**: N = 1, 16, 64 concurrent streaming chat requests through the real
  ``openai`` SDK (``AsyncOpenAI``), against the same N items (the same chat
  messages, greedy, the same ``max_tokens``) as N one-item jobs submitted at
  once through one :class:`kvmux.client.Client`, streaming their events. Aggregate completion
  tokens/s, and time to first token (the first content chunk / the first token
  event) p50 and p90; tokens checked equal (the text each side streamed).
- **batch**: one file of chat lines (default 20,000) through ``/v1/files`` +
  ``/v1/batches`` (polled until completed, output downloaded) against ``kvmux
  submit`` of the same file to the same daemon: wall time and lines/s.
- **floor**: one streaming chat request at a time through the SDK, and through bare
  ``httpx``, against a Starlette/uvicorn server that answers at once with one chunk:
  the first token's cost before any daemon does anything.
- **idle**: 1,000 TCP connections opened to the HTTP port and left idle while a
  client keeps asking; the daemon's RSS before and while they are held, the
  client's latency, and how soon the daemon closes them (``http.header_timeout``).

Usage: python -m bench.bench_http [--quick] [--sizes 1,16,64] [--tokens T]
[--repeats R] [--lines L] [--idle N] [--floor F] [--only floor,streams,batch,idle]
"""

from __future__ import annotations

import argparse
import os
import resource
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import httpx
import msgspec
import openai

from bench.bench_daemon import DaemonProcess, kvmuxd
from bench.common import builtin, write_json
from kvmux.client import Client, Item
from kvmux.client import protocol as p

MODEL = "small"


def tables() -> dict[str, dict[str, object]]:
    return {
        # Kept-alive connections outlive the other side's turn (an SDK client keeps its pool).
        "http": {
            "listen": "127.0.0.1:0",
            "served_model_names": [MODEL],
            "header_timeout": 10.0,
            "keep_alive_timeout": 120.0,
        },
        "scheduler": {
            "max_active_sessions": 64,
            "max_job_items": 1000,
            "max_queued_items": 20000,
            "max_queued_per_owner": 20000,
        },
        "log": {"level": "warning"},
        # Memory only: both sides alike (the batch's own journal writes are its files).
        "jobs": {"journal": ""},
    }


def messages(i: int) -> list[Any]:
    return [{"role": "user", "content": f"Tell me about the number {i}."}]


# -- streams ---------------------------------------------------------------------------
async def via_sdk(sdk: openai.AsyncOpenAI, n: int, tokens: int) -> dict[str, Any]:
    """N concurrent streaming chat requests through the openai SDK (one client, its
    connections kept alive from one run to the next, as an application keeps them)."""
    ttft: list[float] = []
    texts: dict[int, str] = {}
    count = 0
    t0 = time.perf_counter()

    async def one(i: int) -> None:
        nonlocal count
        started = time.perf_counter()
        text = ""
        stream = await sdk.chat.completions.create(
            model=MODEL,
            messages=messages(i),
            max_tokens=tokens,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        async for chunk in stream:
            if chunk.usage is not None:
                count += chunk.usage.completion_tokens
            for choice in chunk.choices:
                if choice.delta.content:
                    if not text:
                        ttft.append(time.perf_counter() - started)
                    text += choice.delta.content
        texts[i] = text

    await all_at_once(n, one)
    return {"wall": time.perf_counter() - t0, "tokens": count, "ttft": ttft, "texts": texts}


async def all_at_once(n: int, one: Callable[[int], Coroutine[Any, Any, None]]) -> None:
    """``one(0)`` ... ``one(n - 1)`` started together; returns once all are done."""
    async with anyio.create_task_group() as tg:
        for i in range(n):
            tg.start_soon(one, i)


async def via_kvmux(endpoint: str, n: int, tokens: int) -> dict[str, Any]:
    """The same N items through the kvmux client: N jobs of one item submitted at once
    over one connection (arriving as the N HTTP requests do), streaming their events."""
    ttft: list[float] = []
    texts: dict[int, str] = {}
    count = 0
    async with Client(endpoint, timeout=60.0) as client:
        t0 = time.perf_counter()

        async def one(i: int) -> None:
            nonlocal count
            item = Item(
                custom_id=str(i),
                messages=[p.ChatMessage(**m) for m in messages(i)],
                max_new_tokens=tokens,
                temperature=0,
            )
            started = time.perf_counter()
            text = ""
            job = await client.submit([item])
            async for event in job.events():
                if isinstance(event, p.TokenDelta):
                    if event.text and not text:
                        ttft.append(time.perf_counter() - started)
                    text += event.text
                    count += len(event.token_ids)
            texts[i] = text

        await all_at_once(n, one)
        wall = time.perf_counter() - t0
    return {"wall": wall, "tokens": count, "ttft": ttft, "texts": texts}


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def streams(
    daemon: DaemonProcess, sizes: list[int], tokens: int, repeats: int
) -> list[dict[str, Any]]:
    rows = []
    sdk = openai.AsyncOpenAI(base_url=daemon.http_url + "/v1", api_key="-", max_retries=0)
    for n in sizes:
        runs: dict[str, list[dict[str, Any]]] = {"http": [], "kvmux": []}
        await via_sdk(sdk, n, 4)  # warm both paths (templates, buckets, connections)
        await via_kvmux(daemon.endpoint, n, 4)
        for r in range(repeats):
            order = ("http", "kvmux") if r % 2 == 0 else ("kvmux", "http")
            for side in order:
                run = (
                    await via_sdk(sdk, n, tokens)
                    if side == "http"
                    else await via_kvmux(daemon.endpoint, n, tokens)
                )
                runs[side].append(run)
        same = all(
            h["texts"] == k["texts"] for h, k in zip(runs["http"], runs["kvmux"], strict=True)
        )
        tps = {s: statistics.median(r["tokens"] / r["wall"] for r in runs[s]) for s in runs}
        p50 = {s: statistics.median(_pct(r["ttft"], 0.5) for r in runs[s]) for s in runs}
        p90 = {s: statistics.median(_pct(r["ttft"], 0.9) for r in runs[s]) for s in runs}
        row = {
            "n": n,
            "tokens_per_request": tokens,
            "http_tokens_per_s": round(tps["http"], 1),
            "kvmux_tokens_per_s": round(tps["kvmux"], 1),
            "http_over_kvmux": round(tps["http"] / tps["kvmux"], 3),
            "ttft_p50_ms": {s: round(1000 * v, 2) for s, v in p50.items()},
            "ttft_p90_ms": {s: round(1000 * v, 2) for s, v in p90.items()},
            "ttft_p50_extra_ms": round(1000 * (p50["http"] - p50["kvmux"]), 2),
            "texts_identical": same,
        }
        print(f"streams N={n}: {row}", flush=True)
        rows.append(row)
    await sdk.close()
    return rows


# -- a batch file --------------------------------------------------------------------
def write_batch(path: Path, lines: int) -> Path:
    with path.open("wb") as f:
        for i in range(lines):
            body = {"model": MODEL, "messages": messages(i), "max_tokens": 2, "temperature": 0}
            line = {"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions"}
            f.write(msgspec.json.encode({**line, "body": body}) + b"\n")
    return path


async def batch_http(url: str, path: Path) -> tuple[float, int]:
    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="-", timeout=600) as sdk:
        t0 = time.perf_counter()
        with path.open("rb") as f:
            upload = await sdk.files.create(file=f, purpose="batch")
        batch = await sdk.batches.create(
            input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        while (batch := await sdk.batches.retrieve(batch.id)).status not in (
            "completed",
            "failed",
            "cancelled",
        ):
            await anyio.sleep(0.2)
        assert batch.output_file_id is not None, batch
        out = (await sdk.files.content(batch.output_file_id)).read()
        wall = time.perf_counter() - t0
    return wall, out.count(b"\n")


async def batch_cli(endpoint: str, path: Path, out: Path) -> tuple[float, int]:
    t0 = time.perf_counter()
    done = await anyio.run_process(
        [sys.executable, "-m", "kvmux.client.cli", "submit", str(path), "--out", str(out), "-q"],
        env={**os.environ, "KVMUX_ENDPOINT": endpoint},
        check=False,
    )
    wall = time.perf_counter() - t0
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    return wall, out.read_bytes().count(b"\n")


async def batches(daemon: DaemonProcess, lines: int, repeats: int) -> dict[str, Any]:
    folder = Path(tempfile.mkdtemp(prefix="kvx-bh-"))
    path = write_batch(folder / "in.jsonl", lines)
    walls: dict[str, list[float]] = {"http": [], "kvmux": []}
    for r in range(repeats):
        for side in ("http", "kvmux") if r % 2 == 0 else ("kvmux", "http"):
            if side == "http":
                wall, got = await batch_http(daemon.http_url, path)
            else:
                wall, got = await batch_cli(daemon.endpoint, path, folder / f"out{r}.jsonl")
            assert got == lines, (side, got)
            walls[side].append(wall)
    med = {s: statistics.median(w) for s, w in walls.items()}
    row = {
        "lines": lines,
        "http_wall_s": round(med["http"], 2),
        "kvmux_submit_wall_s": round(med["kvmux"], 2),
        "http_over_kvmux_throughput": round(med["kvmux"] / med["http"], 3),
        "walls": {s: [round(w, 2) for w in ws] for s, ws in walls.items()},
    }
    print(f"batch: {row}", flush=True)
    return row


# -- idle connections ------------------------------------------------------------------
async def idle(daemon: DaemonProcess, n: int) -> dict[str, Any]:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(soft, n + 1024)), hard))
    host, port = daemon.http_url.removeprefix("http://").rsplit(":", 1)
    base = daemon.rss()
    conns = [socket.create_connection((host, int(port))) for _ in range(n)]
    held_at = time.monotonic()
    latencies = []
    peak = base
    async with httpx.AsyncClient(base_url=daemon.http_url) as client:
        for _ in range(20):
            t0 = time.perf_counter()
            resp = await client.post(
                "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 1}
            )
            latencies.append(time.perf_counter() - t0)
            assert resp.status_code == 200, resp.text
            peak = max(peak, daemon.rss())
            await anyio.sleep(0.05)
    for conn in conns:
        conn.setblocking(False)
    held = _still_open(conns)
    # The daemon closes connections that send no request within http.header_timeout.
    closed_after = None
    deadline = held_at + 30
    while time.monotonic() < deadline:
        if _still_open(conns) == 0:
            closed_after = round(time.monotonic() - held_at, 1)
            break
        await anyio.sleep(0.5)
    for conn in conns:
        conn.close()
    row = {
        "connections": n,
        "held_while_serving": held,
        "rss_before_mib": round(base / 2**20, 1),
        "rss_growth_mib": round((peak - base) / 2**20, 1),
        "completion_p50_ms_meanwhile": round(1000 * statistics.median(latencies), 1),
        "all_closed_after_s": closed_after,
    }
    print(f"idle: {row}", flush=True)
    return row


# -- the floor: the SDK and HTTP with a server that does nothing ------------------------
# Starlette on uvicorn (httptools), the stack kvmuxd's front stands on, answering a
# streaming chat request with one content chunk at once: what a TTFT through the SDK
# costs before any daemon does anything.
_STUB = """
import json, sys
import uvicorn
from starlette.applications import Starlette
from starlette.responses import StreamingResponse
from starlette.routing import Route

CHUNK = {"id": "c", "object": "chat.completion.chunk", "created": 0, "model": "m",
         "choices": [{"index": 0, "delta": {"role": "assistant", "content": "Hi"},
                      "finish_reason": None}]}

async def chat(request):
    await request.body()
    async def chunks():
        yield b"data: " + json.dumps(CHUNK).encode() + b"\\n\\n"
        yield b"data: [DONE]\\n\\n"
    return StreamingResponse(chunks(), media_type="text/event-stream")

app = Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"])])
uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning", http="httptools")
"""


async def floor(requests: int) -> dict[str, Any]:
    """Time to the first content chunk against the do-nothing server: through the
    ``openai`` SDK, and through bare ``httpx`` (alternating, one at a time)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}/v1"
    stub = await anyio.open_process([sys.executable, "-c", _STUB, str(port)])
    ttft: dict[str, list[float]] = {"sdk": [], "httpx": []}
    try:
        with anyio.fail_after(30):
            while True:
                try:
                    socket.create_connection(("127.0.0.1", port)).close()
                    break
                except OSError:
                    await anyio.sleep(0.1)
        body = {"model": MODEL, "messages": messages(1), "max_tokens": 64, "stream": True}
        async with (
            openai.AsyncOpenAI(base_url=url, api_key="-", max_retries=0) as sdk,
            httpx.AsyncClient(base_url=url) as raw,
        ):
            for r in range(requests + 20):  # the first 20 of each warm up
                for side in ("sdk", "httpx") if r % 2 else ("httpx", "sdk"):
                    t0 = time.perf_counter()
                    if side == "sdk":
                        stream = await sdk.chat.completions.create(
                            model=MODEL, messages=messages(1), max_tokens=64, stream=True
                        )
                        async for chunk in stream:
                            if chunk.choices and chunk.choices[0].delta.content:
                                break
                        took = time.perf_counter() - t0
                        await stream.close()
                    else:
                        async with raw.stream("POST", "/chat/completions", json=body) as resp:
                            async for line in resp.aiter_lines():
                                if line.startswith("data: {"):
                                    break
                            took = time.perf_counter() - t0
                    if r >= 20:
                        ttft[side].append(took)
    finally:
        stub.terminate()
        await stub.wait()
    row = {
        "requests": requests,
        **{f"{side}_ttft_p50_ms": round(1000 * _pct(v, 0.5), 2) for side, v in ttft.items()},
        **{f"{side}_ttft_p90_ms": round(1000 * _pct(v, 0.9), 2) for side, v in ttft.items()},
    }
    print(f"floor: {row}", flush=True)
    return row


def _still_open(conns: list[socket.socket]) -> int:
    """How many of these (non-blocking) connections the daemon has not closed."""
    open_now = 0
    for conn in conns:
        try:
            open_now += conn.recv(1) != b""
        except BlockingIOError:
            open_now += 1  # still open, nothing said
    return open_now


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    model = builtin(MODEL)
    out: dict[str, Any] = {"model": MODEL, "threads": args.threads}
    if "floor" in args.only:
        out["floor"] = await floor(args.floor)
    async with kvmuxd(model, threads=args.threads, tables=tables()) as daemon:
        if "streams" in args.only:
            out["streams"] = await streams(daemon, args.sizes, args.tokens, args.repeats)
        if "batch" in args.only:
            out["batch"] = await batches(daemon, args.lines, max(1, args.repeats // 2))
        if "idle" in args.only:
            out["idle"] = await idle(daemon, args.idle)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.bench_http", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="fewer repeats, a smaller batch")
    parser.add_argument("--sizes", default="1,16,64")
    parser.add_argument("--tokens", type=int, default=64, help="new tokens per request")
    parser.add_argument("--repeats", type=int, default=0, help="runs per side (default 4)")
    parser.add_argument("--lines", type=int, default=0, help="batch lines (default 20000)")
    parser.add_argument("--idle", type=int, default=1000, help="idle connections")
    parser.add_argument("--threads", type=int, default=1, help="the daemon's intra-op threads")
    parser.add_argument("--floor", type=int, default=300, help="requests per side, floor")
    parser.add_argument("--only", default="floor,streams,batch,idle", help="which parts to run")
    args = parser.parse_args(argv)
    args.sizes = [int(s) for s in args.sizes.split(",") if s]
    args.repeats = args.repeats or (2 if args.quick else 4)
    args.lines = args.lines or (2000 if args.quick else 20000)
    result = anyio.run(main_async, args)
    print(f"written to {write_json('bench_http', result)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
