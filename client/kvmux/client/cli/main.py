"""The ``kvmux`` command line: its parser, and the one place errors become exit statuses.

Exit status: 0 all items succeeded (or the command did what it was asked),
2 the job ran and some items failed, 1 nothing could run (daemon
unreachable, job refused, bad command line), 130 interrupted (Ctrl-C), 143
terminated (SIGTERM). Either signal stops a command within 2 s whatever the
daemon does, a second one at once (see :mod:`.interrupt`).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, NoReturn

from .. import __version__
from ..endpoint import ENDPOINT_ENV
from ..errors import KvmuxError
from ..protocol import DEFAULT_MAX_NEW_TOKENS
from . import generate, interrupt, jobs, logs, status
from .connect import COULD_NOT_RUN, INTERRUPTED, CliError

Command = Callable[[argparse.Namespace], Coroutine[Any, Any, int]]

_DESCRIPTION = """\
kvmux: submit batched LLM jobs to kvmuxd, stream completions, watch the daemon.

Every command talks to kvmuxd at --endpoint, else $KVMUX_ENDPOINT, else the
default socket (the system service's /run/kvmux/kvmuxd.sock if it exists,
else the one a hand-started kvmuxd uses).
"""

_EPILOG = """\
examples:
  kvmuxd --config configs/local.toml >kvmuxd.log 2>&1 &   # a daemon for this user
  kvmux status --wait 120                   # wait until it answers
  kvmux submit examples/prompts.jsonl --out results.jsonl
  kvmux submit examples/openai-chat.jsonl --out out.jsonl   # OpenAI batch output
  kvmux generate "Once upon a time" --max-tokens 40
  kvmux logs -f

exit status: 0 all ok, 2 some items failed, 1 nothing could run, 130 interrupted
(Ctrl-C), 143 terminated (SIGTERM). A first Ctrl-C stops within 2 s (what was
received is on disk; a submitted job is cancelled, a re-attached one left running),
a second at once.
"""


class _Parser(argparse.ArgumentParser):
    """argparse, but a bad command line exits 1: 2 means "some items failed" here."""

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        self.exit(COULD_NOT_RUN, f"{self.prog}: error: {message}\n")


def _common() -> _Parser:
    common = _Parser(add_help=False)
    common.add_argument(
        "--endpoint",
        metavar="URL",
        help="kvmuxd's ZeroMQ endpoint (ipc://PATH or tcp://HOST:PORT; a bare /PATH or "
        f"HOST:PORT is taken as one); default ${ENDPOINT_ENV}, else the default socket",
    )
    common.add_argument(
        "--timeout",
        type=_positive,
        default=10.0,
        metavar="S",
        help="seconds to wait for each answer from the daemon (default: 10)",
    )
    return common


def _quiet(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress output on stderr")


def _out(parser: argparse.ArgumentParser, *, auto: str) -> None:
    parser.add_argument(
        "-o",
        "--out",
        metavar="FILE",
        help="write results (JSONL) to FILE instead of stdout. FILE is not touched before "
        "the first result: if it exists, results go to FILE.partial beside it, renamed over "
        "FILE when the job completes (an interrupted run leaves FILE as it was and "
        "FILE.partial with the results so far: --resume continues it)",
    )
    parser.add_argument(
        "--errors",
        metavar="FILE",
        help="write failed lines to FILE instead of --out (as the Batch API's error file)",
    )
    parser.add_argument(
        "--format",
        choices=["auto", "kvmux", "openai"],
        default="auto",
        help="result lines in kvmux's shape or OpenAI's batch output shape "
        f"(default: auto, {auto})",
    )


def _wait_daemon(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--wait-daemon",
        type=_non_negative,
        default=300.0,
        metavar="S",
        help="if kvmuxd goes away mid-job (a restart), wait up to S seconds for it and "
        "re-attach (default: 300; 0: fail at once)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="kvmux",
        description=_DESCRIPTION,
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    common = [_common()]

    def command(
        name: str, run: Command, summary: str, description: str, examples: str
    ) -> argparse.ArgumentParser:
        p = sub.add_parser(
            name,
            parents=common,
            help=summary,
            description=f"{summary}\n\n{description}",
            epilog=f"examples:\n{examples}",
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        p.set_defaults(run=run)
        return p

    p = command(
        "submit",
        jobs.submit,
        "Run a batch of prompts from a JSONL file and collect one result per line.",
        'Each line is a kvmux item ({"custom_id", "prompt" | "prompt_tokens" | "messages",\n'
        '"max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "n", ...}) or an\n'
        'OpenAI batch line ({"custom_id", "method": "POST", "url": "/v1/chat/completions"\n'
        'or "/v1/completions", "body": {...}}), as vllm run-batch and the Batch API take them.\n'
        "A line that does not parse gets its own error result; the rest of the job runs.\n"
        'Results are JSON lines written as items finish (sort by "line" for input order),\n'
        "in OpenAI's batch output shape when the file is OpenAI's (--format); progress goes\n"
        "to stderr. With --detach the job keeps running after kvmux exits and its id is\n"
        "printed; collect it later with `kvmux results JOB_ID`.\n"
        "Exit status: 0 all ok, 2 some lines failed, 1 the job could not run (or no line\n"
        "of the file parsed).",
        "  kvmux submit examples/prompts.jsonl --out results.jsonl\n"
        "  kvmux submit examples/openai-chat.jsonl --out out.jsonl --errors errors.jsonl\n"
        "  kvmux submit big.jsonl --out results.jsonl --resume   # after an interrupted run\n"
        "  kvmux submit batch.jsonl | jq -r 'select(.status == \"ok\") | .text'\n"
        '  JOB=$(kvmux submit --detach batch.jsonl) && kvmux results "$JOB" --out results.jsonl',
    )
    p.add_argument("file", metavar="FILE.jsonl", help="the batch file; - reads stdin")
    _out(p, auto="OpenAI's when the file's lines are OpenAI batch lines")
    p.add_argument(
        "--resume",
        action="store_true",
        help="skip the lines whose custom_id already has an ok result in --out (or "
        "--out's .partial) and append the new results to it; failed lines run again",
    )
    _wait_daemon(p)
    p.add_argument(
        "--detach",
        action="store_true",
        help="submit, print the job id and exit; the job runs on without this client",
    )
    _quiet(p)

    p = command(
        "results",
        jobs.results,
        "Re-attach to a job and write all of its results (waiting for the rest).",
        "Results that finished already come at once, the rest as they finish; a client\n"
        "still watching the job keeps its events too, and the lines its file refused come\n"
        "back as error results. The format is the submitted file's unless --format says.\n"
        "Exit status: 0 all ok, 2 some items failed, 1 no such job or no daemon.",
        "  kvmux results 3f9c2a1b7d4e --out results.jsonl",
    )
    p.add_argument("job_id", metavar="JOB_ID")
    _out(p, auto="the shape of the file the job was submitted from")
    _wait_daemon(p)
    _quiet(p)

    p = command(
        "generate",
        generate.generate,
        "Stream one completion of PROMPT to stdout as it decodes.",
        "PROMPT goes in as a user message of the model's chat template when it has one\n"
        "(as `ollama run` does; --system adds a system message before it), else as plain\n"
        "text; --raw sends it as plain text always. A run that generates no token says\n"
        "why on stderr. Sampling options default to the model's own (genai_config\n"
        '"search"). On a terminal, control bytes of the output are shown escaped.\n'
        "Exit status: 0 ok, 2 the item failed (the error is on stderr), 1 no daemon.",
        '  kvmux generate "What is the capital of France?"\n'
        '  kvmux generate "Once upon a time" --raw --max-tokens 40\n'
        '  kvmux generate "Name a color." --system "Answer in one word."\n'
        "  echo 'Tell me a story' | kvmux generate - --temperature 0.8 --seed 7",
    )
    p.add_argument("prompt", metavar="PROMPT", help="the prompt text; - reads stdin")
    p.add_argument(
        "--raw",
        action="store_true",
        help="send PROMPT as plain text, without the model's chat template",
    )
    p.add_argument("--system", metavar="TEXT", help="a system message before PROMPT")
    p.add_argument(
        "--max-tokens",
        type=int,
        metavar="N",
        help=f"most tokens to generate (default: {DEFAULT_MAX_NEW_TOKENS}; the daemon's "
        "scheduler.max_new_tokens bounds it)",
    )
    p.add_argument("--temperature", type=float, metavar="T", help="0 = greedy")
    p.add_argument("--top-p", type=float, metavar="P")
    p.add_argument("--top-k", type=int, metavar="K")
    p.add_argument("--seed", type=int, metavar="N")
    p.add_argument(
        "--stop", action="append", default=[], metavar="TEXT", help="stop at TEXT (repeatable)"
    )
    p.add_argument("--max-context", type=int, metavar="N", help="cap this item's KV length")
    p.add_argument("--ignore-eos", action="store_true", help="keep going past end-of-sequence")

    p = command(
        "status",
        status.status,
        "Show the daemon's state, model, sessions, KV memory and growth counters.",
        "--json prints the full status object (one line) for scripts. --wait keeps\n"
        "trying to connect, for a script that has just started kvmuxd.\n"
        "Exit status: 0 the daemon answered, 1 it did not.",
        "  kvmux status\n  kvmux status --json | jq .kv_bytes_in_use\n  kvmux status --wait 120",
    )
    p.add_argument("--json", action="store_true", help="print the status as one JSON object")
    p.add_argument(
        "--wait",
        type=_non_negative,
        default=0.0,
        metavar="S",
        help="wait up to S seconds until the daemon answers and has loaded its model",
    )

    p = command(
        "jobs",
        jobs.list_jobs,
        "List your jobs (every job for an operator): running and finished, oldest first.",
        "Finished jobs stay listed for jobs.retention; with a journal, across restarts.\n"
        "Exit status: 0 listed, 1 no daemon.",
        "  kvmux jobs\n  kvmux jobs --json | jq -r 'select(.state == \"done\") | .job_id'",
    )
    p.add_argument("--json", action="store_true", help="one JSON object per job and line")

    command(
        "cancel",
        jobs.cancel,
        "Cancel a job: its queued and running items end with the error `cancelled`.",
        "Exit status: 0 cancelled, 1 no such job or no daemon.",
        "  kvmux cancel 3f9c2a1b7d4e",
    ).add_argument("job_id", metavar="JOB_ID")

    p = command(
        "logs",
        logs.logs,
        "Show the daemon's structured log events: pretty on a terminal, JSON lines otherwise.",
        "The daemon streams events live and keeps no history (journalctl -u kvmuxd or its\n"
        "log.file has the past). Without -f this shows what arrives within --window seconds;\n"
        "-f follows until Ctrl-C (exit status 130). With --job it ends at that job's\n"
        "job_finished event (exit status 0).",
        "  kvmux logs -f\n  kvmux logs -f --level warning\n  kvmux logs -f --job 3f9c2a1b7d4e",
    )
    p.add_argument("-f", "--follow", action="store_true", help="keep following until Ctrl-C")
    p.add_argument(
        "--level",
        choices=["debug", "info", "warning", "error", "critical"],
        default="info",
        help="least severe level shown (default: info)",
    )
    p.add_argument("--job", metavar="JOB_ID", help="only events of this job")
    p.add_argument(
        "--window",
        type=_positive,
        default=2.0,
        metavar="S",
        help="without -f: seconds to listen (default: 2)",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one ``kvmux`` command; the return value is the exit status."""
    args = build_parser().parse_args(argv)
    run: Command = args.run
    try:
        return interrupt.run(run(args))
    except (CliError, KvmuxError) as exc:
        print(f"kvmux: {exc}", file=sys.stderr)
        return COULD_NOT_RUN
    except KeyboardInterrupt:
        print("kvmux: interrupted", file=sys.stderr)
        return INTERRUPTED
    except BrokenPipeError:
        # The reader went away (`kvmux submit f | head`): nothing left to say to it.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return COULD_NOT_RUN


def _seconds(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None


def _positive(text: str) -> float:
    value = _seconds(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def _non_negative(text: str) -> float:
    value = _seconds(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value
