"""1B- and 8B-class Llama GGUFs: import time and peak RSS, kvmuxd's RSS, tokens/s vs llama-server.

The bench writes each file itself (random weights: the figures are about size and speed,
not text), streaming one tensor at a time through ``gguf.GGUFWriter``:

- ``1b``: Llama 3.2 1B's shape (hidden 2048, 16 layers, 32/8 heads, MLP 8192, tied);
- ``8b``: Llama 3.1 8B's shape (hidden 4096, 32 layers, 32/8 heads, MLP 14336, untied);

each as ``q4_0`` (every matrix Q4_0, output Q6_K, as llama.cpp's Q4_0 files) and as
``q4_k_m`` (llama.cpp's Q4_K_M mix: Q4_K, with attn_v and ffn_down Q6_K in every other
layer, attn_k Q8_0 in the first, output Q6_K). The vocabulary is the test fixture's
byte-level BPE (384 tokens) padded with reserved control tokens to Llama 3's 128256.

For each file: ``kvmux-model import-gguf`` in a subprocess (wall time, peak RSS), then
kvmuxd (the folder) and llama-server (the file) at once, both with --threads, N requests
of token prompts at once, taking turns; kvmuxd's RSS after the runs. Usage:
    python -m bench.bench_big --server PATH/llama-server [--models 1b,8b]
        [--mixes q4_0,q4_k_m] [--sizes 1,16] [--new 32] [--repeats 2]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import httpx
import numpy as np

from bench.bench_daemon import kvmuxd
from bench.bench_llama_server import (
    BUILD_HINT,
    MODEL,
    completions,
    llama_server,
    rss_mb,
    server_path,
)
from bench.common import MODELS, write_json


@dataclass(frozen=True)
class Shape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    inter: int
    tied: bool
    vocab: int = 128256
    context: int = 8192


SHAPES = {
    "1b": Shape(hidden=2048, layers=16, heads=32, kv_heads=8, inter=8192, tied=True),
    "8b": Shape(hidden=4096, layers=32, heads=32, kv_heads=8, inter=14336, tied=False),
}
#: Where each block type keeps its float16 scale(s): ggml's block structs.
SCALE_AT = {"Q4_0": (0,), "Q8_0": (0,), "Q4_K": (0, 2), "Q6_K": (208,)}
PROMPT_LEN = 16


def _mix(mix: str, name: str, layer: int) -> str:
    if name == "output":
        return "Q6_K"
    if mix == "q4_0":
        return "Q4_0"
    if name in ("attn_v", "ffn_down") and layer % 2 == 0:
        return "Q6_K"
    if name == "attn_k" and layer == 0:
        return "Q8_0"
    return "Q4_K"


def _blocks(kind: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray[Any, Any]:
    """Random blocks with scales that give weights of spread ~1/sqrt(cols)."""
    import gguf

    qtype = gguf.GGMLQuantizationType[kind]
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    data = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    scale = {"Q4_0": 0.25, "Q8_0": 1 / 64, "Q4_K": 1 / 64, "Q6_K": 1 / 128}[kind] / np.sqrt(cols)
    half = np.array([scale], np.float16).view(np.uint8)
    for at in SCALE_AT[kind]:
        data[..., at : at + 2] = half
    return data.reshape(rows, -1)


def write_file(path: Path, shape: Shape, mix: str, seed: int = 0) -> Path:
    """The random-weight GGUF for ``shape`` and ``mix``, one tensor in memory at a time."""
    import gguf

    from tests.model.gguf_fixture import TinyShape, Vocab, train_vocab, writer

    vocab = train_vocab()[1]
    pad = shape.vocab - len(vocab.tokens)
    tokens = vocab.tokens + [f"<|reserved_{i}|>" for i in range(pad)]
    types = vocab.types + [3] * pad
    d = shape.hidden // shape.heads
    tensors: list[tuple[str, str, int, int]] = [
        ("token_embd.weight", "", shape.vocab, shape.hidden)
    ]
    for i in range(shape.layers):
        p = f"blk.{i}"
        tensors += [
            (f"{p}.attn_norm.weight", "F32", 1, shape.hidden),
            (f"{p}.ffn_norm.weight", "F32", 1, shape.hidden),
            (f"{p}.attn_q.weight", _mix(mix, "attn_q", i), shape.heads * d, shape.hidden),
            (f"{p}.attn_k.weight", _mix(mix, "attn_k", i), shape.kv_heads * d, shape.hidden),
            (f"{p}.attn_v.weight", _mix(mix, "attn_v", i), shape.kv_heads * d, shape.hidden),
            (f"{p}.attn_output.weight", _mix(mix, "attn_output", i), shape.hidden, shape.hidden),
            (f"{p}.ffn_gate.weight", _mix(mix, "ffn_gate", i), shape.inter, shape.hidden),
            (f"{p}.ffn_up.weight", _mix(mix, "ffn_up", i), shape.inter, shape.hidden),
            (f"{p}.ffn_down.weight", _mix(mix, "ffn_down", i), shape.hidden, shape.inter),
        ]
    tensors.append(("output_norm.weight", "F32", 1, shape.hidden))
    if not shape.tied:
        tensors.append(("output.weight", _mix(mix, "output", 0), shape.vocab, shape.hidden))
    embed = "Q4_0" if mix == "q4_0" else "Q4_K"
    tensors[0] = ("token_embd.weight", embed, shape.vocab, shape.hidden)

    header = TinyShape(
        hidden=shape.hidden,
        layers=shape.layers,
        heads=shape.heads,
        kv_heads=shape.kv_heads,
        head=d,
        inter=shape.inter,
        context=shape.context,
        rope_theta=500000.0,
    )
    padded = Vocab(tokens, vocab.merges, types)
    # Llama 3's pre-tokenizer: both readers know it (llama.cpp refuses "gpt2").
    w = writer(path, "llama", header, padded, pre="llama-bpe", name=f"kvmux bench {path.stem}")
    for name, kind, rows, cols in tensors:
        if kind == "F32":
            w.add_tensor_info(name, (cols,), np.dtype(np.float32), cols * 4)
        else:
            qtype = gguf.GGMLQuantizationType[kind]
            block, size = gguf.GGML_QUANT_SIZES[qtype]
            nbytes = rows * cols // block * size
            w.add_tensor_info(
                name, (rows, cols // block * size), np.dtype(np.uint8), nbytes, raw_dtype=qtype
            )
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for _name, kind, rows, cols in tensors:
        if kind == "F32":
            w.write_tensor_data(np.ones(cols, np.float32))
        else:
            w.write_tensor_data(_blocks(kind, rows, cols, rng))
    w.close()
    return path


#: The CLI's import in a child that prints its own peak RSS (RUSAGE_CHILDREN would give
#: the largest child so far, a kvmuxd of an earlier file).
_IMPORT = (
    "import resource, sys; from kvmux.daemon.model.__main__ import main; rc = main(sys.argv[1:]); "
    "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, file=sys.stderr); sys.exit(rc)"
)


def import_measured(gguf: Path, out: Path) -> dict[str, float]:
    """``kvmux-model import-gguf`` in a child process: its wall time and peak RSS."""
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-c", _IMPORT, "import-gguf", str(gguf), str(out)],
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    wall = time.perf_counter() - start
    peak_kb = int(done.stderr.strip().splitlines()[-1])
    return {"import_s": round(wall, 1), "import_peak_rss_mb": round(peak_kb / 1000, 1)}


async def serve_and_time(
    args: argparse.Namespace, binary: Path, gguf: Path, folder: Path
) -> dict[str, Any]:
    sizes = [int(x) for x in args.sizes.split(",")]
    rng = np.random.default_rng(1)
    prompts = [[int(t) for t in rng.integers(3, 384, PROMPT_LEN)] for _ in range(max(sizes))]
    slot = max(64, 1 << (PROMPT_LEN + args.new - 1).bit_length())
    tables: dict[str, dict[str, object]] = {
        # completions() names the model MODEL; the daemon answers to it.
        "http": {"listen": "127.0.0.1:0", "served_model_names": [MODEL]},
        "scheduler": {"max_active_sessions": max(sizes)},
        "kv": {"min_bucket": slot, "prefix_cache": False},
        "jobs": {"journal": ""},
        "log": {"level": "warning"},
    }
    extra = {"kvmux": {}, "llama-server": {"cache_prompt": False}}
    rows = []
    async with (
        kvmuxd(folder, threads=args.threads, tables=tables, startup_timeout=900) as daemon,
        llama_server(
            binary, gguf, threads=args.threads, parallel=max(sizes), ctx_per_slot=slot
        ) as llama_url,
    ):
        urls = {"kvmux": daemon.http_url, "llama-server": llama_url}
        clients = {
            side: httpx.AsyncClient(base_url=url, timeout=3600.0) for side, url in urls.items()
        }
        try:
            for side, client in clients.items():
                await completions(client, prompts[:1], 2, extra[side])
            for n in sizes:
                walls: dict[str, list[float]] = {side: [] for side in urls}
                for rep in range(args.repeats):
                    order = list(urls) if rep % 2 == 0 else list(reversed(urls))
                    for side in order:
                        wall, counts, _ = await completions(
                            clients[side], prompts[:n], args.new, extra[side]
                        )
                        if counts != [args.new] * n:
                            raise AssertionError(f"{side} N={n}: generated {counts}")
                        walls[side].append(wall)
                tps = {s: n * args.new / statistics.median(w) for s, w in walls.items()}
                rows.append(
                    {
                        "n": n,
                        "kvmux_tokens_per_s": round(tps["kvmux"], 2),
                        "llama_server_tokens_per_s": round(tps["llama-server"], 2),
                        "ratio": round(tps["kvmux"] / tps["llama-server"], 3),
                        "loadavg_1min": round(os.getloadavg()[0], 2),
                    }
                )
                print(f"    N = {n}: {rows[-1]}", flush=True)
            kvmux_rss = rss_mb(daemon.pid)
        finally:
            for client in clients.values():
                await client.aclose()
    return {"rows": rows, "kvmuxd_rss_mb": round(kvmux_rss, 1)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bench.bench_big", description=__doc__.split("\n")[0]
    )
    ap.add_argument("--server", help="path to llama.cpp's llama-server binary")
    ap.add_argument("--models", default="1b,8b")
    ap.add_argument("--mixes", default="q4_0,q4_k_m")
    ap.add_argument("--sizes", default="1,16")
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--keep", action="store_true", help="keep the files and folders")
    args = ap.parse_args(argv)
    binary = server_path(args.server)
    if binary is None:
        print(f"error: no llama-server\n{BUILD_HINT}", file=sys.stderr)
        return 2
    work = MODELS / "bench-big"
    work.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {"threads": args.threads, "new_tokens": args.new, "files": {}}
    for model in args.models.split(","):
        for mix in args.mixes.split(","):
            label = f"{model}-{mix}"
            gguf, folder = work / f"{label}.gguf", work / label
            print(f"{label}: writing {gguf}", flush=True)
            start = time.perf_counter()
            write_file(gguf, SHAPES[model], mix)
            entry: dict[str, Any] = {
                "gguf_gb": round(gguf.stat().st_size / 1e9, 2),
                "write_s": round(time.perf_counter() - start, 1),
            }
            shutil.rmtree(folder, ignore_errors=True)
            entry.update(import_measured(gguf, folder))
            entry["folder_gb"] = round(sum(f.stat().st_size for f in folder.iterdir()) / 1e9, 2)
            print(f"  {entry}", flush=True)
            entry.update(anyio.run(serve_and_time, args, binary, gguf, folder))
            print(f"  kvmuxd RSS {entry['kvmuxd_rss_mb']} MB", flush=True)
            results["files"][label] = entry
            if not args.keep:
                gguf.unlink()
                shutil.rmtree(folder)
    print(f"wrote {write_json('big', results)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
