"""One real kvmuxd (its socket on loopback tcp and its HTTP front) per module, the real
``kvmux`` CLI run against it as a process, and what every hostile-input test asserts."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bench.bench_daemon import DaemonProcess
from tests.cli.conftest import Kvmuxd
from tests.http.conftest import httpx, started


@pytest.fixture(scope="module")
def daemon(tiny_model: Path) -> Iterator[DaemonProcess]:
    with started(tiny_model, {"kv": {"min_bucket": 4}}) as d:
        yield d
        assert d.alive(), d.stderr_tail()


@pytest.fixture(scope="module")
def http(daemon: DaemonProcess) -> Iterator[Any]:
    with httpx.Client(base_url=daemon.http_url, timeout=60.0) as client:
        yield client


def kvmux(
    daemon: DaemonProcess, *args: str, timeout: float = 90.0
) -> subprocess.CompletedProcess[str]:
    """``kvmux ARGS`` against ``daemon``, to completion, both pipes captured."""
    return Kvmuxd(daemon.endpoint, daemon.log_path, daemon.pid).run(*args, timeout=timeout)


def jsonl(text: str) -> list[Any]:
    """JSON Lines split on newlines only: a string may hold U+0085 or U+2028 raw, which
    ``str.splitlines`` would split on."""
    return [json.loads(line) for line in text.split("\n") if line]


def errors_logged(daemon: DaemonProcess) -> list[dict[str, Any]]:
    """The daemon's error-level log events so far (a traceback is logged as one)."""
    return [e for e in daemon.events() if e.get("level") in ("error", "critical")]
