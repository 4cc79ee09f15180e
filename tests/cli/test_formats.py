"""Output shapes: kvmux's lines and OpenAI's batch output lines, from real daemon results.

The example lines of OpenAI's Batch guide and vLLM's ``run-batch`` docs (in
``examples/``) parse into the expected items, and run through ``kvmux submit``
against a real ``kvmuxd`` come back in the shape OpenAI's tools read:
``r["response"]["body"]["choices"][0]["text"]`` (or ``["message"]["content"]``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec
import pytest

from kvmux.client import Item
from kvmux.client import protocol as p
from kvmux.client.cli.batch import BatchReader, LineError, read_batch
from kvmux.client.cli.results import ResultSink
from kvmux.client.openai import is_rejected
from kvmux.daemon.engine import Engine, EngineOptions

from .conftest import Kvmuxd

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
SYSTEM = p.ChatMessage(role="system", content="You are a helpful assistant.")
UNHELPFUL = p.ChatMessage(role="system", content="You are an unhelpful assistant.")
HELLO = p.ChatMessage(role="user", content="Hello world!")


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(raw) for raw in path.read_text().splitlines()]


def test_the_guides_chat_lines_parse_into_chat_items() -> None:
    batch = read_batch((EXAMPLES / "openai-chat.jsonl").read_bytes().splitlines())
    assert batch.openai is True and not batch.errors
    assert batch.items == [
        Item(custom_id="request-1", messages=[SYSTEM, HELLO], max_new_tokens=1000, line=1),
        Item(custom_id="request-2", messages=[UNHELPFUL, HELLO], max_new_tokens=1000, line=2),
        # vLLM's run-batch example: max_completion_tokens, the newer name.
        Item(custom_id="request-3", messages=[SYSTEM, HELLO], max_new_tokens=1000, line=3),
    ]


def test_the_completions_lines_parse_with_choices_in_openais_order() -> None:
    batch = read_batch((EXAMPLES / "openai-completions.jsonl").read_bytes().splitlines())
    assert batch.openai is True and not batch.errors
    first, *listed, last = batch.items
    assert first == Item(
        custom_id="request-1",
        prompt="Say this is a test",
        max_new_tokens=7,
        temperature=0.0,
        line=1,
    )
    # Two prompts times n=2: choice = prompt index * n + j, seed s + j.
    assert [(i.prompt, i.choice, i.choices, i.n, i.seed) for i in listed] == [
        ("Once upon a time", 0, 4, 2, 1),
        ("Once upon a time", 1, 4, 2, 2),
        ("The capital of France is", 2, 4, 2, 1),
        ("The capital of France is", 3, 4, 2, 2),
    ]
    assert {(i.custom_id, i.line) for i in listed} == {("request-2", 2)}
    assert last.max_new_tokens == 10 and last.logprobs == 2  # 10.0 taken as 10
    # The reader's own checks are the wire's: what it yields passes check_item as is.
    assert all(p.check_item(item) == item for item in batch.items)


def test_chat_content_parts_flatten_and_other_parts_are_refused() -> None:
    def chat(content: Any, **body: Any) -> bytes:
        return json.dumps(
            {
                "custom_id": "c",
                "url": "/v1/chat/completions",
                "body": {"messages": [{"role": "developer", "content": content}], **body},
            }
        ).encode()

    (item,) = read_batch(
        [chat([{"type": "text", "text": "a"}, {"type": "text", "text": "b"}], logprobs=True)]
    ).items
    assert item.messages == [p.ChatMessage(role="developer", content="a\nb")]
    assert item.logprobs == 0 and item.max_new_tokens is None
    for raw, reason in [
        (chat([{"type": "image_url", "image_url": {"url": "x"}}]), "image_url part"),
        (chat("x", max_tokens=1, max_completion_tokens=1), "not both"),
        (chat("x", top_logprobs=2), "needs `body.logprobs`: true"),
        (chat("x", tools=[{"type": "function"}]), "function must be an object"),
        (chat("x", response_format={"type": "xml"}), "text, json_object or json_schema"),
    ]:
        (err,) = read_batch([raw]).errors
        assert reason in err.reason, err.reason
    assert read_batch([chat("x", response_format={"type": "text"})]).items
    (constrained,) = read_batch([chat("x", response_format={"type": "json_object"})]).items
    assert constrained.structured_outputs == p.StructuredOutputs(json_object=True)


def test_bom_crlf_and_duplicate_custom_ids() -> None:
    lines = [
        b'\xef\xbb\xbf{"custom_id": "a", "prompt": "x"}\r\n',
        b"\r\n",
        b'{"custom_id": "b", "prompt": "y"}\r\n',
        b'{"custom_id": "a", "prompt": "z"}\r\n',
    ]
    reader = BatchReader(lines)
    entries = list(reader)
    assert [e.custom_id for e in entries if isinstance(e, Item)] == ["a", "b"]
    (dup,) = [e for e in entries if isinstance(e, LineError)]
    assert dup.line == 4 and "already used by line 1" in dup.reason
    assert reader.openai is False and reader.items == 2 and reader.errors == 1


def test_resume_skip_set_leaves_lines_out_but_not_duplicates() -> None:
    lines = [
        b'{"custom_id": "a", "prompt": "x"}',
        b'{"custom_id": "b", "prompt": "y"}',
        b'{"custom_id": "a", "prompt": "z"}',
    ]
    reader = BatchReader(lines, {"a"})
    entries = list(reader)
    assert [e.custom_id for e in entries] == ["b", "a"]
    assert isinstance(entries[1], LineError) and reader.skipped == 1


def result(**fields: Any) -> p.ItemResult:
    base: dict[str, Any] = {"index": 0, "custom_id": "r", "status": "ok", "line": 1}
    return msgspec.convert({**base, **fields}, p.ItemResult)


def collect(fmt: str) -> tuple[ResultSink, list[dict[str, Any]], list[dict[str, Any]]]:
    out: list[dict[str, Any]] = []
    errors: list[dict[str, Any]] = []
    sink = ResultSink(
        "openai" if fmt == "openai" else "kvmux",
        lambda b: out.append(json.loads(b)),
        lambda b: errors.append(json.loads(b)),
        model="tiny",
    )
    return sink, out, errors


def test_openai_lines_gather_every_choice_of_a_line() -> None:
    sink, out, errors = collect("openai")
    usage = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    sink.result(result(choice=1, choices=2, text="B", finish_reason="length", usage=usage))
    assert out == [] and sink.pending == 1
    sink.result(result(choice=0, choices=2, text="A", finish_reason="stop", usage=usage))
    (line,) = out
    assert sink.pending == 0 and errors == []
    body = line["response"]["body"]
    assert line["id"].startswith("batch_req_") and line["error"] is None
    assert line["response"]["status_code"] == 200
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    assert body["model"] == "tiny" and isinstance(body["created"], int)
    assert [(c["index"], c["text"], c["finish_reason"]) for c in body["choices"]] == [
        (0, "A", "stop"),
        (1, "B", "length"),
    ]
    # Two prompts (n=1): each prompt counted.
    assert body["usage"] == {
        "prompt_tokens": 6,
        "completion_tokens": 4,
        "total_tokens": 10,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    # A job that ended without some choice of a line still writes what it has.
    sink.result(result(custom_id="s", choice=0, choices=3, text="C", usage=usage))
    assert len(out) == 1
    sink.flush()
    assert [c["text"] for c in out[1]["response"]["body"]["choices"]] == ["C"]


def test_openai_usage_counts_a_prompt_once_for_its_n_choices() -> None:
    """As OpenAI counts them: two prompts of 3 and 5 tokens, n=2 each, are 8 prompt tokens."""
    sink, out, _ = collect("openai")
    for choice, prompt_tokens in [(0, 3), (1, 3), (2, 5), (3, 5)]:
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": 2, "total_tokens": 0}
        sink.result(result(choice=choice, choices=4, n=2, text=str(choice), usage=usage))
    (line,) = out
    body = line["response"]["body"]
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert body["usage"] == {
        "prompt_tokens": 8,
        "completion_tokens": 8,
        "total_tokens": 16,
        "prompt_tokens_details": {"cached_tokens": 0},
    }


def test_openai_usage_counts_a_prompts_cached_tokens_once() -> None:
    """``prompt_tokens_details.cached_tokens``, as OpenAI reports it: the prompt tokens none
    of a prompt's choices prefilled. The first of n choices prefills what the next copy."""
    sink, out, _ = collect("openai")
    for choice, cached in [(0, 0), (1, 40), (2, 32), (3, 41)]:
        usage = {
            "prompt_tokens": 42,
            "completion_tokens": 2,
            "total_tokens": 44,
            "cached_tokens": cached,
        }
        sink.result(result(choice=choice, choices=4, n=2, text=str(choice), usage=usage))
    (line,) = out
    usage = line["response"]["body"]["usage"]
    assert usage["prompt_tokens"] == 84 and usage["prompt_tokens_details"] == {"cached_tokens": 32}


def test_openai_chat_body_and_logprobs_shapes() -> None:
    sink, out, _ = collect("openai")
    steps = [
        p.TokenLogprob(5, "Hi", -0.5, [p.TopLogprob(5, "Hi", -0.5), p.TopLogprob(6, "Yo", -1.0)])
    ]
    usage = {"prompt_tokens": 4, "completion_tokens": 1, "total_tokens": 5}
    sink.result(result(text="Hi", chat=True, logprobs=steps, finish_reason="stop", usage=usage))
    body = out[0]["response"]["body"]
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    (choice,) = body["choices"]
    assert choice["message"] == {"role": "assistant", "content": "Hi"}
    (step,) = choice["logprobs"]["content"]
    assert step["token"] == "Hi" and step["bytes"] == [72, 105]
    assert [t["token"] for t in step["top_logprobs"]] == ["Hi", "Yo"]

    sink, out, _ = collect("openai")
    sink.result(result(text="Hi", logprobs=steps, usage=usage))
    lp = out[0]["response"]["body"]["choices"][0]["logprobs"]
    assert lp == {
        "tokens": ["Hi"],
        "token_logprobs": [-0.5],
        "top_logprobs": [{"Hi": -0.5, "Yo": -1.0}],
        "text_offset": [0],
    }


def test_failures_as_openai_writes_them_go_to_the_error_file() -> None:
    sink, out, errors = collect("openai")
    failed = p.ErrorInfo("kv_capacity_exceeded", "too long", {})
    sink.result(result(status="error", error=failed, text="par"))
    rejected = p.ErrorInfo("bad_request", "line 2: nope", {"line": 2, "reason": "nope"})
    refused = result(index=1, custom_id="q", status="error", error=rejected, line=2)
    assert is_rejected(refused)
    sink.result(refused)
    sink.refused(LineError(3, "not valid JSON", "z"))
    stopped = p.ErrorInfo("cancelled", "job cancelled", {})
    sink.result(result(index=2, custom_id="k", status="error", error=stopped, text="par", line=4))
    assert out == []
    ran, never, local, cancelled = errors
    assert cancelled["response"] is None and cancelled["error"]["code"] == "batch_cancelled"
    assert ran["response"]["status_code"] == 400 and ran["error"] is None
    assert ran["response"]["body"]["error"]["code"] == "kv_capacity_exceeded"
    assert never["response"] is None and never["error"]["message"] == "line 2: nope"
    assert local["custom_id"] == "z" and local["error"]["message"] == "line 3: not valid JSON"


def test_kvmux_lines_carry_line_choice_message_and_logprobs() -> None:
    sink, out, errors = collect("kvmux")
    steps = [p.TokenLogprob(5, "Hi", -0.5, [])]
    sink.result(result(text="Hi", chat=True, logprobs=steps, choice=1, choices=2, line=4))
    (line,) = out
    assert line["line"] == 4 and (line["choice"], line["choices"]) == (1, 2)
    assert line["message"] == {"role": "assistant", "content": "Hi"}
    assert line["logprobs"] == [{"token_id": 5, "token": "Hi", "logprob": -0.5, "top": []}]
    sink.refused(LineError(2, "bad"))
    assert errors[0]["status"] == "error" and errors[0]["line"] == 2


def test_openai_completions_through_a_real_daemon(
    kvmuxd: Kvmuxd, tmp_path: Path, tiny_model: Path
) -> None:
    out = tmp_path / "out.jsonl"
    done = kvmuxd.run("submit", str(EXAMPLES / "openai-completions.jsonl"), "--out", str(out), "-q")
    assert done.returncode == 0, done.stderr
    lines = {r["custom_id"]: r for r in read_jsonl(out)}
    assert sorted(lines) == ["request-1", "request-2", "request-3"]
    for r in lines.values():
        assert r["response"]["status_code"] == 200 and r["error"] is None
        assert isinstance(r["response"]["body"]["choices"][0]["text"], str)
    choices = lines["request-2"]["response"]["body"]["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    # Two prompts, n=2: each prompt's tokens counted once, as OpenAI does.
    engine = Engine(tiny_model, EngineOptions(intra_op_threads=1))
    prompts = ["Once upon a time", "The capital of France is"]
    usage = lines["request-2"]["response"]["body"]["usage"]
    assert usage["prompt_tokens"] == sum(len(engine.encode(text)) for text in prompts)
    # Each prompt's second choice copied the first one's prefill: nothing came from a cache.
    assert usage["prompt_tokens_details"] == {"cached_tokens": 0}
    first = lines["request-1"]["response"]["body"]
    assert first["choices"][0]["finish_reason"] in ("stop", "length")
    assert first["usage"]["completion_tokens"] <= 7
    logprobs = lines["request-3"]["response"]["body"]["choices"][0]["logprobs"]
    assert len(logprobs["tokens"]) == len(logprobs["token_logprobs"]) >= 1


def test_openai_chat_through_a_real_daemon(kvmuxd: Kvmuxd, tmp_path: Path) -> None:
    out = tmp_path / "out.jsonl"
    done = kvmuxd.run("submit", str(EXAMPLES / "openai-chat.jsonl"), "--out", str(out), "-q")
    assert done.returncode == 0, done.stderr
    rows = read_jsonl(out)
    assert sorted(r["custom_id"] for r in rows) == ["request-1", "request-2", "request-3"]
    for r in rows:
        body = r["response"]["body"]
        assert body["object"] == "chat.completion"
        assert isinstance(body["choices"][0]["message"]["content"], str)
        assert body["choices"][0]["message"]["role"] == "assistant"


def test_format_override_and_error_file(kvmuxd: Kvmuxd, tmp_path: Path) -> None:
    src = tmp_path / "in.jsonl"
    src.write_text(
        '{"custom_id": "ok", "prompt": "hi", "max_tokens": 2}\n'
        '{"custom_id": "bad", "prompt": "hi", "top_p": 7}\n'
    )
    out, errs = tmp_path / "out.jsonl", tmp_path / "errors.jsonl"
    done = kvmuxd.run(
        "submit", str(src), "--out", str(out), "--errors", str(errs), "--format", "openai", "-q"
    )
    assert done.returncode == 2, done.stderr
    (ok,) = read_jsonl(out)
    assert ok["custom_id"] == "ok" and ok["response"]["body"]["object"] == "text_completion"
    (bad,) = read_jsonl(errs)
    assert (
        bad["custom_id"] == "bad"
        and bad["response"] is None
        and "`top_p`" in bad["error"]["message"]
    )


@pytest.mark.parametrize("content", ["\n", '{"prompt": 1}\n{"nope": 2}\n'])
def test_a_file_where_nothing_parsed_exits_1(kvmuxd: Kvmuxd, tmp_path: Path, content: str) -> None:
    src = tmp_path / "in.jsonl"
    src.write_text(content)
    done = kvmuxd.run("submit", str(src), "-q")
    assert done.returncode == 1, done.stderr


def test_endpoint_normalization() -> None:
    from kvmux.client.endpoint import normalize_endpoint

    assert normalize_endpoint("/run/k.sock") == "ipc:///run/k.sock"
    assert normalize_endpoint("localhost:5555") == "tcp://localhost:5555"
    assert normalize_endpoint("10.0.0.1:1") == "tcp://10.0.0.1:1"
    assert normalize_endpoint("tcp://h:1") == "tcp://h:1"
    for bad in ("localhost", "ftp://x", "a b:1"):
        with pytest.raises(ValueError, match=r"ipc:///path/to/kvmuxd\.sock"):
            normalize_endpoint(bad)


def test_results_of_a_detached_openai_job_keep_its_format_and_refused_lines(
    kvmuxd: Kvmuxd, tmp_path: Path
) -> None:
    src = tmp_path / "in.jsonl"
    good = {"url": "/v1/completions", "method": "POST", "body": {"prompt": "hi", "max_tokens": 2}}
    src.write_text(
        json.dumps({"custom_id": "a", **good})
        + "\n"
        + json.dumps({"custom_id": "b", "url": "/v1/embeddings", "body": {"input": "x"}})
        + "\n"
    )
    sent = kvmuxd.run("submit", str(src), "--detach", "-q")
    assert sent.returncode == 2, sent.stderr  # one line refused
    out = tmp_path / "out.jsonl"
    got = kvmuxd.run("results", sent.stdout.strip(), "--out", str(out), "-q")
    assert got.returncode == 2, got.stderr
    lines = {r["custom_id"]: r for r in read_jsonl(out)}
    assert lines["a"]["response"]["body"]["object"] == "text_completion"
    assert lines["b"]["response"] is None
    assert "computes no embeddings" in lines["b"]["error"]["message"]
    again = kvmuxd.run("results", sent.stdout.strip(), "--format", "kvmux", "-q")
    assert {json.loads(x)["status"] for x in again.stdout.splitlines()} == {"ok", "error"}
