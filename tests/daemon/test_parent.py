"""A daemon started with KVMUX_DIE_WITH_PARENT=1 (as every daemon of this test suite is)
dies with the process that started it, however that one dies."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from kvmux.daemon.__main__ import DIE_WITH_PARENT_ENV

# A parent that starts kvmuxd, says its pid, and waits to be killed.
_PARENT = textwrap.dedent(
    """
    import subprocess, sys, time
    child = subprocess.Popen(
        [sys.executable, "-m", "kvmux.daemon", "--config", sys.argv[1]],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    print(child.pid, flush=True)
    time.sleep(600)
    """
)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead: it waits only for whoever reaps it.
    with open(f"/proc/{pid}/stat", encoding="ascii") as stat:
        return stat.read().rsplit(")", 1)[1].split()[0] != "Z"


@pytest.mark.parametrize("set_env", [True, False], ids=["env", "no-env"])
def test_a_killed_parent_takes_its_daemon_along(
    tiny_model: Path, tmp_path: Path, set_env: bool
) -> None:
    config = tmp_path / "kvmuxd.toml"
    config.write_text(
        f'[model]\npath = "{tiny_model}"\n[server]\nendpoint = "ipc://{tmp_path}/d.sock"\n'
        '[jobs]\njournal = ""\n[shutdown]\ngrace = 1.0\n'
    )
    env = {k: v for k, v in os.environ.items() if k != DIE_WITH_PARENT_ENV}
    if set_env:
        env[DIE_WITH_PARENT_ENV] = "1"
    with subprocess.Popen(
        [sys.executable, "-c", _PARENT, str(config)], stdout=subprocess.PIPE, text=True, env=env
    ) as parent:
        assert parent.stdout is not None
        daemon = int(parent.stdout.readline())
        try:
            deadline = time.monotonic() + 60
            while not (tmp_path / "d.sock").exists() and time.monotonic() < deadline:
                time.sleep(0.05)  # bound: the daemon has set its death signal by now
            parent.send_signal(signal.SIGKILL)
            parent.wait()
            # Dying takes milliseconds (then up to the 1 s grace): 15 s bounds a slow
            # machine's wait for it; the daemon left alone is watched for 3 s.
            deadline = time.monotonic() + (15 if set_env else 3)
            while _alive(daemon) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert _alive(daemon) is not set_env
        finally:
            if _alive(daemon):
                os.kill(daemon, signal.SIGKILL)
