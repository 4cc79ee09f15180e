"""The ``kvmux`` command line: submit JSONL batches, stream completions, watch kvmuxd.

One module per concept: :mod:`.main` (parser, exit statuses), :mod:`.batch`
(input lines), :mod:`.results` (output lines), :mod:`.progress` (stderr
display), and a module per command family (:mod:`.jobs`, :mod:`.generate`,
:mod:`.status`, :mod:`.logs`).
"""

from .main import main

__all__ = ["main"]
