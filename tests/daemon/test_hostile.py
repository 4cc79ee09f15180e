"""Hostile and careless clients against a real kvmuxd process (bench.hostile's scenarios, small).

Each scenario starts its own daemon subprocess on its own socket; the figures
it returns are what ``python -m bench.hostile`` reports at full size.
"""

from __future__ import annotations

import os
from pathlib import Path

import anyio
import pytest

from bench import hostile

pytestmark = pytest.mark.slow


def _run(name: str, model: Path) -> hostile.Figures:
    figures = anyio.run(lambda: hostile.SCENARIOS[name](model, **hostile.QUICK[name]))
    print(name, figures)  # shown with -s or on failure: the figures behind the asserts
    return figures


def test_no_frame_crashes_the_daemon_and_legit_tokens_are_unchanged(tiny_model: Path) -> None:
    f = _run("frames", tiny_model)
    assert f["daemon_alive"] and f["frame_handling_failures"] == 0
    assert f["frames_handled"] >= hostile.QUICK["frames"]["n"]
    # Within budget they were answered; past it dropped, and the senders cut off.
    assert f["frames_rejected"] > 0 and f["frames_dropped"] > 0
    assert f["senders_disconnected"] >= 1
    assert f["legit_tokens_identical"]


def test_a_garbage_flood_does_not_stall_status_or_lose_jobs(tiny_model: Path) -> None:
    f = _run("flood", tiny_model)
    assert f["daemon_alive"] and f["legit_tokens_identical"]
    assert f["status_max_ms"] <= 1000, f
    assert f["flooders_disconnected"] >= 2  # both flooders spent their budget


def test_a_client_that_never_reads_cannot_bloat_the_daemon(tiny_model: Path) -> None:
    f = _run("slow_consumer", tiny_model)
    assert f["rss_growth_mib"] <= 64, f
    assert f["others_served"]


def test_half_open_connections_pause_listening_instead_of_aborting(tiny_model: Path) -> None:
    f = _run("half_open", tiny_model)
    assert f["daemon_alive"], f
    # Paused at least once. Refused connects are not asked for: pausing drops the
    # half-open connections, so a daemon that reacts within the flood may listen
    # again (and pause again) before the flooder's last connect.
    assert f["listening_paused"] >= 1, f
    assert f["next_client_served"]


def test_a_huge_prompt_is_refused_unread_and_stalls_nobody(tiny_model: Path) -> None:
    f = _run("big_prompt", tiny_model)
    assert f["result"] == "kv_capacity_exceeded"
    assert f["answered_in_ms"] < 1000
    assert f["streamer_max_gap_ms"] < 500, f


def test_one_client_cannot_fill_the_queue_for_another(tiny_model: Path) -> None:
    f = _run("fairness", tiny_model)
    assert f["a_jobs_refused_overloaded"] > 0  # A was held to its share
    assert f["b_refused_overloaded"] == 0
    assert f["a_items_still_queued_when_b_done"] > 0  # B did not wait for A's backlog


def test_a_client_gone_while_its_submit_is_checked_never_starts_a_job(tiny_model: Path) -> None:
    f = _run("orphan", tiny_model)
    assert f["jobs_dropped"] == 1
    assert f["sessions_started"] == 0 and f["jobs_active_after"] == 0


def test_wait_finishes_every_item_that_fits_the_budget_alone(tiny_model: Path) -> None:
    f = _run("wait", tiny_model)
    assert f["failed"] == 0, f
    assert f["tokens_identical"] and f["streamed_equal_results"]
    assert f["kv_peak_over_budget"] <= 1.0
    # The budget was tight enough to matter: sessions had to wait or make room.
    assert f["preemptions"] + f["parked_retries"] > 0


@pytest.mark.skipif(os.geteuid() != 0, reason="runs clients as two other OS users: needs root")
def test_two_os_users_cannot_see_or_touch_each_others_jobs(tiny_model: Path) -> None:
    f = _run("two_users", tiny_model)
    assert f["intruder_succeeded"] == 0, f
    assert {f[k] for k in ("attach", "results", "cancel", "detach", "logs_for_job")} == {
        "not_found"
    }
    assert f["status_caller"] == f["owners"][1]
    assert f["owner_items_ok"] == 3  # A's job ran untouched


def test_two_curve_keys_are_two_owners_and_a_removed_key_stops_on_sighup(
    tiny_model: Path,
) -> None:
    f = _run("two_keys", tiny_model)
    assert f["intruder_succeeded"] == 0, f
    assert f["owner_items_ok"] == 3
    assert f["revoked_key_refused"]


def test_a_result_over_a_page_travels_in_parts_and_a_non_reader_pins_the_bound(
    tiny_model: Path,
) -> None:
    f = _run("large_results", tiny_model)
    assert f["result_kib"] > 500  # each result is over two pages
    assert f["largest_message_kib"] <= 256, f
    assert f["parts_byte_identical"]
    assert f["rss_growth_mib"] <= f["bound_mib"] < 24, f
    assert f["others_served"]


def test_a_results_flood_is_refused_past_its_budget_and_slows_no_one_much(
    tiny_model: Path,
) -> None:
    f = _run("results_flood", tiny_model)
    assert f["daemon_alive"] and f["tokens_identical"]
    assert f["requests_refused"] > 0, f
    assert f["status_max_ms"] < 1000, f
    # bench.hostile measures >= 0.8 at full size (bench/README.md); unbounded it was
    # ~0.07 here. A test on a shared machine asserts only that it is no longer that.
    assert f["flood_over_quiet"] >= 0.4, f


def test_a_flood_over_eight_connections_of_one_owner_is_bounded_like_one(
    tiny_model: Path,
) -> None:
    f = _run("results_flood_8", tiny_model)
    assert f["daemon_alive"] and f["tokens_identical"]
    assert f["requests_refused"] > 0, f
    assert f["status_max_ms"] < 1000, f
    assert f["flood_over_quiet"] >= 0.4, f
