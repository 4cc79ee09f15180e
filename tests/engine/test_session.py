"""Decode sessions: failure and retry, limits, sampling, stopping, bad input."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest

from kvmux.daemon.engine import (
    BadPrompt,
    Engine,
    EngineOptions,
    RunFailed,
    RuntimeUnavailable,
    SamplingParams,
    create_session,
    import_onnxruntime,
)
from kvmux.kv import CapacityExceeded, GrowthFailed, failpoints

from .helpers import decode, greedy, prompt_ids

GROWTH_STEPS = ["kv.allocate", "kv.copy_prefix", "kv.build_mask", "kv.invalidate_capture"]


@pytest.mark.parametrize("failpoint", GROWTH_STEPS)
def test_growth_failure_mid_decode_then_retry_gives_undisturbed_tokens(
    engine: Engine, failpoint: str
) -> None:
    prompt = prompt_ids(engine, 3, seed=4)
    expected, _, _ = decode(engine, engine.new_session(prompt, greedy(50)))

    s = engine.new_session(prompt, greedy(50))
    failures = 0
    while not s.finished:
        # Arm just before the growth 16 -> 32.
        if s.required_capacity() == 17 and failures == 0:
            failpoints.arm(failpoint, 1)
            before = (s.cache.capacity, s.cache.valid_len, [id(k) for k in s.cache.keys])
            with pytest.raises(GrowthFailed) as info:
                engine.step(s)
            failures += 1
            assert info.value.details["failed_step"] == failpoint.removeprefix("kv.")
            assert (s.cache.capacity, s.cache.valid_len, [id(k) for k in s.cache.keys]) == before
            continue  # the retry is simply the next step
        engine.step(s)
    assert failures == 1
    assert s.generated == expected
    s.release()
    assert engine.budget.used == 0


def test_run_failure_rolls_back_and_retries(engine: Engine) -> None:
    prompt = prompt_ids(engine, 3, seed=5)
    expected, _, _ = decode(engine, engine.new_session(prompt, greedy(20)))
    s = engine.new_session(prompt, greedy(20))
    for _ in range(5):
        engine.step(s)
    valid = s.cache.valid_len
    failpoints.arm("engine.run", 1)
    with pytest.raises(RunFailed) as info:
        engine.step(s)
    assert info.value.details["cause"] == "injected"
    assert info.value.details["session_unchanged"] is True
    assert s.cache.valid_len == valid and int(s.cache.mask.sum()) == valid
    while not s.finished:
        engine.step(s)
    assert s.generated == expected
    s.release()


def test_prompt_over_model_max_is_refused_with_its_source(engine: Engine) -> None:
    limit = engine.spec.context_length
    assert limit is not None
    with pytest.raises(CapacityExceeded) as info:
        engine.new_session(prompt_ids(engine, limit + 1), greedy(1))
    d = info.value.details
    assert d["requested_tokens"] == limit + 1
    assert d["hard_max"] == limit and d["model_max"] == limit
    assert d["hard_max_source"] == f"model max_length ({limit})"
    assert engine.budget.used == 0


def test_explicit_cap_is_honoured(engine: Engine) -> None:
    with pytest.raises(CapacityExceeded) as info:
        engine.new_session(prompt_ids(engine, 20), greedy(5), max_context=16)
    assert info.value.details["hard_max_source"] == "item max_context 16"

    s = engine.new_session(prompt_ids(engine, 10), greedy(100), max_context=16)
    tokens, _, caps = decode(engine, s)
    # 10 prompt rows + 6 fed tokens fill 16; the 7th token is sampled from that run.
    assert len(tokens) == 7 and s.finish_reason == "length"
    assert max(caps) == 16


def test_config_cap_is_clamped_by_model_and_labelled(tiny_model: Path) -> None:
    e = Engine(tiny_model, EngineOptions(max_len=100_000, intra_op_threads=1))
    limit = e.spec.context_length
    assert (
        e.hard_max_for(None).source
        == f"config kv.max_len 100000 clamped by model max_length ({limit})"
    )
    assert e.hard_max_for(64).source == "item max_context 64"


def test_seeded_sampling_is_reproducible(engine: Engine) -> None:
    prompt = prompt_ids(engine, 4, seed=6)

    def run(seed: int) -> list[int]:
        params = SamplingParams(max_new_tokens=30, temperature=1.0, top_k=50, top_p=0.95, seed=seed)
        return engine.generate(prompt, params).token_ids

    assert run(7) == run(7)
    assert run(7) != run(8)
    assert run(7) != engine.generate(prompt, greedy(30)).token_ids


def test_text_is_the_decoded_tokens(engine: Engine) -> None:
    c = engine.generate("Hello, kvmux", greedy(40))
    assert c.text == engine.tokenizer.decode(c.token_ids)
    assert c.prompt_tokens == len(engine.tokenizer.encode("Hello, kvmux"))
    assert c.completion_tokens == len(c.token_ids) == 40


def test_stop_string_cuts_text_and_finishes(engine: Engine) -> None:
    full = engine.generate("abc", greedy(60))
    # A stop string taken from the middle of what the model would write.
    text = full.text
    stop = next(
        text[i : i + 2] for i in range(10, len(text) - 2) if "\ufffd" not in text[i : i + 2]
    )
    cut = text.index(stop)
    s = engine.new_session("abc", SamplingParams(max_new_tokens=60, temperature=0, stop=(stop,)))
    streamed = ""
    while not s.finished:
        streamed += engine.step(s).text
    assert s.finish_reason == "stop"
    assert streamed == s.completion().text == text[:cut]
    s.release()


def test_eos_finishes_with_stop(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    first = engine.generate("xyz", greedy(5)).token_ids
    monkeypatch.setattr(engine, "spec", dataclasses.replace(engine.spec, eos_token_ids=(first[2],)))
    c = engine.generate("xyz", SamplingParams(max_new_tokens=5, temperature=0))
    assert c.finish_reason == "stop" and c.token_ids == first[:2]


@pytest.mark.parametrize(
    ("prompt", "needle"),
    [([], "empty"), ("", "empty"), ([1, 2, 10**6], "outside the vocabulary"), ([1, -1], "outside")],
)
def test_bad_prompts_are_refused(engine: Engine, prompt: list[int] | str, needle: str) -> None:
    with pytest.raises(BadPrompt, match=needle):
        engine.new_session(prompt, greedy(1))
    assert engine.budget.used == 0


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_new_tokens=0),
        SamplingParams(temperature=-1),
        SamplingParams(top_p=0.0),
        SamplingParams(top_k=-3),
        SamplingParams(stop=("",)),
    ],
)
def test_bad_sampling_params_are_refused(engine: Engine, params: SamplingParams) -> None:
    with pytest.raises(BadPrompt):
        engine.new_session("hi", params)


def test_missing_runtime_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "onnxruntime", None)
    with pytest.raises(RuntimeUnavailable, match=r"kvmux\[cpu\]"):
        import_onnxruntime()


def test_cuda_request_without_cuda_reports_the_fallback(tiny_model: Path) -> None:
    from kvmux.daemon.model import load_model

    with pytest.warns(UserWarning, match="CUDAExecutionProvider"):
        s = create_session(load_model(tiny_model).model_path, provider="cuda")
    assert s.fell_back and "CUDAExecutionProvider" not in s.providers


@pytest.mark.parametrize("temperature", [1e-310, 5e-324, 1e-6])
def test_a_temperature_below_the_floor_decodes_greedily(engine: Engine, temperature: float) -> None:
    # Dividing logits by such a temperature overflows to inf: NaN probabilities
    # would pick the last vocabulary id every time. It means argmax, so it is.
    greedy = engine.generate("abc", SamplingParams(max_new_tokens=20, temperature=0.0))
    tiny = engine.generate("abc", SamplingParams(max_new_tokens=20, temperature=temperature))
    assert tiny.token_ids == greedy.token_ids
    assert len(set(tiny.token_ids)) > 1  # not one id repeated (the NaN symptom)
