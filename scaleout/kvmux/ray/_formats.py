"""The one place kvmux.ray takes the CLI's batch-line parsing and result writing from.

A replica must read lines and write results exactly as ``kvmux submit``
does, so it uses that code itself, never a copy; every import of it is
here, so a move of that code is one edit.
"""

from __future__ import annotations

from kvmux.client.cli.batch import BatchReader, LineError, parse_line
from kvmux.client.cli.results import (
    Format,
    Outputs,
    ResultSink,
    done_ids,
    open_outputs,
    resolve_format,
)
from kvmux.client.openai import is_rejected

__all__ = [
    "BatchReader",
    "Format",
    "LineError",
    "Outputs",
    "ResultSink",
    "done_ids",
    "is_rejected",
    "open_outputs",
    "parse_line",
    "resolve_format",
]
