"""What a newcomer meets first over HTTP: the request's own field names in errors, a
request without ``model``, the names the model answers to, where it is on disk, the
metrics on the API's port, and a port already taken."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from bench.bench_daemon import DaemonProcess
from kvmux.daemon.app import served_names
from kvmux.daemon.config import ModelConfig, toml_config
from kvmux.daemon.model.smollm2 import SMOLLM2_HF_ID

from .conftest import MODEL, free_port, http_tables

pytestmark = pytest.mark.anyio

MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
async def test_a_limit_is_named_by_the_requests_own_field(raw: Any, field: str) -> None:
    resp = await raw.post(
        "/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES, field: 5000}
    )
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == field and error["type"] == "invalid_request_error"
    assert error["message"].startswith(f"`{field}` 5000 is over this daemon's limit 4096")
    assert "max_new_tokens 5000" not in error["message"]


async def test_a_request_without_model_gets_the_served_one(raw: Any) -> None:
    resp = await raw.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 2})
    assert resp.status_code == 200, resp.text
    assert resp.json()["model"] == MODEL
    resp = await raw.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
    assert resp.status_code == 200 and resp.json()["model"] == MODEL


def test_the_builtin_smollm2_answers_to_its_hugging_face_id_too() -> None:
    assert served_names(ModelConfig(name="smollm2")) == ["smollm2", SMOLLM2_HF_ID]
    assert SMOLLM2_HF_ID == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert served_names(ModelConfig(name="tiny")) == ["tiny"]
    assert served_names(ModelConfig(path="/srv/models/qwen")) == ["/srv/models/qwen"]


async def test_models_show_the_folder_and_precision(
    raw: Any, daemon: DaemonProcess, tiny_model: Path
) -> None:
    (model,) = (await raw.get("/v1/models")).json()["data"]
    assert model["id"] == MODEL
    assert model["root"] == str(tiny_model)
    assert model["precision"] == "fp32"
    (ready,) = daemon.events("daemon_ready")
    assert ready["folder"] == str(tiny_model) and ready["precision"] == "fp32"


async def test_metrics_are_served_on_the_api_port(raw: Any) -> None:
    await raw.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
    resp = await raw.get("/metrics")
    assert resp.status_code == 200
    assert resp.headers["content-type"].startswith("text/plain")
    finished = [
        line
        for line in resp.text.splitlines()
        if line.startswith("kvmux_items_finished_total") and 'status="ok"' in line
    ]
    assert finished and float(finished[0].split()[-1]) >= 1, resp.text[:2000]


def test_an_http_port_in_use_names_the_address_and_the_key(
    tiny_model: Path, tmp_path: Path
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        tables = http_tables({"server": {"endpoint": f"tcp://127.0.0.1:{free_port()}"}})
        tables["http"]["listen"] = f"127.0.0.1:{port}"
        tables["log"] = {"format": "json"}
        cfg = tmp_path / "kvmuxd.toml"
        cfg.write_text(toml_config({"model": {"path": str(tiny_model)}, **tables}))
        done = subprocess.run(
            [sys.executable, "-m", "kvmux.daemon", "--config", str(cfg)],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert done.returncode == 1, done.stdout + done.stderr
    (failed,) = [
        e for e in map(json.loads, done.stdout.splitlines()) if e["event"] == "startup_failed"
    ]
    assert f"http.listen 127.0.0.1:{port}: address already in use" in failed["error"]
    assert "kvmuxd --http" in failed["error"]


def test_kvmux_status_at_the_http_port_says_it_is_the_http_api(daemon: DaemonProcess) -> None:
    address = daemon.http_url.removeprefix("http://")
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "kvmux.client.cli", "status", "--endpoint", address],
        capture_output=True,
        text=True,
        timeout=60,
    )
    took = time.monotonic() - started
    assert done.returncode == 1, done.stdout
    assert f"not reachable at tcp://{address}" in done.stderr
    assert "an HTTP server answers there: kvmuxd's OpenAI API (http.listen)" in done.stderr
    assert took < 8, took  # told at once, not after --timeout's 10 s
