"""A real kvmuxd process with its HTTP front on a loopback port, and the real
``openai`` SDK (and ``httpx`` for what the SDK never sends) pointed at it."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import anyio.from_thread
import pytest

from bench.bench_daemon import DaemonProcess, kvmuxd

openai = pytest.importorskip("openai", reason="the HTTP tests drive kvmuxd with the openai SDK")
httpx = pytest.importorskip("httpx", reason="the HTTP tests send raw requests with httpx")

MODEL = "tiny"


def http_tables(extra: dict[str, dict[str, Any]] | None = None) -> dict[str, dict[str, Any]]:
    """A test daemon's config: HTTP on a free loopback port, the model named ``tiny``."""
    tables: dict[str, dict[str, Any]] = {
        "http": {"listen": "127.0.0.1:0", "served_model_names": [MODEL]},
        "kv": {"min_bucket": 8},
        "scheduler": {"prefill_chunk": 16},
        "server": {"heartbeat_interval": 0.2, "client_timeout": 2.0},
        "shutdown": {"grace": 1.0},
    }
    for table, values in (extra or {}).items():
        tables.setdefault(table, {}).update(values)
    return tables


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def started(
    model: Path,
    tables: dict[str, dict[str, Any]] | None = None,
    env: dict[str, str] | None = None,
) -> Iterator[DaemonProcess]:
    """``bench.bench_daemon.kvmuxd`` (the one daemon-as-a-process harness), held open from
    synchronous code: tests of one module share the daemon. Its socket is loopback tcp,
    where every client is ``anonymous``: the owner HTTP requests without keys have too."""
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    run = kvmuxd(model, threads=1, tables=http_tables(tables), env=env, endpoint=endpoint)
    with (
        anyio.from_thread.start_blocking_portal() as portal,
        portal.wrap_async_context_manager(run) as d,
    ):
        yield d


@pytest.fixture(scope="module")
def daemon(tiny_model: Path) -> Iterator[DaemonProcess]:
    with started(tiny_model) as d:
        yield d


@pytest.fixture
async def sdk(daemon: DaemonProcess) -> AsyncIterator[Any]:
    async with openai.AsyncOpenAI(base_url=daemon.http_url + "/v1", api_key="none") as client:
        yield client


@pytest.fixture
async def raw(daemon: DaemonProcess) -> AsyncIterator[Any]:
    async with httpx.AsyncClient(base_url=daemon.http_url, timeout=30.0) as client:
        yield client
