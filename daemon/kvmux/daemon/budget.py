"""What valid requests may cost the daemon: a budget per connection and per owner.

Malformed frames have their own budget (the server's); this one is for the
requests that are perfectly valid and still cost the event loop something to
answer — a results page, an attach, a status. A flood of them would take the
loop's time from everyone's decoding, so each connection and each owner (see
:mod:`.access`) gets a token bucket of *event-loop seconds*: it fills at
``rate`` seconds per second up to ``burst``, and each request is charged what
it took to handle, measured as the loop thread's CPU time (not the time it
waited for the GIL while the model thread held it), plus what sending its
reply costs outside the loop (libzmq's I/O thread and the kernel copying it,
about two nanoseconds a byte: a flood of large pages costs those more than
the loop). A request that finds its connection's or its owner's bucket empty
is answered ``overloaded`` with a ``retry_after`` (the time until it is
positive again), before anything is built for it. A refusal is not charged
(a client that waits as told would otherwise be refused for ever): a flood is
served at the rate its budget refills, and refused, at the cost of the
cheapest answer there is, the rest of the time.

Requests that only release things (cancel, detach, bye, heartbeats) are
never refused, only charged. The budget knows nothing of ZeroMQ or HTTP:
both fronts charge the same owners' buckets.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from kvmux.client.errors import Overloaded

from .config import BudgetConfig

# What answering any request costs beyond the part that is timed (receiving
# it, encoding and sending the reply): measured ~20-40 us on this machine.
REQUEST_OVERHEAD_SECONDS = 50e-6
# What sending a reply costs beyond the loop, per byte (libzmq's I/O thread and the
# kernel copying it, and the reader taking it): about 500 MB/s of replies a core.
BYTE_SECONDS = 2e-9
# Bounds of the retry_after hint: not a busy loop, not an eternity.
_RETRY_MIN = 0.01
_RETRY_MAX = 5.0


@dataclass(slots=True)
class Bucket:
    """Event-loop seconds one connection or owner may still spend (negative: in debt)."""

    rate: float
    burst: float
    level: float
    at: float

    def refill(self, now: float) -> float:
        self.level = min(self.burst, self.level + (now - self.at) * self.rate)
        self.at = now
        return self.level

    def wait(self) -> float:
        """Seconds until the level is positive again (0 if it is)."""
        if self.level > 0 or self.rate <= 0:
            return 0.0
        return -self.level / self.rate


class RequestBudget:
    """The owners' buckets, and the rule both fronts apply with a connection's own."""

    def __init__(self, cfg: BudgetConfig) -> None:
        self.cfg = cfg
        self._owners: dict[str, Bucket] = {}
        self.refused = 0

    def connection(self) -> Bucket:
        """A new connection's bucket, full."""
        cfg = self.cfg
        return Bucket(cfg.connection_rate, cfg.connection_burst, cfg.connection_burst, _now())

    def _owner(self, owner: str, now: float) -> Bucket:
        bucket = self._owners.get(owner)
        if bucket is None:
            cfg = self.cfg
            bucket = Bucket(cfg.owner_rate, cfg.owner_burst, cfg.owner_burst, now)
            self._owners[owner] = bucket
        return bucket

    def check(self, conn: Bucket, owner: str) -> None:
        """Raise :class:`Overloaded` (with ``retry_after``) when ``conn`` or ``owner``
        has spent its budget; nothing is built for such a request."""
        now = _now()
        waits = []
        if self.cfg.connection_rate > 0 and conn.refill(now) <= 0:
            waits.append(("connection", conn.wait()))
        if self.cfg.owner_rate > 0 and (bucket := self._owner(owner, now)).refill(now) <= 0:
            waits.append(("owner", bucket.wait()))
        if not waits:
            return
        self.refused += 1
        which, wait = max(waits, key=lambda w: w[1])
        retry = round(min(_RETRY_MAX, max(_RETRY_MIN, wait)), 3)
        raise Overloaded(
            f"too many requests: this {which}'s request budget is spent "
            f"(budget.{which}_rate {getattr(self.cfg, which + '_rate'):g} s of daemon time a "
            f"second); retry in {retry:g} s",
            {"retry_after": retry, "budget": which},
        )

    def charge(self, conn: Bucket | None, owner: str, seconds: float, reply_bytes: int) -> None:
        """Charge a handled request's cost to ``conn`` and ``owner``: the loop
        ``seconds`` it took and the ``reply_bytes`` it sent."""
        cost = seconds + REQUEST_OVERHEAD_SECONDS + reply_bytes * BYTE_SECONDS
        now = _now()
        if conn is not None and self.cfg.connection_rate > 0:
            conn.refill(now)
            conn.level -= cost
        if self.cfg.owner_rate > 0:
            bucket = self._owner(owner, now)
            bucket.refill(now)
            bucket.level -= cost

    def prune(self) -> None:
        """Forget owners whose bucket is full again (a long-lived daemon sees many)."""
        forget_full(self._owners)


def forget_full(buckets: dict[Any, Bucket]) -> None:
    """Drop the buckets that are full again: spent nothing lately, they are what a new
    one would be."""
    now = _now()
    for key in [k for k, b in buckets.items() if b.refill(now) >= b.burst]:
        del buckets[key]


def _now() -> float:
    return time.monotonic()
