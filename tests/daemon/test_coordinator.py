"""The growth coordinator's verdicts, one decision at a time, without a daemon.

What a refused growth means (wait, retry, make room, fail) is decided in one
place; these tests hand it the items of a scheduler (real sessions of the
tiny model, opened but holding nothing) and a refusal, and read the verdict
and the counters. The daemon-level tests (test_growth.py) show the same policy
carried out under real memory pressure.
"""

from __future__ import annotations

from typing import Literal

from kvmux.daemon.config import SchedulerConfig
from kvmux.daemon.coordinator import Fail, Grew, GrowthCoordinator, Park, Preempt
from kvmux.daemon.engine import Engine
from kvmux.daemon.scheduler import ItemState, JobState, Phase
from kvmux.kv import GrowthFailed


def _coordinator(
    reference: Engine, policy: Literal["wait", "fail"] = "wait", retries: int = 2
) -> GrowthCoordinator:
    coordinator = GrowthCoordinator()
    coordinator.adopt(reference, SchedulerConfig(on_growth_failure=policy, growth_retries=retries))
    return coordinator


def _items(reference: Engine, *phases: Phase) -> list[ItemState]:
    """Items holding sessions, admitted in this order, in these phases."""
    job = JobState("j", [], detached=True, name="", owner="o")
    out = []
    for seq, phase in enumerate(phases, 1):
        admission = reference.admit("hi")
        state = ItemState(job, seq - 1, str(seq), admission, phase=phase, admitted_seq=seq)
        state.session = reference.open_session(admission, state.session_id)
        out.append(state)
    return out


def _refused(cause: str) -> GrowthFailed:
    return GrowthFailed("refused", {"cause": cause, "session_unchanged": True})


def test_a_refusal_by_the_budget_waits_while_others_can_free_memory(reference: Engine) -> None:
    coordinator = _coordinator(reference)
    active, growing = _items(reference, "active", "growing")
    exc = _refused("budget")
    verdict = coordinator.decide(growing, exc, 0.0, [active, growing])
    assert verdict == Park(exc, retry=0)  # the budget's wait spends no retry
    assert coordinator.failures == {"budget": 1}


def test_a_refusal_by_the_device_spends_retries_then_fails(reference: Engine) -> None:
    coordinator = _coordinator(reference, retries=2)
    active, growing = _items(reference, "active", "growing")
    exc = _refused("out_of_memory")
    assert coordinator.decide(growing, exc, 0.0, [active, growing]) == Park(exc, retry=1)
    growing.retries = 2
    assert coordinator.decide(growing, exc, 0.0, [active, growing]) == Fail(growing, exc)
    assert coordinator.failures == {"out_of_memory": 2}


def test_the_fail_policy_fails_at_once(reference: Engine) -> None:
    coordinator = _coordinator(reference, policy="fail")
    active, growing = _items(reference, "active", "growing")
    exc = _refused("budget")
    assert coordinator.decide(growing, exc, 0.0, [active, growing]) == Fail(growing, exc)


def test_when_everyone_else_is_parked_the_newest_makes_room(reference: Engine) -> None:
    coordinator = _coordinator(reference)
    old, growing, new = _items(reference, "parked", "growing", "parked")
    exc = _refused("budget")
    verdict = coordinator.decide(growing, exc, 0.0, [old, growing, new])
    assert verdict == Preempt(new, exc)
    assert coordinator.preemptions == 1


def test_a_stall_preempts_the_newest_or_fails_the_last(reference: Engine) -> None:
    coordinator = _coordinator(reference)
    old, new = _items(reference, "parked", "parked")
    assert coordinator.stalled([old, new]) == Preempt(new)
    assert coordinator.preemptions == 1
    # Alone, it has nobody to make room for: waiting would never end.
    old.failure = _refused("budget")
    assert coordinator.stalled([old]) == Fail(old, old.failure)
    new.phase = "active"
    assert coordinator.stalled([old, new]) is None


def test_resume_counts_the_parked_retries(reference: Engine) -> None:
    coordinator = _coordinator(reference)
    items = _items(reference, "parked", "active", "parked")
    assert coordinator.resume(items) == [items[0], items[2]]
    assert coordinator.stats().parked_retries == 2


def test_a_first_allocation_is_judged_and_counted_like_any_growth(reference: Engine) -> None:
    coordinator = _coordinator(reference)
    [state] = _items(reference, "opening")
    assert state.session is not None
    result = state.session.ensure_capacity()  # capacity 0 -> its first bucket
    try:
        assert coordinator.decide(state, result, 0.0, [state]) == Grew()
        assert coordinator.growths == 1
        assert coordinator.stats().bytes_copied == result.bytes_copied
    finally:
        state.session.release()
