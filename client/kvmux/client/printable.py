"""Model text as a terminal can show it: control bytes and undecodable bytes escaped."""

from __future__ import annotations

import re

# C0 and C1 controls but newline and tab, DEL, and U+FFFD (what bytes that were not
# UTF-8 decode to): a terminal acts on the first (an escape sequence can clear it or
# retitle it) and shows nothing useful for the rest.
_UNSHOWABLE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\ufffd]")


def printable(text: str) -> str:
    """``text`` with what a terminal cannot show written as Python escapes (``\\x1b``,
    ``\\ufffd``); newlines and tabs kept."""
    return _UNSHOWABLE.sub(lambda m: m.group().encode("unicode_escape").decode(), text)
