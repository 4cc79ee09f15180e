"""Structured outputs in the engine: llguidance's grammars on the built-in models' tokenizers."""

from __future__ import annotations

import gc
import itertools
import json
import re
from pathlib import Path

import jsonschema
import numpy as np
import pytest

from kvmux.daemon.engine import BadPrompt, Engine, EngineOptions, SamplingParams
from kvmux.daemon.engine.runner import DecodeSpan
from kvmux.daemon.engine.structured import (
    MAX_SOURCE_BYTES,
    GrammarCompiler,
    Matcher,
    StructuredSpec,
    allocate_bitmask,
    apply_bitmask,
)
from kvmux.daemon.model import ensure_builtin

# Nested objects, arrays, enums, required fields, additionalProperties false.
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                "city": {"type": "string", "maxLength": 10},
            },
            "required": ["zip"],
            "additionalProperties": False,
        },
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "role", "address"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def small_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_builtin("small", tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="module", params=["tiny", "small"])
def model_engine(request: pytest.FixtureRequest, tiny_model: Path, small_model: Path) -> Engine:
    folder = tiny_model if request.param == "tiny" else small_model
    return Engine(folder, EngineOptions(min_bucket=16, intra_op_threads=1))


@pytest.fixture(scope="module")
def tiny_engine(tiny_model: Path) -> Engine:
    return Engine(tiny_model, EngineOptions(min_bucket=16, intra_op_threads=1))


def spec(**kw: object) -> StructuredSpec:
    out = StructuredSpec.from_wire(**kw)  # type: ignore[arg-type]
    assert out is not None
    return out


def allowed(compiler: GrammarCompiler, row: np.ndarray) -> set[int]:
    bits = np.unpackbits(row.view(np.uint8), bitorder="little")[: compiler.vocab_size]
    return {int(t) for t in np.flatnonzero(bits)}


# -- the module ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kw", "wrong"),
    [
        ({"json": {"type": "objekt"}}, "Invalid type: objekt"),
        ({"json": {"type": "string", "pattern": "(("}}, "unclosed group"),
        ({"json": {"$ref": "#/nope"}}, "/nope"),
        ({"json": "{not json"}, "not valid JSON"),
        ({"json": [1, 2]}, "must be a JSON schema object"),
        ({"regex": "a(b"}, "unclosed group"),
        ({"grammar": "start: foo"}, 'unknown name: "foo"'),
        ({"grammar": "root ::= ("}, "grammar"),
        ({"choice": []}, "at least one string"),
        ({"regex": "a", "choice": ["a"]}, "one kind of constraint"),
        ({"regex": "x" * (MAX_SOURCE_BYTES + 1)}, "kvmux compiles at most"),
    ],
)
def test_an_invalid_spec_is_refused_naming_what_is_wrong(
    tiny_engine: Engine, kw: dict[str, object], wrong: str
) -> None:
    with pytest.raises(BadPrompt, match=re.escape(wrong)) as info:
        tiny_engine.structured.compile(spec(**kw))
    assert info.value.code == "bad_request"


def test_a_spec_compiles_once_and_so_does_its_refusal(tiny_model: Path) -> None:
    engine = Engine(tiny_model, EngineOptions(intra_op_threads=1))
    compiler = engine.structured
    schema = spec(json=PERSON)
    for _ in range(50):
        compiler.matcher(spec(json=PERSON))  # equal specs, built apart: one cache entry
    bad = spec(regex="a(b")
    for _ in range(50):
        with pytest.raises(BadPrompt):
            compiler.compile(bad)
    assert compiler.compiled == 2
    assert hash(schema) == hash(spec(json=PERSON))


def test_the_mask_allows_exactly_the_grammars_next_tokens(tiny_engine: Engine) -> None:
    compiler = tiny_engine.structured
    tok = tiny_engine.tokenizer
    m = compiler.matcher(spec(choice=["yes", "no"]))
    row = allocate_bitmask(1, compiler.words)[0]
    m.fill_bitmask(row)
    first = allowed(compiler, row)
    # tiny is byte-level: one token per byte, so exactly "y" and "n" may start.
    assert {tok.token_text(t) for t in first} == {"y", "n"}
    word = tok.encode("yes")
    for i, t in enumerate(word):
        assert not m.is_stopped()
        assert m.advance(t) is (i == len(word) - 1)  # complete once "yes" is
    assert m.is_stopped() and m.is_accepting()
    m.fill_bitmask(row)
    assert allowed(compiler, row) == set(tiny_engine.spec.eos_token_ids)
    with pytest.raises(BadPrompt, match="does not match"):
        compiler.matcher(spec(choice=["yes", "no"])).advance(tok.encode("x")[0])


def test_replay_reaches_the_state_of_accepting_token_by_token(tiny_engine: Engine) -> None:
    compiler = tiny_engine.structured
    tokens = tiny_engine.tokenizer.encode('{"name":"ab","age":7')
    one, two = compiler.matcher(spec(json=PERSON)), compiler.matcher(spec(json=PERSON))
    for t in tokens:
        assert not one.advance(t)
    two.replay(tokens)
    rows = allocate_bitmask(2, compiler.words)
    one.fill_bitmask(rows[0])
    two.fill_bitmask(rows[1])
    assert np.array_equal(rows[0], rows[1])
    assert allowed(compiler, rows[0]) >= set(tiny_engine.tokenizer.encode(","))
    with pytest.raises(BadPrompt, match="do not match"):
        compiler.matcher(spec(json=PERSON)).replay(tiny_engine.tokenizer.encode("[1]"))


def test_many_rows_fill_at_once_as_each_alone(model_engine: Engine) -> None:
    compiler = model_engine.structured
    specs = [spec(json=PERSON), None, spec(regex="[0-9]+"), spec(json_object=True), None]
    matchers = [None if s is None else compiler.matcher(s) for s in specs]
    prefix = model_engine.tokenizer.encode('{"name":"x"')
    assert matchers[0] is not None
    matchers[0].replay(prefix)
    batch = allocate_bitmask(len(specs), compiler.words)
    batch[1] = 12345  # rows without a matcher are left as they are
    compiler.fill_bitmasks(matchers, batch)
    assert (batch[1] == 12345).all() and (batch[4] == -1).all()
    for i, m in enumerate(matchers):
        if m is None:
            continue
        alone = allocate_bitmask(1, compiler.words)
        m.fill_bitmask(alone[0])
        assert np.array_equal(alone[0], batch[i])
        assert 0 < len(allowed(compiler, alone[0])) < compiler.vocab_size


def test_apply_bitmask_masks_only_the_constrained_rows() -> None:
    rng = np.random.default_rng(0)
    vocab = 70  # not a multiple of 32: the last word is partly past the vocabulary
    logits = rng.standard_normal((4, vocab)).astype(np.float32)
    before = logits.copy()
    masks = np.zeros((2, 3), dtype=np.int32)
    want = [{0, 31, 32, 69}, {5, 64}]
    for r, ids in enumerate(want):
        for t in ids:
            masks[r, t // 32] |= np.int32(np.uint32(1 << (t % 32)).view(np.int32))
    apply_bitmask(logits, masks, rows=np.array([1, 3]))
    assert np.array_equal(logits[[0, 2]], before[[0, 2]])
    for r, ids in zip((1, 3), want, strict=True):
        finite = set(np.flatnonzero(np.isfinite(logits[r])).tolist())
        assert finite == ids
        assert np.array_equal(logits[r, sorted(ids)], before[r, sorted(ids)])
    every = before.copy()
    apply_bitmask(every[:2], masks)
    assert set(np.flatnonzero(np.isfinite(every[0])).tolist()) == want[0]
    # A mask narrower than the logits (96 bits, 100 ids) allows none past its end.
    wide = rng.standard_normal((1, 100)).astype(np.float32)
    apply_bitmask(wide, np.full((1, 3), -1, dtype=np.int32))
    assert np.isfinite(wide[0, :96]).all() and np.isneginf(wide[0, 96:]).all()
    # Overflowed logits (fp16's inf): a forbidden +inf is -inf too, an allowed one stays.
    for dtype in (np.float32, np.float16):
        edge = np.zeros((1, vocab), dtype=dtype)
        edge[0, [0, 1]] = np.inf
        apply_bitmask(edge, masks[:1])
        assert edge.dtype == dtype
        assert edge[0, 0] == np.inf and edge[0, 1] == -np.inf
        assert set(np.flatnonzero(np.isfinite(edge[0])).tolist()) == want[0] - {0}


@pytest.mark.gpu
def test_apply_bitmask_on_the_device_equals_the_host() -> None:
    import cupy as cp

    rng = np.random.default_rng(1)
    logits = rng.standard_normal((3, 100)).astype(np.float32)
    masks = rng.integers(-(2**31), 2**31, size=(2, 4), dtype=np.int64).astype(np.int32)
    host = logits.copy()
    apply_bitmask(host, masks, rows=np.array([0, 2]))
    dev = cp.asarray(logits)
    apply_bitmask(dev, cp.asarray(masks), rows=cp.asarray([0, 2]), xp=cp)
    assert np.array_equal(cp.asnumpy(dev), host)


# -- the engine ------------------------------------------------------------------


def test_a_steps_masks_are_applied_where_the_logits_are(
    tiny_engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In a batched step, the constrained rows' masks are applied in the run's own
    logits buffer (the device's with CUDA: only the bitmask crosses), before the host
    copies its rows; no other row's logits are touched."""
    seen: list[tuple[list[int], np.ndarray]] = []
    real = DecodeSpan.host_logits

    def spy(span: DecodeSpan) -> np.ndarray:
        where = np.asarray(span.bound.logits[:, 0, :])  # numpy here, the device's on CUDA
        seen.append((span.host.tolist(), np.asarray(np.isneginf(where).any(axis=1))))
        return real(span)

    monkeypatch.setattr(DecodeSpan, "host_logits", spy)
    rng = np.random.default_rng(3)
    params = [
        SamplingParams(max_new_tokens=6, temperature=0.9, seed=1, structured=spec(json=PERSON)),
        SamplingParams(max_new_tokens=6, temperature=0.9, seed=2, ignore_eos=True),
        SamplingParams(max_new_tokens=6, ignore_eos=True),
        SamplingParams(max_new_tokens=6, temperature=0.0, structured=spec(regex="[a-z]{3,5}")),
    ]
    sessions = [
        tiny_engine.new_session(
            [int(t) for t in rng.integers(3, tiny_engine.spec.vocab_size, 8)], p, session_id=f"m{i}"
        )
        for i, p in enumerate(params)
    ]
    try:
        for _ in range(4):
            outs = tiny_engine.step_many(sessions, 1)
            assert not any(isinstance(o, Exception) for o in outs)
    finally:
        for s in sessions:
            s.release()
    assert seen, "no batched step copied host rows"
    for host, masked in seen:
        # Rows 0 and 3 are constrained (a JSON schema, a regex): masked where they are;
        # the sampled row 1 and the greedy row 2 are not.
        assert host == [0, 1, 3]
        assert masked.tolist() == [True, False, False, True]


def _mixed_decode(engine: Engine, steps_per_call: int) -> list[list[int]]:
    """Four sessions, two of them constrained (sampled and greedy), decoded to their end
    with ``step_many``: each one's tokens."""
    params = [
        SamplingParams(max_new_tokens=40, temperature=0.9, seed=1, structured=spec(json=PERSON)),
        SamplingParams(max_new_tokens=40, temperature=0.9, seed=2, ignore_eos=True),
        SamplingParams(max_new_tokens=40, structured=spec(regex="[a-z]{3,30}")),
        SamplingParams(max_new_tokens=40, ignore_eos=True),
    ]
    sessions = [
        engine.new_session(f"Item {i}:", p, session_id=f"f{i}") for i, p in enumerate(params)
    ]
    try:
        live = list(sessions)
        while live:
            outs = engine.step_many(live, steps_per_call)
            assert not any(isinstance(o, Exception) for o in outs), outs
            live = [s for s in live if not s.finished]
        return [list(s.generated) for s in sessions]
    finally:
        for s in sessions:
            s.release()


@pytest.mark.parametrize("steps_per_call", [1, 8])
def test_every_mask_is_filled_beside_a_run_none_row_by_row(
    tiny_engine: Engine, monkeypatch: pytest.MonkeyPatch, steps_per_call: int
) -> None:
    """The first token after the prompt (a one-run step) and every span step: the
    constrained rows' masks come from one fill per run, made while the run goes on;
    no row masks its own logits after the run."""
    fills: list[int] = []
    real_fill = GrammarCompiler.fill_bitmasks

    def counted(self: GrammarCompiler, matchers: list[Matcher | None], bitmask: np.ndarray) -> None:
        fills.append(sum(m is not None for m in matchers))
        real_fill(self, matchers, bitmask)

    def alone(self: Matcher, logits: np.ndarray) -> np.ndarray:
        raise AssertionError("a row masked its own logits")

    monkeypatch.setattr(GrammarCompiler, "fill_bitmasks", counted)
    monkeypatch.setattr(Matcher, "masked", alone)
    tokens = _mixed_decode(tiny_engine, steps_per_call)
    assert fills[0] == 2  # both constrained rows' first masks in the prompts' run
    assert all(0 < n <= 2 for n in fills)
    assert len(fills) >= len(tokens[2])  # a fill for each of the regex row's tokens


def test_a_failed_fill_leaves_each_row_to_mask_its_own(
    tiny_engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batched fill that fails (here a plain RuntimeError, every other call) costs
    nothing but time: each constrained row then masks its own logits, and every row's
    tokens are those of a decode whose fills all worked."""
    want = _mixed_decode(tiny_engine, 1)
    calls = itertools.count()
    real_fill = GrammarCompiler.fill_bitmasks

    def flaky(self: GrammarCompiler, matchers: list[Matcher | None], bitmask: np.ndarray) -> None:
        if next(calls) % 2 == 0:
            raise RuntimeError("injected: the fill failed")
        real_fill(self, matchers, bitmask)

    monkeypatch.setattr(GrammarCompiler, "fill_bitmasks", flaky)
    assert _mixed_decode(tiny_engine, 1) == want
    assert next(calls) > 4


def test_the_mask_threads_end_with_their_engine(tiny_model: Path) -> None:
    """An engine's mask filler starts its thread at its first constrained step, and the
    thread ends once the engine is gone: a process that makes engines keeps none."""
    engine = Engine(tiny_model, EngineOptions(min_bucket=16, intra_op_threads=1))
    params = SamplingParams(max_new_tokens=4, structured=spec(regex="[a-z]{2,8}"))
    assert engine.generate("Word:", params).finish_reason in ("stop", "length")
    thread = engine._masks._thread
    assert thread is not None and thread.is_alive()
    del engine
    gc.collect()
    thread.join(timeout=10)
    assert not thread.is_alive()


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_random_weights_answer_json_that_matches_the_schema(
    model_engine: Engine, temperature: float
) -> None:
    stops = 0
    for seed in range(4):
        params = SamplingParams(
            max_new_tokens=160, temperature=temperature, seed=seed, structured=spec(json=PERSON)
        )
        done = model_engine.generate(f"Person {seed}:", params)
        if done.finish_reason == "stop":
            stops += 1
            jsonschema.validate(json.loads(done.text), PERSON)
        else:
            assert done.finish_reason == "length" and len(done.token_ids) == 160
    assert stops == 4  # the grammar forces the end once the object is complete


@pytest.mark.parametrize(
    ("kw", "check"),
    [
        ({"regex": r"[a-z]{3,8}@[a-z]{2,6}\.com"}, r"[a-z]{3,8}@[a-z]{2,6}\.com"),
        ({"choice": ["red", "green", "blue"]}, r"red|green|blue"),
        ({"grammar": 'root ::= "x" [0-9] [0-9]?'}, r"x[0-9][0-9]?"),  # GBNF
        ({"grammar": 'start: "id-" /[a-f]{4}/'}, r"id-[a-f]{4}"),  # Lark
    ],
)
def test_regex_choice_and_grammars_match(
    model_engine: Engine, kw: dict[str, object], check: str
) -> None:
    for seed in range(3):
        params = SamplingParams(
            max_new_tokens=40, temperature=1.0, seed=seed, structured=spec(**kw)
        )
        done = model_engine.generate("Answer:", params)
        assert done.finish_reason == "stop", done
        assert re.fullmatch(check, done.text), done.text


def test_json_object_is_an_object(tiny_engine: Engine) -> None:
    reasons = []
    for seed in range(4):
        params = SamplingParams(
            max_new_tokens=60, temperature=1.0, seed=seed, structured=spec(json_object=True)
        )
        done = tiny_engine.generate("Q:", params)
        reasons.append(done.finish_reason)
        if done.finish_reason == "stop":
            assert isinstance(json.loads(done.text), dict)
        else:  # any object: free strings may run to max_tokens
            assert done.text.startswith("{")
    assert "stop" in reasons


def test_constrained_sampling_is_reproducible_and_logprobs_are_finite(
    tiny_engine: Engine,
) -> None:
    def run(seed: int) -> tuple[str, list[float]]:
        params = SamplingParams(
            max_new_tokens=160, temperature=0.9, seed=seed, logprobs=3, structured=spec(json=PERSON)
        )
        done = tiny_engine.generate("Who?", params)
        assert done.logprobs is not None and len(done.logprobs) == len(done.token_ids)
        for entry in done.logprobs:
            assert np.isfinite(entry.logprob)
            assert all(np.isfinite(lp) for _, _, lp in entry.top)
        return done.text, [e.logprob for e in done.logprobs]

    assert run(7) == run(7)
    assert run(7)[0] != run(8)[0]


def test_whitespace_is_compact_unless_asked(tiny_engine: Engine) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    free = spec(json=schema, disable_any_whitespace=False)
    compact = spec(json=schema)
    assert free != compact and free.any_whitespace and not compact.any_whitespace
    compiler = tiny_engine.structured
    rows = allocate_bitmask(2, compiler.words)
    matchers = [compiler.matcher(compact), compiler.matcher(free)]
    for m in matchers:
        m.replay(tiny_engine.tokenizer.encode("{"))
    compiler.fill_bitmasks(matchers, rows)
    space = set(tiny_engine.tokenizer.encode(" "))
    assert not space & allowed(compiler, rows[0])
    assert space <= allowed(compiler, rows[1])


def test_admission_refuses_a_bad_grammar_before_any_session(tiny_engine: Engine) -> None:
    before = tiny_engine.session_kv_bytes()
    with pytest.raises(BadPrompt, match="unclosed group"):
        tiny_engine.admit("hi", SamplingParams(structured=spec(regex="(")))
    assert tiny_engine.session_kv_bytes() == before
