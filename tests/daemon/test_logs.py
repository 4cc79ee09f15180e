"""structlog configuration, the JSON-lines file with logrotate reopen, and the log hub."""

from __future__ import annotations

import io
import json
import os
import re
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
import structlog

from kvmux.daemon import logs
from kvmux.daemon.logs import LogHub, configure_logging, hub, reopen_log_file
from kvmux.kv import failpoints


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(autouse=True)
def _restore_structlog() -> Iterator[None]:
    yield
    logs.close_log_file()
    structlog.reset_defaults()
    structlog.contextvars.clear_contextvars()


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def _lines(stream: io.StringIO) -> list[dict[str, Any]]:
    return [json.loads(line) for line in stream.getvalue().splitlines()]


def test_json_to_a_non_tty_stream_with_contextvars() -> None:
    out = io.StringIO()
    configure_logging(stream=out)
    log = structlog.get_logger()
    with structlog.contextvars.bound_contextvars(job_id="j1"):
        log.info("kv_grew", session_id="s1", old=256, new=512)
    log.info("idle")
    first, second = _lines(out)
    assert first["event"] == "kv_grew"
    assert first["level"] == "info"
    assert first["job_id"] == "j1"
    assert first["session_id"] == "s1"
    assert (first["old"], first["new"]) == (256, 512)
    assert first["timestamp"].endswith("Z")
    assert second["event"] == "idle"
    assert "job_id" not in second


def test_exceptions_become_a_string_field() -> None:
    out = io.StringIO()
    configure_logging(fmt="json", stream=out)
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        structlog.get_logger().exception("step_failed")
    (line,) = _lines(out)
    assert line["level"] == "error"
    assert "RuntimeError: boom" in line["exception"]
    assert "Traceback" in line["exception"]


def test_level_filtering() -> None:
    out = io.StringIO()
    configure_logging(level="warning", stream=out)
    log = structlog.get_logger()
    log.debug("d")
    log.info("i")
    log.warning("w")
    log.error("e")
    assert [(ln["event"], ln["level"]) for ln in _lines(out)] == [
        ("w", "warning"),
        ("e", "error"),
    ]


def test_auto_on_a_tty_renders_for_the_console() -> None:
    out = _Tty()
    configure_logging(stream=out)
    structlog.get_logger().info("hello_console", n=3)
    text = out.getvalue()
    assert "\x1b[" in text  # colors on a TTY
    plain = re.sub(r"\x1b\[[0-9;]*m", "", text)
    assert "hello_console" in plain
    assert "n=3" in plain
    with pytest.raises(json.JSONDecodeError):
        json.loads(text)


def test_console_format_on_a_non_tty_has_no_colors() -> None:
    out = io.StringIO()
    configure_logging(fmt="console", stream=out)
    structlog.get_logger().info("plain", n=3)
    text = out.getvalue()
    assert "plain" in text
    assert "n=3" in text
    assert "\x1b[" not in text


def test_json_format_on_a_tty() -> None:
    out = _Tty()
    configure_logging(fmt="json", stream=out)
    structlog.get_logger().info("j")
    assert _lines(out)[0]["event"] == "j"


def test_bad_level_or_format_is_refused() -> None:
    with pytest.raises(ValueError, match="log level"):
        configure_logging(level="trace")
    with pytest.raises(ValueError, match="log format"):
        configure_logging(fmt="xml")


def test_reconfiguring_replaces_the_configuration() -> None:
    first, second = io.StringIO(), io.StringIO()
    configure_logging(stream=first)
    structlog.get_logger().info("one")
    configure_logging(stream=second, level="error")
    log = structlog.get_logger()
    log.info("two")
    log.error("three")
    assert [ln["event"] for ln in _lines(first)] == ["one"]
    assert [ln["event"] for ln in _lines(second)] == ["three"]


def test_capture_logs_sees_events_after_configuring() -> None:
    configure_logging(stream=io.StringIO())
    with structlog.testing.capture_logs() as captured:
        structlog.get_logger().info("kv_grew", old=4, new=8)
    assert captured == [{"event": "kv_grew", "log_level": "info", "old": 4, "new": 8}]


def test_file_gets_json_lines_and_reopens_after_logrotate(tmp_path: Path) -> None:
    path = tmp_path / "kvmuxd.log"
    out = _Tty()
    configure_logging(fmt="console", file=path, stream=out)
    log = structlog.get_logger()
    log.info("before_rotate", n=1)
    assert "before_rotate" in out.getvalue()  # the stream keeps its console rendering

    rotated = tmp_path / "kvmuxd.log.1"
    path.rename(rotated)
    log.info("still_old_file")  # until reopened, the open handle follows the rename
    reopen_log_file()
    log.info("after_rotate", n=2)

    old = [json.loads(line) for line in rotated.read_text(encoding="utf-8").splitlines()]
    new = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    assert [e["event"] for e in old] == ["before_rotate", "still_old_file"]
    assert old[0]["n"] == 1
    assert old[0]["level"] == "info"
    assert "timestamp" in old[0]
    assert [e["event"] for e in new] == ["after_rotate"]


def test_file_appends_and_respects_the_level(tmp_path: Path) -> None:
    path = tmp_path / "kvmuxd.log"
    path.write_text('{"event": "earlier"}\n', encoding="utf-8")
    configure_logging(level="info", fmt="json", file=str(path), stream=io.StringIO())
    log = structlog.get_logger()
    log.debug("hidden")
    log.info("shown")
    events = [json.loads(line)["event"] for line in path.read_text().splitlines()]
    assert events == ["earlier", "shown"]


def test_values_json_lacks_render_as_structlog_renders_them() -> None:
    """Lines are rendered by msgspec; what it cannot encode (a Path, a key that is no
    string or number) renders as structlog's JSON renderer renders it, and each line
    is still one JSON document."""
    out = io.StringIO()
    configure_logging(stream=out)

    class Named:
        def __structlog__(self) -> str:
            return "named"

    log = structlog.get_logger()
    log.info("odd", path=Path("/x"), sizes=(1, 2), obj=Named(), nan=float("nan"))
    log.info("keys", by_tuple={(1, 2): "a"}, by_int={3: "b"})
    odd, keys = _lines(out)
    assert odd["path"] == repr(Path("/x")) and odd["sizes"] == [1, 2]
    assert odd["obj"] == "named" and odd["nan"] is None
    assert keys["by_int"] == {"3": "b"} and keys["by_tuple"] == {"(1, 2)": "a"}


def test_reopen_without_a_file_is_a_noop() -> None:
    configure_logging(stream=io.StringIO())
    reopen_log_file()


def test_hub_receives_json_safe_copies() -> None:
    configure_logging(stream=io.StringIO())
    sub = hub.subscribe()
    try:
        structlog.get_logger().info("kv_grew", path=Path("/x"), sizes=(1, 2), meta={"k": b"v"})
    finally:
        hub.unsubscribe(sub)
    (event,) = sub.drain()
    assert event["event"] == "kv_grew"
    assert event["level"] == "info"
    assert event["path"] == "/x"
    assert event["sizes"] == [1, 2]
    assert event["meta"] == {"k": "b'v'"}
    assert json.loads(json.dumps(event)) == event
    assert sub.drain() == []


def test_hub_sees_nothing_after_unsubscribe() -> None:
    configure_logging(stream=io.StringIO())
    sub = hub.subscribe()
    hub.unsubscribe(sub)
    hub.unsubscribe(sub)
    structlog.get_logger().info("unseen")
    assert sub.drain() == []
    assert hub.subscriber_count == 0


def test_hub_filters_by_job_and_level() -> None:
    configure_logging(level="debug", stream=io.StringIO())
    job_sub = hub.subscribe(job_id="j1")
    warn_sub = hub.subscribe(min_level="warning")
    try:
        log = structlog.get_logger()
        with structlog.contextvars.bound_contextvars(job_id="j1"):
            log.debug("j1_debug")
            log.warning("j1_warning")
        log.info("other_info", job_id="j2")
        log.error("no_job_error")
    finally:
        hub.unsubscribe(job_sub)
        hub.unsubscribe(warn_sub)
    assert [e["event"] for e in job_sub.drain()] == ["j1_debug", "j1_warning"]
    assert [e["event"] for e in warn_sub.drain()] == ["j1_warning", "no_job_error"]


def test_hub_processor_returns_the_event_unchanged() -> None:
    local = LogHub()
    event = {"event": "x", "level": "info", "obj": object()}
    assert local.processor(None, "info", event) is event
    sub = local.subscribe()
    assert local.processor(None, "info", event) is event
    (published,) = sub.drain()
    assert published is not event
    assert isinstance(published["obj"], str)
    assert not isinstance(event["obj"], str)


def test_overflow_drops_the_oldest_and_counts() -> None:
    local = LogHub()
    sub = local.subscribe(maxlen=3)
    for i in range(5):
        local.processor(None, "info", {"event": f"e{i}", "level": "info"})
    assert sub.dropped == 2
    assert [e["event"] for e in sub.drain()] == ["e2", "e3", "e4"]


def test_subscribe_validates_arguments() -> None:
    local = LogHub()
    with pytest.raises(ValueError, match="maxlen"):
        local.subscribe(maxlen=0)
    with pytest.raises(ValueError, match="log level"):
        local.subscribe(min_level="loud")
    assert local.subscriber_count == 0


@pytest.mark.anyio
async def test_wait_is_woken_by_a_publish_from_another_thread() -> None:
    configure_logging(stream=io.StringIO())
    sub = hub.subscribe()
    started = threading.Event()

    def worker() -> None:
        started.wait(timeout=2)
        structlog.get_logger().info("from_worker", job_id="j1")

    thread = threading.Thread(target=worker)
    try:
        thread.start()
        with anyio.fail_after(2):
            async with anyio.create_task_group() as tg:
                tg.start_soon(sub.wait)
                await anyio.sleep(0.01)  # let wait() block on an empty buffer
                assert sub.drain() == []
                started.set()
        assert [e["event"] for e in sub.drain()] == ["from_worker"]
    finally:
        thread.join(timeout=2)
        hub.unsubscribe(sub)


@pytest.mark.anyio
async def test_wait_returns_at_once_when_events_are_buffered() -> None:
    local = LogHub()
    sub = local.subscribe()
    local.processor(None, "info", {"event": "ready", "level": "info"})
    with anyio.fail_after(1):
        await sub.wait()
        await sub.wait()  # still buffered: not consumed by wait()
    assert [e["event"] for e in sub.drain()] == ["ready"]


@pytest.mark.anyio
async def test_wait_after_drain_blocks_until_the_next_event() -> None:
    local = LogHub()
    sub = local.subscribe()
    local.processor(None, "info", {"event": "first", "level": "info"})
    await sub.wait()
    sub.drain()
    with anyio.move_on_after(0.05) as scope:
        await sub.wait()
    assert scope.cancelled_caught
    threading.Thread(
        target=local.processor, args=(None, "info", {"event": "second", "level": "info"})
    ).start()
    with anyio.fail_after(2):
        await sub.wait()
    assert [e["event"] for e in sub.drain()] == ["second"]


def test_subscription_made_off_the_loop_binds_on_first_wait() -> None:
    local = LogHub()
    sub = local.subscribe()  # no running loop here
    local.processor(None, "info", {"event": "early", "level": "info"})

    async def main() -> list[str]:
        with anyio.fail_after(1):
            await sub.wait()
        return [e["event"] for e in sub.drain()]

    assert anyio.run(main, backend="asyncio") == ["early"]


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != "KVMUX_ENDPOINT"}


async def _kvmux(endpoint: str, *args: str) -> tuple[int, str]:
    """``kvmux ARGS`` as a process against ``endpoint``: exit status and stderr."""
    done = await anyio.run_process(
        [sys.executable, "-m", "kvmux.client.cli", *args, "--endpoint", endpoint],
        env=_env(),
        check=False,
    )
    return done.returncode, done.stderr.decode()


@pytest.mark.anyio
async def test_failures_are_warnings_and_logs_of_a_job_end_with_it(
    tiny_model: Path, sock_dir: Path
) -> None:
    from kvmux.client import Item

    from .conftest import connected, make_config, running

    configure_logging(level="debug", stream=io.StringIO())
    async with running(make_config(tiny_model, sock_dir)) as daemon, connected(daemon) as client:
        stream = await client.subscribe_logs(level="warning")
        too_long = Item(custom_id="big", prompt="x" * 60, max_context=8)
        job = await client.submit([too_long, Item(custom_id="fine", prompt="hi", max_new_tokens=2)])
        [failed, ok] = await job.results()
        with anyio.fail_after(10):
            async for record in stream:
                if record["event"] == "session_finished":
                    break
        await stream.aclose()
        # Unknown: not_found at once. Finished: said so, and the command ends.
        unknown = await _kvmux(daemon.endpoint, "logs", "-f", "--job", "0123456789ab")
        finished = await _kvmux(daemon.endpoint, "logs", "-f", "--job", job.job_id)
        # Running, followed at a level that hides its end event: ends with it all the same.
        # Its steps are slowed (2 x 400 of 5 ms) so it is still running once the
        # CLI has started and subscribed, however fast decoding is.
        failpoints.slow("engine.step", 0.005)
        slow = await client.submit(
            [Item(prompt="go", max_new_tokens=400, ignore_eos=True)] * 2, detach=True
        )
        with anyio.fail_after(60):
            async with await anyio.open_process(
                [
                    *(sys.executable, "-m", "kvmux.client.cli", "logs", "-f", "--level"),
                    *("error", "--job", slow.job_id, "--endpoint", daemon.endpoint),
                ],
                env=_env(),
            ) as proc:
                assert proc.stderr is not None
                header = await proc.stderr.receive()  # printed once it is subscribed
                running_then = [j.state for j in await client.jobs() if j.job_id == slow.job_id]
                rest = b"".join([chunk async for chunk in proc.stderr])
                running_job = (await proc.wait(), (header + rest).decode())
        failpoints.disarm("engine.step")
        assert all(r.status == "ok" for r in await slow.results())
    assert failed.error is not None and failed.error.code == "kv_capacity_exceeded"
    assert ok.status == "ok"
    assert record["level"] == "warning" and record["error"] == "kv_capacity_exceeded"
    assert record["job_id"] == job.job_id
    assert unknown[0] == 1 and "no job '0123456789ab'" in unknown[1]
    assert finished[0] == 0 and f"job {job.job_id} has finished (1 ok, 1 failed)" in finished[1]
    assert b"showing" in header and running_then == ["running"]
    assert running_job[0] == 0 and f"job {slow.job_id} has finished" in running_job[1]
