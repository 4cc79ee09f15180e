"""``kvmux`` end to end: the CLI as a process against a real kvmuxd process."""

from __future__ import annotations

import fcntl
import io
import json
import os
import re
import select
import signal
import socket
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest
from rich.console import Console

from kvmux.client.cli.status import overview
from kvmux.client.protocol import DaemonStatus
from kvmux.kv import failpoints

from .conftest import Kvmuxd, cli_env, kvmux_argv, serve

ANSI = "\x1b["
BAR = "\u2501"  # rich's bar glyph


def write_jsonl(path: Path, lines: list[Any]) -> Path:
    """Objects become JSON lines; a str is written as-is (a blank or malformed line)."""
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


def jsonl(text: str) -> list[dict[str, Any]]:
    return [json.loads(x) for x in text.splitlines() if x.strip()]


def openai_line(custom_id: str, body: dict[str, Any], url: str = "/v1/completions") -> Any:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


def test_mixed_batch_gives_one_result_per_line_and_exit_2(kvmuxd: Kvmuxd, tmp_path: Path) -> None:
    twin = {"prompt": "kvmux twins", "max_tokens": 6, "temperature": 0, "stop": "\n"}
    batch = write_jsonl(
        tmp_path / "mixed.jsonl",
        [
            {"custom_id": "native-text", "prompt": "hello", "max_tokens": 8, "temperature": 0},
            "",
            {"custom_id": "native-tokens", "prompt": [72, 101, 108], "max_tokens": 5},
            '{"custom_id": "broken", "prompt": ',
            openai_line("openai-twin", {"model": "any", **twin}),
            openai_line("openai-chat", {"prompt": "hi"}, url="/v1/chat/completions"),
            {"custom_id": "too-long", "prompt": "x" * 100, "max_context": 16},
            openai_line("openai-default-max", {"prompt": "defaults", "seed": 3}),
            {"custom_id": "native-twin", **twin},
            {"prompt": "no id", "max_tokens": 2},
        ],
    )
    proc = kvmuxd.run("submit", str(batch))
    assert proc.returncode == 2, proc.stderr
    results = jsonl(proc.stdout)
    by_line = {r["line"]: r for r in results}
    assert len(results) == len(by_line) == 9  # one per non-blank line
    got = {
        n: (r["custom_id"], r["status"], (r["error"] or {}).get("code")) for n, r in by_line.items()
    }
    assert got == {
        1: ("native-text", "ok", None),
        3: ("native-tokens", "ok", None),
        4: ("line-4", "error", "bad_request"),
        5: ("openai-twin", "ok", None),
        6: ("openai-chat", "error", "bad_request"),
        7: ("too-long", "error", "kv_capacity_exceeded"),
        8: ("openai-default-max", "ok", None),
        9: ("native-twin", "ok", None),
        10: ("line-10", "ok", None),
    }
    # Lines that reached the daemon are its items 0..6, in line order.
    assert [by_line[n]["index"] for n in (1, 3, 5, 7, 8, 9, 10)] == list(range(7))
    # A refused line is the job's too (kept for `kvmux results`), after its message's items.
    assert by_line[4]["index"] > 6 and "not valid JSON" in by_line[4]["error"]["message"]
    assert by_line[4]["error"]["details"]["line"] == 4
    assert "/v1/chat/completions" in by_line[6]["error"]["message"]
    too_long = by_line[7]["error"]["details"]
    assert too_long["hard_max"] == 16 and "item max_context" in too_long["hard_max_source"]
    assert {"requested_tokens", "bytes_per_token", "levers"} <= too_long.keys()
    # The OpenAI line and its native twin are the same item, so the same greedy tokens.
    assert by_line[5]["token_ids"] == by_line[9]["token_ids"]
    assert by_line[1]["usage"]["completion_tokens"] == len(by_line[1]["token_ids"]) == 8
    assert by_line[1]["finish_reason"] == "length"
    assert by_line[8]["usage"]["completion_tokens"] <= 16  # the Completions API's default
    # Progress went to stderr as plain lines: a pipe gets no bar and no escapes.
    assert "line 7 (too-long): kv_capacity_exceeded" in proc.stderr
    assert "9/9 items, 3 failed" in proc.stderr
    assert ANSI not in proc.stderr and BAR not in proc.stderr
    # Without a bar the job takes no token updates: its tokens count from the results.
    rate = re.search(r"([\d,]+) tok/s", proc.stderr)
    assert rate is not None and int(rate[1].replace(",", "")) > 0, proc.stderr


def test_detach_then_results_collects_every_result(kvmuxd: Kvmuxd, tmp_path: Path) -> None:
    batch = write_jsonl(
        tmp_path / "detach.jsonl",
        [{"custom_id": f"d{i}", "prompt": f"detached {i}", "max_tokens": 20} for i in range(3)]
        + [{"custom_id": "d-too-long", "prompt": "y" * 50, "max_context": 8}],
    )
    submitted = kvmuxd.run("submit", "--detach", str(batch))
    assert submitted.returncode == 0, submitted.stderr
    job_id = submitted.stdout.strip()
    assert job_id and "\n" not in job_id  # only the id on stdout, for $(...)
    assert f"kvmux results {job_id}" in submitted.stderr

    out = tmp_path / "results.jsonl"
    collected = kvmuxd.run("results", job_id, "--out", str(out))
    assert collected.returncode == 2, collected.stderr
    results = sorted(jsonl(out.read_text()), key=lambda r: r["index"])
    assert [(r["index"], r["custom_id"], r["status"]) for r in results] == [
        (0, "d0", "ok"),
        (1, "d1", "ok"),
        (2, "d2", "ok"),
        (3, "d-too-long", "error"),
    ]
    assert [r["line"] for r in results] == [1, 2, 3, 4]  # kept by the daemon with each item
    assert all(len(r["token_ids"]) > 0 for r in results[:3])
    assert results[3]["error"]["code"] == "kv_capacity_exceeded"

    missing = kvmuxd.run("results", "0123456789ab")
    assert missing.returncode == 1 and "no job '0123456789ab'" in missing.stderr


def test_interrupted_submit_keeps_its_results_and_logs_follow_a_job(
    tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A long job holds the daemon's only session slot; interrupting its submit
    # cancels it, which is what lets the watched job start after `kvmux logs`
    # subscribed, so the logs see all of the watched job's events. The watched job
    # takes turns with the long one, so it would start as soon as the long item then
    # decoding ends: each decode step of this daemon sleeps 5 ms, so that item (2,000
    # tokens) holds the slot ~10 s, however slowly a loaded machine starts `kvmux logs`
    # (a race it once lost at 2,000 unslowed tokens, ~1 s). The first item is short:
    # its result is what the interrupt must keep.
    monkeypatch.setenv(failpoints.SLOW_ENV, "engine.step=0.005")
    long_batch = write_jsonl(
        tmp_path / "long.jsonl",
        [
            {
                "custom_id": f"long{i}",
                "prompt": "z",
                "max_tokens": 4 if i == 0 else 2000,
                "ignore_eos": True,
            }
            for i in range(200)
        ],
    )
    partial = tmp_path / "partial.jsonl"
    with serve(tiny_model) as kvmuxd:
        _interrupt_and_follow(kvmuxd, long_batch, partial, tmp_path)


def _interrupt_and_follow(kvmuxd: Kvmuxd, long_batch: Path, partial: Path, tmp_path: Path) -> None:
    env = kvmuxd.env()
    with subprocess.Popen(
        kvmux_argv("submit", str(long_batch), "--out", str(partial)),
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as long:
        deadline = time.monotonic() + 120  # an event's wait, bounded so a broken run ends
        while not partial.exists() or not partial.read_text().endswith("\n"):
            assert long.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)

        watched = write_jsonl(
            tmp_path / "watched.jsonl",
            [{"custom_id": f"w{i}", "prompt": "watch me", "max_tokens": 10} for i in range(2)],
        )
        submitted = kvmuxd.run("submit", "--detach", str(watched))
        assert submitted.returncode == 0, submitted.stderr
        job_id = submitted.stdout.strip()

        with subprocess.Popen(
            kvmux_argv("logs", "-f", "--job", job_id),
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        ) as logs:
            assert logs.stderr is not None
            header = logs.stderr.readline()  # printed once the subscription is acknowledged
            assert f"of job {job_id}" in header

            long.send_signal(signal.SIGINT)
            _, long_err = long.communicate(timeout=30)
            # It stops by itself at the watched job's job_finished event.
            logs_out, logs_err = logs.communicate(timeout=30)

    assert long.returncode == 130, long_err
    # Cancelled; on a machine too busy for kvmuxd to confirm it within the goodbye's
    # 0.75 s, said so (kvmuxd then cancels it on finding the client gone).
    assert "interrupted" in long_err
    assert "cancelled" in long_err or "did not confirm its cancel" in long_err
    kept = jsonl(partial.read_text())
    assert 1 <= len(kept) < 200
    assert all(r["custom_id"].startswith("long") for r in kept)

    assert logs.returncode == 0, logs_err
    records = jsonl(logs_out)  # stdout is a pipe: JSON lines
    assert records and all(r["job_id"] == job_id for r in records)
    events = [r["event"] for r in records]
    assert events.count("session_started") == 2 and events.count("session_finished") == 2
    assert events[-1] == "job_finished"
    assert all(isinstance(r["timestamp"], str) and r["level"] == "info" for r in records)


def test_status_json_parses_and_the_table_shows_the_facts(kvmuxd: Kvmuxd) -> None:
    proc = kvmuxd.run("status", "--json")
    assert proc.returncode == 0, proc.stderr
    status = json.loads(proc.stdout)
    assert status["state"] == "ready"
    assert status["kv_bytes_per_token"] > 0 and status["min_bucket"] == 4
    assert {"growths", "failures", "bytes_copied"} <= status["growth"].keys()
    prefix = status["prefix_cache"]
    assert prefix["scope"] == "owner" and prefix["block"] == 16
    assert {"entries", "bytes", "hit_tokens", "prompt_tokens", "evictions"} <= prefix.keys()

    table = kvmuxd.run("status")
    assert table.returncode == 0, table.stderr
    facts = ("state", "ready", "sessions", "KV in use", "growths", "growth failures")
    for fact in (*facts, "prefix cache"):
        assert fact in table.stdout
    # Where the model is and what it holds: a built-in resolves to a folder of the cache.
    assert "model folder" in table.stdout
    st = json.loads(kvmuxd.run("status", "--json").stdout)
    assert st["model_precision"] == "fp32" and st["chat_template"] is True
    assert Path(st["model_folder"], "genai_config.json").is_file()
    shown = _rendered(msgspec.json.decode(json.dumps(st), type=DaemonStatus))
    assert f"{st['model_folder']} (fp32, chat template)" in shown
    assert "device memory" in shown and "KV budget" not in shown
    # On a kv.memory_budget, free and total are the budget's: the row says so.
    budget = msgspec.structs.replace(
        msgspec.json.decode(json.dumps(st), type=DaemonStatus),
        memory_source="kv.memory_budget",
        device_free_bytes=1 << 20,
        device_total_bytes=1 << 28,
    )
    shown = _rendered(budget)
    assert "KV budget" in shown and "device memory" not in shown
    assert "1.0 MiB free of 256.0 MiB (kv.memory_budget)" in shown


def _rendered(st: DaemonStatus) -> str:
    console = Console(width=400, record=True, file=io.StringIO())
    console.print(overview(st, "ipc://x"))
    return console.export_text()


def test_generate_streams_the_same_completion_as_a_batch_item(
    kvmuxd: Kvmuxd, tmp_path: Path
) -> None:
    """tiny has a chat template, so the prompt goes in as a user message of it, as a
    chat line's does; --raw sends it as a plain prompt line does."""
    args = ("--max-tokens", "12", "--temperature", "0", "--ignore-eos")
    chat = kvmuxd.run("generate", "stream this", *args)
    raw = kvmuxd.run("generate", "stream this", "--raw", *args)
    system = kvmuxd.run("generate", "stream this", "--system", "be brief", *args)
    for proc in (chat, raw, system):
        assert proc.returncode == 0, proc.stderr
    same = {"max_tokens": 12, "temperature": 0, "ignore_eos": True}
    user = {"role": "user", "content": "stream this"}
    lines = [
        {"custom_id": "chat", "messages": [user], **same},
        {"custom_id": "raw", "prompt": "stream this", **same},
        {
            "custom_id": "system",
            "messages": [{"role": "system", "content": "be brief"}, user],
            **same,
        },
    ]
    batch = write_jsonl(tmp_path / "three.jsonl", lines)
    texts = {r["custom_id"]: r["text"] for r in jsonl(kvmuxd.run("submit", str(batch)).stdout)}
    assert chat.stdout == texts["chat"] and raw.stdout == texts["raw"]
    assert system.stdout == texts["system"]
    assert len({chat.stdout, raw.stdout, system.stdout}) == 3  # three different prompts
    refused = kvmuxd.run("generate", "x", "--raw", "--system", "be brief")
    assert refused.returncode == 1 and "--system needs the model's chat template" in (
        refused.stderr
    )

    failed = kvmuxd.run("generate", "far too long", "--max-context", "4")
    assert failed.returncode == 2 and "kv_capacity_exceeded" in failed.stderr


def test_unreachable_daemon_exits_1_naming_the_endpoint_quickly(tmp_path: Path) -> None:
    batch = write_jsonl(tmp_path / "b.jsonl", [{"prompt": "nobody home"}])
    nowhere = f"ipc://{tmp_path}/nobody.sock"

    def kvmux(*args: str, endpoint: str) -> tuple[subprocess.CompletedProcess[str], float]:
        start = time.monotonic()
        proc = subprocess.run(
            kvmux_argv(*args),
            capture_output=True,
            text=True,
            timeout=30,
            env=cli_env(endpoint),
            stdin=subprocess.DEVNULL,
        )
        return proc, time.monotonic() - start

    # The endpoint comes from $KVMUX_ENDPOINT here.
    proc, _ = kvmux("submit", str(batch), endpoint=nowhere)
    assert proc.returncode == 1
    assert nowhere in proc.stderr and "kvmuxd --config" in proc.stderr
    assert proc.stdout == ""

    # A TCP endpoint nobody answers: bounded by --timeout, not a hang.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    silent = f"tcp://127.0.0.1:{port}"
    proc, took = kvmux("status", "--timeout", "1", "--endpoint", silent, endpoint=nowhere)
    assert proc.returncode == 1 and silent in proc.stderr and "no answer within 1 s" in proc.stderr
    assert took < 10

    proc, took = kvmux("status", "--wait", "1", endpoint=nowhere)
    assert proc.returncode == 1 and "Gave up after waiting 1 s" in proc.stderr
    assert 1 <= took < 10


def test_progress_bar_on_a_terminal(kvmuxd: Kvmuxd, tmp_path: Path) -> None:
    batch = write_jsonl(
        tmp_path / "tty.jsonl",
        [{"custom_id": f"t{i}", "prompt": "on a tty", "max_tokens": 10} for i in range(4)],
    )
    out = tmp_path / "tty-results.jsonl"
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 160, 0, 0))
    env = kvmuxd.env() | {"TERM": "xterm-256color"}
    chunks: list[bytes] = []
    try:
        with subprocess.Popen(
            kvmux_argv("submit", str(batch), "--out", str(out)),
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=slave,
        ) as proc:
            os.close(slave)
            slave = -1
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                ready, _, _ = select.select([master], [], [], 0.5)
                if not ready:
                    continue
                try:
                    data = os.read(master, 65536)
                except OSError:  # EIO: the child closed the terminal
                    break
                if not data:
                    break
                chunks.append(data)
            proc.wait(timeout=30)
    finally:
        os.close(master)
        if slave >= 0:
            os.close(slave)
    screen = b"".join(chunks).decode("utf-8", "replace")
    assert proc.returncode == 0, screen
    assert BAR in screen and ANSI in screen
    assert "4/4" in screen and "items" in screen and "tok/s" in screen and "0 failed" in screen
    assert len(jsonl(out.read_text())) == 4


def test_the_cli_imports_nothing_of_the_daemon_or_onnxruntime() -> None:
    probe = (
        "import sys, kvmux.client.cli.main; "
        "print([m for m in sys.modules if m.split('.')[0] == 'onnxruntime' "
        "or m.startswith(('kvmux.daemon', 'kvmux.kv'))])"
    )
    proc = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True
    )
    assert proc.stdout.strip() == "[]"
