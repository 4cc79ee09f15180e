"""A real kvmuxd in the test's task group, on a real ipc socket, serving the tiny model."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest

from kvmux.client import Client
from kvmux.daemon.app import Daemon
from kvmux.daemon.config import Config
from kvmux.daemon.engine import Engine, EngineOptions

PREFILL_CHUNK = 16


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def sock_dir() -> Iterator[Path]:
    # ipc paths are limited to ~107 bytes; pytest's tmp_path can be longer.
    path = Path(tempfile.mkdtemp(prefix="kvx-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def reference(tiny_model: Path) -> Engine:
    """The same model in-process, one big buffer: what "decoded alone" means."""
    return Engine(
        tiny_model,
        EngineOptions(min_bucket=256, intra_op_threads=1, prefill_chunk=PREFILL_CHUNK),
    )


def make_config(model: Path, sock_dir: Path, **tables: dict[str, Any]) -> Config:
    """A test config: tiny model, 1 thread, small buckets so sessions grow; overrides per table."""
    base: dict[str, dict[str, Any]] = {
        "model": {"path": str(model), "intra_op_threads": 1},
        "server": {
            "endpoint": f"ipc://{sock_dir}/kvmuxd.sock",
            "heartbeat_interval": 0.2,
            "client_timeout": 1.0,
        },
        "kv": {"min_bucket": 4},
        "scheduler": {"prefill_chunk": PREFILL_CHUNK},
        "shutdown": {"grace": 1.0},
        # Memory-only unless a test is about the journal: tests stay independent.
        "jobs": {"journal": ""},
    }
    for name, values in tables.items():
        base.setdefault(name, {}).update(values)
    return msgspec.convert(base, Config)


@asynccontextmanager
async def running(config: Config, **kwargs: Any) -> AsyncIterator[Daemon]:
    """Serve ``config`` until the block ends, then stop (drain) and wait for the exit."""
    daemon = Daemon(config, **kwargs)
    async with anyio.create_task_group() as tg:
        await tg.start(daemon.serve)
        try:
            yield daemon
        finally:
            daemon.stop()


@asynccontextmanager
async def connected(daemon: Daemon, **kwargs: Any) -> AsyncIterator[Client]:
    async with Client(daemon.endpoint, timeout=10.0, **kwargs) as client:
        yield client
