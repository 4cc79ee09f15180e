"""Issue 12's isolation, through real kvmuxd processes (``bench.bench_isolation --quick``):
a growth failure, a budget refusal and a run failure each fail one item, and
every other item's tokens are byte-identical to the undisturbed run's."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import anyio
import pytest

from bench.bench_isolation import LONG, RUN_TARGET, run_isolation


@pytest.fixture(scope="module")
def report(tiny_model: Path) -> dict[str, Any]:
    # One run of every scenario (about 25 s: six daemons); the tests read its rows.
    result: dict[str, Any] = anyio.run(
        functools.partial(run_isolation, tiny_model, "tiny", repeats=1)
    )
    return result


def row(report: dict[str, Any], name: str) -> dict[str, Any]:
    found: list[dict[str, Any]] = [r for r in report["scenarios"] if r["scenario"] == name]
    assert len(found) == 1, name
    return found[0]


def test_the_undisturbed_runs_agree(report: dict[str, Any]) -> None:
    assert report["baseline_problems"] == []
    assert len(report["baseline_wall_s"]) == 1


def test_an_injected_growth_failure_fails_its_item_alone(report: dict[str, Any]) -> None:
    r = row(report, "growth-fail")
    assert r["problems"] == [] and r["others_identical"] is True
    (failed,) = r["failed"]
    assert (failed["code"], failed["cause"]) == ("kv_growth_failed", "injected")
    assert failed["details"]["failed_step"] == "copy_prefix"


def test_an_injected_growth_failure_is_retried_under_wait(report: dict[str, Any]) -> None:
    r = row(report, "growth-wait")
    assert r["problems"] == [] and r["failed"] == [] and r["others_identical"] is True
    assert r["growth_failures"] == {"injected": 1} and r["parked_retries"] == 1


def test_a_budget_refusal_fails_the_growing_item_alone(report: dict[str, Any]) -> None:
    r = row(report, "budget")
    assert r["problems"] == [] and r["others_identical"] is True
    (failed,) = r["failed"]
    assert failed["index"] == LONG
    assert (failed["code"], failed["cause"]) == ("kv_growth_failed", "budget")
    d = failed["details"]
    assert (d["old_capacity"], d["new_capacity"]) == (512, 1024)
    # Refused mid-decode, after the tokens that filled 512 were streamed.
    assert failed["streamed_tokens"] > 400


def test_a_failing_run_fails_its_row_alone(report: dict[str, Any]) -> None:
    r = row(report, "run-fail")
    assert r["problems"] == [] and r["others_identical"] is True
    (failed,) = r["failed"]
    assert failed["index"] == RUN_TARGET
    assert (failed["code"], failed["cause"]) == ("run_failed", "injected")
