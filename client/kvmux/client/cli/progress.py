"""How a running job looks on stderr: a rich progress bar on a terminal, plain lines otherwise.

Both show items done/total, failures, tokens per second and elapsed time;
each failed item also gets a line of its own. The bar is drawn only when
stderr is a terminal, so logs and CI output never fill with redraws.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from types import TracebackType
from typing import IO

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    Task,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)
from rich.text import Text

from .. import protocol as p
from .results import ResultWriter

# Plain output prints a progress line at most this often (seconds).
PLAIN_INTERVAL = 2.0


@dataclass
class Tally:
    """What a job has produced so far."""

    total: int = 0
    done: int = 0
    failed: int = 0
    tokens: int = 0
    started: float = field(default_factory=time.monotonic)
    waiting: float = 0.0  # seconds the current message has waited for queue room

    @property
    def elapsed(self) -> float:
        return time.monotonic() - self.started

    @property
    def tokens_per_second(self) -> float:
        elapsed = self.elapsed
        return self.tokens / elapsed if elapsed > 0 else 0.0

    def summary(self) -> str:
        return (
            f"{self.done}/{self.total} items, {self.failed} failed, "
            f"{self.tokens_per_second:,.0f} tok/s, {self.elapsed:.1f} s"
        ) + (f", waiting for queue room {self.waiting:.0f}s" if self.waiting else "")


def failure_label(
    custom_id: str | None, error: p.ErrorInfo, *, line: int | None, index: int | None = None
) -> str:
    """``line 4 (custom-id): code: message``; by item index when the line is unknown."""
    where = f"line {line}" if line is not None else f"item {index}"
    who = f" ({custom_id})" if custom_id else ""
    return f"{where}{who}: {error.code}: {error.message}"


class Reporter:
    """Plain-line progress on a stream; the base of the terminal one."""

    #: Shows a live token rate: its jobs take token updates (``stream``); without
    #: one, tokens are counted from the results and the daemon sends no updates.
    live = False

    def __init__(self, stream: IO[str] | None = None, *, quiet: bool = False) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.quiet = quiet
        self.tally = Tally()
        self.job_id = ""
        self._last_line = 0.0

    def __enter__(self) -> Reporter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def start(self, job_id: str, total: int) -> None:
        """The job is running: ``total`` results are coming (some may be in already)."""
        self.job_id = job_id
        self.tally.total = total
        self.tally.started = self._last_line = time.monotonic()
        # A file streams into its job: the count grows as its lines go in.
        self.note(f"job {job_id}: {total} items" if total else f"job {job_id}: started")

    def tokens(self, n: int) -> None:
        self.tally.tokens += n
        self._tick()

    def grow(self, total: int) -> None:
        """More lines went into the job (a file is read as it is sent): ``total`` now."""
        self.tally.total = total
        self._tick()

    def waiting(self, seconds: float) -> None:
        """The daemon's queue is full: the next lines have waited ``seconds`` (0: went in)."""
        was = self.tally.waiting
        self.tally.waiting = seconds
        if seconds and not was:
            self.note(f"job {self.job_id}: kvmuxd's queue is full; waiting for room")
        self._tick()

    def item(self, ok: bool, label: str | None = None) -> None:
        """One result arrived; ``label`` says what failed, for a failure."""
        self.tally.done += 1
        if not ok:
            self.tally.failed += 1
            if label is not None:
                self.note(label)
        self._tick()

    def note(self, message: str) -> None:
        """A line for people, above the bar where there is one."""
        if not self.quiet:
            print(f"kvmux: {message}", file=self.stream, flush=True)

    def stop(self) -> None:
        """End the display (idempotent)."""

    def stdout_writer(self) -> ResultWriter:
        """Where result lines meant for stdout go without tearing this display."""
        return ResultWriter.to_stream(sys.stdout)

    def _tick(self) -> None:
        now = time.monotonic()
        if now - self._last_line >= PLAIN_INTERVAL:
            self._last_line = now
            self.note(f"job {self.job_id}: {self.tally.summary()}")


class _TokensPerSecond(ProgressColumn):
    def render(self, task: Task) -> Text:
        elapsed = task.elapsed or 0.0
        tokens = int(task.fields.get("tokens", 0))
        rate = tokens / elapsed if elapsed > 0 else 0.0
        return Text(f"{rate:,.0f} tok/s", style="progress.data.speed")


class _Waiting(ProgressColumn):
    def render(self, task: Task) -> Text:
        waited = float(task.fields.get("waiting", 0.0))
        if not waited:
            return Text("")
        return Text(f"waiting for queue room {waited:.0f}s", style="yellow")


class _Failures(ProgressColumn):
    def render(self, task: Task) -> Text:
        failed = int(task.fields.get("failed", 0))
        return Text(f"{failed} failed", style="bold red" if failed else "dim")


class TerminalReporter(Reporter):
    """A rich progress bar on a terminal; failures and notes print above it."""

    live = True

    def __init__(self, console: Console, *, stdout_is_terminal: bool) -> None:
        super().__init__(console.file)
        self.console = console
        self._stdout_is_terminal = stdout_is_terminal
        self._progress = Progress(
            TextColumn("[bold]job {task.fields[job]}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("items"),
            _Failures(),
            _TokensPerSecond(),
            TimeElapsedColumn(),
            _Waiting(),
            console=console,
            # Results may go to a file or pipe while the bar is on the
            # terminal: rich must not reroute stdout into the bar's stream.
            redirect_stdout=False,
            redirect_stderr=False,
        )
        self._task: TaskID | None = None

    def start(self, job_id: str, total: int) -> None:
        self.job_id = job_id
        self.tally.total = total
        self.tally.started = time.monotonic()
        self._task = self._progress.add_task(
            "", total=total, job=job_id, failed=0, tokens=0, waiting=0.0
        )
        self._progress.start()

    def waiting(self, seconds: float) -> None:
        # The bar itself says so: no note line per wait.
        self.tally.waiting = seconds
        self._tick()

    def note(self, message: str) -> None:
        self._progress.console.print(Text(f"kvmux: {message}"), soft_wrap=True)

    def stop(self) -> None:
        if self._task is not None:
            self._refresh()
        self._progress.stop()

    def stdout_writer(self) -> ResultWriter:
        if not self._stdout_is_terminal:
            return super().stdout_writer()
        # Both streams are this terminal: print through the bar's console so
        # result lines scroll above the bar instead of tearing it.
        return ResultWriter(
            lambda text: self._progress.console.print(
                Text(text.rstrip("\n")), soft_wrap=True, highlight=False
            ),
            lambda: None,
        )

    def _tick(self) -> None:
        self._refresh()

    def _refresh(self) -> None:
        if self._task is not None:
            self._progress.update(
                self._task,
                total=self.tally.total,
                completed=self.tally.done,
                failed=self.tally.failed,
                tokens=self.tally.tokens,
                waiting=self.tally.waiting,
            )


def make_reporter(*, quiet: bool = False) -> Reporter:
    """The bar when stderr is a terminal (and not ``quiet``), plain lines otherwise."""
    console = Console(file=sys.stderr)
    if not quiet and console.is_interactive:
        return TerminalReporter(console, stdout_is_terminal=sys.stdout.isatty())
    return Reporter(sys.stderr, quiet=quiet)
