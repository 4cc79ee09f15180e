"""A step's host rows drawn together (``draw_many``) draw exactly what each row's own
sampler draws alone: the same token for the same seed, whatever rows share the step."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest

import kvmux.daemon.engine.engine as engine_module
from kvmux.daemon.engine import Engine, ResolvedSampling, Sampler, SamplingParams
from kvmux.daemon.engine.sampling import CHUNK_VALUES, Draws, cdf_many, draw_many
from kvmux.daemon.engine.structured import StructuredSpec

from .helpers import prompt_ids, record

EOS = (2,)
PLAIN = ResolvedSampling(
    greedy=False,
    temperature=1.0,
    top_k=0,
    top_p=1.0,
    seed=0,
    max_new_tokens=1_000,
    stop=(),
    ignore_eos=False,
)


def configs() -> list[ResolvedSampling]:
    """Every kind of row the sampler knows, each twice or more with its own seed."""
    kinds: list[dict[str, Any]] = [
        {},
        {"temperature": 0.7},
        {"temperature": 1e-3},  # sharp: the cdf jumps to ~1 at once
        {"temperature": 3.0, "top_k": 5},
        {"top_k": 40},
        {"top_k": 1},
        {"top_p": 0.9},
        {"top_p": 0.3, "top_k": 40},
        {"min_p": 0.1},
        {"min_p": 0.05, "top_p": 0.8, "top_k": 50, "temperature": 1.4},
        {"greedy": True, "temperature": 0.0},
        {"greedy": True, "temperature": 0.0, "repetition_penalty": 1.3},
        {"repetition_penalty": 1.2, "presence_penalty": 0.5, "frequency_penalty": 0.3},
        {"frequency_penalty": -0.7, "top_p": 0.95},
        {"min_new_tokens": 6},
        {"min_new_tokens": 4, "presence_penalty": 1.0, "top_k": 30},
    ]
    return [
        dataclasses.replace(PLAIN, seed=1_000 * n + i, **kw)
        for n in range(3)
        for i, kw in enumerate(kinds)
    ]


def step_logits(rng: np.random.Generator, rows: int, vocab: int) -> np.ndarray[Any, Any]:
    """Float32 logits as a run gives them; some rows masked as a grammar masks them
    (-inf where forbidden), down to a single allowed token."""
    x = (rng.standard_normal((rows, vocab)) * rng.uniform(0.5, 8.0, (rows, 1))).astype(np.float32)
    for r in range(0, rows, 3):
        x[r, rng.random(vocab) < rng.uniform(0.3, 0.99)] = -np.inf
        x[r, rng.integers(vocab)] = rng.standard_normal()  # one allowed, at least
    if rows > 1:
        x[1, :] = -np.inf
        x[1, 7] = 0.5
    if rows > 2:
        # Ties: equal top logits, so order and argmax are tested on equal keys.
        x[2, 10:14] = x[2].max() + 1.0
    return x


@pytest.mark.parametrize("vocab", [259, 4099])
def test_rows_drawn_together_draw_what_each_draws_alone(vocab: int) -> None:
    cfgs = configs()
    prompt = [3, 5, 5, 9, 17, 3, 200]
    alone = [Sampler(c, prompt, EOS) for c in cfgs]
    together = [Sampler(c, prompt, EOS) for c in cfgs]
    rng = np.random.default_rng(vocab)
    shares = 0
    for _ in range(40):
        # A different subset each step, in a different order: a row's tokens must not
        # depend on which rows share its step or where it sits.
        rows = rng.permutation(len(cfgs))[: rng.integers(1, len(cfgs) + 1)]
        logits = step_logits(rng, len(rows), vocab)
        expected = [alone[i](logits[k]) for k, i in enumerate(rows)]
        got = draw_many([together[i] for i in rows], logits)
        for k, i in enumerate(rows):
            together[i].record(int(got[k]))
        assert got.tolist() == expected
        shares += len(rows) > 1
    assert shares > 30
    # The generators moved alike: the next draws agree too.
    for a, b in zip(alone, together, strict=True):
        if a._rng is not None or b._rng is not None:
            assert a._rng is not None and b._rng is not None
            assert a._rng.random() == b._rng.random()


@pytest.mark.parametrize("vocab", [259, 4099])
def test_a_blocks_distributions_are_each_rows_bit_for_bit(vocab: int) -> None:
    """Sharper than the tokens (a draw rarely lands within an ulp of a boundary): every
    row's cumulative distribution is the bytes of the one its sampler computes alone."""
    cfgs = [c for c in configs() if not c.greedy]
    rng = np.random.default_rng(vocab + 1)
    for _ in range(20):
        rows = rng.permutation(len(cfgs))[: rng.integers(1, len(cfgs) + 1)]
        x = step_logits(rng, len(rows), vocab).astype(np.float64)
        x[rng.random(x.shape) < 0.05] -= 0.5  # float64 logits, as penalties make them
        alone = [Sampler(cfgs[i])._cdf(x[k]) for k, i in enumerate(rows)]
        together = cdf_many([cfgs[i] for i in rows], x.copy())
        for k, i in enumerate(rows):
            assert together[k].tobytes() == alone[k].tobytes(), cfgs[i]
    # A top-p the cumulative sum meets exactly: the first token alone reaches it.
    tie = np.full((1, vocab), -np.inf)
    tie[0, :2] = 0.0
    half = dataclasses.replace(PLAIN, top_p=0.5)
    alone_tie = Sampler(half)._cdf(tie[0])
    assert alone_tie[0] == 1.0
    assert cdf_many([half], tie.copy()).tobytes() == alone_tie.tobytes()


def test_rows_that_are_not_finite_draw_as_alone() -> None:
    """A NaN, a +inf or nothing allowed: the row alone draws the last id; together too,
    and the other rows are untouched."""
    cfgs = [dataclasses.replace(PLAIN, seed=s, top_p=0.9 if s % 2 else 1.0) for s in range(5)]
    logits = np.random.default_rng(3).standard_normal((5, 300)).astype(np.float32)
    logits[0, 4] = np.nan
    logits[2, 9] = np.inf
    logits[3, :] = -np.inf
    with np.errstate(all="ignore"):
        expected = [Sampler(c)(row) for c, row in zip(cfgs, logits, strict=True)]
        got = draw_many([Sampler(c) for c in cfgs], logits)
    assert got.tolist() == expected
    assert expected[0] == expected[2] == expected[3] == 299


@pytest.mark.parametrize(("vocab", "chunks"), [(259, 1), (4099, 3)])
def test_one_plan_of_draws_serves_every_step_of_its_rows(vocab: int, chunks: int) -> None:
    """A span plans its rows' draws once (Draws) and draws from it every step; a wide
    vocabulary is drawn some rows at a time (CHUNK_VALUES), a narrow one at once."""
    cfgs = configs()
    alone = [Sampler(c, [4, 4, 8], EOS) for c in cfgs]
    planned = [Sampler(c, [4, 4, 8], EOS) for c in cfgs]
    draws = Draws(planned)
    rng = np.random.default_rng(vocab)
    for step in range(20):
        logits = step_logits(rng, len(cfgs), vocab)
        expected = [a(row) for a, row in zip(alone, logits, strict=True)]
        got = draws(logits).tolist()
        for p, token in zip(planned, got, strict=True):
            p.record(token)
        assert got == expected, step
    sampled = sum(not c.greedy for c in cfgs)
    assert len(draws._chunks) == chunks == -(-sampled // max(1, CHUNK_VALUES // vocab))


@pytest.mark.parametrize("vocab", [1, 7, 127, 128, 129, 259, 1000, 4099, 32_000])
def test_a_blocks_row_sums_equal_each_row_summed_alone(vocab: int) -> None:
    """What draw_many rests on: NumPy sums each row of a C-contiguous float64 block along
    the row bit for bit as it sums that row alone (and cumulates it alike)."""
    block = np.random.default_rng(vocab).random((37, vocab)) ** 3
    sums, cums = block.sum(axis=1), np.cumsum(block, axis=1)
    for r in range(block.shape[0]):
        assert sums[r] == block[r].copy().sum()
        assert np.array_equal(cums[r], np.cumsum(block[r].copy()))


def wave(engine: Engine) -> list[tuple[list[int], SamplingParams]]:
    """Host rows of every kind in one wave: sampled ones of each shape, greedy rows that
    the host decodes (stop strings, penalties, logprobs), min_tokens, constrained ones."""
    schema = {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"enum": ["x", "yy", "zzz"]}},
        "required": ["a", "b"],
    }
    structured = StructuredSpec.from_wire(json=schema)
    kinds: list[dict[str, Any]] = [
        {"temperature": 0.8},
        {"temperature": 1.2, "top_k": 20},
        {"temperature": 0.9, "top_p": 0.8},
        {"temperature": 1.0, "min_p": 0.05},
        {"temperature": 0.0, "stop": ("zz",)},
        {"temperature": 0.0, "repetition_penalty": 1.3},
        {"temperature": 0.7, "presence_penalty": 0.8, "frequency_penalty": 0.4},
        {"temperature": 1.1, "min_new_tokens": 20},
        {"temperature": 0.9, "logprobs": 3},
        {"temperature": 0.9, "structured": structured},
        {"temperature": 1.3, "top_k": 30, "structured": structured, "logprobs": 2},
        {"temperature": 0.0, "structured": structured},
    ]
    return [
        (
            prompt_ids(engine, 4 + i % 5, seed=i),
            SamplingParams(max_new_tokens=40, seed=100 + i, **kinds[i % len(kinds)]),
        )
        for i in range(2 * len(kinds))
    ]


def drive(
    engine: Engine, items: list[tuple[list[int], SamplingParams]], *, alone: bool
) -> list[tuple[list[int], str | None, list[Any] | None]]:
    """Step the wave together to its end; ``alone``: every row's draw through its own
    sampler, one at a time (a recording wrapper, which the engine never draws for)."""
    sessions = [
        engine.new_session(p, params, session_id=f"d{i}") for i, (p, params) in enumerate(items)
    ]
    if alone:
        for s in sessions:
            record(s)
    try:
        while live := [s for s in sessions if not s.finished]:
            for out in engine.step_many(live, steps=8):
                assert not isinstance(out, Exception), out
        return [(s.generated, s.finish_reason, s.logprobs) for s in sessions]
    finally:
        for s in sessions:
            s.release()


def test_a_wave_drawn_together_decodes_what_each_row_draws_alone(
    big_buffer_engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = big_buffer_engine
    items = wave(engine)
    drawn: list[int] = []

    class Counted(Draws):
        def __call__(self, logits: Any) -> Any:
            drawn.append(len(self.samplers))
            return super().__call__(logits)

    monkeypatch.setattr(engine_module, "Draws", Counted)
    reference = drive(engine, items, alone=True)
    assert drawn == []
    together = drive(engine, items, alone=False)
    assert together == reference
    assert max(drawn) >= len(items) - 4, "the rows were not drawn together"
    reasons = {reason for _, reason, _ in reference}
    assert "stop" in reasons and "length" in reasons
