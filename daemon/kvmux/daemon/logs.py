"""structlog configuration for the daemon, and the hub that streams log events to subscribers.

:func:`configure_logging` sets one processor chain: context variables, level,
UTC timestamp, stack and exception rendering, the :data:`hub` tee, an
optional JSON-lines file, then JSON lines (not a TTY) or the console renderer
(a TTY). :class:`LogHub` fans events out to live :class:`LogSubscription`\\ s
(the daemon's "subscribe to logs" request) from any thread, waking the
subscriber's event loop only when its buffer goes from empty to non-empty.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import threading
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

import msgspec
import structlog
from structlog.typing import EventDict, Processor, WrappedLogger

__all__ = [
    "LEVELS",
    "LogHub",
    "LogSubscription",
    "close_log_file",
    "configure_logging",
    "hub",
    "reopen_log_file",
]

LEVELS: dict[str, int] = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
    "critical": logging.CRITICAL,
}
"""Level names as structlog's ``add_log_level`` writes them, least severe first."""

_FORMATS = ("auto", "json", "console")
_MAX_DEPTH = 8


def _level_number(name: str) -> int:
    try:
        return LEVELS[name]
    except KeyError:
        raise ValueError(
            f"unknown log level {name!r}; expected one of {', '.join(LEVELS)}"
        ) from None


def _json_safe(value: Any, depth: int = 0) -> Any:
    """``value`` with everything JSON cannot carry turned into ``str``."""
    if value is None or isinstance(value, str | int | float | bool):
        return value
    if depth < _MAX_DEPTH:
        if isinstance(value, list | tuple):
            return [_json_safe(v, depth + 1) for v in value]
        if isinstance(value, dict):
            return {str(k): _json_safe(v, depth + 1) for k, v in value.items()}
    return str(value)


class LogSubscription:
    """A bounded buffer of the log events one subscriber asked for."""

    def __init__(
        self,
        *,
        min_level: str,
        job_id: str | None,
        maxlen: int,
        loop: asyncio.AbstractEventLoop | None,
        visible: Callable[[dict[str, Any]], bool] | None = None,
    ) -> None:
        self.min_level = min_level
        self.job_id = job_id
        self._visible = visible
        self.dropped = 0
        """Events lost because the buffer was full (the oldest go first)."""
        self._min_number = _level_number(min_level)
        self._buffer: deque[dict[str, Any]] = deque(maxlen=maxlen)
        self._lock = threading.Lock()
        self._loop = loop
        self._ready = asyncio.Event()

    def wants(self, event: dict[str, Any]) -> bool:
        """Whether ``event`` passes this subscription's level and job filters."""
        level = LEVELS.get(str(event.get("level")), logging.INFO)
        if level < self._min_number:
            return False
        if self.job_id is not None and event.get("job_id") != self.job_id:
            return False
        return self._visible is None or self._visible(event)

    def offer(self, event: dict[str, Any]) -> None:
        """Buffer ``event`` if it passes the filters; safe to call from any thread."""
        if not self.wants(event):
            return
        with self._lock:
            was_empty = not self._buffer
            if len(self._buffer) == self._buffer.maxlen:
                self.dropped += 1
            self._buffer.append(event)
            loop = self._loop
        if was_empty and loop is not None:
            # RuntimeError: the loop is closed, so nobody is waiting any more.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(self._ready.set)

    def drain(self) -> list[dict[str, Any]]:
        """Return and clear the buffered events, oldest first; never blocks."""
        with self._lock:
            events = list(self._buffer)
            self._buffer.clear()
        return events

    async def wait(self) -> None:
        """Return once at least one event is buffered (at once if one already is)."""
        while True:
            with self._lock:
                if self._loop is None:
                    self._loop = asyncio.get_running_loop()
                if self._buffer:
                    return
                self._ready.clear()
            await self._ready.wait()


class LogHub:
    """A thread-safe fan-out of log events to live subscribers."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._subscriptions: tuple[LogSubscription, ...] = ()

    def subscribe(
        self,
        *,
        min_level: str = "debug",
        job_id: str | None = None,
        maxlen: int = 10000,
        visible: Callable[[dict[str, Any]], bool] | None = None,
    ) -> LogSubscription:
        """A new subscription; call it on the event loop that will ``wait()`` on it.

        ``visible`` further limits what it gets (a client sees only its own jobs);
        it is called from whichever thread logs."""
        if maxlen < 1:
            raise ValueError(f"maxlen must be >= 1, got {maxlen}")
        try:
            loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            loop = None  # bound by the first wait() instead
        sub = LogSubscription(
            min_level=min_level, job_id=job_id, maxlen=maxlen, loop=loop, visible=visible
        )
        with self._lock:
            self._subscriptions = (*self._subscriptions, sub)
        return sub

    def unsubscribe(self, sub: LogSubscription) -> None:
        """Stop delivering to ``sub``; unsubscribing twice is harmless."""
        with self._lock:
            self._subscriptions = tuple(s for s in self._subscriptions if s is not sub)

    @property
    def subscriber_count(self) -> int:
        """How many subscriptions are live."""
        return len(self._subscriptions)

    def processor(
        self, logger: WrappedLogger, method_name: str, event_dict: EventDict
    ) -> EventDict:
        """structlog processor: publish a JSON-safe copy of the event, return it unchanged.

        Subscribers share that copy and must not mutate it.
        """
        subscriptions = self._subscriptions
        if not subscriptions:
            return event_dict
        event = {str(k): _json_safe(v) for k, v in event_dict.items()}
        for sub in subscriptions:
            sub.offer(event)
        return event_dict


hub = LogHub()
"""The daemon's log hub; :func:`configure_logging` puts its tee in the chain."""


def _fallback(value: Any) -> Any:
    """What a type JSON lacks becomes: its ``__structlog__()``, else its repr (as
    structlog's own JSON renderer does)."""
    try:
        return value.__structlog__()
    except AttributeError:
        return repr(value)


_encoder = msgspec.json.Encoder(enc_hook=_fallback)
_stdlib_json = structlog.processors.JSONRenderer()


def render_json(logger: WrappedLogger, method_name: str, event_dict: EventDict) -> str:
    """One event as a JSON line, by msgspec: a session's events are logged on the event
    loop, several a session, and msgspec renders one in half the time of ``json``
    (structlog's default). Keys msgspec refuses (not strings or numbers) take the
    standard library's path."""
    try:
        return _encoder.encode(event_dict).decode()
    except (TypeError, msgspec.EncodeError):
        return str(_stdlib_json(logger, method_name, event_dict))


class _FileSink:
    """A structlog processor that appends each event to a file as a JSON line."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.write_errors = 0
        self._render = render_json
        self._lock = threading.Lock()
        self._file: TextIO | None = self._open()

    def _open(self) -> TextIO:
        return self.path.open("a", buffering=1, encoding="utf-8")

    def __call__(self, logger: WrappedLogger, method_name: str, event_dict: EventDict) -> EventDict:
        line = self._render(logger, method_name, dict(event_dict))
        with self._lock:
            if self._file is not None:
                try:
                    self._file.write(f"{line}\n")
                except OSError:  # a full disk must not fail the code that logged
                    self.write_errors += 1
        return event_dict

    def reopen(self) -> None:
        """Close the file and open ``path`` afresh (after logrotate moved it)."""
        with self._lock:
            if self._file is not None:
                self._file.close()
            self._file = None
            self._file = self._open()

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
            self._file = None


_sink: _FileSink | None = None


class _Writer:
    """structlog's ``WriteLogger`` for every logger at once (its factory builds one per
    event); without a stream, ``sys.stdout`` as it is at each write."""

    def __init__(self, stream: TextIO | None) -> None:
        self._stream = stream
        self._lock = threading.Lock()

    def msg(self, message: str) -> None:
        stream = self._stream or sys.stdout
        with self._lock:
            stream.write(message + "\n")
            stream.flush()

    log = debug = info = warn = warning = error = critical = exception = fatal = msg


def _writer(stream: TextIO | None) -> Callable[..., _Writer]:
    writer = _Writer(stream)
    return lambda *args: writer


def _is_tty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


def configure_logging(
    *,
    level: str = "info",
    fmt: str = "auto",
    file: str | Path | None = None,
    stream: TextIO | None = None,
) -> None:
    """Configure structlog for the daemon; calling it again replaces the configuration.

    ``fmt`` is ``"json"``, ``"console"`` or ``"auto"`` (console on a TTY, JSON
    lines otherwise). ``stream`` defaults to ``sys.stdout`` as it is when a
    logger is made. With ``file`` (a path; ``None`` or ``""`` = none) every
    event is also appended to it as a JSON line, whatever ``fmt`` is.
    Raises ValueError for an unknown level or format and OSError when the
    file cannot be opened (the previous configuration then stays).
    """
    global _sink
    threshold = _level_number(level)
    if fmt not in _FORMATS:
        raise ValueError(f"unknown log format {fmt!r}; expected one of {', '.join(_FORMATS)}")
    tty = _is_tty(stream if stream is not None else sys.stdout)
    sink = _FileSink(Path(file)) if file else None

    renderer: Processor
    if fmt == "json" or (fmt == "auto" and not tty):
        renderer = render_json
    else:
        renderer = structlog.dev.ConsoleRenderer(colors=tty)

    processors: list[Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.StackInfoRenderer(),
        structlog.processors.format_exc_info,
        hub.processor,
    ]
    if sink is not None:
        processors.append(sink)
    processors.append(renderer)

    structlog.configure(
        processors=processors,
        wrapper_class=structlog.make_filtering_bound_logger(threshold),
        logger_factory=_writer(stream),
        cache_logger_on_first_use=False,
    )
    previous, _sink = _sink, sink
    if previous is not None:
        previous.close()


def reopen_log_file() -> None:
    """Reopen the log file at its path (SIGHUP after logrotate); a no-op without one."""
    if _sink is not None:
        _sink.reopen()


def close_log_file() -> None:
    """Close the log file, if any; later events go to the stream only."""
    global _sink
    if _sink is not None:
        _sink.close()
        _sink = None
