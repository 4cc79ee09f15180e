"""Named failpoints at each fallible growth step, armed by tests or KVMUX_FAILPOINTS.

``KVMUX_FAILPOINTS="kv.copy_prefix"`` fails that step every time;
``"kv.copy_prefix=2,kv.allocate=1"`` fails the next two copies and the next
allocation. ``"engine.run@s7"`` fails only hits that name the key ``s7`` (a
batched run that holds session ``s7``'s row, say). ``"kv.allocate!RuntimeError"``
raises a plain ``RuntimeError`` instead of :class:`InjectedFault`: what a library
raises that nobody planned for (see :data:`ERRORS`). :func:`slow` makes a step
sleep instead of fail, to hold a race window open in tests. Unarmed,
:func:`hit` is two truthiness tests of empty dicts.

A process arms what the variable names by calling :func:`arm_from_env` once
every failpoint it has is registered (kvmuxd does at start): read at import,
the names the engine registers later (``engine.run``) would be refused.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

from ._errors import InjectedFault, KvConfigError

ENV = "KVMUX_FAILPOINTS"
ALWAYS = -1

_known: set[str] = {
    "kv.allocate",
    "kv.copy_prefix",
    "kv.fork",
    "kv.build_mask",
    "kv.invalidate_capture",
    "kv.clear_row",
}
_armed: dict[str, int] = {}
_errors: dict[str, type[Exception]] = {}
#: What an armed failpoint may raise instead of :class:`InjectedFault`, by name.
ERRORS: dict[str, type[Exception]] = {
    "RuntimeError": RuntimeError,
    "ValueError": ValueError,
    "KeyError": KeyError,
    "OSError": OSError,
}
_slow: dict[str, float] = {}
_keys: dict[str, str] = {}
_lock = threading.Lock()


def register(name: str) -> None:
    """Declare a failpoint name outside kv (an engine step, say) so it can be armed."""
    _known.add(name)


def known() -> frozenset[str]:
    return frozenset(_known)


def arm(
    name: str,
    times: int = ALWAYS,
    *,
    key: str | None = None,
    error: type[Exception] | None = None,
) -> None:
    """Fail ``name`` the next ``times`` hits (``ALWAYS``: until disarmed).

    With ``key``, only hits that name that key count (and fail). ``error``: raise
    that type (with a message naming the failpoint) instead of :class:`InjectedFault`.
    """
    if name not in _known:
        raise KvConfigError(f"unknown failpoint {name!r}; known: {', '.join(sorted(_known))}")
    if times != ALWAYS and times <= 0:
        raise KvConfigError(f"failpoint {name} count must be positive, got {times}")
    with _lock:
        _armed[name] = times
        if error is None:
            _errors.pop(name, None)
        else:
            _errors[name] = error
        if key is None:
            _keys.pop(name, None)
        else:
            _keys[name] = key


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
            _keys.clear()
            _errors.clear()
        else:
            _armed.pop(name, None)
            _slow.pop(name, None)
            _keys.pop(name, None)
            _errors.pop(name, None)


def active(name: str) -> bool:
    """Whether ``name`` is armed or slowed (a caller may then take its slow path)."""
    return name in _slow or name in _armed


def any_active() -> bool:
    """Whether any failpoint is armed or slowed."""
    return bool(_slow or _armed)


def armed() -> dict[str, int]:
    with _lock:
        return dict(_armed)


@contextmanager
def armed_for(
    name: str,
    times: int = ALWAYS,
    *,
    key: str | None = None,
    error: type[Exception] | None = None,
) -> Iterator[None]:
    """Arm ``name`` inside a ``with`` block only."""
    arm(name, times, key=key, error=error)
    try:
        yield
    finally:
        disarm(name)


def delay(name: str) -> None:
    """Sleep if ``name`` is slowed; never raise (a step of many rows at once: its rows'
    failures are hit one by one elsewhere)."""
    if _slow:
        seconds = _slow.get(name)
        if seconds is not None:
            time.sleep(seconds)


def hit(name: str, keys: Iterable[str] = ()) -> None:
    """Sleep if ``name`` is slowed; raise :class:`InjectedFault` if it is armed
    (for one of ``keys``, when it was armed with a key)."""
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
        key = _keys.get(name)
        if key is not None and key not in keys:
            return
        error = _errors.get(name)
        if remaining != ALWAYS:
            if remaining <= 1:
                del _armed[name]
                _errors.pop(name, None)
            else:
                _armed[name] = remaining - 1
    where = name if key is None else f"{name}@{key}"
    if error is not None:
        raise error(f"failpoint {where}: an unplanned {error.__name__}")
    raise InjectedFault(where)


def parse_spec(spec: str) -> dict[str, int]:
    """Parse ``"a,b=2,c@k,d!RuntimeError"`` into ``{"a": ALWAYS, "b": 2, "c@k": ALWAYS,
    "d!RuntimeError": ALWAYS}``; errors name the bad part."""
    parsed: dict[str, int] = {}
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            continue
        target, sep, count = part.partition("=")
        target, bang, error = target.strip().partition("!")
        name, _, key = target.strip().partition("@")
        target = name if not key else f"{name}@{key}"
        if bang:
            if error not in ERRORS:
                raise KvConfigError(
                    f"{ENV}: {name} may raise one of {', '.join(ERRORS)}, not {error!r}"
                )
            target = f"{target}!{error}"
        if name not in _known:
            raise KvConfigError(
                f"{ENV}: unknown failpoint {name!r}; known: {', '.join(sorted(_known))}"
            )
        if not sep:
            parsed[target] = ALWAYS
            continue
        if not count.strip().isdigit() or int(count) <= 0:
            raise KvConfigError(
                f"{ENV}: count for {name} must be a positive integer, got {count!r}"
            )
        parsed[target] = int(count)
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
    """Arm what ``KVMUX_FAILPOINTS`` names; an invalid spec (an unknown name, a bad
    count) is an error, not ignored. Call it after the process's last
    :func:`register`."""
    spec = os.environ.get(ENV, "")
    parsed = parse_spec(spec)
    for target, times in parsed.items():
        target, _, error = target.partition("!")
        name, _, key = target.partition("@")
        arm(name, times, key=key or None, error=ERRORS[error] if error else None)
    return parsed
