"""pyproject.toml's extras say each dependency once: the daemon's stack in one list,
each runtime extra adding only its onnxruntime build (and CuPy)."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

_PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


def _name(requirement: str) -> str:
    return re.split(r"[\[<>=!~;\s]", requirement, maxsplit=1)[0].lower()


def test_runtime_extras_add_only_their_runtime_to_the_daemon_stack() -> None:
    extras = tomllib.loads(_PYPROJECT.read_text())["project"]["optional-dependencies"]
    for runtime in ("cpu", "cuda12", "cuda13"):
        assert "kvmux[daemon]" in extras[runtime], runtime
        own = {_name(r) for r in extras[runtime] if r != "kvmux[daemon]"}
        assert own <= {"onnxruntime", "onnxruntime-gpu", "cupy-cuda12x", "cupy-cuda13x"}, own
    assert "onnxruntime" not in {_name(r) for r in extras["daemon"]}
