"""Shared bench plumbing: the built-in model cache, timing, JSON output."""

from __future__ import annotations

import json
import os
import platform
import sys
from pathlib import Path
from typing import Any

from kvmux.daemon.model import ensure_builtin

ROOT = Path(__file__).resolve().parent.parent
MODELS = Path(os.environ.get("KVMUX_MODEL_CACHE", ROOT / "models"))
RESULTS = ROOT / "bench" / "results"


def builtin(size: str) -> Path:
    return ensure_builtin(size, MODELS)


def machine() -> dict[str, Any]:
    return {
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "cpus": os.cpu_count(),
    }


def write_json(name: str, payload: dict[str, Any]) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps({"machine": machine(), **payload}, indent=2))
    return path
