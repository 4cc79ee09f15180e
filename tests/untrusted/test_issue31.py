"""The three entry points issue 31 found broken by one line of JSON nested thousands deep:
each answers it as bad input of its own kind, and what was good beside it still runs."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest

from bench.bench_daemon import DaemonProcess
from kvmux.client.cli.connect import ITEMS_FAILED

from .conftest import errors_logged, jsonl, kvmux

CHAT = "/v1/chat/completions"


def deep(levels: int) -> str:
    return "[" * levels + "1" + "]" * levels


def chat_body(content: str) -> str:
    return (
        '{"model": "tiny", "max_tokens": 3, "messages": [{"role": "user", "content": @}]}'.replace(
            "@", content
        )
    )


def openai_line(cid: str, body: str) -> str:
    head = json.dumps({"custom_id": cid, "method": "POST", "url": CHAT})
    return head[:-1] + ', "body": ' + body + "}"


@pytest.mark.parametrize("levels", [1000, 3000])
def test_http_answers_deep_json_with_400_and_logs_no_error(
    daemon: DaemonProcess, http: Any, levels: int
) -> None:
    before = len(errors_logged(daemon))
    resp = http.post(CHAT, content=chat_body(deep(levels)).encode())
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert "nested deeper than 128" in error["message"]
    # The same request a hundred deep is inside the limit: refused for its type only.
    shallow = http.post(CHAT, content=chat_body(deep(100)).encode())
    assert shallow.status_code == 400 and "content" in shallow.json()["error"]["message"]
    assert errors_logged(daemon)[before:] == []


@pytest.mark.parametrize("shape", ["kvmux", "openai"])
def test_cli_submit_gives_the_deep_line_its_error_and_the_rest_their_results(
    daemon: DaemonProcess, tmp_path: Path, shape: str
) -> None:
    good = [{"role": "user", "content": f"good line {i}"} for i in range(2)]
    if shape == "kvmux":
        lines = [
            json.dumps({"custom_id": "a", "messages": [good[0]], "max_tokens": 3}),
            '{"custom_id": "deep", "max_tokens": 3, "messages": @}'.replace("@", deep(2000)),
            json.dumps({"custom_id": "b", "messages": [good[1]], "max_tokens": 3}),
        ]
    else:
        lines = [
            openai_line("a", json.dumps({"messages": [good[0]], "max_tokens": 3})),
            openai_line("deep", chat_body(deep(2000))),
            openai_line("b", json.dumps({"messages": [good[1]], "max_tokens": 3})),
        ]
    batch = tmp_path / "deep.jsonl"
    batch.write_text("\n".join(lines) + "\n")
    out = tmp_path / "out.jsonl"
    proc = kvmux(daemon, "submit", "--quiet", str(batch), "--out", str(out))
    assert "Traceback" not in proc.stderr, proc.stderr
    assert proc.returncode == ITEMS_FAILED, proc.stderr
    results = {r["custom_id"]: r for r in jsonl(out.read_text())}
    # A line that does not decode has no custom_id to give: it is `line-N`.
    assert results.keys() == {"a", "b", "line-2"}
    if shape == "kvmux":
        assert results["a"]["status"] == results["b"]["status"] == "ok"
        error = results["line-2"]["error"]
    else:
        assert results["a"]["error"] is None and results["b"]["error"] is None
        assert results["a"]["response"]["status_code"] == 200
        error = results["line-2"]["error"] or results["line-2"]["response"]["body"]["error"]
    assert "line 2" in error["message"] and "nested deeper than 128" in error["message"]


def upload(http: Any, data: bytes) -> str:
    resp = http.post("/v1/files", files={"file": ("in.jsonl", data)}, data={"purpose": "batch"})
    assert resp.status_code == 200, resp.text
    file_id: str = resp.json()["id"]
    return file_id


def run_batch(http: Any, data: bytes, timeout: float = 90.0) -> dict[str, Any]:
    """Upload ``data``, batch it, and wait for the batch to end."""
    body = {"input_file_id": upload(http, data), "endpoint": CHAT, "completion_window": "24h"}
    created = http.post("/v1/batches", json=body)
    assert created.status_code == 200, created.text
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        batch: dict[str, Any] = http.get(f"/v1/batches/{created.json()['id']}").json()
        if batch["status"] in ("completed", "failed", "cancelled", "expired"):
            return batch
        time.sleep(0.05)
    raise AssertionError(f"the batch did not end within {timeout} s: {batch}")


def test_batch_api_fails_the_file_naming_the_deep_line(daemon: DaemonProcess, http: Any) -> None:
    lines = [
        openai_line("a", json.dumps({"messages": [{"role": "user", "content": "hi"}]})),
        openai_line("deep", chat_body(deep(3000))),
        deep(1000),
    ]
    batch = run_batch(http, "\n".join(lines).encode())
    assert batch["status"] == "failed"
    errors = batch["errors"]["data"]
    assert [(e["code"], e["line"]) for e in errors] == [
        ("invalid_json_line", 2),
        ("invalid_json_line", 3),
    ]
    assert all("nested deeper than 128" in e["message"] for e in errors)
    assert msgspec.json.decode(msgspec.json.encode(batch))  # a well-formed object
