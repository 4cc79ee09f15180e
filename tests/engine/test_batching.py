"""Batched decode: each session's tokens and logits equal the same session decoded alone.

Sessions join at different steps, leave when they finish, grow mid-batch
(min_bucket 4), and share runs with whoever sits in adjacent rows of their
bucket's cohort. Coherence is the assertion: logits compared bit for bit.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest

from kvmux.daemon.engine import DecodeSession, Engine, RunFailed, SamplingParams
from kvmux.daemon.engine.runner import RowInput, RowsNotRunnable
from kvmux.kv import GrowthFailed, failpoints

from .helpers import RecordingSampler, decode, greedy, prompt_ids, record


@dataclass
class Plan:
    prompt: list[int]
    params: SamplingParams
    start: int  # the step at which it joins
    sid: str
    session: DecodeSession | None = None
    errors: list[Exception] = field(default_factory=list)


def _plans(engine: Engine, n: int, seed: int) -> list[Plan]:
    rng = np.random.default_rng(seed)
    plans = []
    for i in range(n):
        prompt = prompt_ids(engine, int(rng.integers(1, 40)), seed=seed * 100 + i)
        new = int(rng.integers(5, 70))
        params = (
            greedy(new)
            if i % 3
            else SamplingParams(max_new_tokens=new, temperature=0.8, top_k=40, seed=i)
        )
        plans.append(Plan(prompt, params, start=int(rng.integers(0, 30)), sid=f"s{seed}-{i}"))
    return plans


def _drive(
    engine: Engine, plans: list[Plan], *, retry: bool = False, argmax: bool = False
) -> dict[str, Any]:
    """Step every live session together until all finish; sessions join at their step.

    Every token goes through its session's (recording) sampler, unless ``argmax``:
    then greedy sessions take the engine's argmax of their run, as they do unrecorded."""
    recorders: dict[str, RecordingSampler] = {}
    step = 0
    while step < 10_000:
        for p in plans:
            if p.session is None and p.start == step:
                p.session = engine.new_session(p.prompt, p.params, session_id=p.sid)
                picks_argmax = p.session.picks_argmax
                recorders[p.sid] = record(p.session)
                if argmax:
                    p.session.picks_argmax = picks_argmax
        live = [p for p in plans if p.session is not None and not p.session.finished]
        if not live and all(p.session is not None for p in plans):
            break
        outs = engine.step_many([p.session for p in live if p.session is not None])
        for p, out in zip(live, outs, strict=True):
            if isinstance(out, Exception):
                p.errors.append(out)
                assert p.session is not None
                if not retry:
                    p.session.finished = True  # failed: it leaves the batch
        step += 1
    result = {}
    for p in plans:
        assert p.session is not None
        logits = recorders[p.sid].logits
        if not argmax or not p.session.picks_argmax:
            assert len(logits) >= len(p.session.generated), f"{p.sid}: picks not recorded"
        result[p.sid] = (list(p.session.generated), logits)
        p.session.release()
    return result


def _solo(engine: Engine, p: Plan) -> tuple[list[int], list[np.ndarray[Any, Any]]]:
    tokens, logits, _ = decode(engine, engine.new_session(p.prompt, p.params))
    return tokens, logits


@pytest.mark.parametrize(
    ("which", "seed", "rows_per_run"),
    # min_bucket 4: sessions spread over buckets 4..128 and grow mid-batch;
    # min_bucket 256: they all share one cohort.
    [("engine", 1, 1.3), ("engine", 2, 1.3), ("engine", 3, 1.3), ("big_buffer_engine", 4, 2)],
)
def test_batched_tokens_and_logits_equal_solo_bit_for_bit(
    request: pytest.FixtureRequest, which: str, seed: int, rows_per_run: float
) -> None:
    engine: Engine = request.getfixturevalue(which)
    plans = _plans(engine, 12, seed)
    runs, rows = engine.runner.runs, engine.runner.rows_run
    batched = _drive(engine, plans)
    runs, rows = engine.runner.runs - runs, engine.runner.rows_run - rows
    assert rows / runs > rows_per_run, "sessions were not batched"
    for p in plans:
        tokens, logits = _solo(engine, p)
        got_tokens, got_logits = batched[p.sid]
        assert got_tokens == tokens, p.sid
        assert len(got_logits) == len(logits)
        for step, (a, b) in enumerate(zip(got_logits, logits, strict=True)):
            assert a.tobytes() == b.tobytes(), f"{p.sid}: logits differ at step {step}"
    assert engine.budget.used == 0 and engine.pool.cohorts() == []


def test_greedy_rows_take_their_tokens_from_one_argmax_per_run(engine: Engine) -> None:
    """Greedy rows' tokens come from one argmax over their run's logits, with no sampler
    called; they equal what each row's sampler picks, and the sampling rows that share
    those runs draw exactly as before."""
    plans = _plans(engine, 12, seed=6)
    assert {bool(p.params.temperature) for p in plans} == {True, False}
    reference = _drive(engine, plans)
    for p in plans:
        p.session = None
    runs, rows = engine.runner.runs, engine.runner.rows_run
    through_argmax = _drive(engine, plans, argmax=True)
    assert (engine.runner.rows_run - rows) / (engine.runner.runs - runs) > 1.3
    for p in plans:
        tokens, logits = reference[p.sid]
        got_tokens, got_logits = through_argmax[p.sid]
        assert got_tokens == tokens, p.sid
        if p.params.temperature:
            assert [a.tobytes() for a in got_logits] == [b.tobytes() for b in logits], p.sid
        else:
            assert got_logits == [], f"{p.sid}: a greedy row called its sampler"


def test_sessions_of_one_bucket_decode_in_one_run_per_step(big_buffer_engine: Engine) -> None:
    engine = big_buffer_engine
    sessions = [
        engine.new_session(prompt_ids(engine, 3 + i, seed=i), greedy(20), session_id=f"b{i}")
        for i in range(16)
    ]
    runs = engine.runner.runs
    outs = engine.step_many(sessions, steps=20)
    # One run of the 16 first prompts (right-padded; each samples its first
    # token), then 19 decode runs of 16 rows.
    assert engine.runner.runs - runs == 1 + 19
    for i, (s, out) in enumerate(zip(sessions, outs, strict=True)):
        assert not isinstance(out, Exception) and out.finished
        alone = engine.generate(prompt_ids(engine, 3 + i, seed=i), greedy(20))
        assert s.generated == alone.token_ids
        s.release()


def test_a_row_whose_runs_fail_fails_alone(engine: Engine) -> None:
    plans = _plans(engine, 9, seed=4)
    for p in plans:
        p.start = 0  # all at once: the victim shares every decode run
    victim = plans[4]
    victim.params = greedy(60)
    failing_from = 12
    armed = False
    recorders: dict[str, RecordingSampler] = {}
    sessions = {p.sid: engine.new_session(p.prompt, p.params, session_id=p.sid) for p in plans}
    for sid, s in sessions.items():
        recorders[sid] = record(s)
    runs_before = 0
    for step in range(200):
        if step == failing_from:
            failpoints.arm("engine.run", key=victim.sid)
            armed = True
            runs_before = engine.runner.runs
        live = [s for s in sessions.values() if not s.finished]
        if not live:
            break
        valid = sessions[victim.sid].cache.valid_len
        outs = engine.step_many(live)
        for s, out in zip(live, outs, strict=True):
            if isinstance(out, Exception):
                assert s.session_id == victim.sid
                assert isinstance(out, RunFailed)
                assert out.details["cause"] == "injected" and out.details["session_unchanged"]
                assert s.cache.valid_len == valid and int(s.cache.mask.sum()) == valid
                s.finished = True
                failpoints.disarm()
    assert armed and engine.runner.runs > runs_before
    for p in plans:
        s = sessions[p.sid]
        if p is victim:
            assert s.finish_reason is None and len(s.generated) < 60
        else:
            assert s.finish_reason is not None
            tokens, logits = _solo(engine, p)
            assert s.generated == tokens, p.sid
            for a, b in zip(recorders[p.sid].logits, logits, strict=True):
                assert a.tobytes() == b.tobytes()
        s.release()
    assert engine.budget.used == 0


def test_a_failed_growth_in_a_batch_stays_with_its_row_and_retries(engine: Engine) -> None:
    plans = _plans(engine, 8, seed=5)
    for p in plans:
        p.start = 0
    failpoints.arm("kv.copy_prefix", 3)  # the next three growths, whoever they are
    batched = _drive(engine, plans, retry=True)
    failed = [p for p in plans if p.errors]
    assert failed, "no growth failed"
    for p in failed:
        assert all(isinstance(e, GrowthFailed) for e in p.errors)
    assert sum(len(p.errors) for p in plans) == 3
    for p in plans:
        tokens, logits = _solo(engine, p)
        assert batched[p.sid][0] == tokens, p.sid
        for a, b in zip(batched[p.sid][1], logits, strict=True):
            assert a.tobytes() == b.tobytes()


def test_rows_that_cannot_share_a_run_are_refused_before_it(engine: Engine) -> None:
    a = engine.new_session(prompt_ids(engine, 4), greedy(5))
    b = engine.new_session(prompt_ids(engine, 4, seed=1), greedy(5))
    for s in (a, b):
        s.ensure_capacity()
    runs = engine.runner.runs
    full = RowInput(a.cache, [1] * (a.cache.capacity + 1), "a")
    with pytest.raises(RowsNotRunnable, match="do not fit"):
        engine.runner.run([full])
    a.cache.advance(1)  # as if a had run a token: a prompt chunk after it has past
    chunk = RowInput(a.cache, [1, 2], "a")
    with pytest.raises(RowsNotRunnable, match="with past runs alone"):
        engine.runner.run([chunk, RowInput(b.cache, [3, 4], "b")])
    a.cache.truncate(0)
    assert a.cache.placement().row + 1 == b.cache.placement().row
    with pytest.raises(RowsNotRunnable, match="adjacent"):
        engine.runner.run([RowInput(b.cache, [3], "b"), RowInput(a.cache, [3], "a")])
    assert engine.runner.runs == runs and a.cache.valid_len == b.cache.valid_len == 0
    a.release()
    b.release()


def test_a_prompt_that_fills_the_context_ends_after_its_first_token(engine: Engine) -> None:
    """The step after a prompt chunk feeds nothing (the context is full): the engine
    plans that step afresh instead of reusing the prompt's plan."""
    prompt = prompt_ids(engine, 5)
    session = engine.new_session(prompt, greedy(10), max_context=5)
    (out,) = engine.step_many([session], steps=3)
    assert not isinstance(out, Exception)
    assert out.finished and out.finish_reason == "length"
    assert out.token_ids == engine.generate(prompt, greedy(1)).token_ids
    session.release()


def test_launching_is_called_once_just_before_the_first_run(big_buffer_engine: Engine) -> None:
    """The scheduler hands the chunk before to its loop from ``launching``: that must be
    after the call's Python has prepared its first run and before any run, once."""
    engine = big_buffer_engine
    sessions = [
        engine.new_session(prompt_ids(engine, 5 + i, seed=i), greedy(6), session_id=f"l{i}")
        for i in range(4)
    ]
    runs_at_call: list[int] = []
    before = engine.runner.runs
    outs = engine.step_many(sessions, 3, launching=lambda: runs_at_call.append(engine.runner.runs))
    assert runs_at_call == [before]  # once, and no run had started
    assert engine.runner.runs - before == 3
    runs_at_call.clear()
    outs = engine.step_many(sessions, 10, launching=lambda: runs_at_call.append(engine.runner.runs))
    assert len(runs_at_call) == 1 and all(not isinstance(o, Exception) and o.finished for o in outs)
    # Nothing left to step: no run, and no call.
    runs_at_call.clear()
    engine.step_many(sessions, 1, launching=lambda: runs_at_call.append(engine.runner.runs))
    assert runs_at_call == []
    for i, s in enumerate(sessions):
        assert (
            s.generated == engine.generate(prompt_ids(engine, 5 + i, seed=i), greedy(6)).token_ids
        )
        s.release()


def test_a_halt_ends_the_call_after_the_step_under_way(big_buffer_engine: Engine) -> None:
    """The scheduler's poke sets ``halt`` while a chunk runs: the call returns after the
    step under way, every session one step on, and they go on from there with the
    tokens an uninterrupted decode gives."""
    engine = big_buffer_engine
    prompts = [prompt_ids(engine, 5 + i, seed=40 + i) for i in range(4)]
    sessions = [
        engine.new_session(p, greedy(30), session_id=f"h{i}") for i, p in enumerate(prompts)
    ]
    halt = threading.Event()
    halt.set()  # set before the call: still one step (the prompts here)
    first = engine.step_many(sessions, 20, halt=halt)
    assert [len(o.token_ids) for o in first if not isinstance(o, Exception)] == [1] * 4
    halt.clear()
    before = engine.runner.runs
    # Set as the first decode run starts, as a poke landing mid-chunk.
    outs = engine.step_many(sessions, 20, launching=halt.set, halt=halt)
    assert engine.runner.runs - before == 1
    assert [len(o.token_ids) for o in outs if not isinstance(o, Exception)] == [1] * 4
    halt.clear()
    rest = engine.step_many(sessions, 100, halt=halt)  # never set: to their ends
    assert all(not isinstance(o, Exception) and o.finished for o in rest)
    for p, s in zip(prompts, sessions, strict=True):
        assert s.generated == engine.generate(p, greedy(30)).token_ids
        s.release()


@pytest.mark.parametrize("ends_after", [None, "future", "past"])
def test_past_ends_after_a_session_that_ends_returns_the_call(
    big_buffer_engine: Engine, ends_after: str | None
) -> None:
    """Past ``ends_after`` the call returns at the step where a session ended (the
    scheduler has an item waiting for the slot); before it, or without it, the others
    go on. Either way they go on to the tokens an uninterrupted decode gives."""
    engine = big_buffer_engine
    prompts = [prompt_ids(engine, 6, seed=50), prompt_ids(engine, 7, seed=51)]
    short, long = (
        engine.new_session(prompts[0], greedy(3), session_id="short"),
        engine.new_session(prompts[1], greedy(30), session_id="long"),
    )
    engine.step_many([short, long], 1)  # the prompts: a first token each
    when = {None: None, "future": time.perf_counter() + 3600, "past": 0.0}[ends_after]
    outs = engine.step_many([short, long], 20, ends_after=when)
    assert not isinstance(outs[0], Exception) and outs[0].finished  # two more tokens
    assert not isinstance(outs[1], Exception)
    assert len(outs[1].token_ids) == (2 if ends_after == "past" else 20)
    engine.step_many([long], 100)
    assert short.generated == engine.generate(prompts[0], greedy(3)).token_ids
    assert long.generated == engine.generate(prompts[1], greedy(30)).token_ids
    short.release()
    long.release()
