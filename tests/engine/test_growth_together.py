"""Sessions that cross into one bucket at one step grow together, and decode on exactly as
the same sessions decoded alone in one big buffer: tokens and logits, bit for bit."""

from __future__ import annotations

from typing import Any

import numpy as np

from kvmux.daemon.engine import DecodeSession, Engine, grow_together
from kvmux.kv import GrowthResult

from .helpers import decode, greedy, prompt_ids, record


def test_sessions_grown_together_match_one_big_buffer(
    engine: Engine, big_buffer_engine: Engine
) -> None:
    # Equal prompts cross buckets at the same steps (groups); the others join them
    # mid-prompt or a step apart (groups of mixed valid lengths, and singletons).
    lengths = [3, 3, 3, 3, 3, 5, 7, 2, 11]
    prompts = [prompt_ids(engine, n, seed=40 + i) for i, n in enumerate(lengths)]
    sessions = [
        engine.new_session(p, greedy(70), session_id=f"g{i}") for i, p in enumerate(prompts)
    ]
    recorders = [record(s) for s in sessions]
    groups: list[int] = []
    while live := [s for s in sessions if not s.finished]:
        growing = [s for s in live if s.needs_growth()]
        if growing:
            by_bucket: dict[int, list[DecodeSession]] = {}
            for s in growing:
                by_bucket.setdefault(s.growth_bucket(), []).append(s)
            for group in by_bucket.values():
                results = grow_together(group)
                assert all(isinstance(r, GrowthResult) and r.grew for r in results)
                groups.append(len(group))
        # Nothing left for the step to grow on its own.
        assert not any(s.needs_growth() for s in live)
        for out in engine.step_many(live):
            assert not isinstance(out, Exception), out
    assert max(groups) >= 5 and len(groups) < sum(groups), groups
    got: list[tuple[list[int], list[np.ndarray[Any, Any]]]] = []
    for s, rec in zip(sessions, recorders, strict=True):
        got.append((list(s.generated), rec.logits))
        s.release()
    for i, p in enumerate(prompts):
        tokens, logits, _ = decode(big_buffer_engine, big_buffer_engine.new_session(p, greedy(70)))
        assert got[i][0] == tokens, i
        assert len(got[i][1]) == len(logits)
        for step, (a, b) in enumerate(zip(got[i][1], logits, strict=True)):
            assert a.tobytes() == b.tobytes(), f"session {i}: logits differ at step {step}"
    assert engine.budget.used == 0 and engine.pool.cohorts() == []
