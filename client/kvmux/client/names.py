"""The known name nearest a misspelled one, for errors that say "did you mean ...?"."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


def nearest(name: str, known: Iterable[str]) -> str | None:
    """The known name ``name`` most likely misspells (``max_token``: ``max_tokens``), or
    None when none is close. Case is ignored for the comparison, not in the answer."""
    by_lower = {k.lower(): k for k in known}
    close = difflib.get_close_matches(name.lower(), list(by_lower), n=1, cutoff=0.75)
    return by_lower[close[0]] if close else None


def did_you_mean(name: str, known: Iterable[str], *, prefix: str = "") -> str:
    """``" (did you mean `max_tokens`?)"`` for a close known name (written after
    ``prefix``: ``body.``, ``[kv] ``), else ``""``: to append to an error naming ``name``."""
    found = nearest(name, known)
    return f" (did you mean `{prefix}{found}`?)" if found is not None else ""
