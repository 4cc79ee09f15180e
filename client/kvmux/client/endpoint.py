"""Where the daemon listens by default, and the endpoint a client picks."""

from __future__ import annotations

import asyncio
import os
import re
import socket
import time
from pathlib import Path

ENDPOINT_ENV = "KVMUX_ENDPOINT"
SOCKET_NAME = "kvmuxd.sock"
# Where the systemd unit's RuntimeDirectory=kvmux puts the service's socket.
SYSTEM_SOCKET = Path("/run/kvmux") / SOCKET_NAME


def user_runtime_dir() -> Path:
    """The per-user runtime directory for a daemon started by hand."""
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg:
        return Path(xdg) / "kvmux"
    return Path("/tmp") / f"kvmux-{os.getuid()}"


def daemon_default_endpoint() -> str:
    """The daemon's endpoint when its config leaves ``server.endpoint`` empty.

    Under systemd, ``$RUNTIME_DIRECTORY`` is the unit's runtime directory;
    otherwise the user's runtime directory.
    """
    runtime = os.environ.get("RUNTIME_DIRECTORY")
    folder = Path(runtime.split(":")[0]) if runtime else user_runtime_dir()
    return f"ipc://{folder / SOCKET_NAME}"


def client_default_endpoint() -> str:
    """``$KVMUX_ENDPOINT``, else the system service's socket if it exists, else the user's."""
    env = os.environ.get(ENDPOINT_ENV)
    if env:
        return env
    if SYSTEM_SOCKET.exists():
        return f"ipc://{SYSTEM_SOCKET}"
    return f"ipc://{user_runtime_dir() / SOCKET_NAME}"


def ipc_path(endpoint: str) -> Path | None:
    """The filesystem path of an ``ipc://`` endpoint (None for other transports)."""
    if endpoint.startswith("ipc://"):
        return Path(endpoint[len("ipc://") :])
    return None


_SCHEMES = ("ipc://", "tcp://", "inproc://", "pgm://", "epgm://", "vmci://", "ws://", "wss://")
_HOST_PORT = re.compile(r"^(?:\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9*][A-Za-z0-9.*-]*):\d{1,5}$")


def normalize_endpoint(endpoint: str) -> str:
    """An endpoint as ZeroMQ takes it: ``/path/to.sock`` (or ``./x.sock``) as
    ``ipc://``, ``HOST:PORT`` as ``tcp://``; an endpoint with a scheme unchanged.

    Raises ``ValueError`` naming the accepted forms for anything else, instead
    of the ZMQError ZeroMQ would give.
    """
    text = endpoint.strip()
    if text.startswith(_SCHEMES):
        return text
    if "://" in text:
        raise ValueError(f"endpoint {endpoint!r}: unknown scheme; {ENDPOINT_FORMS}")
    if text.startswith(("/", "./", "../", "~")):
        return f"ipc://{Path(text).expanduser()}"
    if _HOST_PORT.match(text):
        return f"tcp://{text}"
    raise ValueError(f"endpoint {endpoint!r} is not one kvmux understands; {ENDPOINT_FORMS}")


ENDPOINT_FORMS = (
    "use ipc:///path/to/kvmuxd.sock, tcp://HOST:PORT, a socket path (/path/to/kvmuxd.sock) "
    "or HOST:PORT"
)


def stale_socket(path: Path) -> bool:
    """Whether ``path`` is a unix socket file with nothing listening behind it (a
    daemon that crashed): connecting is refused at once, where ZeroMQ would
    retry quietly until its timeout."""
    return _probe(path) == "refused"


def _probe(path: Path) -> str:
    """``listening``, ``refused`` (a stale socket file), ``missing``, or ``unknown``."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(str(path))
    except ConnectionRefusedError:
        return "refused"
    except FileNotFoundError:
        return "missing"
    except OSError:
        return "unknown"  # not ours to judge (a permission problem, not a socket): ZeroMQ says
    finally:
        probe.close()
    return "listening"


async def socket_revives(path: Path, within: float) -> bool:
    """Whether a stale ``path`` gets a listener within ``within`` seconds: a daemon
    being restarted unlinks and binds it again within a second or two."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        await asyncio.sleep(0.1)
        if _probe(path) in ("listening", "unknown"):
            return True
    return False


def tcp_address(endpoint: str) -> tuple[str, int] | None:
    """(host, port) of a ``tcp://`` endpoint, None for other transports or a wildcard."""
    if not endpoint.startswith("tcp://"):
        return None
    host, _, port = endpoint[len("tcp://") :].rpartition(":")
    if not port.isdigit() or not host or "*" in host:
        return None
    return host.strip("[]"), int(port)


async def http_server_at(endpoint: str, timeout: float = 1.0) -> bool:
    """Whether an HTTP server (kvmuxd's own OpenAI API, say) answers at a ``tcp://``
    endpoint, where the client wants ZeroMQ: a ZeroMQ peer greets first, an HTTP
    server waits for a request and answers ``HTTP/...``."""
    address = tcp_address(endpoint)
    if address is None:
        return False
    try:
        async with asyncio.timeout(timeout):
            reader, writer = await asyncio.open_connection(*address)
            try:
                try:
                    async with asyncio.timeout(min(0.2, timeout / 2)):
                        await reader.read(1)
                    return False  # it spoke first (ZeroMQ's greeting, 0xFF) or hung up
                except TimeoutError:
                    pass  # silent, as HTTP servers are: ask it as one
                writer.write(b"GET /health HTTP/1.0\r\nHost: kvmux\r\n\r\n")
                await writer.drain()
                return (await reader.read(5)) == b"HTTP/"
            finally:
                writer.close()
    except (OSError, TimeoutError):
        return False
