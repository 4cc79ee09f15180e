"""Waiting out a daemon restart: a job's results, re-attaching as often as kvmuxd comes back."""

from __future__ import annotations

import asyncio
import time

from . import protocol as p
from ._client import Client
from .curve import CurveKeys
from .errors import DaemonUnreachable, NotReady


async def results_through_restarts(
    job_id: str,
    endpoint: str | None = None,
    *,
    wait_daemon: float = 300.0,
    timeout: float = 10.0,
    curve: CurveKeys | None = None,
) -> list[p.ItemResult]:
    """Every result of ``job_id``, in item order, once the job is done.

    If kvmuxd goes away meanwhile (a restart, an upgrade, a crash; with a job
    journal it takes the job back when it starts), wait up to ``wait_daemon``
    seconds for it, attach again and go on; :class:`DaemonUnreachable` past
    that. What ``kvmux results`` does, for Python callers.
    """
    gone_since: float | None = None
    while True:
        try:
            async with Client(endpoint, timeout=timeout, curve=curve) as client:
                while True:
                    try:
                        job = await client.attach(job_id, stream=False)
                        break
                    except NotReady:  # back, still loading its model and journal
                        if gone_since is not None and time.monotonic() - gone_since > wait_daemon:
                            raise
                        await asyncio.sleep(0.2)
                return await job.results()
        except DaemonUnreachable:
            now = time.monotonic()
            gone_since = now if gone_since is None else gone_since
            if now - gone_since > wait_daemon:
                raise
            await asyncio.sleep(0.2)
