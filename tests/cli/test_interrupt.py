"""Ctrl-C stops ``kvmux submit``, ``results``, ``generate`` and ``logs -f`` within 2 s, whatever
kvmuxd is doing: streaming a big job, refusing more items (``overloaded``), or stopped (SIGSTOP).

Each case starts the command against a real daemon, waits for an event (its first result
or record on disk, and for ``overloaded`` the command's own note that the queue is full),
puts the daemon in its condition, sends SIGINT and measures the time to exit. The limit,
2 s, is the point of these tests: the product's own deadline is 1.5 s from the signal
(``interrupt.STOP_SECONDS``; its goodbye to the daemon gets 0.75 s of it), so 0.5 s is
left for a loaded CI machine to schedule the process and tear the interpreter down.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvmux.client.cli.interrupt import STOP_SECONDS

from .conftest import Kvmuxd, kvmux_argv, serve

LIMIT = 2.0  # seconds from the signal to the exit: the requirement
assert STOP_SECONDS < LIMIT
# Waiting for an event (a result on disk) is bounded only so a broken run ends.
EVENT_WAIT = 120.0

# One session at a time, and a queue of 4 (two a message), so a file of more
# lines than that keeps its `kvmux submit` waiting out `overloaded`.
_SCHEDULER = "max_queued_items = 4\nmax_queued_per_owner = 4\nmax_job_items = 2\n"
LONG = {"prompt": "z", "max_tokens": 2000, "ignore_eos": True}


@pytest.fixture(scope="module")
def daemon(tiny_model: Path) -> Iterator[Kvmuxd]:
    with serve(tiny_model, _SCHEDULER) as d:
        yield d


class Command:
    """A ``kvmux`` process whose stdout and stderr go to files the test can watch."""

    def __init__(self, daemon: Kvmuxd, folder: Path, name: str, *args: str) -> None:
        self.stdout = folder / f"{name}.out"
        self.stderr = folder / f"{name}.err"
        with self.stdout.open("w") as out, self.stderr.open("w") as err:
            self.proc = subprocess.Popen(
                kvmux_argv(*args),
                env=daemon.env(),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
            )

    def wrote(self) -> bool:
        return self.stdout.stat().st_size > 0

    def says(self, text: str) -> Callable[[], bool]:
        return lambda: text in self.err()

    def err(self) -> str:
        return self.stderr.read_text()

    def wait_for(self, what: str, ready: Callable[[], bool]) -> None:
        """Until ``ready()``: the command must still be running meanwhile."""
        deadline = time.monotonic() + EVENT_WAIT
        while not ready():
            assert self.proc.poll() is None, (
                f"exited {self.proc.returncode} before {what}: {self.err()}"
            )
            assert time.monotonic() < deadline, f"no {what} within {EVENT_WAIT:g} s: {self.err()}"
            time.sleep(0.02)

    def interrupt(self) -> float:
        """SIGINT; the seconds until the process was gone."""
        start = time.monotonic()
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            pytest.fail(f"still running 30 s after SIGINT: {self.err()}")
        return time.monotonic() - start

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def lines(path: Path) -> list[dict[str, object]]:
    """The whole JSON lines of ``path`` (a line still being written is not one yet)."""
    text = path.read_text() if path.exists() else ""
    return [json.loads(x) for x in text.splitlines(keepends=True) if x.endswith("\n")]


def write_batch(path: Path, n: int, prefix: str) -> Path:
    path.write_text(
        "".join(json.dumps({"custom_id": f"{prefix}{i}", **LONG}) + "\n" for i in range(n))
    )
    return path


@contextlib.contextmanager
def condition(daemon: Kvmuxd, state: str) -> Iterator[None]:
    """The daemon ``stopped`` (SIGSTOP) for the block, or as it is."""
    if state == "stopped":
        os.kill(daemon.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        if state == "stopped":
            os.kill(daemon.pid, signal.SIGCONT)


def quiet_daemon(daemon: Kvmuxd) -> None:
    """Cancel every job still running, so the next case starts on an idle daemon."""
    listed = daemon.run("jobs", "--json", timeout=60)
    assert listed.returncode == 0, listed.stderr
    for info in map(json.loads, listed.stdout.splitlines()):
        if info["state"] != "done":
            daemon.run("cancel", info["job_id"], timeout=60)
    deadline = time.monotonic() + EVENT_WAIT
    while True:
        listed = daemon.run("jobs", "--json", timeout=60)
        if all(json.loads(x)["state"] == "done" for x in listed.stdout.splitlines()):
            return
        assert time.monotonic() < deadline, listed.stdout
        time.sleep(0.1)


def job_info(
    daemon: Kvmuxd, job_id: str, ready: Callable[[dict[str, object]], bool]
) -> dict[str, object]:
    """``kvmux jobs``' line for ``job_id``, once ``ready(it)``."""
    deadline = time.monotonic() + EVENT_WAIT
    while True:
        listed = daemon.run("jobs", "--json", timeout=60)
        assert listed.returncode == 0, listed.stderr
        info: dict[str, object] = next(
            json.loads(x) for x in listed.stdout.splitlines() if job_id in x
        )
        if ready(info):
            return info
        assert time.monotonic() < deadline, info
        time.sleep(0.1)


def overloaded_note(cmd: Command) -> Callable[[], bool]:
    return cmd.says("queue is full; waiting for room")


def started_job(cmd: Command) -> str:
    """The job id a running ``kvmux submit`` announced on stderr."""
    cmd.wait_for("job id", cmd.says(": started"))
    first = next(x for x in cmd.err().splitlines() if x.endswith(": started"))
    return first.removeprefix("kvmux: job ").removesuffix(": started")


def assert_interrupted(cmd: Command, latency: float) -> None:
    assert cmd.proc.returncode == 130, cmd.err()
    assert latency < LIMIT, f"exited {latency:.2f} s after SIGINT: {cmd.err()}"
    assert "interrupted" in cmd.err()


@pytest.mark.parametrize("state", ["streaming", "overloaded", "stopped"])
def test_ctrl_c_stops_submit_in_time_keeping_its_results(
    daemon: Kvmuxd, tmp_path: Path, state: str
) -> None:
    # 4 lines fit the queue; 40 keep the feeder waiting out `overloaded`.
    cmd, out = submitting(daemon, tmp_path, "s", 40 if state == "overloaded" else 4)
    try:
        if state == "overloaded":
            cmd.wait_for("overloaded", overloaded_note(cmd))
        with condition(daemon, state):
            latency = cmd.interrupt()
    finally:
        cmd.stop()
    assert_interrupted(cmd, latency)
    total = 40 if state == "overloaded" else 4
    kept = lines(out)
    assert 1 <= len(kept) < total
    assert all(str(r["custom_id"]).startswith("s") for r in kept)
    if state == "stopped":
        assert "did not confirm its cancel" in cmd.err()
    # Cancelled, by the cancel it sent or (unconfirmed) when kvmuxd found the client gone.
    info = job_info(daemon, started_job(cmd), lambda info: info["state"] == "done")
    assert isinstance(info["ok"], int) and info["ok"] < total, info


@pytest.mark.parametrize("state", ["streaming", "overloaded", "stopped"])
def test_ctrl_c_stops_results_in_time_leaving_the_job_running(
    daemon: Kvmuxd, tmp_path: Path, state: str
) -> None:
    # The job belongs to a `kvmux submit` still feeding it (overloaded: still waiting
    # for queue room); `kvmux results` attaches to it beside that.
    batch = write_batch(tmp_path / "in.jsonl", 40 if state == "overloaded" else 4, "r")
    feeder = Command(
        daemon, tmp_path, "submit", "submit", str(batch), "--out", str(tmp_path / "s.jsonl")
    )
    out = tmp_path / "out.jsonl"
    try:
        job_id = started_job(feeder)
        if state == "overloaded":
            feeder.wait_for("overloaded", overloaded_note(feeder))
        cmd = Command(daemon, tmp_path, "results", "results", job_id, "--out", str(out))
        try:
            cmd.wait_for("first result on disk", lambda: len(lines(out)) >= 1)
            with condition(daemon, state):
                latency = cmd.interrupt()
        finally:
            cmd.stop()
        assert_interrupted(cmd, latency)
        assert all(str(r["custom_id"]).startswith("r") for r in lines(out))
        if state != "stopped":
            # Detached, not cancelled: nothing of it failed (its submitter still runs).
            info = job_info(daemon, job_id, lambda info: True)
            assert info["failed"] == 0, info
    finally:
        feeder.stop()
        quiet_daemon(daemon)


@pytest.mark.parametrize("state", ["streaming", "overloaded", "stopped"])
def test_ctrl_c_stops_logs_follow_in_time(daemon: Kvmuxd, tmp_path: Path, state: str) -> None:
    batch = write_batch(tmp_path / "in.jsonl", 40 if state == "overloaded" else 4, "l")
    cmd = Command(daemon, tmp_path, "logs", "logs", "-f")
    feeder: Command | None = None
    try:
        cmd.wait_for("subscription", cmd.says("showing"))
        feeder = Command(
            daemon, tmp_path, "submit", "submit", str(batch), "--out", str(tmp_path / "s.jsonl")
        )
        if state == "overloaded":
            feeder.wait_for("overloaded", overloaded_note(feeder))
        cmd.wait_for("first record on disk", lambda: len(lines(cmd.stdout)) >= 1)
        with condition(daemon, state):
            latency = cmd.interrupt()
    finally:
        cmd.stop()
        if feeder is not None:
            feeder.stop()
    assert cmd.proc.returncode == 130, cmd.err()
    assert latency < LIMIT, f"exited {latency:.2f} s after SIGINT: {cmd.err()}"
    assert all("event" in r for r in lines(cmd.stdout))
    quiet_daemon(daemon)


@pytest.mark.parametrize("state", ["streaming", "stopped"])
def test_ctrl_c_stops_generate_in_time(daemon: Kvmuxd, tmp_path: Path, state: str) -> None:
    # (With the queue full, `kvmux generate` is refused at once: exit 1, nothing to stop.)
    # 2000 tokens of the tiny model take well under a second: the signal may land after
    # the completion ended, which proves nothing; such a try is run again.
    for attempt in range(5):
        cmd = Command(
            daemon,
            tmp_path,
            f"generate{attempt}",
            "generate",
            "z",
            "--max-tokens",
            "2000",
            "--ignore-eos",
            "--temperature",
            "0",
        )
        try:
            cmd.wait_for("first text on disk", cmd.wrote)
            with condition(daemon, state):
                latency = cmd.interrupt()
        finally:
            cmd.stop()
        if cmd.proc.returncode == 0:
            continue  # it had finished
        assert_interrupted(cmd, latency)
        assert cmd.stdout.stat().st_size > 0
        quiet_daemon(daemon)
        return
    pytest.fail("every completion ended before the signal reached it")


def submitting(daemon: Kvmuxd, folder: Path, name: str, n: int) -> tuple[Command, Path]:
    """``kvmux submit`` of ``n`` long lines, once its first result is on disk."""
    batch = write_batch(folder / f"{name}.jsonl", n, name)
    out = folder / f"{name}.results.jsonl"
    cmd = Command(daemon, folder, name, "submit", str(batch), "--out", str(out))
    try:
        cmd.wait_for("first result on disk", lambda: len(lines(out)) >= 1)
    except BaseException:
        cmd.stop()
        raise
    return cmd, out


def test_a_second_ctrl_c_stops_at_once(daemon: Kvmuxd, tmp_path: Path) -> None:
    # The daemon stopped: the first signal's goodbye waits (0.75 s) for an answer that
    # cannot come; the second one ends the process without waiting for it. A second
    # signal that only lands after that goodbye ended proves nothing: tried again.
    for attempt in range(5):
        cmd, out = submitting(daemon, tmp_path, f"twice{attempt}", 4)
        try:
            with condition(daemon, "stopped"):
                cmd.proc.send_signal(signal.SIGINT)
                # Two signals sent before the first is handled would be one.
                cmd.wait_for("the first signal handled", cmd.says("again to stop"))
                latency = cmd.interrupt()
        finally:
            cmd.stop()
        assert cmd.proc.returncode == 130, cmd.err()
        assert len(lines(out)) >= 1
        quiet_daemon(daemon)
        if "a second signal" in cmd.err():
            # "At once": a signal handled and the process ended; 0.5 s is for a loaded CI
            # machine to schedule it (the goodbye it cut short would have taken 0.75 s).
            assert latency < 0.5, f"exited {latency:.2f} s after the second SIGINT"
            return
    pytest.fail("every first goodbye ended before the second signal reached it")


def test_sigterm_stops_submit_with_143(daemon: Kvmuxd, tmp_path: Path) -> None:
    cmd, out = submitting(daemon, tmp_path, "term", 4)
    try:
        start = time.monotonic()
        cmd.proc.send_signal(signal.SIGTERM)
        cmd.proc.wait(timeout=30)
        latency = time.monotonic() - start
    finally:
        cmd.stop()
    assert cmd.proc.returncode == 143, cmd.err()
    assert latency < LIMIT
    assert "interrupted" in cmd.err() and len(lines(out)) >= 1
    quiet_daemon(daemon)
