"""The front page and the manual: every relative link and anchor resolves, the
configuration reference matches the code, and README.md stays a front page."""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

import pytest

from kvmux.daemon import config_reference

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted([ROOT / "README.md", *(ROOT / "bench").glob("*.md"), *(ROOT / "docs").glob("*.md")])

# Pages another branch writes, linked from here before it lands: the lead merges both.

_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)|<a\s+href=\"([^\"]+)\"")
_FENCE = re.compile(r"^(```|~~~)")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def _prose(path: Path) -> list[str]:
    """The page's lines outside fenced code, inline code blanked out."""
    lines, fenced = [], False
    for line in path.read_text(encoding="utf-8").splitlines():
        if _FENCE.match(line.lstrip()):
            fenced = not fenced
            continue
        if not fenced:
            lines.append(re.sub(r"`[^`]*`", "``", line))
    return lines


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"`([^`]*)`", r"\1", heading)
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    text = re.sub(r"<[^>]+>", "", text).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    found: set[str] = set()
    seen: dict[str, int] = {}
    for line in _prose(path):
        if m := _HEADING.match(line):
            slug = _slug(m.group(2))
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            found.add(slug if n == 0 else f"{slug}-{n}")
        found.update(re.findall(r"<a\s+(?:name|id)=\"([^\"]+)\"", line))
    return found


def links(path: Path) -> list[str]:
    return [a or b for line in _prose(path) for a, b in _LINK.findall(line)]


def test_the_slug_rule_is_githubs() -> None:
    assert _slug("Run it as a service (systemd)") == "run-it-as-a-service-systemd"
    assert _slug("`kvmux.kv`: the KV API") == "kvmuxkv-the-kv-api"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_and_anchor_resolves(page: Path) -> None:
    broken = []
    for target in links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        file, _, anchor = unquote(target).partition("#")
        dest = (page.parent / file).resolve() if file else page
        if not dest.exists():
            broken.append(f"{target}: no {dest.relative_to(ROOT)}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading #{anchor} in {dest.relative_to(ROOT)}")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


def test_the_link_checker_catches_a_broken_link(tmp_path: Path) -> None:
    page = tmp_path / "p.md"
    page.write_text("# Here\n[ok](#here) [bad](#there) `[code](nowhere.md)`\n```\n[x](y.md)\n```\n")
    assert links(page) == ["#here", "#there"]
    assert anchors(page) == {"here"}


def test_the_configuration_reference_matches_the_code() -> None:
    page = ROOT / "docs" / "configuration.md"
    assert page.read_text(encoding="utf-8") == config_reference.render(), (
        "docs/configuration.md is stale: python -m kvmux.daemon.config_reference --write"
    )
    assert config_reference.main(["--check", str(page)]) == 0


def test_the_drift_check_fails_on_a_stale_page(tmp_path: Path) -> None:
    stale = tmp_path / "configuration.md"
    stale.write_text(config_reference.render().replace("`max_len`", "`max_length`"))
    assert config_reference.main(["--check", str(stale)]) == 1


def test_readme_is_a_front_page() -> None:
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines: move detail into docs/"
