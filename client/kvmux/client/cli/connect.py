"""Exit statuses, the error that ends a command, and connecting (optionally waiting) to kvmuxd."""

from __future__ import annotations

import asyncio
import time

from .._client import Client
from ..endpoint import (
    client_default_endpoint,
    ipc_path,
    normalize_endpoint,
    socket_revives,
    stale_socket,
)
from ..errors import DaemonUnreachable

OK = 0
"""Every item succeeded (or the command did what it was asked)."""
COULD_NOT_RUN = 1
"""Nothing ran: the daemon is unreachable, refused the job, or the command line is wrong."""
ITEMS_FAILED = 2
"""The job ran and some items failed; each failure is in the results."""
INTERRUPTED = 130
"""Stopped by Ctrl-C (128 + SIGINT), as shells report it."""

CLIENT_NAME = "kvmux-cli"
_RETRY_SECONDS = 0.2
# How long a socket file nobody accepts on may stay so before it is taken as left by
# a crash: a daemon being restarted binds it again well within this.
STALE_GRACE = 3.0


class CliError(Exception):
    """A command cannot go on; its message is for people and the exit status is 1."""


async def open_client(endpoint: str | None, timeout: float, *, wait: float = 0.0) -> Client:
    """A connected client; with ``wait`` > 0, keep trying that many seconds.

    Each attempt is bounded by ``timeout``, so an endpoint nobody answers
    fails within ``max(timeout, wait)`` seconds instead of hanging; a socket file
    left by a daemon that died fails at once (or is retried, with ``wait``).
    """
    try:
        endpoint = normalize_endpoint(endpoint or client_default_endpoint())
    except ValueError as exc:
        raise CliError(str(exc)) from None
    path = ipc_path(endpoint)
    deadline = time.monotonic() + wait
    while True:
        remaining = deadline - time.monotonic()
        attempt = timeout if wait <= 0 else max(min(timeout, round(remaining, 1)), 0.1)
        client = Client(endpoint, timeout=attempt, name=CLIENT_NAME)
        try:
            if (
                path is not None
                and stale_socket(path)
                and not await socket_revives(path, min(attempt, STALE_GRACE))
            ):
                raise client._unreachable(
                    f"{path} is left from a kvmuxd that is no longer running (nothing has "
                    f"accepted connections on it for {min(attempt, STALE_GRACE):g} s)"
                )
            await client.connect()
        except DaemonUnreachable as exc:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                if wait > 0:
                    raise DaemonUnreachable(
                        f"{exc.message} Gave up after waiting {wait:g} s.",
                        {**exc.details, "waited_seconds": wait},
                    ) from None
                raise
            await asyncio.sleep(min(_RETRY_SECONDS, remaining))
            continue
        client.timeout = timeout  # a last attempt may have had less; requests get it all
        return client
