"""The HTTP front's connections, seen from inside a daemon in the test's loop."""

from __future__ import annotations

import socket
import tempfile
from pathlib import Path

import pytest

from tests.daemon.conftest import make_config, running

from .conftest import MODEL, httpx

pytestmark = pytest.mark.anyio


async def test_connections_send_without_nagle(tiny_model: Path) -> None:
    """A stream is many small writes: with Nagle's algorithm each waited for the
    reader's delayed ACK (40 ms a chunk, measured before this was set)."""
    folder = Path(tempfile.mkdtemp(prefix="kvx-", dir="/tmp"))
    http = {"listen": "127.0.0.1:0", "served_model_names": [MODEL]}
    async with running(make_config(tiny_model, folder, http=http)) as daemon:
        assert daemon.http is not None and daemon.http.server is not None
        async with httpx.AsyncClient(base_url=daemon.http.url) as client:
            assert (await client.get("/health")).status_code == 200  # kept alive
            (conn,) = daemon.http.server.server_state.connections
            sock = conn.transport.get_extra_info("socket")
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
