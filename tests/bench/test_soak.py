"""The short soak: a real kvmuxd subprocess under load, kills and garbage; invariants hold."""

from __future__ import annotations

from pathlib import Path

import anyio

from bench.soak import SoakConfig, run_soak


def test_short_soak_keeps_every_invariant(tiny_model: Path) -> None:
    report = anyio.run(run_soak, SoakConfig.short(), tiny_model)
    assert report.problems() == []
    assert report.daemon_restarts == 0 and report.daemon_exit_code == 0
    assert report.results_lost == 0 and report.results_duplicated == 0
    assert report.kv_bytes_in_use_end == 0
    # The run did what it claims: load, refused growths, kills, garbage, checked tokens.
    assert report.items_submitted >= 100 and report.items_completed > 0
    # The budget bound the run: admission held sessions back for it, and the
    # peak came close to it (refused growths and preemptions may or may not
    # happen in a run this short: admission avoids them).
    assert report.kv_peak_bytes > 0.75 * report.kv_budget_bytes
    assert report.clients_killed >= 1 and report.killed_items > 0
    assert report.killed_items_unresolved == 0
    assert report.frames_sent > 50 and report.frames_typed_replies == report.frames_sent
    assert report.verified > 0 and report.verify_mismatches == 0
