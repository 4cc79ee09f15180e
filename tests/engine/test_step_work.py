"""A decode step's host work does not grow with its rows (issue 28).

Counted, not timed: every line of Python the engine executes and every C function it
calls (NumPy's included) while ``step_many`` decodes, traced with ``sys.settrace`` and
``sys.setprofile``. Every array operation and host/device copy of a step is issued by
one of those lines, so equal counts mean the same operations, whatever the rows.

A call of ``k`` steps pays once for its rows (reading and settling each session) and
then ``k`` times for a step, so the work of a step is the difference between a call
of 9 steps and one of 3, divided by 6; it must be the same at N = 16 and N = 256, in
one run per step. Rows that need the host (sampling here) add their own work, and only
theirs.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

import numpy as np
import pytest

from kvmux.daemon.engine import DecodeSession, Engine, EngineOptions, SamplingParams


@pytest.fixture(scope="module")
def wide_engine(tiny_model: Path) -> Engine:
    """Every row of one bucket in one cohort and one run (256 rows)."""
    return Engine(
        tiny_model,
        EngineOptions(min_bucket=256, intra_op_threads=1, rows_per_cohort=256, max_batch=256),
    )


class _Tally:
    """Lines executed and C functions called while it is installed (this thread)."""

    def __init__(self) -> None:
        self.lines = 0
        self.c_calls = 0

    def _trace(self, frame: FrameType, event: str, arg: Any) -> Callable[..., Any]:
        if event == "line":
            self.lines += 1
        return self._trace

    def _profile(self, frame: FrameType, event: str, arg: Any) -> None:
        if event == "c_call":
            self.c_calls += 1

    def __enter__(self) -> _Tally:
        sys.settrace(self._trace)
        sys.setprofile(self._profile)
        return self

    def __exit__(self, *exc: object) -> None:
        sys.setprofile(None)
        sys.settrace(None)


def _sessions(engine: Engine, n: int, *, sampled: int = 0) -> list[DecodeSession]:
    rng = np.random.default_rng(n)
    out = []
    for i in range(n):
        prompt = [int(t) for t in rng.integers(3, engine.spec.vocab_size, 12)]
        params = SamplingParams(max_new_tokens=100, temperature=0.0, ignore_eos=True)
        if i < sampled:
            params = SamplingParams(max_new_tokens=100, temperature=0.9, seed=i, ignore_eos=True)
        out.append(engine.new_session(prompt, params, session_id=f"w{n}-{i}"))
    return out


def _work(engine: Engine, n: int, steps: int, *, sampled: int = 0) -> tuple[int, int, int]:
    """Lines, C calls and runs of one ``step_many`` call of ``steps`` decode steps, on
    sessions already past their prompts and one call of warm-up (the plan is reused)."""
    sessions = _sessions(engine, n, sampled=sampled)
    try:
        engine.step_many(sessions, 2)  # prompts, then a first decode step
        engine.step_many(sessions, 2)  # the plan and its span, as every later call finds them
        runs = engine.runner.runs
        with _Tally() as tally:
            outs = engine.step_many(sessions, steps)
        assert all(not isinstance(o, Exception) and len(o.token_ids) == steps for o in outs)
        return tally.lines, tally.c_calls, engine.runner.runs - runs
    finally:
        for s in sessions:
            s.release()


def _per_step(engine: Engine, n: int, *, sampled: int = 0) -> tuple[float, float, float]:
    short = _work(engine, n, 3, sampled=sampled)
    long = _work(engine, n, 9, sampled=sampled)
    return tuple((b - a) / 6 for a, b in zip(short, long, strict=True))  # type: ignore[return-value]


def test_a_decode_steps_host_work_is_the_same_for_16_and_256_rows(wide_engine: Engine) -> None:
    small = _per_step(wide_engine, 16)
    large = _per_step(wide_engine, 256)
    assert small == large, f"per step (lines, C calls, runs): N=16 {small}, N=256 {large}"
    lines, c_calls, runs = large
    assert runs == 1  # 256 rows of one bucket: one run a step
    # A fixed handful of array operations a step, not a loop over the rows.
    assert lines < 60 and c_calls < 40, large


def test_rows_that_need_the_host_add_only_their_own_work(wide_engine: Engine) -> None:
    """Four sampled rows among 16 and among 256 cost the same per step: their logits
    alone come to the host and their samplers run; the greedy rows stay in the arrays."""
    small = _per_step(wide_engine, 16, sampled=4)
    large = _per_step(wide_engine, 256, sampled=4)
    assert small == large, f"per step (lines, C calls, runs): N=16 {small}, N=256 {large}"
    greedy = _per_step(wide_engine, 256)
    assert large[0] > greedy[0]  # the sampled rows' own work is there, and counted


def test_a_run_of_many_steps_gives_the_tokens_of_one_step_at_a_time(wide_engine: Engine) -> None:
    """Coherence: the same sessions stepped 1 step a call and 24 steps a call decode the
    same tokens (greedy and seeded sampling, EOS on, so rows end mid-call)."""

    def decode(steps: int) -> list[list[int]]:
        rng = np.random.default_rng(7)
        sessions = []
        for i in range(40):
            prompt = [int(t) for t in rng.integers(3, wide_engine.spec.vocab_size, 5 + i % 7)]
            temp = 0.0 if i % 4 else 1.0
            params = SamplingParams(max_new_tokens=30 + i, temperature=temp, seed=i)
            sessions.append(wide_engine.new_session(prompt, params, session_id=f"c{i}"))
        tokens: list[list[int]] = [[] for _ in sessions]
        live = list(range(len(sessions)))
        while live:
            outs = wide_engine.step_many([sessions[i] for i in live], steps)
            for i, out in zip(live, outs, strict=True):
                assert not isinstance(out, Exception)
                tokens[i] += out.token_ids
            live = [i for i in live if not sessions[i].finished]
        texts = [s.completion().text for s in sessions]
        for s in sessions:
            s.release()
        assert texts == [wide_engine.tokenizer.decode(t) for t in tokens]
        return tokens

    assert decode(24) == decode(1)
