"""``kvmux logs``: the daemon's structured log events, pretty on a terminal, JSON lines otherwise.

The daemon streams events live and keeps no history (``journalctl -u kvmuxd``
or its ``log.file`` has the past). So without ``-f`` the command shows what
arrives within ``--window`` seconds; with ``-f`` it follows until Ctrl-C (exit 130).
With ``--job`` it stops at that job's end either way (its ``job_finished``
event, or, when the level hides that, the job listed as done), and a job that
has already finished is said to be so at once; an unknown job is ``not_found``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
from typing import Any

import msgspec
from rich.console import Console
from rich.text import Text

from .._client import Client
from .connect import INTERRUPTED, OK, open_client
from .interrupt import goodbye_left

# With --job: how often the job's state is checked, for an end the level filter hides.
_JOB_POLL_SECONDS = 1.0

_LEVEL_STYLES = {
    "debug": "dim",
    "info": "green",
    "warning": "yellow",
    "error": "bold red",
    "critical": "bold white on red",
}
_HEADER = ("timestamp", "level", "event")


async def logs(args: argparse.Namespace) -> int:
    client = await open_client(args.endpoint, args.timeout)
    console = Console(soft_wrap=True) if sys.stdout.isatty() else None
    scope = f" of job {args.job}" if args.job else ""
    span = "until Ctrl-C" if args.follow else f"for {args.window:g} s"
    if args.job:
        span += " or the job's end"
    try:
        # Subscribed (acknowledged) before the header: a script that waits for the
        # header knows no later event is missed. Closing the stream unsubscribes.
        stream = await client.subscribe_logs(level=args.level, job_id=args.job)
        print(
            f"kvmux: showing {client.endpoint} logs{scope} at level {args.level} and above, {span}",
            file=sys.stderr,
            flush=True,
        )
        async with (
            contextlib.aclosing(stream),
            asyncio.timeout(None if args.follow else args.window),
        ):

            async def show() -> None:
                async for record in stream:
                    if console is not None:
                        console.print(pretty(record), highlight=False)
                    else:
                        sys.stdout.write(msgspec.json.encode(record).decode() + "\n")
                        sys.stdout.flush()
                    if args.job and _ends(record, args.job):
                        return

            if args.job:
                # Subscribed first, then checked: an end in between is not missed.
                ended = await _job_end(client, args.job)
                if ended is None:
                    shown = asyncio.ensure_future(show())
                    watched = asyncio.ensure_future(_watch(client, args.job))
                    try:
                        await asyncio.wait({shown, watched}, return_when=asyncio.FIRST_COMPLETED)
                    finally:
                        shown.cancel()
                        watched.cancel()
                        # gather: a Ctrl-C landing here must reach the except below.
                        await asyncio.gather(shown, watched, return_exceptions=True)
                    ended = watched.result() if watched.done() and not watched.cancelled() else None
                if ended is not None:
                    print(f"kvmux: {ended}", file=sys.stderr, flush=True)
            else:
                await show()
    except TimeoutError:
        pass  # the window is over
    except asyncio.CancelledError:
        # Ctrl-C is how one stops following; it still exits 130, as `tail -f` does,
        # so a script tells it from following a job to its end.
        task = asyncio.current_task()
        if task is not None:
            task.uncancel()
        await client.close(goodbye=goodbye_left())
        return INTERRUPTED
    finally:
        await client.close(goodbye=goodbye_left())
    return OK


async def _job_end(client: Client, job_id: str) -> str | None:
    """What to say if the job has finished (None while it runs)."""
    for info in await client.jobs():
        if info.job_id == job_id and info.state == "done":
            return (
                f"job {job_id} has finished ({info.ok} ok, {info.failed} failed): "
                "nothing more will be logged for it"
            )
    return None


async def _watch(client: Client, job_id: str) -> str | None:
    while True:
        await asyncio.sleep(_JOB_POLL_SECONDS)
        ended = await _job_end(client, job_id)
        if ended is not None:
            return ended


def _ends(record: dict[str, Any], job_id: str) -> bool:
    return record.get("event") == "job_finished" and record.get("job_id") == job_id


def pretty(record: dict[str, Any]) -> Text:
    """``12:00:01.123 info    event key=value ...`` with the level coloured."""
    stamp = str(record.get("timestamp", ""))
    level = str(record.get("level", ""))
    text = Text()
    # ISO 8601 UTC from the daemon: the time of day is what a reader scans for.
    text.append(stamp[11:23] if len(stamp) >= 23 else stamp, style="dim")
    text.append(" ")
    text.append(f"{level:<8}", style=_LEVEL_STYLES.get(level, ""))
    text.append(str(record.get("event", "")), style="bold")
    for key, value in record.items():
        if key in _HEADER:
            continue
        text.append(f" {key}=", style="cyan")
        text.append(value if isinstance(value, str) else msgspec.json.encode(value).decode())
    return text
