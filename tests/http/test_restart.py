"""A batch whose daemon is SIGKILLed midway completes after a restart: the files and the
batch come back from the journal, the job goes on where it was, and the output holds
every line once, with the tokens of an uninterrupted run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from .conftest import openai, started
from .test_batches import (
    CHAT,
    answers,
    lines_of,
    requests_file,
    start_batch,
    wait_completed,
    wait_done,
)

pytestmark = pytest.mark.anyio


async def test_a_batch_survives_a_sigkill_and_writes_each_line_once(
    tiny_model: Path, tmp_path: Path
) -> None:
    tables: dict[str, dict[str, Any]] = {
        "jobs": {"journal": str(tmp_path / "jobs.sqlite3")},
        "scheduler": {"max_active_sessions": 2},
    }
    path = requests_file(tmp_path / "in.jsonl", 60, max_tokens=48)
    with started(tiny_model, tables) as first:
        async with openai.AsyncOpenAI(base_url=first.http_url + "/v1", api_key="-") as sdk:
            batch = await start_batch(sdk, path)
            await wait_completed(sdk, batch.id, 10, timeout=60)
        first.proc.kill()  # SIGKILL: no drain, no goodbye
        first.proc.wait()
    with started(tiny_model, tables) as second:
        replayed = next(second.events("journal_replayed"))
        assert replayed["items_queued"] > 0  # it was killed mid-run
        async with openai.AsyncOpenAI(base_url=second.http_url + "/v1", api_key="-") as sdk:
            done = await wait_done(sdk, batch.id)
            assert done.status == "completed", done
            assert (done.request_counts.completed, done.request_counts.failed) == (60, 0)
            got = answers(await lines_of(sdk, done.output_file_id))
            assert sorted(got) == sorted(f"req-{i}" for i in range(60))  # each exactly once
            assert done.error_file_id is None
            # The same file, uninterrupted, on the same daemon: the same tokens.
            again = await sdk.batches.create(
                input_file_id=batch.input_file_id, endpoint=CHAT, completion_window="24h"
            )
            again = await wait_done(sdk, again.id)
            assert answers(await lines_of(sdk, again.output_file_id)) == got
            assert (await sdk.files.retrieve(batch.input_file_id)).bytes == path.stat().st_size
