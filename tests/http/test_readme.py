"""The manual's HTTP examples (docs/http-api.md, docs/structured-outputs.md), run as
written against a kvmuxd process (its address put in place of 127.0.0.1:8000, where the
shipped config listens)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bench.bench_daemon import DaemonProcess

ROOT = Path(__file__).resolve().parents[2]
PAGES = (ROOT / "docs" / "http-api.md", ROOT / "docs" / "structured-outputs.md")
WRITTEN = "http://127.0.0.1:8000"
SHIPPED_MODEL = '"smollm2"'


def _blocks(language: str) -> list[str]:
    text = "\n".join(page.read_text(encoding="utf-8") for page in PAGES)
    return re.findall(rf"```{language}\n(.*?)```", text, re.S)


def _as_the_test_daemon(code: str, daemon: DaemonProcess) -> str:
    """The example aimed at the test daemon: its address, and its model (the built-in
    tiny, named "tiny") where the manual names the shipped config's smollm2."""
    return code.replace(WRITTEN, daemon.http_url).replace(SHIPPED_MODEL, '"tiny"')


def _runs_and_prints(code: str, daemon: DaemonProcess) -> None:
    done = subprocess.run(
        [sys.executable, "-c", _as_the_test_daemon(code, daemon)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip()


def test_the_readme_examples_point_at_the_shipped_configs_address() -> None:
    assert all(WRITTEN in block for block in _blocks("python") + _blocks("sh"))
    shipped = (ROOT / "configs" / "local.toml").read_text(encoding="utf-8")
    assert 'listen = "127.0.0.1:8000"' in shipped
    assert f"name = {SHIPPED_MODEL}" in shipped
    chat_examples = [b for b in _blocks("python") + _blocks("sh") if "chat.completions" in b]
    assert chat_examples and all(SHIPPED_MODEL in b for b in chat_examples)


@pytest.mark.parametrize("index", range(3))
def test_the_readme_python_examples_run(daemon: DaemonProcess, index: int) -> None:
    _runs_and_prints(_blocks("python")[index], daemon)


@pytest.mark.skipif(shutil.which("curl") is None, reason="the manual's shell examples use curl")
def test_the_readme_curl_examples_run(daemon: DaemonProcess) -> None:
    script = "\n".join(_blocks("sh"))
    done = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", _as_the_test_daemon(script, daemon)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert '"chat.completion"' in done.stdout and "data: [DONE]" in done.stdout
    assert '{"status":"ready"}' in done.stdout
    assert re.search(r'"content":"(red|green|blue)"', done.stdout), done.stdout


def test_the_front_pages_example_runs(daemon: DaemonProcess) -> None:
    front = (ROOT / "README.md").read_text(encoding="utf-8")
    (code,) = re.findall(r"```python\n(.*?)```", front, re.S)
    assert WRITTEN in code and SHIPPED_MODEL in code
    _runs_and_prints(code, daemon)
