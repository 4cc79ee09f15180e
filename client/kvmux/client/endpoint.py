"""Where the daemon listens by default, and the endpoint a client picks."""

from __future__ import annotations

import os
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
