"""Who is asking: the owner a message comes from, and whether it may see everything.

A job belongs to the owner that submitted it. On an ipc socket the owner is
the connecting OS user, read from the kernel's peer credentials (libzmq puts
them in the ``Peer-Address`` property as ``host:uid:gid:pid``); on a CURVE
endpoint it is the client's public key (the ``User-Id`` the ZAP handler
assigns). A client cannot choose either. Plain tcp on loopback and inproc
carry no identity: everyone there is one ``anonymous`` owner, so a daemon
shared by people who do not trust each other must listen on ipc or CURVE.

Operators (the daemon's own user, root, and CURVE keys listed in
``server.operator_keys``) see and act on every job.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

ANONYMOUS = "anonymous"


@dataclass(frozen=True, slots=True)
class Caller:
    """The owner behind one message, and whether it is an operator."""

    owner: str
    operator: bool = False

    def may_see(self, owner: str) -> bool:
        return self.operator or owner == self.owner


OPERATOR = Caller("operator", operator=True)
"""The daemon itself acting (shutdown, tests driving the scheduler directly)."""


def ipc_caller(peer_address: str | None) -> Caller:
    """The OS user on the other end of an ipc connection (libzmq's ``Peer-Address``)."""
    try:
        uid = int(str(peer_address).rsplit(":", 3)[1])
    except (ValueError, IndexError):
        # Without SO_PEERCRED there is no way to tell users apart.
        return Caller(ANONYMOUS)
    return Caller(f"uid:{uid}", operator=uid in (0, os.getuid()))


def curve_caller(user_id: str | None, operator_keys: frozenset[str]) -> Caller:
    """The CURVE public key (z85) the ZAP handler authenticated (libzmq's ``User-Id``)."""
    if not user_id:
        return Caller(ANONYMOUS)
    return Caller(f"key:{user_id}", operator=user_id in operator_keys)
