"""The in-process demo command, run as a newcomer runs it: a real subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from kvmux.daemon.engine.__main__ import parser
from kvmux.daemon.model.builder import builtin_folder_name


def _run(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "KVMUX_MODEL_CACHE": str(tmp_path / "models")}
    return subprocess.run(
        [sys.executable, "-m", "kvmux.daemon.engine", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_builds_the_model_on_first_use_and_decodes(tmp_path: Path) -> None:
    args = ("--model", "tiny", "--min-bucket", "4", "--max-new-tokens", "40", "--seed", "3")
    proc = _run(tmp_path, *args, "Hi")
    assert proc.returncode == 0, proc.stderr
    assert "[length] prompt 2 + 40 tokens" in proc.stderr
    assert "KV buckets 4 -> 8 -> 16 -> 32 -> 64" in proc.stderr
    assert "KV in use after release 0 B" in proc.stderr
    assert (tmp_path / "models" / builtin_folder_name("tiny") / "genai_config.json").exists()


def test_a_prompt_over_its_cap_is_a_clear_error(tmp_path: Path) -> None:
    proc = _run(tmp_path, "--model", "tiny", "--max-context", "8", "Hello from kvmux")
    assert proc.returncode == 1
    assert "error [kv_capacity_exceeded]" in proc.stderr
    assert "hard maximum 8 from item max_context 8" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_the_demo_serves_smollm2_by_default() -> None:
    """A newcomer's first in-process run decodes a real model, not tiny's noise (the
    model itself runs in tests/model/test_smollm2.py)."""
    assert parser().parse_args(["Hello"]).model == "smollm2"
