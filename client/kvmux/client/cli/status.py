"""``kvmux status``: the daemon's state, sessions, KV memory and growths, as a table or JSON."""

from __future__ import annotations

import argparse
import asyncio
import sys
import time

import msgspec
from rich.console import Console
from rich.table import Table
from rich.text import Text

from .. import protocol as p
from .connect import OK, CliError, open_client


async def status(args: argparse.Namespace) -> int:
    deadline = time.monotonic() + args.wait
    client = await open_client(args.endpoint, args.timeout, wait=args.wait)
    try:
        st = await client.status()
        # --wait means "until it takes jobs": a daemon still loading its model answers.
        while st.state == "loading" and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
            st = await client.status()
    finally:
        await client.close()
    if args.wait and st.state == "loading":
        raise CliError(
            f"kvmuxd at {client.endpoint} is still loading its model after {args.wait:g} s"
        )
    if args.json:
        sys.stdout.write(msgspec.json.encode(st).decode() + "\n")
    else:
        console = Console()
        console.print(overview(st, client.endpoint))
        if st.sessions:
            console.print(sessions(st.sessions))
            if st.sessions_omitted:
                console.print(f"... and {st.sessions_omitted} more sessions")
    return OK


def overview(st: p.DaemonStatus, endpoint: str) -> Table:
    """One row per fact, grouped: the daemon, its work, KV memory, growths."""
    table = Table(title=f"kvmuxd at {endpoint}", show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column()
    state_style = {"ready": "green", "loading": "yellow", "draining": "yellow"}[st.state]
    table.add_row("state", Text(st.state, style=state_style))
    # Values are Text, not markup: a model path may hold "[".
    rows: list[tuple[str, str]] = [
        ("model", f"{st.model} ({st.provider})"),
        ("model folder", _folder(st)),
        ("version", f"{st.version}, pid {st.pid}, up {_duration(st.uptime_seconds)}"),
        ("clients", str(st.clients)),
        ("HTTP", f"{st.http_url}/v1 (OpenAI's API)" if st.http_url else "off (http.listen)"),
        (
            "you",
            f"{st.caller or '?'}"
            + (" (operator: every job)" if st.caller_is_operator else " (your jobs only)"),
        ),
        ("jobs", f"{st.jobs_active} active, {st.jobs_retained} retained"),
        (
            "sessions",
            f"{st.sessions_active} active, {st.sessions_queued} queued, "
            f"{st.sessions_parked} parked",
        ),
        (
            "KV in use",
            f"{_bytes(st.kv_bytes_in_use)} (peak {_bytes(st.kv_peak_bytes)}, budget "
            f"{'none' if st.kv_budget_bytes is None else _bytes(st.kv_budget_bytes)})",
        ),
        ("KV per token", f"{_bytes(st.kv_bytes_per_token)}, min bucket {st.min_bucket} tokens"),
        # On a budget, free and total are the budget's (as growth errors report them).
        (
            "KV budget" if st.memory_source == "kv.memory_budget" else "device memory",
            _device(st),
        ),
        (
            "growths",
            f"{st.growth.growths} ({_bytes(st.growth.bytes_copied)} copied), lock wait "
            f"{st.growth.lock_wait_seconds_total:.3f} s total, "
            f"{st.growth.lock_wait_seconds_max:.3f} s max",
        ),
        ("growth failures", _failures(st.growth)),
        (
            "clients refused",
            f"{st.requests_refused} requests over budget, {st.frames_rejected} malformed "
            f"answered, {st.replies_dropped} replies dropped unread (a client that never "
            f"reads holds at most {_bytes(st.client_bound_bytes)})",
        ),
        ("prefix cache", _prefix(st)),
    ]
    for name, value in rows:
        table.add_row(name, Text(value))
    return table


def sessions(rows: list[p.SessionInfo]) -> Table:
    table = Table(title="sessions", title_justify="left")
    for name in ("session", "state", "valid / capacity", "KV"):
        table.add_column(name, justify="right" if name != "session" else "left")
    for s in rows:
        table.add_row(
            Text(s.session_id), s.state, f"{s.valid_len} / {s.capacity}", _bytes(s.kv_bytes)
        )
    return table


def _failures(growth: p.GrowthStats) -> str:
    if not growth.failures:
        return "none"
    causes = ", ".join(f"{cause}: {n}" for cause, n in sorted(growth.failures.items()))
    return f"{causes}; {growth.parked_retries} parked retries; {growth.preemptions} preemptions"


def _prefix(st: p.DaemonStatus) -> str:
    pc = st.prefix_cache
    if pc is None:
        return "off"
    rate = f"{pc.hit_tokens / pc.prompt_tokens:.0%}" if pc.prompt_tokens else "-"
    return (
        f"{pc.entries} kept, {_bytes(pc.bytes)} of {_bytes(pc.max_bytes)} "
        f"({pc.scope} scope, blocks of {pc.block}); {pc.hit_tokens} of {pc.prompt_tokens} "
        f"prompt tokens copied ({rate}), {pc.waits} waits, {pc.evictions} evictions"
    )


def _folder(st: p.DaemonStatus) -> str:
    if not st.model_folder:
        return "not loaded yet"
    template = "chat template" if st.chat_template else "no chat template"
    return f"{st.model_folder} ({st.model_precision}, {template})"


def _device(st: p.DaemonStatus) -> str:
    if st.device_free_bytes is None or st.device_total_bytes is None:
        return f"unknown ({st.memory_source})"
    return (
        f"{_bytes(st.device_free_bytes)} free of {_bytes(st.device_total_bytes)} "
        f"({st.memory_source})"
    )


def _bytes(n: int) -> str:
    units = ("B", "KiB", "MiB", "GiB", "TiB")
    value, i = float(n), 0
    while abs(value) >= 1024 and i < len(units) - 1:
        value /= 1024
        i += 1
    return f"{n} B" if i == 0 else f"{value:.1f} {units[i]}"


def _duration(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m{secs:02d}s" if hours else f"{minutes}m{secs:02d}s"
