"""Structured outputs' cost: an extraction batch under one ~10-field JSON schema.

In-process, on the engine's batched step (``step_many``), the lines decoded in
waves of ``--wave`` sessions (a scheduler's active set):

- compile: the schema compiled on a fresh compiler (llguidance's tokenizer built
  first, timed apart), then looked up again for every line (the cache);
- the batch constrained vs the same batch unconstrained (same prompts, seeds and
  max_tokens): tokens/s, and the step's thread's time on masks per constrained
  token (waiting for the fill made beside the run, applying the masks, any row
  masked alone), every ``stop`` answer checked with jsonschema;
- mixed: one wave, half its rows constrained, against the same wave with none
  constrained. The unconstrained rows (ignore_eos, ``--plain-tokens`` each)
  finish before any constrained row can (the schema needs more tokens), so both
  runs step the very same rows until then; the unconstrained rows' tokens/s is
  their tokens over the time to their end, and their tokens are checked equal.
  Repeated ``--repeats`` times, the two sides interleaved; the median ratio.

Usage:
    python -m bench.bench_structured [--model tiny|small] [--lines 2000] [--wave 64]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from bench.common import builtin, write_json
from kvmux.daemon.engine import DecodeSession, Engine, EngineOptions, SamplingParams
from kvmux.daemon.engine.structured import Filling, GrammarCompiler, Matcher, StructuredSpec

# One invoice's fields: strings with patterns and bounds, enums, a nested object,
# an array of objects, numbers, a boolean; additionalProperties false throughout.
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "invoice_id": {"type": "string", "pattern": "^INV-[0-9]{5}$"},
        "date": {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"},
        "vendor": {"type": "string", "maxLength": 16},
        "total": {"type": "integer", "minimum": 0, "maximum": 99999},
        "currency": {"enum": ["EUR", "USD", "GBP", "JPY"]},
        "paid": {"type": "boolean"},
        "priority": {"enum": ["low", "normal", "high"]},
        "customer": {
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 16},
                "country": {"enum": ["DE", "FR", "US", "JP", "GB"]},
            },
            "required": ["name", "country"],
            "additionalProperties": False,
        },
        "lines": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "sku": {"type": "string", "pattern": "^[A-Z]{3}[0-9]{2}$"},
                    "qty": {"type": "integer", "minimum": 1, "maximum": 99},
                },
                "required": ["sku", "qty"],
                "additionalProperties": False,
            },
            "maxItems": 2,
        },
        "notes": {"type": "string", "maxLength": 24},
    },
    "required": ["invoice_id", "date", "vendor", "total", "currency", "customer"],
    "additionalProperties": False,
}

_VENDORS = ["ACME GmbH", "Globex", "Initech SARL", "Umbrella KK", "Hooli Inc"]


def prompt(i: int) -> str:
    return (
        f"Extract the invoice as JSON. Invoice INV-{i:05d} from {_VENDORS[i % 5]}, dated "
        f"2026-{1 + i % 12:02d}-{1 + i % 28:02d}, total {(i * 37) % 9000} EUR, "
        f"customer number {i * 7 % 1000}. "
    )


@contextmanager
def mask_timer() -> Iterator[list[float]]:
    """The seconds the step's thread spends on masks, added up: waiting for a fill
    (:meth:`Filling.error`), applying masks (``apply_bitmask`` as the engine and the
    runner call it) and any row masked alone (:meth:`Matcher.masked`, the fallback)."""
    from kvmux.daemon.engine import engine as engine_module
    from kvmux.daemon.engine import runner as runner_module

    spent = [0.0]

    def timed(fn: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[0] += time.perf_counter() - t0

        return wrapper

    where = [
        (Filling, "error"),
        (Matcher, "masked"),
        (engine_module, "apply_bitmask"),
        (runner_module, "apply_bitmask"),
    ]
    saved = [(owner, name, getattr(owner, name)) for owner, name in where]
    for owner, name, fn in saved:
        setattr(owner, name, timed(fn))
    try:
        yield spent
    finally:
        for owner, name, fn in saved:
            setattr(owner, name, fn)


def run_batch(
    engine: Engine, lines: int, wave: int, max_tokens: int, constrained: bool
) -> dict[str, Any]:
    """Every line, ``wave`` sessions at a time: tokens/s, finish reasons, valid answers."""
    import jsonschema

    spec = StructuredSpec.from_wire(json=SCHEMA) if constrained else None
    tokens = valid = stops = 0
    with mask_timer() as spent:
        t0 = time.perf_counter()
        for start in range(0, lines, wave):
            sessions = [
                engine.new_session(
                    prompt(i),
                    SamplingParams(
                        max_new_tokens=max_tokens, temperature=0.8, seed=i, structured=spec
                    ),
                )
                for i in range(start, min(start + wave, lines))
            ]
            live = list(sessions)
            while live:
                engine.step_many(live, 1)
                live = [s for s in live if not s.finished]
            for s in sessions:
                done = s.completion()
                s.release()
                tokens += len(done.token_ids)
                if done.finish_reason == "stop":
                    stops += 1
                    if constrained:
                        jsonschema.validate(json.loads(done.text), SCHEMA)
                        valid += 1
        wall = time.perf_counter() - t0
    return {
        "lines": lines,
        "tokens": tokens,
        "seconds": wall,
        "tokens_per_s": tokens / wall,
        "stop": stops,
        "valid_json": valid,
        "mask_us_per_token": spent[0] / tokens * 1e6 if constrained and tokens else 0.0,
        "mask_share": spent[0] / wall,
    }


def mixed_wave(
    engine: Engine, wave: int, plain_tokens: int, constrain: bool
) -> tuple[float, list[list[int]]]:
    """One wave: even rows plain (ignore_eos, ``plain_tokens``), odd rows constrained
    (or, with ``constrain`` False, the same rows unconstrained). Returns the time
    until every plain row finished and the plain rows' tokens."""
    spec = StructuredSpec.from_wire(json=SCHEMA)
    sessions: list[DecodeSession] = []
    for i in range(wave):
        if i % 2 == 0:
            params = SamplingParams(
                max_new_tokens=plain_tokens, temperature=0.8, seed=i, ignore_eos=True
            )
        else:
            params = SamplingParams(
                max_new_tokens=400,
                temperature=0.8,
                seed=i,
                ignore_eos=True,
                structured=spec if constrain else None,
            )
        sessions.append(engine.new_session(prompt(i), params))
    plain = sessions[0::2]
    try:
        t0 = time.perf_counter()
        while not all(s.finished for s in plain):
            live = [s for s in sessions if not s.finished]
            engine.step_many(live, 1)
        wall = time.perf_counter() - t0
        if any(s.finished for s in sessions[1::2]):
            raise RuntimeError(
                "a constrained row ended before the plain rows: lower --plain-tokens"
            )
        return wall, [list(s.generated) for s in plain]
    finally:
        for s in sessions:
            s.release()


def fill_costs(engine: Engine, rows: int, repeats: int = 50) -> dict[str, float]:
    """One step's masks for ``rows`` constrained rows (each a few fields into the schema):
    one row at a time (the fallback when a fill fails) vs one ``fill_bitmasks`` call
    (llguidance's threads, no GIL: what a step calls beside the model's run)."""
    from kvmux.daemon.engine.structured import allocate_bitmask

    compiler = engine.structured
    spec = StructuredSpec.from_wire(json=SCHEMA)
    assert spec is not None
    head = engine.tokenizer.encode('{"invoice_id":"INV-00012","date":"2026-0')
    matchers = [compiler.matcher(spec) for _ in range(rows)]
    for m in matchers:
        m.replay(head)
    masks = allocate_bitmask(rows, compiler.words)
    t0 = time.perf_counter()
    for _ in range(repeats):
        for i, m in enumerate(matchers):
            m.fill_bitmask(masks[i])
    serial = (time.perf_counter() - t0) / repeats / rows
    t0 = time.perf_counter()
    for _ in range(repeats):
        compiler.fill_bitmasks(matchers, masks)
    batched = (time.perf_counter() - t0) / repeats / rows
    return {"fill_serial_us_per_row": serial * 1e6, "fill_batched_us_per_row": batched * 1e6}


def compile_times(engine: Engine, lines: int) -> dict[str, float]:
    fresh = GrammarCompiler.for_model(engine.spec)
    t0 = time.perf_counter()
    _ = fresh.tokenizer
    tokenizer_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    fresh.compile(StructuredSpec.from_wire(json=SCHEMA))  # type: ignore[arg-type]
    compile_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(lines):
        spec = StructuredSpec.from_wire(json=SCHEMA)
        assert spec is not None
        fresh.matcher(spec)
    per_line = (time.perf_counter() - t0) / lines
    assert fresh.compiled == 1
    return {
        "tokenizer_ms": tokenizer_s * 1e3,
        "compile_ms": compile_s * 1e3,
        "per_line_cached_us": per_line * 1e6,
    }


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=["tiny", "small"], default="tiny")
    ap.add_argument("--lines", type=int, default=2000)
    ap.add_argument("--wave", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--plain-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    engine = Engine(
        builtin(args.model),
        EngineOptions(
            intra_op_threads=args.threads, max_batch=args.wave, rows_per_cohort=args.wave
        ),
    )
    comp = compile_times(engine, args.lines)
    print(
        f"{args.model}: tokenizer {comp['tokenizer_ms']:.1f} ms, schema compile "
        f"{comp['compile_ms']:.2f} ms once, then {comp['per_line_cached_us']:.1f} us a line "
        f"(cache hit + matcher copy)"
    )
    free = run_batch(engine, args.lines, args.wave, args.max_tokens, constrained=False)
    bound = run_batch(engine, args.lines, args.wave, args.max_tokens, constrained=True)
    print(
        f"{'batch':<14}{'lines':>7}{'tokens':>9}{'tok/s':>9}{'stop':>7}{'valid':>7}"
        f"{'mask us/tok':>13}{'mask share':>12}"
    )
    for name, r in (("unconstrained", free), ("constrained", bound)):
        print(
            f"{name:<14}{r['lines']:>7}{r['tokens']:>9}{r['tokens_per_s']:>9.0f}{r['stop']:>7}"
            f"{r['valid_json']:>7}{r['mask_us_per_token']:>13.1f}{r['mask_share']:>12.1%}"
        )
    print(
        f"constrained / unconstrained tokens/s: {bound['tokens_per_s'] / free['tokens_per_s']:.2f}"
    )
    fills = fill_costs(engine, args.wave // 2)
    print(
        f"one step's masks for {args.wave // 2} rows: {fills['fill_serial_us_per_row']:.1f} us a "
        f"row one at a time, {fills['fill_batched_us_per_row']:.1f} us a row in one "
        "fill_bitmasks call (fill only: a step makes that call beside its run)"
    )
    ratios = []
    for _ in range(args.repeats):
        t_plain, want = mixed_wave(engine, args.wave, args.plain_tokens, constrain=False)
        t_mixed, got = mixed_wave(engine, args.wave, args.plain_tokens, constrain=True)
        if got != want:
            raise RuntimeError("an unconstrained row's tokens changed beside constrained rows")
        ratios.append(t_mixed / t_plain)
    slowdown = statistics.median(ratios) - 1.0
    print(
        f"mixed wave of {args.wave} (half constrained): unconstrained rows' time to their "
        f"{args.plain_tokens} tokens {statistics.median(ratios):.3f}x the same wave with no "
        f"constraints (slowdown {slowdown:+.1%}; runs {', '.join(f'{r:.3f}' for r in ratios)}); "
        "tokens equal"
    )
    write_json(
        f"structured-{args.model}",
        {
            "args": vars(args),
            "compile": comp,
            "fill": fills,
            "unconstrained": free,
            "constrained": bound,
            "mixed_ratios": ratios,
            "mixed_slowdown": slowdown,
        },
    )


if __name__ == "__main__":
    main()
