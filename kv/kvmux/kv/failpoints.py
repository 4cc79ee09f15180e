"""Named failpoints at each fallible growth step, armed by tests or KVMUX_FAILPOINTS.

``KVMUX_FAILPOINTS="kv.copy_prefix"`` fails that step every time;
``"kv.copy_prefix=2,kv.allocate=1"`` fails the next two copies and the next
allocation. :func:`slow` makes a step sleep instead of fail, to hold a race
window open in tests. Unarmed, :func:`hit` is two truthiness tests of empty dicts.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from ._errors import InjectedFault, KvConfigError

ENV = "KVMUX_FAILPOINTS"
ALWAYS = -1

_known: set[str] = {"kv.allocate", "kv.copy_prefix", "kv.build_mask", "kv.invalidate_capture"}
_armed: dict[str, int] = {}
_slow: dict[str, float] = {}
_lock = threading.Lock()


def register(name: str) -> None:
    """Declare a failpoint name outside kv (an engine step, say) so it can be armed."""
    _known.add(name)


def known() -> frozenset[str]:
    return frozenset(_known)


def arm(name: str, times: int = ALWAYS) -> None:
    """Fail ``name`` the next ``times`` hits (``ALWAYS``: until disarmed)."""
    if name not in _known:
        raise KvConfigError(f"unknown failpoint {name!r}; known: {', '.join(sorted(_known))}")
    if times != ALWAYS and times <= 0:
        raise KvConfigError(f"failpoint {name} count must be positive, got {times}")
    with _lock:
        _armed[name] = times


def slow(name: str, seconds: float) -> None:
    """Sleep ``seconds`` at every hit of ``name`` until disarmed (a slow copy, say)."""
    if name not in _known:
        raise KvConfigError(f"unknown failpoint {name!r}; known: {', '.join(sorted(_known))}")
    if not seconds > 0:
        raise KvConfigError(f"failpoint {name} delay must be positive, got {seconds}")
    with _lock:
        _slow[name] = seconds


def disarm(name: str | None = None) -> None:
    """Disarm one failpoint (its failure and its delay), or all of them."""
    with _lock:
        if name is None:
            _armed.clear()
            _slow.clear()
        else:
            _armed.pop(name, None)
            _slow.pop(name, None)


def armed() -> dict[str, int]:
    with _lock:
        return dict(_armed)


@contextmanager
def armed_for(name: str, times: int = ALWAYS) -> Iterator[None]:
    """Arm ``name`` inside a ``with`` block only."""
    arm(name, times)
    try:
        yield
    finally:
        disarm(name)


def hit(name: str) -> None:
    """Sleep if ``name`` is slowed; raise :class:`InjectedFault` if it is armed."""
    if _slow:
        delay = _slow.get(name)
        if delay is not None:
            time.sleep(delay)
    if not _armed:
        return
    with _lock:
        remaining = _armed.get(name)
        if remaining is None:
            return
        if remaining != ALWAYS:
            if remaining <= 1:
                del _armed[name]
            else:
                _armed[name] = remaining - 1
    raise InjectedFault(name)


def parse_spec(spec: str) -> dict[str, int]:
    """Parse ``"a,b=2"`` into ``{"a": ALWAYS, "b": 2}``; errors name the bad part."""
    parsed: dict[str, int] = {}
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            continue
        name, sep, count = part.partition("=")
        name = name.strip()
        if name not in _known:
            raise KvConfigError(
                f"{ENV}: unknown failpoint {name!r}; known: {', '.join(sorted(_known))}"
            )
        if not sep:
            parsed[name] = ALWAYS
            continue
        if not count.strip().isdigit() or int(count) <= 0:
            raise KvConfigError(
                f"{ENV}: count for {name} must be a positive integer, got {count!r}"
            )
        parsed[name] = int(count)
    return parsed


SLOW_ENV = "KVMUX_SLOW_FAILPOINTS"


def slow_from_env() -> dict[str, float]:
    """Slow what ``KVMUX_SLOW_FAILPOINTS`` names (``"scheduler.admit=2.5"``: seconds per
    hit), so a test can hold a race open in a process it starts. Called by the
    daemon once every failpoint is registered; a bad spec is an error."""
    parsed: dict[str, float] = {}
    for part in (p.strip() for p in os.environ.get(SLOW_ENV, "").split(",")):
        if not part:
            continue
        name, _, seconds = part.partition("=")
        try:
            delay = float(seconds)
        except ValueError:
            raise KvConfigError(
                f"{SLOW_ENV}: {name.strip()} needs a delay in seconds, got {seconds!r}"
            ) from None
        slow(name.strip(), delay)  # unknown names and bad delays raise
        parsed[name.strip()] = delay
    return parsed


def arm_from_env() -> dict[str, int]:
    """Arm what ``KVMUX_FAILPOINTS`` names; an invalid spec is an error, not ignored."""
    spec = os.environ.get(ENV, "")
    parsed = parse_spec(spec)
    for name, times in parsed.items():
        arm(name, times)
    return parsed


arm_from_env()
