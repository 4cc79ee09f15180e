"""What ``kvmux generate`` writes besides the model's text: terminal-safe output, and
why a run produced nothing."""

from __future__ import annotations

from kvmux.client import protocol as p
from kvmux.client.cli.generate import _why_nothing
from kvmux.client.printable import printable


def test_control_bytes_and_undecodable_bytes_are_escaped_newlines_kept() -> None:
    raw = "ok\x1b[2J\x07 caf\u00e9 \ufffd\x9b\tend\n"
    assert printable(raw) == "ok\\x1b[2J\\x07 caf\u00e9 \\ufffd\\x9b\tend\n"
    assert printable("Paris, \u00e0 bient\u00f4t \U0001f600") == (
        "Paris, \u00e0 bient\u00f4t \U0001f600"
    )


def _ended(reason: str) -> p.ItemResult:
    return p.ItemResult(
        index=0,
        custom_id="generate",
        status="ok",
        token_ids=[],
        text="",
        finish_reason=reason,
    )


def test_a_run_with_no_tokens_says_why_and_what_to_try() -> None:
    chat = _why_nothing(_ended("stop"), chat=True)
    assert chat.startswith("no tokens generated: the model's first token was its end of")
    assert "--raw" in chat
    plain = _why_nothing(_ended("stop"), chat=False)
    assert "plain text" in plain and "chat template" in plain
