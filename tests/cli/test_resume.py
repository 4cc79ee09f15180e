"""Nothing overwritten: ``--out`` survives a refused job, a missing or killed daemon and
``--detach``; ``--resume`` runs only the lines without a result.

Each test runs its own ``kvmuxd`` process (real socket, tiny model), since
it kills or limits it.
"""

from __future__ import annotations

import json
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import pytest

from .conftest import _CONFIG, cli_env, kvmux_argv

OLD = '{"custom_id": "old", "status": "ok"}\n'


@dataclass
class Daemon:
    folder: Path
    model: Path
    extra: str = ""
    proc: subprocess.Popen[bytes] | None = None
    log: IO[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"ipc://{self.folder}/kvmuxd.sock"

    def start(self) -> None:
        config = self.folder / "kvmuxd.toml"
        text = _CONFIG.format(model=self.model, endpoint=self.endpoint, scheduler=self.extra)
        config.write_text(text)
        if self.log is None:
            self.log = (self.folder / "kvmuxd.log").open("ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvmux.daemon", "--config", str(config)],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
        ready = self.run("status", "--wait", "60", timeout=90)
        assert ready.returncode == 0, ready.stderr

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.log is not None:
            self.log.close()

    def run(self, *args: str, timeout: float = 120.0) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            kvmux_argv(*args),
            capture_output=True,
            text=True,
            timeout=timeout,
            env=cli_env(self.endpoint),
            stdin=subprocess.DEVNULL,
        )

    def popen(self, *args: str) -> subprocess.Popen[str]:
        return subprocess.Popen(
            kvmux_argv(*args),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=cli_env(self.endpoint),
            stdin=subprocess.DEVNULL,
        )


@pytest.fixture
def daemon(tiny_model: Path) -> Iterator[Daemon]:
    folder = Path(tempfile.mkdtemp(prefix="kvx-res-", dir="/tmp"))
    d = Daemon(folder, tiny_model)
    try:
        yield d
    finally:
        d.stop()
        shutil.rmtree(folder, ignore_errors=True)


def batch(path: Path, n: int, max_tokens: int = 4) -> Path:
    path.write_text(
        "".join(
            json.dumps(
                {
                    "custom_id": f"c{i}",
                    "prompt": f"line {i}",
                    "max_tokens": max_tokens,
                    "ignore_eos": True,
                    "temperature": 0,
                }
            )
            + "\n"
            for i in range(n)
        )
    )
    return path


def rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(raw) for raw in path.read_text().splitlines()]


def test_no_daemon_leaves_out_untouched_and_creates_nothing(tmp_path: Path) -> None:
    src = batch(tmp_path / "in.jsonl", 2)
    out = tmp_path / "out.jsonl"
    out.write_text(OLD)
    done = subprocess.run(
        kvmux_argv("submit", str(src), "--out", str(out), "--endpoint", str(tmp_path / "x.sock")),
        capture_output=True,
        text=True,
        env=cli_env(None),
        timeout=60,
    )
    assert done.returncode == 1 and "no socket at" in done.stderr, done.stderr
    assert out.read_text() == OLD
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl", "out.jsonl"]
    fresh = tmp_path / "fresh.jsonl"
    subprocess.run(
        kvmux_argv("submit", str(src), "--out", str(fresh), "--endpoint", str(tmp_path / "x.sock")),
        capture_output=True,
        env=cli_env(None),
        timeout=60,
    )
    assert not fresh.exists()


def test_a_refused_job_leaves_out_intact(daemon: Daemon, tmp_path: Path) -> None:
    # The daemon takes at most 3 items per job: the 4th line's message is refused.
    daemon.extra = "max_job_items = 2\nmax_job_total = 3\n"
    daemon.start()
    src = batch(tmp_path / "in.jsonl", 6)
    out = tmp_path / "out.jsonl"
    out.write_text(OLD)
    done = daemon.run("submit", str(src), "--out", str(out), "-q", "--wait-daemon", "0")
    assert done.returncode == 1, done.stderr
    assert "max_job_total" in done.stderr, done.stderr
    assert out.read_text() == OLD
    partial = tmp_path / "out.jsonl.partial"
    for r in rows(partial) if partial.exists() else []:
        assert r["custom_id"].startswith("c")  # whole lines of this run only


def test_detach_leaves_out_intact(daemon: Daemon, tmp_path: Path) -> None:
    daemon.start()
    src = batch(tmp_path / "in.jsonl", 2)
    out = tmp_path / "out.jsonl"
    out.write_text(OLD)
    done = daemon.run("submit", str(src), "--out", str(out), "--detach", "-q")
    assert done.returncode == 0, done.stderr
    assert out.read_text() == OLD
    job = done.stdout.strip()
    got = daemon.run("results", job, "--out", str(out), "-q")
    assert got.returncode == 0, got.stderr
    assert sorted(r["custom_id"] for r in rows(out)) == ["c0", "c1"]
    assert {r["line"] for r in rows(out)} == {1, 2}
    assert not (tmp_path / "out.jsonl.partial").exists()


def test_killed_daemon_then_resume_runs_only_the_missing_lines(
    daemon: Daemon, tmp_path: Path
) -> None:
    daemon.start()
    src = batch(tmp_path / "in.jsonl", 24, max_tokens=48)
    out = tmp_path / "out.jsonl"
    out.write_text(OLD)
    partial = tmp_path / "out.jsonl.partial"
    client = daemon.popen("submit", str(src), "--out", str(out), "-q", "--wait-daemon", "0")
    deadline = time.monotonic() + 120
    while not (partial.exists() and len(partial.read_bytes().splitlines()) >= 3):
        assert client.poll() is None, client.communicate()
        assert time.monotonic() < deadline
        time.sleep(0.05)
    daemon.kill()
    _, stderr = client.communicate(timeout=60)
    assert client.returncode == 1, stderr
    assert out.read_text() == OLD  # the old results stay until a complete run replaces them
    first = rows(partial)  # whole lines only
    assert 3 <= len(first) < 24 and all(r["status"] == "ok" for r in first)
    done_ids = {r["custom_id"] for r in first}

    daemon.start()  # over the socket file the killed one left
    again = daemon.run("submit", str(src), "--out", str(out), "--resume", "-q")
    assert again.returncode == 0, again.stderr
    assert not partial.exists()
    final = rows(out)
    assert sorted(r["custom_id"] for r in final) == sorted(f"c{i}" for i in range(24))
    # The newest job is the resumed run (a journal may bring the killed one back too).
    jobs = [json.loads(x) for x in daemon.run("jobs", "--json").stdout.splitlines()]
    assert jobs[-1]["total"] == 24 - len(done_ids)


def test_resume_appends_and_reruns_failed_lines(daemon: Daemon, tmp_path: Path) -> None:
    daemon.start()
    src = tmp_path / "in.jsonl"
    src.write_text(
        "".join(
            json.dumps(
                {
                    "custom_id": c,
                    "url": "/v1/completions",
                    "body": {"prompt": "hi", "max_tokens": 2},
                }
            )
            + "\n"
            for c in ("a", "b", "c")
        )
    )
    out = tmp_path / "out.jsonl"
    # An earlier run in OpenAI's shape: a ok, b failed, c never written.
    out.write_text(
        json.dumps(
            {
                "id": "1",
                "custom_id": "a",
                "response": {"status_code": 200, "body": {}},
                "error": None,
            }
        )
        + "\n"
        + json.dumps(
            {"id": "2", "custom_id": "b", "response": None, "error": {"code": "x", "message": "y"}}
        )
        + "\n"
    )
    done = daemon.run("submit", str(src), "--out", str(out), "--resume", "-q")
    assert done.returncode == 0, done.stderr
    got = [r["custom_id"] for r in rows(out)]
    assert got[:2] == ["a", "b"] and sorted(got[2:]) == ["b", "c"]
    jobs = [json.loads(x) for x in daemon.run("jobs", "--json").stdout.splitlines()]
    assert [j["total"] for j in jobs] == [2]


def test_stale_socket_fails_at_once(tmp_path: Path) -> None:
    path = tmp_path / "kvmuxd.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(path))
    sock.close()  # the file stays, nothing listens: what a crashed daemon leaves
    start = time.monotonic()
    done = subprocess.run(
        kvmux_argv("status", "--endpoint", str(path), "--timeout", "10"),
        capture_output=True,
        text=True,
        env=cli_env(None),
        timeout=60,
    )
    assert done.returncode == 1
    assert "no longer running" in done.stderr and "Traceback" not in done.stderr
    assert time.monotonic() - start < 8


@pytest.mark.parametrize(
    ("endpoint", "says"),
    [
        ("localhost", "not one kvmux understands"),
        ("http://x:1", "unknown scheme"),
        ("/nonexistent/kvmuxd.sock", "no socket at /nonexistent/kvmuxd.sock"),
    ],
)
def test_endpoint_forms_give_clear_errors(endpoint: str, says: str) -> None:
    done = subprocess.run(
        kvmux_argv("status", "--endpoint", endpoint, "--timeout", "1"),
        capture_output=True,
        text=True,
        env=cli_env(None),
        timeout=60,
    )
    assert done.returncode == 1 and says in done.stderr, done.stderr
    assert "Traceback" not in done.stderr


def test_version_flags() -> None:
    for argv in (kvmux_argv("--version"), [sys.executable, "-m", "kvmux.daemon", "--version"]):
        done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0
        name, version = done.stdout.split()
        assert name in ("kvmux", "kvmuxd") and version[0].isdigit()


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        (["--resume"], "give --out"),
        (["--out", "/nonexistent-dir/out.jsonl"], "missing or not writable"),
        (["--out", "OUT", "--errors", "/nonexistent-dir/e.jsonl"], "missing or not writable"),
    ],
)
def test_output_options_are_checked_before_anything_runs(
    tmp_path: Path, extra: list[str], says: str
) -> None:
    src = batch(tmp_path / "in.jsonl", 1)
    extra = [str(tmp_path / "out.jsonl") if a == "OUT" else a for a in extra]
    done = subprocess.run(
        kvmux_argv("submit", str(src), *extra, "--endpoint", str(tmp_path / "none.sock")),
        capture_output=True,
        text=True,
        env=cli_env(None),
        timeout=60,
    )
    assert done.returncode == 1 and says in done.stderr, done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl"]
