"""vLLM's sampling parameters on the real tiny model: each changes the tokens exactly as a
NumPy reference computed from the logits the engine produced predicts."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from kvmux.daemon.engine import (
    BadPrompt,
    Engine,
    ResolvedSampling,
    Sampler,
    SamplingParams,
)

from .helpers import decode, prompt_ids

Logits = np.ndarray[Any, Any]
N = 24


def penalized(
    logits: Logits, prompt: list[int], out: list[int], rep: float, pres: float, freq: float
) -> Logits:
    """vLLM's apply_penalties for one row, written out."""
    x = logits.astype(np.float64)
    seen = np.zeros(x.shape[0], dtype=bool)
    seen[prompt] = True
    seen[out] = True
    counts = np.bincount(np.asarray(out, dtype=np.int64), minlength=x.shape[0])
    r = np.where(seen, rep, 1.0)
    x = np.where(x > 0, x / r, x * r)
    out_x: Logits = x - freq * counts - pres * (counts > 0)
    return out_x


def log_softmax(logits: Logits) -> Logits:
    x = logits.astype(np.float64)
    m = x.max()
    out: Logits = x - (m + np.log(np.exp(x - m).sum()))
    return out


def run(engine: Engine, prompt: list[int], **params: Any) -> tuple[list[int], list[Logits], Any]:
    session = engine.new_session(prompt, SamplingParams(**params))
    tokens, logits, _ = decode(engine, session)
    return tokens, logits, session


def greedy_params(**extra: Any) -> dict[str, Any]:
    return {"max_new_tokens": N, "temperature": 0.0, "ignore_eos": True, **extra}


@pytest.fixture(scope="module")
def prompt(engine: Engine) -> list[int]:
    # Repeats inside the prompt, so the repetition penalty has prompt tokens to act on.
    base = prompt_ids(engine, 10, seed=5)
    return base + base[:6]


@pytest.mark.parametrize(
    ("rep", "pres", "freq"),
    [(1.8, 0.0, 0.0), (0.6, 0.0, 0.0), (1.0, 1.5, 0.0), (1.0, 0.0, 1.2), (1.3, -0.5, 0.7)],
)
def test_penalties_change_greedy_as_the_reference_predicts(
    engine: Engine, prompt: list[int], rep: float, pres: float, freq: float
) -> None:
    plain, _, _ = run(engine, prompt, **greedy_params())
    tokens, logits, _ = run(
        engine,
        prompt,
        **greedy_params(repetition_penalty=rep, presence_penalty=pres, frequency_penalty=freq),
    )
    assert len(tokens) == len(logits) == N
    for i, step in enumerate(logits):
        assert tokens[i] == int(np.argmax(penalized(step, prompt, tokens[:i], rep, pres, freq)))
    assert tokens != plain


def test_neutral_values_give_the_tokens_of_no_parameters(engine: Engine, prompt: list[int]) -> None:
    neutral = {
        "repetition_penalty": 1.0,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "min_p": 0.0,
        "min_new_tokens": 0,
        "stop_token_ids": (),
        "skip_special_tokens": True,
    }
    for base in (greedy_params(), {"max_new_tokens": N, "temperature": 1.3, "seed": 11}):
        plain, _, plain_session = run(engine, prompt, **base)
        same, _, session = run(engine, prompt, **base, **neutral)
        assert same == plain
        assert session.completion().text == plain_session.completion().text
        assert not session.sampling.penalized and session.completion().logprobs is None


def test_min_p_draws_as_the_reference_predicts(engine: Engine, prompt: list[int]) -> None:
    temperature, min_p, seed = 2.0, 0.25, 3
    sampled = {"max_new_tokens": N, "temperature": temperature, "top_k": 0, "seed": seed}
    sampled["ignore_eos"] = True
    plain, _, _ = run(engine, prompt, **sampled)
    tokens, logits, _ = run(engine, prompt, **sampled, min_p=min_p)
    rng = np.random.default_rng(seed)
    dropped = 0
    for i, step in enumerate(logits):
        x = step.astype(np.float64) / temperature
        p = np.exp(x - x.max())
        p /= p.sum()
        keep = p >= min_p * p.max()
        dropped += int((~keep).sum())
        p = np.where(keep, p, 0.0)
        p /= p.sum()
        cdf = np.cumsum(p)
        expected = min(int(np.searchsorted(cdf, rng.random() * cdf[-1], side="right")), len(p) - 1)
        assert tokens[i] == expected
        assert keep[tokens[i]]
    assert dropped > 0
    assert tokens != plain


def test_stop_token_ids_end_the_item_like_eos(engine: Engine, prompt: list[int]) -> None:
    plain, _, _ = run(engine, prompt, **greedy_params())
    # The first token, from the fourth on, that the plain run had not produced before.
    at = next(i for i in range(3, N) if plain[i] not in plain[:i])
    tokens, _, session = run(engine, prompt, **greedy_params(stop_token_ids=(plain[at], 258)))
    assert tokens == plain[:at]
    done = session.completion()
    assert done.finish_reason == "stop"
    assert done.token_ids == plain[:at] and done.completion_tokens == at


def test_min_new_tokens_holds_off_stop_tokens(engine: Engine, prompt: list[int]) -> None:
    plain, _, _ = run(engine, prompt, **greedy_params())
    stop, least = plain[0], 5
    tokens, logits, session = run(
        engine, prompt, **greedy_params(stop_token_ids=(stop,), min_new_tokens=least)
    )
    for i, step in enumerate(logits[:least]):
        masked = step.astype(np.float64)
        masked[stop] = -np.inf
        assert tokens[i] == int(np.argmax(masked)) != stop
    # From there on the stop token may end it: it ends exactly where argmax picks it.
    for i, step in enumerate(logits[least:], start=least):
        chosen = int(np.argmax(step))
        if chosen == stop:
            assert len(tokens) == i and session.completion().finish_reason == "stop"
            break
        assert tokens[i] == chosen
    else:
        assert len(tokens) == N and session.completion().finish_reason == "length"
    assert tokens[0] != plain[0]
    # Without min_new_tokens the same stop token ends it before it starts.
    none, _, early = run(engine, prompt, **greedy_params(stop_token_ids=(stop,)))
    assert none == [] and early.completion().finish_reason == "stop"


def test_min_new_tokens_masks_eos_unless_ignored(engine: Engine) -> None:
    eos = engine.spec.eos_token_ids[0]
    logits = np.zeros(engine.spec.vocab_size, dtype=np.float32)
    logits[eos], logits[7] = 5.0, 1.0
    base = ResolvedSampling(
        greedy=True,
        temperature=0.0,
        top_k=0,
        top_p=1.0,
        seed=0,
        max_new_tokens=8,
        stop=(),
        ignore_eos=False,
        min_new_tokens=2,
    )
    sampler = Sampler(base, [], engine.spec.eos_token_ids)
    assert [sampler(logits) for _ in range(3)] == [7, 7, eos]
    ignoring = Sampler(
        ResolvedSampling(**{**_fields(base), "ignore_eos": True}), [], engine.spec.eos_token_ids
    )
    assert ignoring(logits) == eos


def _fields(r: ResolvedSampling) -> dict[str, Any]:
    return {name: getattr(r, name) for name in r.__slots__}


def test_logprobs_are_the_raw_log_softmax(engine: Engine, prompt: list[int]) -> None:
    k = 5
    # A penalty changes the choice, never the logprobs: they are the model's raw ones.
    tokens, logits, session = run(engine, prompt, **greedy_params(logprobs=k, presence_penalty=1.0))
    done = session.completion()
    assert done.logprobs is not None and len(done.logprobs) == len(tokens) == N
    for token, step, entry in zip(tokens, logits, done.logprobs, strict=True):
        lp = log_softmax(step)
        assert entry.token_id == token
        assert entry.logprob == pytest.approx(lp[token], abs=1e-9)
        assert entry.token == engine.tokenizer.decode([token], skip_special_tokens=False)
        top = np.argsort(-lp, kind="stable")[:k]
        assert [t[0] for t in entry.top] == [int(i) for i in top]
        assert [t[2] for t in entry.top] == pytest.approx([float(lp[i]) for i in top], abs=1e-9)
        assert [t[1] for t in entry.top] == [
            engine.tokenizer.decode([int(i)], skip_special_tokens=False) for i in top
        ]
    zero, _, zero_session = run(engine, prompt, **greedy_params(logprobs=0))
    zero_lp = zero_session.completion().logprobs
    assert zero_lp is not None and all(e.top == () for e in zero_lp)
    assert [e.token_id for e in zero_lp] == zero


def test_skip_special_tokens_false_keeps_them_in_the_text(engine: Engine) -> None:
    # Near-uniform sampling over 300 tokens draws some of the 3 special tokens.
    params = {"max_new_tokens": 300, "temperature": 100.0, "top_k": 0, "seed": 1}
    params["ignore_eos"] = True
    prompt = prompt_ids(engine, 4, seed=2)
    skipped, _, a = run(engine, prompt, **params)
    kept, _, b = run(engine, prompt, **params, skip_special_tokens=False)
    assert kept == skipped
    assert any(engine.tokenizer.is_special(t) for t in kept)
    tok = engine.tokenizer
    assert a.completion().text == tok.decode(skipped, skip_special_tokens=True)
    assert b.completion().text == tok.decode(kept, skip_special_tokens=False)
    assert b.completion().text != a.completion().text


@pytest.mark.parametrize(
    ("params", "problem"),
    [
        ({"min_p": 1.5}, "min_p"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3.0}, "frequency_penalty"),
        ({"min_new_tokens": -1}, "min_new_tokens"),
        ({"min_new_tokens": 9, "max_new_tokens": 8}, "min_new_tokens"),
        ({"min_new_tokens": 500}, "min_new_tokens"),  # over the default max_new_tokens
        ({"logprobs": 21}, "logprobs"),
        ({"stop_token_ids": (-1,)}, "stop_token_ids"),
        ({"stop_token_ids": (5, 100_000)}, "stop_token_ids"),
    ],
)
def test_out_of_range_parameters_are_refused(
    engine: Engine, params: dict[str, Any], problem: str
) -> None:
    with pytest.raises(BadPrompt, match=problem):
        engine.admit([5, 6, 7], SamplingParams(**params))
