"""Hostile JSON, generated, against each entry point of one real kvmuxd and the real
``kvmux`` CLI: every input gets a clean refusal or a valid answer, what was good beside
it still gets its result, and the daemon logs no error and stays up.

The corpus (``corpus/*.json``) holds what fuzzing ever found; its cases run first, as
explicit examples, every time."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from bench.bench_daemon import DaemonProcess
from kvmux.client.cli.connect import ITEMS_FAILED, OK

from .conftest import errors_logged, jsonl, kvmux
from .hostile import EXAMPLES, corpus, encode, hostile
from .test_issue31 import CHAT, run_batch, upload

F = TypeVar("F", bound=Callable[..., None])
_FUZZ = settings(
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    print_blob=True,
)
_MESSAGES = [{"role": "user", "content": "hi"}]
CHAT_BODY: dict[str, Any] = {
    "model": "tiny",
    "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
    "max_tokens": 2,
    "temperature": 0.5,
    "seed": 1,
    "stop": ["\n"],
    "n": 1,
    "logprobs": False,
    "response_format": {"type": "text"},
    "stream": False,
    "logit_bias": {},
    "presence_penalty": 0.5,
    "user": "u",
}
COMPLETION_BODY: dict[str, Any] = {
    "model": "tiny",
    "prompt": ["hi", [72, 105]],
    "max_tokens": 2,
    "top_p": 0.9,
    "logprobs": 1,
    "echo": False,
    "stop_token_ids": [0],
}
NATIVE_LINE: dict[str, Any] = {
    "custom_id": "x",
    "prompt": [72, 105],
    "max_tokens": 2,
    "top_k": 4,
    "stop": "\n",
    "max_context": 64,
    "n": 1,
    "min_p": 0.1,
}
OPENAI_LINE: dict[str, Any] = {"custom_id": "x", "method": "POST", "url": CHAT, "body": CHAT_BODY}


def _as_line(body: str) -> str:
    return json.dumps({**OPENAI_LINE, "body": None}).replace("null", body)


# A batch line hostile anywhere, or in its body only (which the Batch API runs line by line).
_OPENAI_LINES = hostile(OPENAI_LINE) | hostile(CHAT_BODY).map(_as_line)


@pytest.fixture(autouse=True)
def _no_error_logged(daemon: DaemonProcess) -> Any:
    """Whatever a test sends, the daemon logs no error (a traceback is one) and lives."""
    before = len(errors_logged(daemon))
    yield
    assert daemon.alive(), daemon.stderr_tail()
    assert errors_logged(daemon)[before:] == []


def _answered(resp: Any) -> None:
    """A clean refusal, or a valid answer. (404 is OpenAI's for a model or file that
    does not exist.)"""
    assert resp.status_code in (200, 400, 404, 413), resp.text
    event(
        f"HTTP {resp.status_code} {resp.json()['error']['code'] if resp.status_code >= 400 else ''}"
    )
    if resp.status_code == 200:
        if resp.headers["content-type"].startswith("text/event-stream"):
            assert resp.text.rstrip().endswith("data: [DONE]"), resp.text
        else:
            assert resp.json()["object"] in ("chat.completion", "text_completion", "batch")
        return
    error = resp.json()["error"]
    assert error["type"] == "invalid_request_error", resp.text
    assert error["message"] and "Traceback" not in error["message"]


def with_corpus(name: str) -> Callable[[F], F]:
    """Every case of ``corpus/NAME.json`` as an explicit example of the test."""

    def apply(test: F) -> F:
        for case in corpus(name):
            test = example(**case)(test)
        return test

    return apply


BATCH_BODY: dict[str, Any] = {
    "input_file_id": "FILE_ID",  # an uploaded file's, put in by the test
    "endpoint": CHAT,
    "completion_window": "24h",
    "metadata": {"k": "v"},
}
_BODIES = st.one_of(
    hostile(CHAT_BODY).map(lambda text: [CHAT, text]),
    hostile(COMPLETION_BODY).map(lambda text: ["/v1/completions", text]),
    hostile(BATCH_BODY).map(lambda text: ["/v1/batches", text]),
)


@pytest.fixture(scope="module")
def file_id(http: Any) -> str:
    """A one-line batch file, for batch-creation bodies to name."""
    line = json.dumps({**OPENAI_LINE, "custom_id": "one"})
    return upload(http, line.encode())


@settings(_FUZZ, max_examples=EXAMPLES * 3)
@with_corpus("http")
@given(case=_BODIES)
def test_http_answers_any_body_cleanly(http: Any, file_id: str, case: list[str]) -> None:
    url, text = case
    body = encode(text.replace("FILE_ID", file_id))
    _answered(http.post(url, content=body, headers={"content-type": "application/json"}))


def _batch_file(
    path: Path, shape: dict[str, Any], bad: list[str]
) -> tuple[dict[int, str], set[int]]:
    """A file with a good line before, between and after the ``bad`` ones: the good
    lines' custom_ids by line number, and the bad lines' numbers."""
    good = {}
    lines = []
    for i, text in enumerate([*bad, ""]):
        cid = f"good-{i}"
        line = json.loads(json.dumps(shape))
        line["custom_id"] = cid
        lines.append(json.dumps(line))
        good[len(lines)] = cid
        if text:
            lines.append(text)
    path.write_bytes(b"\n".join(encode(line) for line in lines) + b"\n")
    return good, set(range(1, len(lines) + 1)) - good.keys()


def _line_of(result: dict[str, Any]) -> int | None:
    line = result.get("line")
    if line is None:  # an OpenAI-shaped result names no line; its custom_id may
        cid = result["custom_id"]
        line = int(cid[5:]) if cid.startswith("line-") else None
    return line


@settings(_FUZZ, max_examples=EXAMPLES)
@with_corpus("cli")
@given(
    shape=st.sampled_from(["kvmux", "openai"]),
    bad=st.lists(hostile(NATIVE_LINE) | _OPENAI_LINES, min_size=1, max_size=3),
)
def test_cli_submit_runs_every_good_line_beside_any_bad_one(
    daemon: DaemonProcess, tmp_path_factory: pytest.TempPathFactory, shape: str, bad: list[str]
) -> None:
    folder = tmp_path_factory.mktemp("cli")
    # Lines hold no raw line break: a JSON encoder escapes them, and splitting is bytes.
    bad = [text for text in bad if "\n" not in text and "\r" not in text and text.strip()]
    template = NATIVE_LINE if shape == "kvmux" else OPENAI_LINE
    good, bad_lines = _batch_file(folder / "in.jsonl", template, bad)
    out = folder / "out.jsonl"
    proc = kvmux(daemon, "submit", "--quiet", str(folder / "in.jsonl"), "--out", str(out))
    assert "Traceback" not in proc.stderr, proc.stderr
    assert proc.returncode in (OK, ITEMS_FAILED), proc.stderr
    event(f"exit {proc.returncode}")
    results = jsonl(out.read_text())
    by_id: dict[str, list[dict[str, Any]]] = {}
    for result in results:
        by_id.setdefault(result["custom_id"], []).append(result)
    for cid in good.values():
        (result,) = by_id.pop(cid)
        if shape == "kvmux":
            assert result["status"] == "ok", result
        else:
            assert result["error"] is None and result["response"]["status_code"] == 200, result
    # Each bad line has its results: one per choice it asked for, or its error.
    if shape == "kvmux":
        assert {r["line"] for r in results} == good.keys() | bad_lines, results
    else:
        assert len(results) >= len(good) + len(bad_lines), results
    for group in by_id.values():
        for result in group:
            error = result.get("error") or (result.get("response") or {}).get("body", {}).get(
                "error"
            )
            if error:
                assert "Traceback" not in error["message"]


@settings(_FUZZ, max_examples=EXAMPLES)
@with_corpus("batches")
@given(bad=st.lists(_OPENAI_LINES, min_size=1, max_size=3))
def test_batch_api_names_each_bad_line_or_runs_it(
    http: Any, tmp_path_factory: pytest.TempPathFactory, bad: list[str]
) -> None:
    folder = tmp_path_factory.mktemp("batch")
    bad = [text for text in bad if "\n" not in text and "\r" not in text and text.strip()]
    good, bad_lines = _batch_file(folder / "in.jsonl", OPENAI_LINE, bad)
    batch = run_batch(http, (folder / "in.jsonl").read_bytes())
    event(f"batch {batch['status']}")
    if batch["status"] == "failed":
        # OpenAI's validation: the file fails, naming each line that fails it.
        errors = batch["errors"]["data"]
        assert errors and all(e["line"] in bad_lines for e in errors), errors
        assert all(e["code"] != "internal" for e in errors), errors
        return
    assert batch["status"] == "completed", batch
    assert batch["request_counts"]["total"] == len(good) + len(bad_lines), batch
    output = http.get(f"/v1/files/{batch['output_file_id']}/content").text
    done = {r["custom_id"]: r for r in jsonl(output)}
    for cid in good.values():
        assert done[cid]["response"]["status_code"] == 200, done[cid]
