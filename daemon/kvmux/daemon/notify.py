"""systemd's notify protocol, spoken directly: one datagram to ``$NOTIFY_SOCKET`` per message.

``Type=notify`` units learn readiness (``READY=1``), status lines
(``STATUS=...``), liveness (``WATCHDOG=1``) and shutdown (``STOPPING=1``) this
way. Without ``NOTIFY_SOCKET`` every call is a no-op, so the daemon behaves
the same outside systemd.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping

import structlog

log = structlog.get_logger("kvmux.notify")


class Notifier:
    """Sends sd_notify datagrams; ``watchdog_interval`` is how often systemd expects ``WATCHDOG=1``
    (``WATCHDOG_USEC``), or None when the unit has no watchdog (or it is for another pid)."""

    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
        env = os.environ if environ is None else environ
        addr = env.get("NOTIFY_SOCKET", "")
        # "@name" is an abstract socket: the name begins with a NUL byte.
        self._address = "\0" + addr[1:] if addr.startswith("@") else addr
        self.watchdog_interval: float | None = None
        usec, pid = env.get("WATCHDOG_USEC", ""), env.get("WATCHDOG_PID", "")
        if usec.isdigit() and int(usec) > 0 and (not pid or pid == str(os.getpid())):
            self.watchdog_interval = int(usec) / 1e6
        self._sock: socket.socket | None = None
        self._warned = False

    @property
    def enabled(self) -> bool:
        return bool(self._address)

    def notify(self, *lines: str) -> bool:
        """Send one message (its lines joined); False if not under systemd or it failed."""
        if not self._address:
            return False
        try:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            self._sock.sendto("\n".join(lines).encode(), self._address)
        except OSError as exc:
            if not self._warned:  # the manager went away: say so once, keep serving
                self._warned = True
                log.warning("sd_notify_failed", socket=self._address, error=str(exc))
            return False
        return True

    def ready(self, status: str) -> bool:
        return self.notify("READY=1", f"STATUS={status}", f"MAINPID={os.getpid()}")

    def status(self, status: str) -> bool:
        return self.notify(f"STATUS={status}")

    def watchdog(self) -> bool:
        return self.notify("WATCHDOG=1")

    def stopping(self, status: str) -> bool:
        return self.notify("STOPPING=1", f"STATUS={status}")

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
