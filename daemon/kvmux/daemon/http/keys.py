"""API keys for the HTTP front: which key acts as which owner.

The keys file is TOML, one ``[[key]]`` table per key: the key's SHA-256 (hex),
the owner it acts as, and whether that owner is an operator (sees and acts on
every job, as the daemon's own user does on the socket)::

    [[key]]
    owner = "alice"
    sha256 = "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08"
    operator = false

Only hashes are stored, so the file reveals no key. ``kvmuxd-keys new OWNER
FILE`` makes a key, appends its hash and prints the key once. The daemon reads
the file at start and again on SIGHUP: a key removed from it is refused from
then on. An owner named ``uid:N`` is the OS user N's, so the jobs that key
makes are that user's over the socket too.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import secrets
import sys
from pathlib import Path
from typing import Annotated

import msgspec

from ..access import Caller
from ..config import ConfigError

_HEX = re.compile(r"^[0-9a-f]{64}$")


class KeyEntry(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One key: its hash and the owner it acts as."""

    owner: Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
    sha256: str
    operator: bool = False


class KeysFile(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    key: list[KeyEntry] = msgspec.field(default_factory=list)


def digest(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8", errors="surrogatepass")).hexdigest()


class ApiKeys:
    """The keys the daemon admits: hash -> caller."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._callers: dict[str, Caller] = {}

    @property
    def enabled(self) -> bool:
        return bool(self.path)

    def load(self) -> int:
        """(Re-)read the file; a bad file is a :class:`ConfigError` and changes nothing."""
        if not self.path:
            return 0
        try:
            data = Path(self.path).read_bytes()
            parsed = msgspec.toml.decode(data, type=KeysFile)
        except OSError as exc:
            why = f"cannot read {self.path}: {exc.strerror or exc}"
            raise ConfigError(why, key="http.api_keys") from exc
        except msgspec.DecodeError as exc:  # ValidationError too
            raise ConfigError(f"{self.path}: {exc}", key="http.api_keys") from exc
        except RecursionError:  # tomllib on inline arrays or tables nested thousands deep
            why = f"{self.path}: invalid TOML: arrays or tables nested too deep"
            raise ConfigError(why, key="http.api_keys") from None
        callers = {}
        for entry in parsed.key:
            if not _HEX.match(entry.sha256):
                raise ConfigError(
                    f"{self.path}: the key of owner {entry.owner!r} has sha256 {entry.sha256!r}, "
                    "not 64 lowercase hex digits (write keys with `kvmuxd-keys new`)",
                    key="http.api_keys",
                )
            callers[entry.sha256] = Caller(entry.owner, operator=entry.operator)
        self._callers = callers
        return len(callers)

    def caller(self, key: str) -> Caller | None:
        """The owner ``key`` acts as; None for a key the file does not hold."""
        return self._callers.get(digest(key))


def new_key(path: Path, owner: str, *, operator: bool = False) -> str:
    """Make a key for ``owner``, append its hash to the keys file at ``path`` (created
    0600 if missing) and return the key: the only time it is seen."""
    key = "kvx-" + secrets.token_urlsafe(32)
    entry = KeyEntry(owner=owner, sha256=digest(key), operator=operator)
    msgspec.convert(msgspec.to_builtins(entry), KeyEntry)  # the owner's bounds
    lines = [
        "",
        "[[key]]",
        f"owner = {msgspec.json.encode(owner).decode()}",
        f'sha256 = "{entry.sha256}"',
        f"operator = {'true' if operator else 'false'}",
        "",
    ]
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    with os.fdopen(fd, "a", encoding="utf-8") as f:
        f.write("\n".join(lines))
    return key


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="kvmuxd-keys",
        description="Make an API key for kvmuxd's HTTP front (http.api_keys).",
        epilog="example: kvmuxd-keys new alice /etc/kvmux/api-keys.toml  "
        "(then `systemctl reload kvmuxd`)",
    )
    sub = ap.add_subparsers(dest="command", required=True)
    new = sub.add_parser("new", help="make a key, append its hash to FILE, print the key")
    new.add_argument("owner", help='the owner the key acts as (e.g. "alice", or "uid:1000")')
    new.add_argument("file", type=Path, help="the keys file (http.api_keys)")
    new.add_argument("--operator", action="store_true", help="the key sees every job")
    args = ap.parse_args(argv)
    try:
        print(new_key(args.file, args.owner, operator=args.operator))
    except (OSError, msgspec.ValidationError) as exc:
        print(f"kvmuxd-keys: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
