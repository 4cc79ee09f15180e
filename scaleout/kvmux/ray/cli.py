"""``kvmux-ray submit``: one batch file over N kvmux replicas on Ray, written as ``kvmux submit``
writes it.

Exit status as ``kvmux``'s: 0 every line ok, 2 some lines failed, 1 nothing
could run (bad command line or config, no Ray cluster at ``--address``, a
replica that cannot start), 130 interrupted (Ctrl-C), 143 stopped by SIGTERM.
Either signal stops the command as it stops ``kvmux``'s
(:mod:`kvmux.client.cli.interrupt`): within 2 s, with every result received
on disk for ``--resume``; a second one at once.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import logging
import math
import os
import sys
import warnings
from collections.abc import Sequence
from typing import Any, NoReturn

import msgspec

from kvmux.client import protocol as p
from kvmux.client.cli import interrupt
from kvmux.client.cli.connect import COULD_NOT_RUN, INTERRUPTED, ITEMS_FAILED, OK, CliError
from kvmux.client.cli.progress import Reporter, failure_label, make_reporter
from kvmux.daemon.config import ConfigError

from ._formats import Outputs, done_ids, open_outputs, resolve_format
from ._processor import ProcessorConfig, build_processor
from ._rows import entry

# Enough object store for a big file's rows and results in flight; Ray spills past it.
_OBJECT_STORE_BYTES = 512 << 20

_EPILOG = """\
examples:
  kvmux-ray submit prompts.jsonl --out results.jsonl --replicas 2 --cpus-per-replica 1
  kvmux-ray submit s3://bucket/batch.jsonl --out out.jsonl --replicas 8 --gpus-per-replica 1 \\
      --config /etc/kvmux/kvmuxd.toml --address auto
  kvmux-ray submit big.jsonl --out results.jsonl --replicas 2 --resume   # after an interrupted run

exit status: 0 all ok, 2 some lines failed, 1 nothing could run, 130 interrupted,
  143 stopped by SIGTERM
"""


class _Parser(argparse.ArgumentParser):
    """argparse, but a bad command line exits 1: 2 means "some lines failed" here."""

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        self.exit(COULD_NOT_RUN, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="kvmux-ray",
        description="Run kvmux batch files on a Ray cluster: one kvmuxd per replica.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    s = sub.add_parser(
        "submit",
        help="Run a JSONL batch file over N replicas and write one result per line (or choice).",
        description="Each replica is a Ray actor that owns one kvmuxd (started with --config,\n"
        "on the GPU or CPUs Ray gives it); Ray Data spreads the file's lines over them and\n"
        "runs a dead replica's lines again. Lines and results are those of `kvmux submit`:\n"
        "kvmux items or OpenAI batch lines in, the same result lines out, written as they\n"
        "finish (sort by line for input order).",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    s.add_argument("file", metavar="FILE", help="the batch file: a local path or any URI Ray reads")
    s.add_argument(
        "-o",
        "--out",
        metavar="OUT",
        required=True,
        help="results file (JSONL): as kvmux submit's --out, an existing file is replaced only "
        "when the run completes (results go to OUT.partial until then)",
    )
    s.add_argument("--errors", metavar="FILE", help="failed lines go here instead of --out")
    s.add_argument(
        "--format",
        choices=["auto", "kvmux", "openai"],
        default="auto",
        help="result lines in kvmux's shape or OpenAI's batch output shape (default: auto, "
        "OpenAI's when the file's lines are OpenAI batch lines)",
    )
    s.add_argument("--replicas", type=_count, required=True, metavar="N", help="kvmuxd replicas")
    s.add_argument("--config", metavar="FILE", help="kvmuxd config for every replica")
    s.add_argument(
        "--address",
        metavar="ADDR",
        help="the Ray cluster to run on (host:port, ray://..., or auto); default: start a "
        "local Ray on this machine for the run",
    )
    share = s.add_mutually_exclusive_group()
    share.add_argument(
        "--gpus-per-replica", type=_share, metavar="G", help="GPUs per replica (may be 0.5)"
    )
    share.add_argument(
        "--cpus-per-replica",
        type=_share,
        metavar="C",
        help="CPUs per replica, its daemon's onnxruntime threads (default: 1)",
    )
    s.add_argument(
        "--batch-size", type=_count, default=64, metavar="B", help="lines per job (default: 64)"
    )
    s.add_argument(
        "--resume",
        action="store_true",
        help="skip the lines whose custom_id already has an ok result in --out (or its "
        ".partial) and append the new results to it; failed lines run again",
    )
    s.add_argument("-q", "--quiet", action="store_true", help="no progress output on stderr")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one ``kvmux-ray`` command; the return value is the exit status."""
    args = build_parser().parse_args(argv)
    try:
        return interrupt.run_blocking(lambda: submit(args))
    except CliError as exc:
        print(f"kvmux-ray: {exc}", file=sys.stderr)
        return COULD_NOT_RUN


def submit(args: argparse.Namespace) -> int:
    try:
        config = ProcessorConfig.from_file(
            args.config,
            replicas=args.replicas,
            cpus_per_replica=args.cpus_per_replica or 1.0,
            gpus_per_replica=args.gpus_per_replica or 0.0,
            batch_size=args.batch_size,
        )
    except (OSError, ConfigError, UnicodeDecodeError) as exc:
        raise CliError(f"--config: {exc}") from None
    skip = done_ids(args.out) if args.resume else set()
    import ray

    _start_ray(args, config)
    try:
        with make_reporter(quiet=args.quiet) as reporter:
            return _run(args, config, skip, reporter)
    finally:
        # Interrupted, Ray is left to end with this process (run_blocking ends it next):
        # a local Ray's processes share its fate (Ray starts them with a parent-death
        # signal), and a cluster drops a gone driver's actors, so the replicas and their
        # daemons go either way. ray.shutdown would wait a second for each of its
        # processes, and Ray Data's threads, still running, make Ray's core worker end
        # the process with status 1 when they touch it after a shutdown.
        if ray.is_initialized() and interrupt.interrupted_status() is None:
            ray.shutdown()  # a local Ray ends here, and every replica and daemon with it


def _run(
    args: argparse.Namespace, config: ProcessorConfig, skip: set[str], reporter: Reporter
) -> int:
    from ._read import read_batch

    try:
        # A block a batch: Ray Data hands each to the replica with the least queued,
        # and a replica that dies takes back only what it had.
        batch = read_batch(args.file, skip=skip, rows_per_block=args.batch_size)
    except OSError as exc:
        raise CliError(f"cannot read {args.file}: {exc.strerror or exc}") from None
    if batch.rows == 0:
        if batch.skipped:
            reporter.note(f"every line of {args.file} has a result in {args.out}: nothing to run")
            return OK
        raise CliError(f"{args.file} holds no items (every line is blank)")
    fmt = resolve_format(args.format, batch.openai)
    outputs = open_outputs(fmt, args.out, args.errors, None, resume=args.resume)
    if not batch.items:
        # As kvmux submit: each line's reason, and no replica started for nothing.
        for row in batch.dataset.iter_rows():
            refused = entry(row).refused
            assert refused is not None
            outputs.sink.refused(refused)
            reporter.note(failure_label(refused.custom_id, refused.to_info(), line=refused.line))
        outputs.finish()
        reporter.note(f"no line of {args.file} is a valid item: nothing ran")
        return COULD_NOT_RUN
    process = build_processor(dataclasses.replace(config, format=fmt))
    total = batch.items + batch.refused if fmt == "kvmux" else batch.rows
    reporter.start(f"ray x{config.replicas}", total)
    written: set[tuple[str, int, int]] = set()
    nodes: collections.Counter[str] = collections.Counter()
    replicas: dict[str, set[str]] = collections.defaultdict(set)
    duplicates = 0
    try:
        for block in process(batch.dataset).iter_batches(batch_format="pyarrow", batch_size=None):
            for row in block.to_pylist():
                key = (row["custom_id"], row["line"], row["choice"])
                if key in written:
                    duplicates += 1  # Ray ran a batch twice: its first results stand
                    continue
                written.add(key)
                _write(outputs, row)
                nodes[row["node"]] += 1
                replicas[row["node"]].add(row["replica"])
                reporter.tokens(row["tokens"])
                reporter.item(row["ok"], None if row["ok"] else _failure(row))
            if interrupt.interrupted_status() is not None:
                # The signal's own KeyboardInterrupt was lost on its way out of Ray Data.
                raise KeyboardInterrupt
    except KeyboardInterrupt:
        outputs.close()
        reporter.stop()
        reporter.note(f"interrupted; {len(written)} of {total} results written (--resume goes on)")
        return INTERRUPTED
    except Exception as exc:  # noqa: BLE001 - Ray's errors carry the replica's traceback
        outputs.close()
        reporter.stop()
        raise CliError(f"the run failed: {exc}") from None
    outputs.finish()
    reporter.stop()
    if duplicates:
        reporter.note(f"{duplicates} result(s) of batches Ray ran twice were dropped")
    if batch.skipped:
        reporter.note(f"--resume: {batch.skipped} line(s) had results already")
    spread = ", ".join(
        f"{node[:12]}: {n} from {len(replicas[node])} replica(s)"
        for node, n in sorted(nodes.items())
    )
    reporter.note(f"results by node: {spread}")
    reporter.note(f"{reporter.tally.summary()}; results in {args.out}")
    return ITEMS_FAILED if reporter.tally.failed else OK


def _write(outputs: Outputs, row: dict[str, Any]) -> None:
    data = row["output"].encode() + b"\n"
    files = outputs.files
    # open_outputs lists --out first, then --errors when it is given.
    (files[0] if row["ok"] or len(files) == 1 else files[1]).write(data)


def _failure(row: dict[str, Any]) -> str:
    obj = msgspec.json.decode(row["output"])
    response = obj.get("response") or {}
    error = obj.get("error") or (response.get("body") or {}).get("error") or {}
    info = p.ErrorInfo(code=str(error.get("code")), message=str(error.get("message")))
    return failure_label(row["custom_id"], info, line=row["line"])


def _start_ray(args: argparse.Namespace, config: ProcessorConfig) -> None:
    import ray
    import ray.data

    # Offline by default: no usage report from a batch job.
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    try:
        if args.address is not None:
            ray.init(address=args.address, logging_level=logging.WARNING)
        else:
            # A GPU replica's actor takes one CPU beside its GPU.
            per_replica = 1.0 if config.gpus_per_replica else config.cpus_per_replica
            need = math.ceil(config.replicas * per_replica)
            ray.init(
                address="local",
                num_cpus=max(os.cpu_count() or 1, need),
                include_dashboard=False,
                object_store_memory=_OBJECT_STORE_BYTES,
                logging_level=logging.WARNING,
            )
    except (ConnectionError, RuntimeError, ValueError) as exc:
        raise CliError(f"cannot start or reach Ray ({args.address or 'local'}): {exc}") from None
    # ray.init makes SIGTERM sys.exit(15), which unwinds through Ray's waits as it likes.
    interrupt.reclaim_signals()
    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False  # the command draws its own
    ctx.print_on_execution_start = False
    logging.getLogger("ray.data").setLevel(logging.ERROR)
    # Ray Data warns when a small file gives fewer blocks than replicas: the command
    # sizes blocks itself, so it is no news to its user.
    warnings.filterwarnings("ignore", category=UserWarning, module=r"ray\.data\.")


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {text}")
    return value


def _share(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value
