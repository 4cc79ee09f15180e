"""kvmuxd as a service: the notify protocol, draining on SIGTERM, SIGHUP, the units, metrics,
CURVE and oversize messages."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import anyio
import pytest
import zmq
import zmq.asyncio
import zmq.auth

from kvmux.client import Client, DaemonUnreachable, Item, ShuttingDown
from kvmux.client import protocol as p
from kvmux.client.curve import load_curve
from kvmux.daemon.config import EX_CONFIG, ConfigError, parse_config
from kvmux.daemon.notify import Notifier

from .conftest import connected, make_config, running

pytestmark = pytest.mark.anyio

REPO = Path(__file__).resolve().parents[2]


def write_config(path: Path, model: Path, endpoint: str, extra: str = "") -> Path:
    path.write_text(
        f'[model]\npath = "{model}"\nintra_op_threads = 1\n'
        f'[server]\nendpoint = "{endpoint}"\nheartbeat_interval = 0.2\nclient_timeout = 2.0\n'
        f'[kv]\nmin_bucket = 16\n[log]\nformat = "json"\n{extra}'
    )
    return path


@contextmanager
def kvmuxd_process(config: Path, *args: str, **env: str) -> Iterator[subprocess.Popen[str]]:
    with subprocess.Popen(
        [sys.executable, "-m", "kvmux.daemon", "--config", str(config), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **env},
    ) as proc:
        try:
            yield proc
        finally:
            if proc.poll() is None:
                proc.kill()


async def wait_connected(endpoint: str, proc: subprocess.Popen[str]) -> Client:
    """A client of a kvmuxd process that has loaded its model (the socket answers earlier)."""
    with anyio.fail_after(60):
        while True:
            client = Client(endpoint, timeout=1.0)
            try:
                await client.connect()
                break
            except DaemonUnreachable:
                assert proc.poll() is None, "kvmuxd exited during startup"
                await anyio.sleep(0.1)
        while (await client.status()).state == "loading":
            await anyio.sleep(0.05)
    return client


# -- the notify protocol ------------------------------------------------------------------
@pytest.mark.parametrize("abstract", [False, True], ids=["path", "abstract"])
def test_notifier_sends_datagrams(sock_dir: Path, abstract: bool) -> None:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    name = f"@kvmux-test-{os.getpid()}" if abstract else str(sock_dir / "notify")
    sock.bind("\0" + name[1:] if abstract else name)
    sock.settimeout(2)
    try:
        notifier = Notifier({"NOTIFY_SOCKET": name, "WATCHDOG_USEC": "3000000"})
        assert notifier.enabled and notifier.watchdog_interval == 3.0
        assert notifier.ready("ready: 0 active")
        assert sock.recv(4096).decode().split("\n")[:2] == ["READY=1", "STATUS=ready: 0 active"]
        assert notifier.watchdog()
        assert sock.recv(4096) == b"WATCHDOG=1"
        notifier.close()
    finally:
        sock.close()
    silent = Notifier({})
    assert not silent.enabled and not silent.ready("x") and silent.watchdog_interval is None
    other_pid = Notifier({"NOTIFY_SOCKET": name, "WATCHDOG_USEC": "1000", "WATCHDOG_PID": "1"})
    assert other_pid.watchdog_interval is None  # the watchdog is another process's


async def test_daemon_plays_the_notify_protocol(
    tiny_model: Path, sock_dir: Path, tmp_path: Path
) -> None:
    endpoint = f"ipc://{sock_dir}/kvmuxd.sock"
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(str(sock_dir / "notify"))
    notify.settimeout(60)
    cfg = write_config(tmp_path / "k.toml", tiny_model, endpoint)
    messages: list[str] = []
    try:
        with kvmuxd_process(
            cfg, NOTIFY_SOCKET=str(sock_dir / "notify"), WATCHDOG_USEC="400000"
        ) as proc:
            # Before READY=1 only the watchdog and "loading" status lines may come.
            while not (first := notify.recv(4096).decode()).startswith("READY=1"):
                assert first in ("WATCHDOG=1", "STATUS=loading"), first
            messages.append(first)
            assert first.startswith("READY=1\nSTATUS=ready")
            # READY=1 means it answers now, not "soon".
            client = Client(endpoint, timeout=2.0)
            await client.connect()
            status = await client.status()
            await client.close()
            assert status.state == "ready"
            started = time.monotonic()
            while time.monotonic() - started < 1.0:
                messages.append(notify.recv(4096).decode())
            proc.send_signal(signal.SIGTERM)
            while "STOPPING=1" not in messages[-1]:
                messages.append(notify.recv(4096).decode())
            assert proc.wait(timeout=30) == 0
    finally:
        notify.close()
    watchdogs = [m for m in messages if m == "WATCHDOG=1"]
    assert len(watchdogs) >= 3  # every 0.2 s for a 0.4 s watchdog
    assert messages[-1].startswith("STOPPING=1\nSTATUS=draining")


# -- draining ------------------------------------------------------------------------------
async def test_sigterm_drains_then_ends_the_rest_with_shutdown(
    tiny_model: Path, sock_dir: Path, tmp_path: Path
) -> None:
    endpoint = f"ipc://{sock_dir}/kvmuxd.sock"
    cfg = write_config(
        tmp_path / "k.toml",
        tiny_model,
        endpoint,
        # Memory-only: with a journal, unfinished items wait for the restart instead.
        '[shutdown]\ngrace = 1.0\n[scheduler]\nmax_active_sessions = 3\n[jobs]\njournal = ""\n',
    )
    quick = [Item(custom_id=f"quick-{i}", prompt="q", max_new_tokens=8) for i in range(2)]
    slow = [
        Item(
            custom_id=f"slow-{i}",
            prompt="s",
            max_new_tokens=2000,
            ignore_eos=True,
            max_context=2040,
        )
        for i in range(30)  # far more than the 1 s grace can finish
    ]
    with kvmuxd_process(cfg) as proc:
        client = await wait_connected(endpoint, proc)
        try:
            job = await client.submit([*quick, *slow])
            async for ev in job.events():
                if isinstance(ev, p.TokenDelta):
                    break
            proc.send_signal(signal.SIGTERM)
            await anyio.sleep(0.3)
            async with Client(endpoint, timeout=5.0) as late:
                with pytest.raises(ShuttingDown):
                    await late.submit([Item(prompt="too late")])
            results = await job.results()
        finally:
            await client.close()
        out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0
    by_id = {r.custom_id: r for r in results}
    assert len(by_id) == len(quick) + len(slow)  # every item has a result
    assert all(by_id[it.custom_id].status == "ok" for it in quick)
    ended = [r for r in results if r.error is not None]
    assert ended and all(r.error is not None and r.error.code == "shutdown" for r in ended)
    events = [json.loads(line)["event"] for line in out.splitlines() if line.startswith("{")]
    assert events.index("daemon_draining") < events.index("daemon_stopped")


async def test_a_second_sigterm_stops_at_once(
    tiny_model: Path, sock_dir: Path, tmp_path: Path
) -> None:
    endpoint = f"ipc://{sock_dir}/kvmuxd.sock"
    cfg = write_config(tmp_path / "k.toml", tiny_model, endpoint, "[shutdown]\ngrace = 60.0\n")
    long = [Item(prompt="s", max_new_tokens=2000, ignore_eos=True) for _ in range(40)]
    with kvmuxd_process(cfg) as proc:
        client = await wait_connected(endpoint, proc)
        try:
            job = await client.submit(long)
            async for ev in job.events():
                if isinstance(ev, p.TokenDelta):
                    break
            proc.send_signal(signal.SIGTERM)
            await anyio.sleep(0.3)
            assert proc.poll() is None  # draining: the grace is 60 s
            proc.send_signal(signal.SIGTERM)
            started = time.monotonic()
            out, _ = await anyio.to_thread.run_sync(lambda: proc.communicate(timeout=30))
        finally:
            await client.close()
    assert proc.returncode == 0 and time.monotonic() - started < 10
    events = [json.loads(line)["event"] for line in out.splitlines() if line.startswith("{")]
    assert "daemon_crashed" not in events and events[-1] == "daemon_stopped"


async def test_sighup_reopens_the_log_file(
    tiny_model: Path, sock_dir: Path, tmp_path: Path
) -> None:
    endpoint = f"ipc://{sock_dir}/kvmuxd.sock"
    log_file = tmp_path / "kvmuxd.log"
    cfg = write_config(tmp_path / "k.toml", tiny_model, endpoint, f'file = "{log_file}"\n')
    # write_config appends `extra` to its [log] table.
    with kvmuxd_process(cfg) as proc:
        client = await wait_connected(endpoint, proc)
        await client.close()
        rotated = log_file.rename(tmp_path / "kvmuxd.log.1")
        proc.send_signal(signal.SIGHUP)
        with anyio.fail_after(10):
            while not log_file.exists():
                await anyio.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    old = [json.loads(line)["event"] for line in rotated.read_text().splitlines()]
    new = [json.loads(line)["event"] for line in log_file.read_text().splitlines()]
    assert "daemon_ready" in old and "log_reopened" in new and "daemon_stopped" in new


async def test_instances_of_one_config_each_keep_their_own_journal(
    tiny_model: Path, sock_dir: Path, tmp_path: Path
) -> None:
    """kvmuxd@N's way: one config file naming a journal, each instance its own socket
    and --journal. Without --journal the second instance is refused, saying why."""
    shared = tmp_path / "shared.sqlite3"
    cfg = write_config(
        tmp_path / "k.toml",
        tiny_model,
        f"ipc://{sock_dir}/unused.sock",
        f'[jobs]\njournal = "{shared}"\n',
    )
    ends = [f"ipc://{sock_dir}/gpu{n}.sock" for n in range(3)]
    journals = [tmp_path / f"gpu{n}" / "jobs.sqlite3" for n in range(2)]
    item = Item(prompt="one", max_new_tokens=4, temperature=0.0)
    with (
        kvmuxd_process(cfg, "--endpoint", ends[0], "--journal", str(journals[0])) as first,
        kvmuxd_process(cfg, "--endpoint", ends[1], "--journal", str(journals[1])) as second,
    ):
        got = []
        for end, proc in ((ends[0], first), (ends[1], second)):
            client = await wait_connected(end, proc)
            try:
                got.append(await (await client.submit([item])).results())
            finally:
                await client.close()
        assert [r[0].status for r in got] == ["ok", "ok"]
        assert got[0][0].token_ids == got[1][0].token_ids
        # Both journals exist and are held; the config's own path is nobody's.
        assert all(j.exists() for j in journals) and not shared.exists()
        with kvmuxd_process(cfg, "--endpoint", ends[2], "--journal", str(journals[0])) as third:
            out, err = await anyio.to_thread.run_sync(lambda: third.communicate(timeout=60))
        assert third.returncode == EX_CONFIG
        assert f"the job journal {journals[0]} is in use by another kvmuxd" in out + err
        for proc in (first, second):
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=30) == 0


# -- the units --------------------------------------------------------------------------------
@pytest.mark.parametrize("unit", ["kvmuxd.service", "kvmuxd@.service"])
def test_units_pass_systemd_analyze_verify(unit: str, tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed here; the units are verified where it is")
    kvmuxd = Path(sys.executable).with_name("kvmuxd")
    assert kvmuxd.exists(), "the kvmuxd console script is installed next to python"
    text = (REPO / "systemd" / unit).read_text()
    assert "/opt/kvmux/.venv/bin/kvmuxd" in text
    # verify checks that ExecStart exists: point it at this environment's kvmuxd.
    name = unit.replace("@.", "@0.")
    (tmp_path / name).write_text(text.replace("/opt/kvmux/.venv/bin/kvmuxd", str(kvmuxd)))
    proc = subprocess.run(
        [analyze, "verify", str(tmp_path / name)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    # Unknown or malformed settings are only warnings ("..., ignoring"): there must be none.
    assert proc.stderr.strip() == "" and proc.stdout.strip() == ""
    for setting in (
        "Type=notify",
        "NotifyAccess=main",
        "RestartPreventExitStatus=78",
        "WatchdogSec=",
        "TimeoutStopSec=45",
        "ProtectSystem=strict",
    ):
        assert setting in text


# -- metrics ------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


async def test_metrics_endpoint_serves_the_counters(tiny_model: Path, sock_dir: Path) -> None:
    port = free_port()
    cfg = make_config(tiny_model, sock_dir, metrics={"listen": f"127.0.0.1:{port}"})
    async with running(cfg) as daemon, connected(daemon) as client:
        job = await client.submit(
            [
                Item(prompt="count me", max_new_tokens=40, ignore_eos=True),
                Item(prompt_tokens=[999_999]),
            ]
        )
        await job.results()
        assert daemon.engine is not None
        prompt_tokens = len(daemon.engine.encode("count me"))
        url = f"http://127.0.0.1:{port}/metrics"
        body = await anyio.to_thread.run_sync(
            lambda: urllib.request.urlopen(url, timeout=10).read().decode()
        )
    samples = {}
    for line in body.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            samples[name] = float(value)
    assert samples['kvmux_items_finished_total{status="ok"}'] == 1
    assert samples['kvmux_items_finished_total{status="bad_request"}'] == 1
    assert samples["kvmux_tokens_generated_total"] == 40
    assert samples["kvmux_kv_growths_total"] >= 2
    assert samples["kvmux_kv_bytes_in_use"] == 0 and samples["kvmux_queue_depth"] == 0
    assert samples["kvmux_kv_bytes_rows"] == 0
    assert samples['kvmux_kv_growth_failures_total{cause="budget"}'] == 0
    assert samples["kvmux_growth_lock_wait_seconds_count"] >= 2
    # One prompt looked up (the bad item never reached the queue), nothing copied or kept.
    assert samples["kvmux_prefix_cache_lookups_total"] == 1
    assert samples["kvmux_prefix_cache_prompt_tokens_total"] == prompt_tokens
    assert samples["kvmux_prefix_cache_hit_tokens_total"] == 0
    assert samples["kvmux_prefix_cache_bytes"] == samples["kvmux_prefix_cache_entries"] == 0
    assert samples["kvmux_prefix_cache_evictions_total"] == 0
    assert samples["kvmux_time_to_first_token_seconds_count"] == 1
    assert samples["kvmux_time_per_output_token_seconds_count"] == 1
    assert samples['kvmux_requests_total{outcome="accepted"}'] >= 2


# -- access control -------------------------------------------------------------------------------
def test_tcp_beyond_loopback_needs_curve() -> None:
    with pytest.raises(ConfigError) as info:
        parse_config('[server]\nendpoint = "tcp://0.0.0.0:7000"\n')
    assert info.value.key == "server.endpoint" and "CURVE" in str(info.value)
    parse_config('[server]\nendpoint = "tcp://127.0.0.1:7000"\n')
    parse_config(
        '[server]\nendpoint = "tcp://0.0.0.0:7000"\n'
        'curve_secret_key = "/k/server.key_secret"\ncurve_authorized_keys = "/k/clients"\n'
    )
    with pytest.raises(ConfigError, match="needs both"):
        parse_config('[server]\ncurve_secret_key = "/k/server.key_secret"\n')


async def test_curve_admits_only_authorized_clients(
    tiny_model: Path, sock_dir: Path, tmp_path: Path
) -> None:
    keys, allowed = tmp_path / "keys", tmp_path / "allowed"
    keys.mkdir()
    allowed.mkdir()
    _, server_secret = zmq.auth.create_certificates(keys, "server")
    good_public, good_secret = zmq.auth.create_certificates(keys, "good")
    _, bad_secret = zmq.auth.create_certificates(keys, "bad")
    shutil.copy(good_public, allowed)
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    cfg = make_config(
        tiny_model,
        sock_dir,
        server={
            "endpoint": endpoint,
            "curve_secret_key": str(server_secret),
            "curve_authorized_keys": str(allowed),
        },
    )
    server_public = keys / "server.key"
    async with running(cfg):
        with pytest.raises(DaemonUnreachable):
            await Client(endpoint, timeout=1.0).connect()  # no CURVE at all
        with pytest.raises(DaemonUnreachable):
            await Client(
                endpoint, timeout=1.0, curve=load_curve(server_public, bad_secret)
            ).connect()
        async with Client(endpoint, curve=load_curve(server_public, good_secret)) as client:
            (result,) = await (
                await client.submit([Item(prompt="secret", max_new_tokens=9)])
            ).results()
    assert result.status == "ok" and len(result.token_ids) > 0


async def test_oversize_message_is_dropped_without_harm(tiny_model: Path, sock_dir: Path) -> None:
    cfg = make_config(tiny_model, sock_dir, server={"max_message_bytes": 64 * 1024})
    async with running(cfg) as daemon:
        ctx = zmq.asyncio.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.connect(daemon.endpoint)
        try:
            huge = p.Submit(id=1, items=[Item(prompt="x" * 200_000)])
            await sock.send(p.encode(huge))
            with anyio.move_on_after(1.0) as scope:
                await sock.recv()
            assert scope.cancelled_caught, "an oversize message got an answer"
        finally:
            sock.close(linger=0)
            ctx.term()
        async with connected(daemon) as client:
            (result,) = await (
                await client.submit([Item(prompt="small", max_new_tokens=5)])
            ).results()
            status = await client.status()
    assert result.status == "ok" and status.jobs_active == 0 and status.kv_bytes_in_use == 0
