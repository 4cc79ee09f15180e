"""``kvmux-model``: build a built-in model folder, or show what kvmux reads from one.

python -m kvmux.daemon.model build {tiny,small} DIR [--dtype float32|float16]
python -m kvmux.daemon.model info DIR
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kvmux.daemon.model.builder import BUILTIN_SIZES, DTYPES, build_builtin
from kvmux.daemon.model.config import load_model
from kvmux.daemon.model.errors import ModelFormatError


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvmux-model", description="Build or inspect onnxruntime-genai model folders."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    build = sub.add_parser("build", help="write a deterministic random-weight model folder")
    build.add_argument("size", choices=sorted(BUILTIN_SIZES))
    build.add_argument("dir", type=Path, help="output folder (created if absent)")
    build.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    info = sub.add_parser("info", help="validate a model folder and print its spec")
    info.add_argument("dir", type=Path)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "build":
            folder = build_builtin(args.size, args.dir, dtype=args.dtype)
            spec = load_model(folder)
            print(f"built {args.size} ({args.dtype}) in {folder}")
            print(spec.describe())
        else:
            print(load_model(args.dir).describe())
    except ModelFormatError as exc:
        print(f"kvmux-model: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"kvmux-model: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
