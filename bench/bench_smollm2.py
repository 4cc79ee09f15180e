"""SmolLM2-135M-Instruct through kvmux vs onnxruntime-genai's Generator on the same weights.

kvmux runs its own import of the GGUF file (``model.name = "smollm2"``: Q4_1
dequantized to float32); the Generator runs its model builder's fp32 CPU export of
the same dequantized weights (transformers loading the GGUF file), the reference
``tests/model/test_smollm2.py`` checks the import against. Both greedy, float32,
the same ``intra_op_num_threads``, measured interleaved in one run:

- one session: kvmux's engine vs a Generator of batch 1;
- N sessions (16): kvmux stepping all N in one run per step (the daemon scheduler's
  turn, ``bench_daemon.run_inprocess``) vs the Generator as one static batch of N.

Prompts are the first ``PROMPT_LEN`` tokens of plain-text openings, screened so each
decodes ``N_NEW`` tokens without reaching eos: both sides do the same work, and their
tokens are checked equal. Both models are made once under the model cache
(``$KVMUX_MODEL_CACHE``, else ``models/``). Needs the [genai] extra. Usage:
    python -m bench.bench_smollm2 [--threads N] [--sizes 16] [--repeats R] [--new 128]
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from bench.bench_daemon import run_inprocess
from bench.bench_genai import GenaiPeer, tps
from bench.common import MODELS, write_json
from kvmux.daemon.engine import Engine, EngineOptions, SamplingParams
from kvmux.daemon.model import ensure_smollm2
from tests.genai.genai_fixture import smollm2_reference_export

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


def screened(engine: Engine, n: int, n_new: int) -> list[list[int]]:
    params = SamplingParams(max_new_tokens=n_new, temperature=0.0)
    out: list[list[int]] = []
    for text in OPENINGS:
        ids = engine.encode(text)[:PROMPT_LEN]
        if len(ids) == PROMPT_LEN and engine.generate(ids, params).finish_reason == "length":
            out.append(ids)
        if len(out) == n:
            return out
    raise RuntimeError(f"only {len(out)} of {len(OPENINGS)} openings decode {n_new} tokens")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=0, help="intra-op threads (0: default)")
    ap.add_argument("--sizes", default="16")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--new", type=int, default=128)
    args = ap.parse_args(argv)
    n_new, sizes = args.new, [int(x) for x in args.sizes.split(",")]

    ours = ensure_smollm2(MODELS)
    reference = smollm2_reference_export(MODELS)
    # First bucket prompt + new: the capacity the Generator's max_length also binds.
    bucket = 1 << (PROMPT_LEN + n_new - 1).bit_length()
    engine = Engine(ours, EngineOptions(intra_op_threads=args.threads, min_bucket=bucket))
    peer = GenaiPeer(reference, args.threads)
    print(
        "SmolLM2-135M-Instruct (Q4_1 GGUF): kvmux's import, float32 | the Generator on the "
        "builder's fp32 export of transformers' float32 load of the same file"
    )
    print(
        f"intra_op_num_threads={args.threads or 'default'} on both sides; greedy; prompt "
        f"{PROMPT_LEN}; {n_new} new tokens per session (screened: no eos); "
        f"{args.repeats} repeats, interleaved"
    )
    prompts = screened(engine, max(sizes), n_new)
    result: dict[str, Any] = {"threads": args.threads, "new": n_new, "repeats": args.repeats}

    params = SamplingParams(max_new_tokens=n_new, temperature=0.0)
    engine.generate(prompts[0], SamplingParams(max_new_tokens=8, temperature=0.0))  # warm-up
    peer.batch(prompts[:1], 8)
    kv_w, gen_w = [], []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        done = engine.generate(prompts[0], params)
        kv_w.append(time.perf_counter() - t0)
        toks, w = peer.batch(prompts[:1], n_new)
        gen_w.append(w)
        if toks[0] != done.token_ids:
            raise AssertionError("kvmux and the Generator decoded different tokens")
    single = {"kvmux_tokens_per_s": tps(n_new, kv_w), "generator_tokens_per_s": tps(n_new, gen_w)}
    single["ratio"] = single["kvmux_tokens_per_s"] / single["generator_tokens_per_s"]
    result["single"] = single
    print(
        f"one session: kvmux {single['kvmux_tokens_per_s']:.1f} tokens/s, Generator "
        f"{single['generator_tokens_per_s']:.1f}: kvmux / Generator = {single['ratio']:.2f}"
    )

    rows = []
    for n in sizes:
        batch = prompts[:n]
        walls: dict[str, list[float]] = {"kvmux": [], "generator": []}
        for rep in range(args.repeats):
            order = ["kvmux", "generator"] if rep % 2 == 0 else ["generator", "kvmux"]
            got: dict[str, list[list[int]]] = {}
            for side in order:
                if side == "kvmux":
                    run = run_inprocess(engine, batch, n_new)
                    got[side], wall = [run.tokens[i] for i in range(n)], run.wall
                else:
                    got[side], wall = peer.batch(batch, n_new)
                walls[side].append(wall)
            if got["kvmux"] != got["generator"]:
                raise AssertionError(f"N={n}: kvmux and the Generator decoded different tokens")
        row = {"n": n, **{f"{k}_tokens_per_s": tps(n * n_new, v) for k, v in walls.items()}}
        row["ratio"] = row["kvmux_tokens_per_s"] / row["generator_tokens_per_s"]
        rows.append(row)
        print(
            f"N={n}: kvmux {row['kvmux_tokens_per_s']:.1f} tokens/s, Generator (one static "
            f"batch) {row['generator_tokens_per_s']:.1f}: kvmux / Generator = {row['ratio']:.2f}"
        )
    result["batched"] = rows
    print(f"wrote {write_json('smollm2', result)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
