"""What the kvmux.ray tests share: a batch file, the one-daemon reference run, the CLI as a
process, and a look at which kvmuxd processes are running.

Nothing here imports Ray: each test module skips itself, saying why, when
the ``ray`` extra is not installed.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import pytest

from bench.bench_daemon import kvmuxd
from kvmux.daemon.config import toml_config

from ..cli.conftest import cli_env, kvmux_argv

LINES = 2000
REFUSED_LINE = 1500  # not JSON: refused by the reader, never a task
CAPPED_LINE = 1234  # a max_context below its prompt: kv_capacity_exceeded in the daemon


def daemon_tables(model: Path) -> dict[str, dict[str, Any]]:
    """The kvmuxd config of every daemon here: the reference one and each replica's."""
    return {
        "model": {"path": str(model), "intra_op_threads": 1},
        "kv": {"min_bucket": 16},
        "scheduler": {"max_active_sessions": 64, "prefill_chunk": 64},
        "log": {"format": "json", "level": "info"},
        "shutdown": {"grace": 2.0},
    }


def write_batch(path: Path, n: int = LINES, max_tokens: int = 12) -> Path:
    """Greedy lines, seeded sampled lines (some with n=2), one line the daemon fails and
    one the reader refuses: every result but the refused line's comes from a daemon."""
    lines = []
    for i in range(1, n + 1):
        line: dict[str, Any] = {
            "custom_id": f"c{i}",
            "prompt": f"line {i} of the batch",
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "temperature": 0,
        }
        if i % 10 == 3:
            line.update(temperature=0.9, top_k=20, seed=i, n=2)
        elif i % 10 == 7:
            line.update(temperature=0.8, top_p=0.9, seed=1000 + i)
        if i == CAPPED_LINE:
            line["max_context"] = 4
        lines.append("{not json" if i == REFUSED_LINE else json.dumps(line))
    path.write_text("\n".join(lines) + "\n")
    return path


def results(path: Path) -> dict[tuple[str, int], dict[str, Any]]:
    """kvmux result lines by (custom_id, choice); a key written twice fails the test."""
    out: dict[tuple[str, int], dict[str, Any]] = {}
    for raw in path.read_text().splitlines():
        obj = json.loads(raw)
        key = (obj["custom_id"], obj["choice"])
        assert key not in out, f"{key} written twice"
        out[key] = obj
    return out


def assert_same_results(
    got: dict[tuple[str, int], dict[str, Any]],
    want: dict[tuple[str, int], dict[str, Any]],
    *,
    index: bool = True,
) -> None:
    """Every result line of one daemon's run, the same: tokens, text, status, errors.

    ``seed`` differs where the line gave none (the daemon picks one; greedy
    lines do not use it), ``index`` for the refused line, which a replica
    writes without sending it to any daemon (null, as the CLI's result
    format says of such lines), the capped line's diagnostics, and
    ``usage.cached_tokens``: how much of a prompt another item's prefill
    served depends on which items a daemon ran before it. Without
    ``index`` item positions are not compared: a resumed run numbers the
    items it runs, as ``kvmux submit --resume``'s job does."""
    assert got.keys() == want.keys()
    for key, w in want.items():
        g = dict(got[key])
        w = dict(w)
        if key[0] == f"line-{REFUSED_LINE}":
            assert g.pop("index") is None
            w.pop("index")
        elif not index:
            g.pop("index")
            w.pop("index")
        if not _seed_given(key):
            g.pop("seed")
            w.pop("seed")
        if key[0] == f"c{CAPPED_LINE}":
            # Its diagnostics name the device memory free at that moment.
            assert g.pop("error")["code"] == w.pop("error")["code"] == "kv_capacity_exceeded"
        for r in (g, w):
            if r.get("usage") is not None:
                r["usage"] = {k: v for k, v in r["usage"].items() if k != "cached_tokens"}
        assert g == w, key


def _seed_given(key: tuple[str, int]) -> bool:
    i = int(key[0][1:]) if key[0].startswith("c") else 0
    return i % 10 in (3, 7)


def kvmuxd_pids(root: Path) -> set[int]:
    """The running kvmuxd processes whose folders are under ``root``."""
    pids = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        text = b" ".join(argv)
        if b"kvmux.daemon" in text and str(root).encode() in text:
            pids.add(int(entry.name))
    return pids


def parent_pid(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("PPid:"):
            return int(line.split()[1])
    raise AssertionError(f"no parent for {pid}")


def kvmux_ray_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "kvmux.ray", *args]


@dataclass
class RaySetup:
    """Where the tests' replicas keep their daemons, and the config they run."""

    root: Path
    config: Path

    def env(self) -> dict[str, str]:
        env = cli_env(None)
        env["KVMUX_RAY_TMPDIR"] = str(self.root)
        env["RAY_USAGE_STATS_ENABLED"] = "0"
        return env

    def submit(self, src: Path, out: Path, *extra: str) -> list[str]:
        return kvmux_ray_argv(
            "submit", str(src), "--out", str(out), "--config", str(self.config), *extra
        )

    def run(self, *argv: str, timeout: float = 240.0) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            list(argv),
            capture_output=True,
            text=True,
            timeout=timeout,
            env=self.env(),
            stdin=subprocess.DEVNULL,
        )

    @contextlib.contextmanager
    def running(
        self, *argv: str, env: dict[str, str] | None = None
    ) -> Iterator[subprocess.Popen[str]]:
        """``argv`` as a process for the block, pipes captured; killed if it outlives it.
        ``env``: more variables for it (and the Ray it starts, and that Ray's daemons)."""
        proc = subprocess.Popen(
            list(argv),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**self.env(), **(env or {})},
            stdin=subprocess.DEVNULL,
        )
        try:
            yield proc
        finally:
            # Always reap it and close its pipes, alive or not: pipes left to the
            # collector warn in whichever test runs next, and fail that one.
            if proc.poll() is None:
                proc.kill()
            proc.communicate()


@pytest.fixture(scope="module")
def ray_setup(tiny_model: Path) -> Iterator[RaySetup]:
    # Short: each replica's ipc socket lives under it.
    root = Path(tempfile.mkdtemp(prefix="kvx-ray-", dir="/tmp"))
    config = root / "kvmuxd.toml"
    config.write_text(toml_config(daemon_tables(tiny_model)))
    saved = os.environ.get("KVMUX_RAY_TMPDIR")
    # Ray nodes started in this process hand it to their workers, the replicas.
    os.environ["KVMUX_RAY_TMPDIR"] = str(root)
    try:
        yield RaySetup(root, config)
    finally:
        if saved is None:
            del os.environ["KVMUX_RAY_TMPDIR"]
        else:
            os.environ["KVMUX_RAY_TMPDIR"] = saved
        for pid in kvmuxd_pids(root):  # only if a test failed to clean up: never leak
            os.kill(pid, signal.SIGKILL)
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def reference(
    tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, dict[tuple[str, int], dict[str, Any]]]:
    """The batch file, and ``kvmux submit``'s results for it against one kvmuxd."""
    src = write_batch(tmp_path_factory.mktemp("batch") / "in.jsonl")
    out = src.with_name("reference.jsonl")

    async def submit() -> subprocess.CompletedProcess[str]:
        async with kvmuxd(tiny_model, threads=1, tables=daemon_tables(tiny_model)) as daemon:
            argv = kvmux_argv("submit", str(src), "--out", str(out), "-q")
            return await anyio.to_thread.run_sync(
                lambda: subprocess.run(
                    argv, env=cli_env(daemon.endpoint), capture_output=True, text=True, timeout=180
                )
            )

    done = anyio.run(submit)
    assert done.returncode == 2, done.stderr  # the refused and the capped line
    return src, results(out)
