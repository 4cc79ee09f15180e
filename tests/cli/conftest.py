"""One kvmuxd process for the CLI tests, and a helper that runs ``kvmux`` as a process.

The CLI always talks to a separate process, so the daemon is one too: a real
``kvmuxd --config`` on an ipc socket, serving the tiny model, started once per
module (startup is most of a test's cost) and stopped with SIGTERM.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

# One session at a time: a long job in front holds a later one back, which
# the logs test needs to subscribe before the later job's first event.
_CONFIG = """\
[model]
path = "{model}"
intra_op_threads = 1

[server]
endpoint = "{endpoint}"
heartbeat_interval = 0.2
client_timeout = 2.0

[kv]
min_bucket = 4

[scheduler]
max_active_sessions = 1
prefill_chunk = 16
{scheduler}

[log]
level = "info"
format = "json"

[shutdown]
grace = 1.0
"""


def cli_env(endpoint: str | None) -> dict[str, str]:
    """The environment a ``kvmux`` process gets: no stray endpoint or terminal settings."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in {"KVMUX_ENDPOINT", "COLUMNS", "LINES", "FORCE_COLOR", "NO_COLOR"}
    }
    if endpoint is not None:
        env["KVMUX_ENDPOINT"] = endpoint
    return env


def kvmux_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "kvmux.client.cli", *args]


@dataclass(frozen=True)
class Kvmuxd:
    """A running daemon: where it listens, and a way to run the CLI against it."""

    endpoint: str
    log: Path
    pid: int

    def env(self) -> dict[str, str]:
        return cli_env(self.endpoint)

    def run(self, *args: str, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
        """``kvmux ARGS`` to completion, stdout and stderr captured (both pipes, not terminals)."""
        return subprocess.run(
            kvmux_argv(*args),
            capture_output=True,
            text=True,
            timeout=timeout,
            env=self.env(),
            stdin=subprocess.DEVNULL,
        )


@pytest.fixture(scope="module")
def kvmuxd(tiny_model: Path) -> Iterator[Kvmuxd]:
    with serve(tiny_model) as daemon:
        yield daemon


@contextlib.contextmanager
def serve(tiny_model: Path, scheduler: str = "") -> Iterator[Kvmuxd]:
    """A kvmuxd of the config above (``scheduler``: more ``[scheduler]`` keys), ready."""
    # ipc paths are limited to ~107 bytes; pytest's tmp_path can be longer.
    folder = Path(tempfile.mkdtemp(prefix="kvx-cli-", dir="/tmp"))
    endpoint = f"ipc://{folder}/kvmuxd.sock"
    config = folder / "kvmuxd.toml"
    config.write_text(_CONFIG.format(model=tiny_model, endpoint=endpoint, scheduler=scheduler))
    log = folder / "kvmuxd.log"
    with (
        log.open("w") as out,
        subprocess.Popen(
            [sys.executable, "-m", "kvmux.daemon", "--config", str(config)],
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        ) as proc,
    ):
        daemon = Kvmuxd(endpoint, log, proc.pid)
        try:
            ready = daemon.run("status", "--wait", "60", timeout=90)
            assert ready.returncode == 0, ready.stderr + log.read_text()
            yield daemon
        finally:
            proc.send_signal(signal.SIGCONT)  # a test that stopped it may have failed
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            shutil.rmtree(folder, ignore_errors=True)
    assert proc.returncode == 0, f"kvmuxd exited {proc.returncode}"
