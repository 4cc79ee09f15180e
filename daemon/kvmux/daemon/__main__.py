"""``kvmuxd --config FILE``: run the daemon until SIGTERM/SIGINT (``python -m kvmux.daemon``).

Exit status: 0 after a stop, 78 (EX_CONFIG) for a configuration the daemon
cannot start with (invalid config, model folder, KV setting, a job journal
that is corrupt, locked by another daemon or unwritable), 1 otherwise.
The first SIGTERM/SIGINT drains (``shutdown.grace``); a second one stops at
once. SIGHUP reopens the log file, for logrotate, and re-reads the CURVE
authorized keys.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import sys
from pathlib import Path

import anyio
import structlog

from kvmux.kv import KvConfigError

from .app import DAEMON_VERSION, Daemon
from .config import (
    EX_CONFIG,
    Config,
    ConfigError,
    load_config,
    with_endpoint,
    with_http,
    with_journal,
)
from .engine import EngineError
from .journal import JournalError
from .logs import close_log_file, configure_logging, reopen_log_file
from .model import ModelFormatError
from .server import EndpointInUse

log = structlog.get_logger("kvmux.daemon")


async def _signals(daemon: Daemon, scope: anyio.CancelScope) -> None:
    with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as signals:
        draining = False
        async for signum in signals:
            name = signal.Signals(signum).name
            if signum == signal.SIGHUP:
                reopen_log_file()
                log.info("log_reopened", signal=name)
                try:
                    daemon.reload()
                except Exception:
                    log.exception("reload_failed", signal=name)
            elif not draining:
                draining = True
                log.info("signal_received", signal=name, action="drain")
                daemon.stop()
            else:
                log.warning("signal_received", signal=name, action="stop_now")
                scope.cancel()


async def _run(daemon: Daemon) -> None:
    async with anyio.create_task_group() as tg:
        tg.start_soon(_signals, daemon, tg.cancel_scope)
        await daemon.serve()
        tg.cancel_scope.cancel()


def _leaf(exc: BaseException) -> BaseException:
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc


DIE_WITH_PARENT_ENV = "KVMUX_DIE_WITH_PARENT"
"""Set to 1, the daemon gets SIGTERM (and drains) when the process that started it
dies, however it dies: test suites and supervisors other than systemd set it, so a
killed parent leaves no daemon behind (the kernel's PR_SET_PDEATHSIG)."""

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    if os.environ.get(DIE_WITH_PARENT_ENV) != "1":
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() == 1:  # the parent died before the call: nobody left to signal it
        os.kill(os.getpid(), signal.SIGTERM)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="kvmuxd",
        description="kvmux daemon: many LLM decode sessions on one device, served over ZeroMQ.",
        epilog="example: kvmuxd --config configs/local.toml",
    )
    ap.add_argument("--config", type=Path, help="TOML config file (default: built-in defaults)")
    ap.add_argument(
        "--endpoint",
        help="listen here instead of server.endpoint (ipc://PATH or tcp://HOST:PORT)",
    )
    ap.add_argument(
        "--http",
        metavar="HOST:PORT",
        help='serve OpenAI\'s HTTP API here instead of http.listen ("" turns it off)',
    )
    ap.add_argument(
        "--journal",
        metavar="PATH",
        help='keep the job journal here instead of jobs.journal ("" keeps jobs in memory only)',
    )
    ap.add_argument("--version", action="version", version=f"%(prog)s {DAEMON_VERSION}")
    ap.add_argument(
        "--check-config", action="store_true", help="validate the config and exit (0 if valid)"
    )
    args = ap.parse_args(argv)
    try:
        config = load_config(args.config) if args.config else Config()
        if args.endpoint:
            config = with_endpoint(config, args.endpoint)
        if args.http is not None:
            config = with_http(config, args.http)
        if args.journal is not None:
            config = with_journal(config, args.journal)
    except ConfigError as exc:
        print(f"kvmuxd: invalid config: {exc}", file=sys.stderr)
        return EX_CONFIG
    if args.check_config:
        from .app import startup_problems  # what the daemon would refuse at start

        problems = startup_problems(config)
        for problem in problems:
            print(f"kvmuxd: invalid config: {problem}", file=sys.stderr)
        if problems:
            return EX_CONFIG
        print(f"kvmuxd: config {args.config or '(defaults)'} is valid")
        return 0
    try:
        configure_logging(
            level=config.log.level, fmt=config.log.format, file=config.log.file or None
        )
    except (OSError, ValueError) as exc:
        print(f"kvmuxd: cannot open log.file: {exc}", file=sys.stderr)
        return EX_CONFIG
    daemon = Daemon(config)
    try:
        _die_with_parent()
        anyio.run(_run, daemon)
    except BaseException as group:  # mapped to an exit status below
        err = _leaf(group)
        if isinstance(err, KeyboardInterrupt):
            return 0
        if isinstance(err, ModelFormatError | KvConfigError | ConfigError | JournalError):
            log.error("startup_failed", error=str(err), kind="config")
            return EX_CONFIG
        if isinstance(err, EngineError | EndpointInUse | OSError):
            log.error("startup_failed", error=str(err), kind=type(err).__name__)
            return 1
        log.critical("daemon_crashed", exc_info=err)
        return 1
    finally:
        # Stopped: a late second signal must not turn a clean exit into "killed".
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        close_log_file()
    return 0


if __name__ == "__main__":
    sys.exit(main())
