"""The engine's cohorts on device storage: batched decode equal to solo, one refused growth
failing one session. On CPU through the storage seam (a NumPy fake with CudaStorage's
semantics); on CUDA for real, in the tests marked gpu."""

from __future__ import annotations

import dataclasses
import json
import warnings
from pathlib import Path
from typing import Any

import jsonschema
import numpy as np
import pytest

from kvmux.daemon.engine import DecodeSession, Engine, EngineOptions, SamplingParams, grow_together
from kvmux.daemon.engine.structured import StructuredSpec
from kvmux.daemon.model import ensure_builtin
from kvmux.kv import (
    CohortPool,
    GrowthFailed,
    GrowthResult,
    RowKvCache,
    ensure_capacity,
    resolve_hard_max,
)

from ..kv.fake_device import FakeDeviceStorage, FakeOutOfMemory
from .helpers import decode, greedy, prompt_ids, record
from .test_batching import _drive, _plans, _solo


def _on_fake_device(engine: Engine, storage: FakeDeviceStorage) -> Engine:
    """Swap the engine's host cohorts for the fake device's, as Engine does with CudaStorage."""
    assert engine.budget.used == 0
    engine.pool = CohortPool(
        engine.kv_spec,
        storage=storage,
        rows_per_cohort=engine.options.rows_per_cohort,
        min_bucket=engine.min_bucket,
        budget=engine.budget,
    )
    return engine


@pytest.fixture
def fake_device_engine(tiny_model: Path) -> Engine:
    engine = Engine(tiny_model, EngineOptions(min_bucket=4, intra_op_threads=1))
    return _on_fake_device(engine, FakeDeviceStorage())


def _step_all(
    engine: Engine, sessions: list[DecodeSession]
) -> tuple[dict[str, list[Exception]], dict[str, list[np.ndarray[Any, Any]]]]:
    """Step every session together to the end; a session that fails leaves the batch."""
    errors: dict[str, list[Exception]] = {s.session_id: [] for s in sessions}
    recorders = {}
    for s in sessions:
        recorders[s.session_id] = record(s)
    live = list(sessions)
    while live:
        outs = engine.step_many(live)
        for s, out in zip(live, outs, strict=True):
            if isinstance(out, Exception):
                errors[s.session_id].append(out)
                s.finished = True
        live = [s for s in live if not s.finished]
    return errors, {sid: r.logits for sid, r in recorders.items()}


def test_batched_decode_on_device_cohorts_equals_solo_bit_for_bit(
    fake_device_engine: Engine,
) -> None:
    engine = fake_device_engine
    plans = _plans(engine, 12, seed=5)
    runs, rows = engine.runner.runs, engine.runner.rows_run
    batched = _drive(engine, plans)
    runs, rows = engine.runner.runs - runs, engine.runner.rows_run - rows
    assert rows / runs > 1.3, "sessions were not batched"
    for p in plans:
        tokens, logits = _solo(engine, p)
        assert batched[p.sid][0] == tokens, p.sid
        for step, (a, b) in enumerate(zip(batched[p.sid][1], logits, strict=True)):
            assert a.tobytes() == b.tobytes(), f"{p.sid}: logits differ at step {step}"
    assert engine.budget.used == 0 and engine.pool.cohorts() == []


def test_a_refused_cohort_fails_one_session_and_the_others_decode_as_alone(
    fake_device_engine: Engine,
) -> None:
    engine = fake_device_engine
    storage = engine.pool.storage
    assert isinstance(storage, FakeDeviceStorage)
    storage.refuse_capacities.add(64)  # only the long session reaches bucket 64
    shapes = [(30, 40, "long"), (5, 20, "a"), (9, 15, "b"), (3, 25, "c")]
    alone = {
        sid: decode(engine, engine.new_session(prompt_ids(engine, n, seed=n), greedy(new)))[:2]
        for n, new, sid in shapes
        if sid != "long"
    }
    sessions = [
        engine.new_session(prompt_ids(engine, n, seed=n), greedy(new), session_id=sid)
        for n, new, sid in shapes
    ]
    errors, logits = _step_all(engine, sessions)
    (failure,) = errors["long"]
    assert isinstance(failure, GrowthFailed)
    d = failure.details
    assert (d["cause"], d["old_capacity"], d["new_capacity"]) == ("out_of_memory", 32, 64)
    assert d["memory_source"] == "fake device" and d["session_unchanged"] is True
    assert isinstance(failure.__cause__, FakeOutOfMemory)
    long = sessions[0]
    assert long.cache.capacity == 32 and long.cache.valid_len == 32
    for s in sessions[1:]:
        assert errors[s.session_id] == []
        tokens, solo_logits = alone[s.session_id]
        assert list(s.generated) == tokens
        assert all(
            a.tobytes() == b.tobytes()
            for a, b in zip(logits[s.session_id], solo_logits, strict=True)
        )
    for s in sessions:
        s.release()
    assert engine.budget.used == 0 and engine.pool.cohorts() == []


# -- on a real device ------------------------------------------------------------


@pytest.fixture(scope="module")
def cuda_engines(tmp_path_factory: pytest.TempPathFactory) -> tuple[Engine, Engine]:
    """fp16 tiny on CUDA (its GroupQueryAttention runs fp16/bf16 only): min_bucket 4
    (sessions grow on the device) and 256 (one buffer that never grows)."""
    model = ensure_builtin("tiny", tmp_path_factory.mktemp("fp16"), dtype="float16")
    engines = []
    for min_bucket in (4, 256):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")  # a fallback to CPU warns; it is the skip's reason
            engine = Engine(model, EngineOptions(provider="cuda", min_bucket=min_bucket))
        if not engine.on_cuda:
            pytest.skip(
                f"gpu test: onnxruntime runs {engine.ort.providers} here, not "
                f"CUDAExecutionProvider ({'; '.join(str(w.message) for w in caught)})"
            )
        engines.append(engine)
    return engines[0], engines[1]


def _close(a: np.ndarray[Any, Any], b: np.ndarray[Any, Any]) -> bool:
    # Not bit for bit on a device: a run of n rows may pick other kernels (other
    # reduction orders) than a run of one, in fp16.
    return bool(np.allclose(a, b, rtol=0, atol=5e-2))


@pytest.mark.gpu
def test_cuda_batched_decode_equals_solo(cuda_engines: tuple[Engine, Engine]) -> None:
    engine = cuda_engines[0]
    shapes = [(3 + 5 * i, 40 + 7 * i) for i in range(8)]
    sessions = [
        engine.new_session(prompt_ids(engine, n, seed=i), greedy(new), session_id=f"g{i}")
        for i, (n, new) in enumerate(shapes)
    ]
    runs, rows = engine.runner.runs, engine.runner.rows_run
    errors, logits = _step_all(engine, sessions)
    assert (engine.runner.rows_run - rows) / (engine.runner.runs - runs) > 1.3
    assert all(isinstance(s.cache, RowKvCache) for s in sessions)
    for i, (s, (n, new)) in enumerate(zip(sessions, shapes, strict=True)):
        assert errors[s.session_id] == []
        tokens, solo_logits, _ = decode(
            engine, engine.new_session(prompt_ids(engine, n, seed=i), greedy(new))
        )
        assert list(s.generated) == tokens, s.session_id
        assert all(_close(a, b) for a, b in zip(logits[s.session_id], solo_logits, strict=True))
        s.release()
    assert engine.budget.used == 0 and engine.pool.cohorts() == []


@pytest.mark.gpu
def test_cuda_growth_on_the_device_equals_one_big_buffer(
    cuda_engines: tuple[Engine, Engine],
) -> None:
    grown, big = cuda_engines
    prompt = prompt_ids(grown, 5, seed=11)
    tokens, logits, capacities = decode(grown, grown.new_session(prompt, greedy(150)))
    ref_tokens, ref_logits, ref_capacities = decode(big, big.new_session(prompt, greedy(150)))
    assert capacities == [8, 16, 32, 64, 128, 256] and ref_capacities == [256]
    assert tokens == ref_tokens
    assert all(_close(a, b) for a, b in zip(logits, ref_logits, strict=True))


@pytest.mark.gpu
def test_cuda_out_of_memory_fails_one_session_and_the_others_go_on(
    cuda_engines: tuple[Engine, Engine],
) -> None:
    engine = cuda_engines[0]
    assert engine.budget.total is None  # kv.memory_budget off: the device refuses
    shapes = [(7, 30), (12, 30), (4, 30)]
    sessions = []
    for i, (n, new) in enumerate(shapes):
        admission = engine.admit(prompt_ids(engine, n, seed=20 + i), greedy(new))
        if i == 1:  # the victim: no ceiling at all, so it may ask the device for anything
            admission = dataclasses.replace(admission, hard_max=resolve_hard_max(None, None))
        sessions.append(engine.open_session(admission, f"o{i}"))
    engine.step_many(sessions, steps=3)
    victim = sessions[1]
    before = (victim.cache.placement(), victim.cache.capacity, victim.cache.valid_len)
    used = engine.budget.used
    # 2**40 tokens is petabytes: a real refusal, of one row.
    with pytest.raises(GrowthFailed) as info:
        ensure_capacity(victim.cache, 1 << 40)
    d = info.value.details
    assert d["cause"] == "out_of_memory" and d["memory_source"].startswith("cudaMemGetInfo")
    assert d["device_total_bytes"] > 0 and d["bytes_per_token"] == engine.kv_spec.bytes_per_token
    assert (victim.cache.placement(), victim.cache.capacity, victim.cache.valid_len) == before
    assert engine.budget.used == used
    errors, _ = _step_all(engine, sessions)
    for i, (s, (n, new)) in enumerate(zip(sessions, shapes, strict=True)):
        assert errors[s.session_id] == [] and s.finished
        alone = engine.generate(prompt_ids(engine, n, seed=20 + i), greedy(new))
        assert list(s.generated) == alone.token_ids, s.session_id
        s.release()
    assert engine.budget.used == 0


@pytest.mark.gpu
def test_cuda_graphs_give_the_tokens_of_plain_runs(
    cuda_engines: tuple[Engine, Engine], tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Graphs on (captured per binding, again after every growth and move) decode the
    batched, growing sessions to the tokens of the same engine without graphs, and leave
    nothing charged."""
    plain = cuda_engines[0]
    model = ensure_builtin("tiny", tmp_path_factory.mktemp("fp16g"), dtype="float16")
    graphs = Engine(model, EngineOptions(provider="cuda", min_bucket=4, cuda_graph=True))
    assert graphs.graphs_enabled

    def run(engine: Engine) -> list[list[int]]:
        sessions = [
            engine.new_session(prompt_ids(engine, 3 + 4 * i, seed=i), greedy(60 + 9 * i))
            for i in range(8)
        ]
        tokens: list[list[int]] = [[] for _ in sessions]
        live = list(range(len(sessions)))
        while live:
            outs = engine.step_many([sessions[i] for i in live], 8)
            for i, out in zip(live, outs, strict=True):
                assert not isinstance(out, Exception), out
                tokens[i] += out.token_ids
            live = [i for i in live if not sessions[i].finished]
        for s in sessions:
            s.release()
        return tokens

    assert run(graphs) == run(plain)
    assert graphs.budget.used == 0 and graphs.pool.cohorts() == []


@pytest.mark.gpu
def test_cuda_constrained_rows_beside_plain_ones_answer_valid_json(
    cuda_engines: tuple[Engine, Engine],
) -> None:
    """Constrained rows decode in the batched runs beside plain ones, their masks applied
    to their logits on the device (only llguidance's bitmask crosses); every answer that
    ends with "stop" parses and matches its schema."""
    engine = cuda_engines[0]
    schema = {
        "type": "object",
        "properties": {
            "id": {"type": "string", "maxLength": 8},
            "n": {"type": "integer", "minimum": 0},
            "kind": {"enum": ["a", "b"]},
        },
        "required": ["id", "n", "kind"],
        "additionalProperties": False,
    }
    structured = StructuredSpec.from_wire(json=schema)
    params = [
        SamplingParams(
            max_new_tokens=120,
            temperature=0.8 * (i % 2),
            seed=i,
            structured=structured if i % 4 < 2 else None,
        )
        for i in range(8)
    ]
    sessions = [
        engine.new_session(prompt_ids(engine, 5 + i, seed=40 + i), p, session_id=f"j{i}")
        for i, p in enumerate(params)
    ]
    while live := [s for s in sessions if not s.finished]:
        for out in engine.step_many(live, 8):
            assert not isinstance(out, Exception), out
    stops = 0
    for s, p in zip(sessions, params, strict=True):
        if p.structured is not None and s.finish_reason == "stop":
            jsonschema.validate(json.loads(engine.tokenizer.decode(list(s.generated))), schema)
            stops += 1
        s.release()
    assert stops >= 1
    assert engine.budget.used == 0


@pytest.mark.gpu
def test_cuda_sessions_grown_together_match_one_big_buffer(
    cuda_engines: tuple[Engine, Engine],
) -> None:
    """Equal prompts cross each bucket at one step and grow as one group on the device
    (list-indexed copies, one mask write, one wait): the tokens of one big buffer each."""
    grown, big = cuda_engines
    prompts = [prompt_ids(grown, 3, seed=60 + i) for i in range(6)]
    sessions = [grown.new_session(p, greedy(70), session_id=f"t{i}") for i, p in enumerate(prompts)]
    groups: list[int] = []
    while live := [s for s in sessions if not s.finished]:
        by_bucket: dict[int, list[DecodeSession]] = {}
        for s in live:
            if s.needs_growth():
                by_bucket.setdefault(s.growth_bucket(), []).append(s)
        for group in by_bucket.values():
            assert all(isinstance(r, GrowthResult) and r.grew for r in grow_together(group))
            groups.append(len(group))
        for out in grown.step_many(live):
            assert not isinstance(out, Exception), out
    assert max(groups) == len(sessions)
    for s, p in zip(sessions, prompts, strict=True):
        ref, _, _ = decode(big, big.new_session(p, greedy(70)))
        assert list(s.generated) == ref, s.session_id
        s.release()
    assert grown.budget.used == 0 and grown.pool.cohorts() == []
