"""The Files and Batch API through the real ``openai`` SDK against a kvmuxd process: the
whole workflow, its output against ``kvmux submit`` of the same file, validation,
cancel, listing with pagination, and the batch as a kvmux job."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest

from bench.bench_daemon import DaemonProcess

from .conftest import MODEL, openai, started

pytestmark = pytest.mark.anyio

CHAT = "/v1/chat/completions"
TERMINAL = {"completed", "failed", "cancelled", "expired"}


def batch_line(cid: str, body: dict[str, Any], url: str = CHAT) -> bytes:
    return msgspec.json.encode({"custom_id": cid, "method": "POST", "url": url, "body": body})


def requests_file(path: Path, n: int, max_tokens: int = 12, bad: tuple[int, ...] = ()) -> Path:
    """``n`` chat requests, greedy and seeded in turn; the lines in ``bad`` ask for the legacy
    ``functions`` (valid lines kvmux refuses: that line's error, not the file's)."""
    lines = []
    for i in range(n):
        body: dict[str, Any] = {
            "model": MODEL,
            "messages": [{"role": "user", "content": f"request number {i}"}],
            "max_tokens": max_tokens,
        }
        if i % 2:
            body.update(temperature=0.8, seed=100 + i)
        if i in bad:
            body["functions"] = [{"name": "f"}]
        lines.append(batch_line(f"req-{i}", body))
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


async def start_batch(sdk: Any, path: Path, **extra: Any) -> Any:
    """Upload ``path`` and create a batch of it, as OpenAI's guide does."""
    with path.open("rb") as f:
        upload = await sdk.files.create(file=f, purpose="batch")
    batch = await sdk.batches.create(
        input_file_id=upload.id, endpoint=CHAT, completion_window="24h", **extra
    )
    assert batch.status == "validating" and batch.input_file_id == upload.id
    return batch


async def run_batch(sdk: Any, path: Path, **extra: Any) -> Any:
    return await wait_done(sdk, (await start_batch(sdk, path, **extra)).id)


async def wait_completed(sdk: Any, batch_id: str, n: int, timeout: float) -> None:
    """Until at least ``n`` of the batch's requests have completed."""
    with anyio.fail_after(timeout):
        while (await sdk.batches.retrieve(batch_id)).request_counts.completed < n:
            await anyio.sleep(0.02)


async def wait_done(sdk: Any, batch_id: str, timeout: float = 90.0) -> Any:
    with anyio.fail_after(timeout):
        while (batch := await sdk.batches.retrieve(batch_id)).status not in TERMINAL:
            await anyio.sleep(0.1)
    return batch


async def lines_of(sdk: Any, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    content = await sdk.files.content(file_id)
    return [msgspec.json.decode(line) for line in content.read().splitlines()]


def answers(lines: list[dict[str, Any]]) -> dict[str, Any]:
    """custom_id -> each choice's text (or the error's code), as a batch output holds it."""
    out: dict[str, Any] = {}
    for obj in lines:
        assert obj["custom_id"] not in out, f"{obj['custom_id']} twice"
        response = obj["response"]
        if response is None:
            out[obj["custom_id"]] = obj["error"]["code"]
        elif "choices" in response["body"]:
            out[obj["custom_id"]] = [c["message"]["content"] for c in response["body"]["choices"]]
        else:
            out[obj["custom_id"]] = response["body"]["error"]["code"]
    return out


async def kvmux(daemon: DaemonProcess, *args: str) -> str:
    done = await anyio.run_process(
        [sys.executable, "-m", "kvmux.client.cli", *args],
        env={**os.environ, "KVMUX_ENDPOINT": daemon.endpoint},
        check=False,
    )
    assert done.returncode in (0, 2), done.stderr.decode()
    return done.stdout.decode()


async def test_a_batch_runs_its_file_as_kvmux_submit_does_and_is_a_kvmux_job(
    sdk: Any, daemon: DaemonProcess, tmp_path: Path
) -> None:
    path = requests_file(tmp_path / "in.jsonl", 30, bad=(7,))
    batch = await run_batch(sdk, path, metadata={"team": "qa"})
    assert batch.status == "completed", batch
    assert (batch.request_counts.total, batch.request_counts.completed) == (30, 29)
    assert batch.request_counts.failed == 1 and batch.metadata == {"team": "qa"}
    assert batch.completed_at >= batch.in_progress_at >= batch.created_at
    assert 0 < batch.usage.output_tokens <= 29 * 12  # some stop early, at end of sequence
    output = await lines_of(sdk, batch.output_file_id)
    errors = await lines_of(sdk, batch.error_file_id)
    got = answers(output) | answers(errors)
    assert sorted(got) == sorted(f"req-{i}" for i in range(30))  # each line exactly once
    assert got["req-7"] == "invalid_request"

    out, err = tmp_path / "out.jsonl", tmp_path / "err.jsonl"
    await kvmux(daemon, "submit", str(path), "--out", str(out), "--errors", str(err), "-q")
    cli = [msgspec.json.decode(x) for x in (out.read_bytes() + err.read_bytes()).splitlines()]
    assert answers(cli) == got  # the same writer: the same lines, token for token

    # The batch is a kvmux job of its owner's: `kvmux jobs` and `kvmux results` show it.
    jobs = [
        msgspec.json.decode(line) for line in (await kvmux(daemon, "jobs", "--json")).splitlines()
    ]
    (job,) = [j for j in jobs if j["name"] == f"batch {batch.id}"]
    assert (job["state"], job["total"], job["ok"]) == ("done", 30, 29)
    results = await kvmux(daemon, "results", job["job_id"], "--format", "openai", "-q")
    assert answers([msgspec.json.decode(x) for x in results.splitlines()]) == got


async def test_a_file_that_fails_validation_fails_the_batch_naming_each_line(
    sdk: Any, tmp_path: Path
) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
    path = tmp_path / "bad.jsonl"
    path.write_bytes(
        b"\n".join(
            [
                batch_line("a", body),
                batch_line("b", body, url="/v1/completions"),  # not the batch's endpoint
                batch_line("a", body),  # a custom_id used twice
                b"{not json",
                msgspec.json.encode({"method": "POST", "url": CHAT, "body": body}),
                batch_line("c", body),
            ]
        )
    )
    batch = await run_batch(sdk, path)
    assert batch.status == "failed" and batch.failed_at is not None
    assert [(e.line, e.code) for e in batch.errors.data] == [
        (2, "mismatched_endpoint"),
        (3, "duplicate_custom_id"),
        (4, "invalid_json_line"),
        (5, "missing_custom_id"),
    ]
    assert batch.output_file_id is None and batch.request_counts.completed == 0


async def test_a_cancelled_batch_keeps_what_finished_and_names_the_rest(
    sdk: Any, tmp_path: Path
) -> None:
    path = requests_file(tmp_path / "long.jsonl", 60, max_tokens=400)
    batch = await start_batch(sdk, path)
    await wait_completed(sdk, batch.id, 3, timeout=30)
    cancelling = await sdk.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled")
    batch = await wait_done(sdk, batch.id)
    assert batch.status == "cancelled" and batch.cancelled_at is not None
    got = answers(await lines_of(sdk, batch.output_file_id)) | answers(
        await lines_of(sdk, batch.error_file_id)
    )
    assert sorted(got) == sorted(f"req-{i}" for i in range(60))
    done = [cid for cid, v in got.items() if isinstance(v, list)]
    stopped = [cid for cid, v in got.items() if v == "batch_cancelled"]
    assert len(done) >= 3 and stopped and len(done) + len(stopped) == 60
    with pytest.raises(openai.BadRequestError):
        await sdk.batches.cancel((await run_batch(sdk, requests_file(tmp_path / "s", 1))).id)


async def test_files_and_batches_list_a_page_at_a_time_and_a_file_deletes(
    sdk: Any, tmp_path: Path
) -> None:
    made = [(await run_batch(sdk, requests_file(tmp_path / f"{i}.jsonl", 2))).id for i in range(3)]
    first = await sdk.batches.list(limit=2)
    assert len(first.data) == 2 and first.has_more
    listed = [b.id async for b in sdk.batches.list(limit=1)]  # the SDK follows `after`
    assert len(listed) == len(set(listed)) and set(made) <= set(listed)
    assert listed.index(made[2]) < listed.index(made[1]) < listed.index(made[0])  # newest first

    files = [f async for f in sdk.files.list()]
    assert {f.purpose for f in files} >= {"batch", "batch_output"}
    victim = next(f for f in files if f.purpose == "batch")
    assert (await sdk.files.retrieve(victim.id)).bytes == victim.bytes
    deleted = await sdk.files.delete(victim.id)
    assert deleted.deleted and deleted.id == victim.id
    for call in (sdk.files.retrieve, sdk.files.content, sdk.files.delete):
        with pytest.raises(openai.NotFoundError):
            await call(victim.id)


async def test_what_a_batch_cannot_be_is_refused(sdk: Any, tmp_path: Path) -> None:
    with (tmp_path / "f.jsonl").open("wb") as f:
        f.write(batch_line("a", {"model": MODEL, "messages": []}))
    with (tmp_path / "f.jsonl").open("rb") as f:
        upload = await sdk.files.create(file=f, purpose="batch")
    with pytest.raises(openai.BadRequestError, match="embeddings"):
        await sdk.batches.create(
            input_file_id=upload.id, endpoint="/v1/embeddings", completion_window="24h"
        )
    with pytest.raises(openai.BadRequestError, match="24h"):
        await sdk.batches.create(input_file_id=upload.id, endpoint=CHAT, completion_window="1h")
    with pytest.raises(openai.NotFoundError):
        await sdk.batches.create(input_file_id="file-nope", endpoint=CHAT, completion_window="24h")
    with pytest.raises(openai.BadRequestError, match="purpose"):
        await sdk.files.create(file=("x.jsonl", b"{}"), purpose="fine-tune")


async def test_a_batch_feeds_its_job_within_max_job_items_however_many_choices(
    tiny_model: Path, tmp_path: Path
) -> None:
    """10 lines of n = 3 are 30 items: more than one message may carry where
    scheduler.max_job_items is 8, so the batch feeds them in several, never failing."""
    path = tmp_path / "choices.jsonl"
    body = {"model": MODEL, "max_tokens": 4, "n": 3, "temperature": 0.5, "seed": 1}
    lines = [
        batch_line(f"c{i}", {**body, "messages": [{"role": "user", "content": f"q {i}"}]})
        for i in range(10)
    ]
    path.write_bytes(b"\n".join(lines) + b"\n")
    with started(tiny_model, {"scheduler": {"max_job_items": 8}}) as daemon:
        async with openai.AsyncOpenAI(base_url=daemon.http_url + "/v1", api_key="-") as sdk:
            batch = await run_batch(sdk, path)
            assert batch.status == "completed", batch
            assert (batch.request_counts.completed, batch.request_counts.failed) == (10, 0)
            got = answers(await lines_of(sdk, batch.output_file_id))
            assert sorted(got) == sorted(f"c{i}" for i in range(10))
            assert all(len(choices) == 3 for choices in got.values())
