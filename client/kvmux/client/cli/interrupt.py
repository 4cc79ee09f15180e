"""Ctrl-C and SIGTERM for a ``kvmux`` command: the first stops it in time, a second at once.

``asyncio.run`` handles only Ctrl-C, by cancelling the command's task, and
then waits for that task however long it takes: a goodbye the daemon never
answers (it is stopped, or gone), a cancellation swallowed on the way, or an
event loop kept busy by a flood of messages held a command for good. Here:

- the first SIGINT or SIGTERM cancels the command's task, which tells the
  daemon what becomes of its job within :data:`GOODBYE_SECONDS` (cancelled
  for ``submit`` and ``generate``, detached for ``results``) and returns;
- if the process is still there :data:`STOP_SECONDS` after the signal, a
  watchdog thread ends it;
- a second signal ends it at once, whatever is pending.

A command with no event loop (``kvmux-ray submit``, which waits in Ray Data)
runs under :func:`run_blocking`: there the first signal raises
``KeyboardInterrupt`` in the main thread, the command also polls
:func:`interrupted_status` between results (a library may swallow that
exception), and the same watchdog ends it whatever it is waiting in.

Every result line is one ``write(2)`` (files) or a flushed line (stdout), so
what was received is on disk however the process ends. The exit status is
128 + the signal's number, as shells report a process a signal ended:
130 for Ctrl-C (SIGINT), 143 for SIGTERM.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from types import FrameType
from typing import Any, NoReturn

from .._client import Client
from ..errors import KvmuxError

# Seconds an interrupted command may spend telling the daemon what becomes of its job:
# a daemon that answers at all answers well within this, and one that does not (stopped,
# gone) must not hold the user's prompt; kvmuxd cancels the jobs of a client it has not
# heard from for server.client_timeout anyway, and keeps detached ones.
GOODBYE_SECONDS = 0.75
# After this many seconds from the first signal the process ends whatever it is doing.
STOP_SECONDS = 1.5
# ... and if flushing stdout blocks (a reader that stopped reading), this much later still.
_LAST_RESORT_SECONDS = 0.3
_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def status_for(signum: int) -> int:
    """The exit status of a command a signal stopped: 128 + its number."""
    return 128 + signum


class _Stop:
    """The signals one command has received, and what they do."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.at = 0.0
        self.task: asyncio.Task[Any] | None = None
        self.loop: asyncio.AbstractEventLoop | None = None

    def handle(self, signum: int, frame: FrameType | None) -> None:
        del frame
        if self.signum is not None:
            _exit_now(status_for(self.signum), "stopped at once (a second signal)")
        self.signum, self.at = signum, time.monotonic()
        with contextlib.suppress(OSError):
            os.write(2, b"\nkvmux: stopping (Ctrl-C again to stop at once)\n")
        for delay, flush in ((STOP_SECONDS, True), (STOP_SECONDS + _LAST_RESORT_SECONDS, False)):
            timer = threading.Timer(delay, _exit_now, (status_for(signum), _TOO_SLOW, flush))
            timer.daemon = True
            timer.start()
        if self.task is None or self.loop is None:
            # A blocking command, or one not started yet: the exception ends whatever the
            # main thread waits in (a lock, a sleep, a queue), and the timers bound the rest.
            raise KeyboardInterrupt
        # From the loop's own thread, not from inside whatever the signal interrupted.
        self.loop.call_soon_threadsafe(self.task.cancel)


_TOO_SLOW = f"stopped: still running {STOP_SECONDS:g} s after the signal"
_stop = _Stop()


def goodbye_left() -> float:
    """Seconds left of an interrupted command's goodbye (the full budget before a signal)."""
    if _stop.signum is None:
        return GOODBYE_SECONDS
    return max(GOODBYE_SECONDS - (time.monotonic() - _stop.at), 0.0)


def interrupted_status() -> int | None:
    """The exit status the signal received calls for; None when none was."""
    return None if _stop.signum is None else status_for(_stop.signum)


def run(command: Coroutine[Any, Any, int]) -> int:
    """Run ``command`` on a fresh event loop with the signal handling above; its exit status.

    A command that returns after a signal exits 128 + the signal's number, whatever it
    returned; so does one that the cancellation ended without a word of its own."""

    global _stop
    _stop = _Stop()

    async def main() -> int:
        _stop.task = asyncio.current_task()
        _stop.loop = asyncio.get_running_loop()
        return await command

    with _handled():
        try:
            # asyncio.Runner leaves SIGINT alone when someone else handles it.
            status = asyncio.run(main())
        except (asyncio.CancelledError, KeyboardInterrupt):
            if _stop.signum is None:
                raise
            print("kvmux: interrupted", file=sys.stderr, flush=True)
            status = status_for(_stop.signum)
    interrupted = interrupted_status()
    return status if interrupted is None else interrupted


def run_blocking(command: Callable[[], int]) -> int:
    """Run ``command``, a command with no event loop, with the signal handling above; its
    exit status.

    The handlers go in whatever the process inherited: Python keeps SIGINT ignored when
    its parent ignored it (a command run as a background job of a non-interactive shell,
    as CI runs a suite), and then no ``KeyboardInterrupt`` ever comes by default.

    The first signal raises ``KeyboardInterrupt`` in the main thread. A command that
    waits inside a library which may swallow it (a ``finally`` that waits, an ``except
    BaseException``) also checks :func:`interrupted_status` between results; whatever it
    does, the watchdog ends the process :data:`STOP_SECONDS` after the signal. A library
    that installs its own handler while the command runs (``ray.init`` does, for
    SIGTERM) is overruled with :func:`reclaim_signals`.

    An interrupted command ends the process here, without the interpreter's exit
    handlers: a library's (``ray.shutdown``, which waits for its processes to go) would
    outlast the budget, and what they would clean up ends with this process anyway."""

    global _stop
    _stop = _Stop()
    with _handled():
        try:
            status = command()
        except KeyboardInterrupt:
            if _stop.signum is None:
                raise
        if _stop.signum is not None:
            _exit_now(status_for(_stop.signum), "interrupted")
    return status


def reclaim_signals() -> None:
    """SIGINT and SIGTERM to the running command's handling again, after a library put
    in a handler of its own (``ray.init`` makes SIGTERM ``sys.exit(15)``)."""
    for signum in _SIGNALS:
        signal.signal(signum, _stop.handle)


@contextlib.contextmanager
def _handled() -> Iterator[None]:
    previous = {signum: signal.signal(signum, _stop.handle) for signum in _SIGNALS}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


async def goodbye(client: Client, last_word: Awaitable[object]) -> bool:
    """An interrupted command's last word about its job (cancel it, detach from it), then
    close the client, all within what is left of :data:`GOODBYE_SECONDS`. True when the
    daemon confirmed the last word; False when it did not answer in time (stopped, gone,
    too busy) or refused."""
    try:
        await asyncio.wait_for(last_word, max(goodbye_left(), 0.05))
        confirmed = True
    except (KvmuxError, TimeoutError):
        confirmed = False
    await client.close(goodbye=goodbye_left())
    return confirmed


def _exit_now(status: int, why: str, flush: bool = True) -> NoReturn:
    """End the process now. Result files need nothing: each line went out in one write."""
    if flush:
        for stream in (sys.stdout, sys.stderr):
            # A signal can land inside a write to this very stream: its lock is then held.
            with contextlib.suppress(Exception):
                stream.flush()
    with contextlib.suppress(OSError):
        os.write(2, f"\nkvmux: {why}\n".encode())
    os._exit(status)
