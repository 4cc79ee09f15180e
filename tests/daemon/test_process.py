"""kvmuxd as a process: its config errors, its JSON logs, a job, a clean stop; and log events."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
from io import StringIO
from pathlib import Path

import anyio
import pytest
import structlog

from kvmux.client import Client, DaemonUnreachable, Item, NotReady
from kvmux.daemon.app import Daemon
from kvmux.daemon.config import EX_CONFIG
from kvmux.daemon.engine import Engine
from kvmux.daemon.logs import configure_logging
from kvmux.kv import failpoints

from .conftest import connected, make_config, running

pytestmark = pytest.mark.anyio


def kvmuxd(*args: str) -> list[str]:
    return [sys.executable, "-m", "kvmux.daemon", *args]


def test_invalid_config_exits_78_naming_the_key(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[scheduler]\nmax_active_sessions = -1\n")
    proc = subprocess.run(kvmuxd("--config", str(bad)), capture_output=True, text=True, timeout=60)
    assert proc.returncode == EX_CONFIG
    assert "scheduler.max_active_sessions" in proc.stderr and str(bad) in proc.stderr

    unknown = tmp_path / "unknown.toml"
    unknown.write_text("[kv]\nmax_lenght = 100\n")
    proc = subprocess.run(
        kvmuxd("--config", str(unknown)), capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == EX_CONFIG and "kv.max_lenght" in proc.stderr


def test_missing_model_folder_exits_78(tmp_path: Path, sock_dir: Path) -> None:
    cfg = tmp_path / "kvmuxd.toml"
    cfg.write_text(
        f'[model]\npath = "{tmp_path / "nope"}"\n[server]\nendpoint = "ipc://{sock_dir}/k.sock"\n'
    )
    proc = subprocess.run(kvmuxd("--config", str(cfg)), capture_output=True, text=True, timeout=60)
    assert proc.returncode == EX_CONFIG
    assert "startup_failed" in proc.stdout and "nope" in proc.stdout


async def test_daemon_process_serves_a_job_and_stops_on_sigterm(
    tiny_model: Path, sock_dir: Path, tmp_path: Path
) -> None:
    endpoint = f"ipc://{sock_dir}/kvmuxd.sock"
    cfg = tmp_path / "kvmuxd.toml"
    cfg.write_text(
        f'[model]\npath = "{tiny_model}"\nintra_op_threads = 1\n'
        f'[server]\nendpoint = "{endpoint}"\n[kv]\nmin_bucket = 8\n[log]\nformat = "json"\n'
    )
    with subprocess.Popen(
        kvmuxd("--config", str(cfg)), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    ) as proc:
        try:
            with anyio.fail_after(60):
                while True:
                    try:
                        client = Client(endpoint, timeout=1.0)
                        await client.connect()
                        break
                    except DaemonUnreachable:
                        assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
                        await anyio.sleep(0.1)
                while (await client.status()).state == "loading":
                    await anyio.sleep(0.05)
            try:
                job = await client.submit([Item(custom_id="a", prompt="hello", max_new_tokens=30)])
                (result,) = await job.results()
            finally:
                await client.close()
            proc.send_signal(signal.SIGTERM)
            out, err = await anyio.to_thread.run_sync(lambda: proc.communicate(timeout=30))
        finally:
            if proc.poll() is None:
                proc.kill()
    assert result.status == "ok" and len(result.token_ids) > 0
    assert proc.returncode == 0, err
    events = [json.loads(line) for line in out.splitlines() if line.strip()]
    names = [e["event"] for e in events]
    for name in (
        "daemon_ready",
        "job_accepted",
        "session_started",
        "kv_grew",
        "session_finished",
        "job_finished",
        "signal_received",
        "daemon_stopped",
    ):
        assert name in names, name
    grew = next(e for e in events if e["event"] == "kv_grew")
    assert grew["job_id"] == job.job_id and grew["session_id"] == f"{job.job_id}/0"
    assert {"old", "new", "bytes_copied", "lock_wait_seconds"} <= set(grew)
    assert not Path(endpoint[len("ipc://") :]).exists()  # the socket file is cleaned up


async def test_log_events_name_the_job_and_reach_a_subscriber(
    tiny_model: Path, sock_dir: Path
) -> None:
    configure_logging(level="info", fmt="json", stream=StringIO())
    cfg = make_config(tiny_model, sock_dir, scheduler={"max_active_sessions": 1})
    seen: list[dict[str, object]] = []
    try:
        async with (
            running(cfg) as daemon,
            connected(daemon) as watcher,
            connected(daemon) as worker,
        ):
            with structlog.testing.capture_logs() as captured:
                job = await worker.submit([Item(prompt="log me", max_new_tokens=20)])
                await job.results()
            # One session at a time: the watched job waits behind a long one
            # (slowed to ~0.6 s), so the subscription is in place before its first event.
            failpoints.slow("engine.step", 0.001)
            long = await worker.submit(
                [Item(prompt="not watched", max_new_tokens=600, ignore_eos=True)]
            )
            watched = await worker.submit([Item(prompt="watched", max_new_tokens=20)])

            async def watch() -> None:
                async for record in watcher.logs(level="info", job_id=watched.job_id):
                    seen.append(record)
                    if record["event"] == "job_finished":
                        return

            with anyio.fail_after(20):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(watch)
                    await watched.results()
            await long.results()
    finally:
        structlog.reset_defaults()
    events = {e["event"] for e in captured if e.get("job_id") == job.job_id}
    assert {"job_accepted", "session_started", "session_finished", "job_finished"} <= events
    assert seen and all(r["job_id"] == watched.job_id for r in seen)
    assert {"session_started", "session_finished", "job_finished"} <= {r["event"] for r in seen}
    assert all(isinstance(r["timestamp"], str) and r["level"] == "info" for r in seen)


async def test_status_says_loading_until_the_model_is_loaded(
    tiny_model: Path, sock_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The socket answers while a (slow) model loads: status ``loading``, jobs ``not_ready``."""
    release = threading.Event()
    real_load = Daemon._load_engine

    def slow_load(self: Daemon) -> Engine:
        release.wait(10)  # a large model takes a while; this one waits for the test
        return real_load(self)

    monkeypatch.setattr(Daemon, "_load_engine", slow_load)
    daemon = Daemon(make_config(tiny_model, sock_dir))
    async with anyio.create_task_group() as tg:
        tg.start_soon(daemon.serve)
        with anyio.fail_after(10):
            while not Path(daemon.endpoint[len("ipc://") :]).exists():
                await anyio.sleep(0.02)
        async with Client(daemon.endpoint, timeout=5.0) as client:
            status = await client.status()
            assert status.state == "loading" and status.sessions == []
            with pytest.raises(NotReady, match="loading"):
                await client.submit([Item(prompt="early")])
            release.set()
            with anyio.fail_after(10):
                while (await client.status()).state != "ready":
                    await anyio.sleep(0.02)
            (result,) = await (
                await client.submit([Item(prompt="now", max_new_tokens=4)])
            ).results()
            assert result.status == "ok"
        daemon.stop()
