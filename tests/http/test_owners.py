"""Keys and owners over HTTP, against kvmuxd processes: a key acts as its owner; another
owner's files and batches are 404, exactly as ids that never existed; a key removed
from the file is refused after SIGHUP; beyond loopback without keys is refused."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import anyio
import pytest

from kvmux.daemon.config import EX_CONFIG, toml_config
from kvmux.daemon.http.keys import new_key

from .conftest import MODEL, httpx, openai, started
from .test_batches import CHAT, kvmux, requests_file, run_batch

pytestmark = pytest.mark.anyio


def sdk_for(url: str, key: str) -> Any:
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key=key, max_retries=0)


async def test_each_owner_sees_only_its_own_files_and_batches(
    tiny_model: Path, tmp_path: Path
) -> None:
    keys = tmp_path / "keys.toml"
    alice, bob = new_key(keys, "alice"), new_key(keys, "bob")
    root = new_key(keys, "root", operator=True)
    assert alice not in keys.read_text()  # only hashes are stored
    with started(tiny_model, {"http": {"api_keys": str(keys)}}) as daemon:
        url = daemon.http_url
        async with sdk_for(url, alice) as a, sdk_for(url, bob) as b, sdk_for(url, root) as op:
            batch = await run_batch(a, requests_file(tmp_path / "in.jsonl", 3))
            assert batch.status == "completed"
            for call, arg in (
                (b.files.retrieve, batch.input_file_id),
                (b.files.content, batch.input_file_id),
                (b.files.delete, batch.input_file_id),
                (b.files.content, batch.output_file_id),
                (b.batches.retrieve, batch.id),
                (b.batches.cancel, batch.id),
            ):
                with pytest.raises(openai.NotFoundError) as info:
                    await call(arg)
                # Word for word what an id that never existed gets.
                assert "never" not in info.value.message and arg in info.value.message
            with pytest.raises(openai.NotFoundError):  # nor can he batch alice's file
                await b.batches.create(
                    input_file_id=batch.input_file_id, endpoint=CHAT, completion_window="24h"
                )
            assert [f async for f in b.files.list()] == []
            assert [x async for x in b.batches.list()] == []
            # An operator sees everyone's; the owner still sees hers.
            assert batch.id in [x.id async for x in op.batches.list()]
            assert (await a.files.retrieve(batch.input_file_id)).id == batch.input_file_id
            # Alice's batch is alice's job: the socket's anonymous owner does not see it.
            listed = await kvmux(daemon, "jobs", "--json")
            assert f"batch {batch.id}" not in listed

            # Keys: none, a wrong one, and one removed from the file then SIGHUP.
            async with httpx.AsyncClient(base_url=url) as raw:
                assert (await raw.get("/health")).status_code == 200  # no key needed
                resp = await raw.get("/v1/models")
                assert resp.status_code == 401 and resp.json()["error"]["code"] == "invalid_api_key"
            async with sdk_for(url, "kvx-wrong") as wrong:
                with pytest.raises(openai.AuthenticationError):
                    await wrong.models.list()
            assert [m.id for m in (await b.models.list()).data] == [MODEL]
            text = keys.read_text()
            entries = text.split("[[key]]")
            keys.write_text("[[key]]".join(e for e in entries if '"bob"' not in e))
            daemon.proc.send_signal(signal.SIGHUP)
            with anyio.fail_after(10):
                while len(list(daemon.events("api_keys_loaded"))) < 1:
                    await anyio.sleep(0.05)
            with pytest.raises(openai.AuthenticationError):
                await b.models.list()
            assert [m.id for m in (await a.models.list()).data] == [MODEL]


def test_beyond_loopback_without_keys_is_refused_at_start(tmp_path: Path, tiny_model: Path) -> None:
    cfg = tmp_path / "kvmuxd.toml"
    keys = tmp_path / "keys.toml"
    new_key(keys, "alice")
    base = {"model": {"path": str(tiny_model)}, "server": {"endpoint": f"ipc://{tmp_path}/k.sock"}}
    for http, code in (
        ({"listen": "0.0.0.0:8123"}, EX_CONFIG),
        ({"listen": "0.0.0.0:8123", "api_keys": str(keys)}, 0),
    ):
        cfg.write_text(toml_config({**base, "http": http}))
        proc = subprocess.run(
            [sys.executable, "-m", "kvmux.daemon", "--config", str(cfg), "--check-config"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert proc.returncode == code, proc.stderr
        if code:
            assert "http.listen" in proc.stderr and "api_keys" in proc.stderr
