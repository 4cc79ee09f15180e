"""docs/configuration.md, written from the Structs that parse kvmuxd's config.

python -m kvmux.daemon.config_reference [--write | --check] [PATH]

Every key's type, default and meaning come from :mod:`kvmux.daemon.config` (its
``msgspec.Meta`` descriptions), so the page cannot say what the parser does not do;
``--check`` (run by tests/docs) exits 1 when the page and the code disagree.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import msgspec
import msgspec.inspect as mi

from .config import Config

DEFAULT_PAGE = Path(__file__).resolve().parents[3] / "docs" / "configuration.md"

_HEAD = """\
# Configuration reference

<!-- Written by `python -m kvmux.daemon.config_reference --write` from
daemon/kvmux/daemon/config.py; tests/docs fails when they disagree. Edit the code. -->

kvmuxd reads one TOML file (`kvmuxd --config FILE`); every key is optional and an
empty file is a valid config. An unknown key, a wrong type or a value out of range
is refused at start-up with the file, the dotted key and the nearest known name
(exit status 78, which the systemd unit does not restart on).
`kvmuxd --check-config --config FILE` checks a file without starting. Sizes in bytes
also take a unit: `memory_budget = "256MiB"`. Three flags override one key each:
`--endpoint` (`server.endpoint`), `--http` (`http.listen`), `--journal`
(`jobs.journal`). The annotated examples are [configs/kvmuxd.toml](../configs/kvmuxd.toml)
(the service) and [configs/local.toml](../configs/local.toml) (the quickstart).
"""


def _type(t: mi.Type) -> tuple[str, str, str]:
    """(type, constraints, unit) of one key."""
    unit = ""
    if isinstance(t, mi.Metadata):
        unit = (t.extra or {}).get("unit", "")
        t = t.type
    if isinstance(t, mi.LiteralType):
        return " \\| ".join(json.dumps(v) for v in t.values), "", unit
    if isinstance(t, mi.ListType):
        inner, _, _ = _type(t.item_type)
        return f"list of {inner}", "", unit
    names = {mi.IntType: "integer", mi.FloatType: "float", mi.StrType: "string"}
    name = names.get(type(t), "boolean" if isinstance(t, mi.BoolType) else type(t).__name__)
    bounds = [
        f"{op} {getattr(t, attr)}"
        for attr, op in (("gt", ">"), ("ge", "≥"), ("lt", "<"), ("le", "≤"))
        if getattr(t, attr, None) is not None
    ]
    return name, ", ".join(bounds), unit


def _description(t: mi.Type) -> str:
    if isinstance(t, mi.Metadata):
        return str((t.extra_json_schema or {}).get("description", ""))
    return ""


def _default(field: mi.Field) -> str:
    value = field.default
    if value is msgspec.NODEFAULT:
        value = field.default_factory()
    return f"`{json.dumps(value)}`"


def render() -> str:
    """The page's text."""
    lines = [_HEAD]
    config = mi.type_info(Config)
    assert isinstance(config, mi.StructType)
    for table in config.fields:
        info = table.type
        assert isinstance(info, mi.StructType)
        doc = " ".join((info.cls.__doc__ or "").strip().split("\n\n")[0].split())
        doc = doc.removeprefix(f"``[{table.name}]``: ").replace("``", "`")
        lines += [f"## [{table.name}]", "", doc[:1].upper() + doc[1:], ""]
        lines += ["| key | type | default | meaning |", "|---|---|---|---|"]
        for field in info.fields:
            kind, bounds, unit = _type(field.type)
            if unit:
                kind += f" ({unit}, or a size with a unit)"
            if bounds:
                kind += f", {bounds}"
            meaning = _description(field.type).replace("|", "\\|")
            if not meaning:
                raise ValueError(f"{table.name}.{field.name} has no description in config.py")
            lines.append(f"| `{field.name}` | {kind} | {_default(field)} | {meaning} |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvmux.daemon.config_reference")
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", action="store_true", help="write the page")
    mode.add_argument("--check", action="store_true", help="exit 1 unless the page is current")
    ap.add_argument("page", nargs="?", type=Path, default=DEFAULT_PAGE)
    args = ap.parse_args(argv)
    text = render()
    if args.write:
        args.page.parent.mkdir(parents=True, exist_ok=True)
        args.page.write_text(text, encoding="utf-8")
        return 0
    if not args.page.is_file() or args.page.read_text(encoding="utf-8") != text:
        print(
            f"{args.page} differs from kvmux/daemon/config.py: "
            "run python -m kvmux.daemon.config_reference --write",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
