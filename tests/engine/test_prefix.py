"""Coherence is the assertion: a session started on a cached prefix decodes exactly as the
same session prefilling its whole prompt, logits bit for bit (chunked prefill is bit-equal
on this model, and a fork only moves where a chunk boundary falls)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvmux.daemon.engine import DecodeSession, Engine, EngineOptions, SamplingParams
from kvmux.kv import Holder, PromptKey

from .helpers import decode, greedy, prompt_ids

BLOCK = 8


@pytest.fixture
def engine(tiny_model: Path) -> Engine:
    """Small buckets and prompt chunks, so forks land in other buckets and grow soon."""
    return Engine(
        tiny_model,
        EngineOptions(min_bucket=4, prefill_chunk=16, intra_op_threads=1, prefix_block=BLOCK),
    )


def _donor(engine: Engine, prompt: list[int], n_new: int = 30) -> tuple[Holder, DecodeSession]:
    """A live session that has prefilled ``prompt`` (and decoded on), registered as a holder
    as the scheduler registers one."""
    assert engine.prefix is not None
    key = engine.prefix.key(prompt)
    engine.prefix.lookup(key)
    holder = engine.prefix.register(key)
    assert holder is not None
    session = engine.new_session(prompt, greedy(n_new))
    engine.prefix.attach(holder, session.cache, session.exact_prefix())  # type: ignore[arg-type]
    while not session.finished:
        engine.step(session)
    return holder, session


def _forked(
    engine: Engine, prompt: list[int], params: SamplingParams
) -> tuple[DecodeSession, int, PromptKey]:
    """A session of ``prompt`` started on what the cache holds of it, as the scheduler
    starts one; (session, tokens copied, key)."""
    assert engine.prefix is not None
    key = engine.prefix.key(prompt)
    match = engine.prefix.lookup(key)
    assert match.holder is not None
    session = engine.new_session(prompt, params)
    tokens = session.fork_tokens(min(match.tokens, match.holder.exact))
    session.start_from(engine.prefix, match.holder, key, tokens)
    return session, tokens, key


@pytest.mark.parametrize(
    ("shared", "expected"),
    [(37, 32), (40, 40)],
    ids=["prefix-ends-mid-block", "prefix-ends-on-a-block"],
)
def test_a_forked_session_decodes_exactly_as_a_full_prefill(
    engine: Engine, shared: int, expected: int
) -> None:
    system = prompt_ids(engine, shared, seed=10)
    _, donor = _donor(engine, [*system, *prompt_ids(engine, 13, seed=11)])
    mine = [*system, *prompt_ids(engine, 11, seed=12)]
    session, tokens, _ = _forked(engine, mine, greedy(60))
    assert tokens == expected == session.cached_tokens
    # Its first bucket holds the copy and the first prompt chunk: not the donor's bucket.
    assert session.cache.capacity == 64 != donor.cache.capacity == 128
    got_tokens, got_logits, capacities = decode(engine, session)
    assert capacities[0] == 64 and capacities[-1] == 128  # and it grew on from there
    want_tokens, want_logits, _ = decode(engine, engine.new_session(mine, greedy(60)))
    assert got_tokens == want_tokens
    assert [x.tobytes() for x in got_logits] == [x.tobytes() for x in want_logits]
    assert session.completion().cached_tokens == expected
    donor.release()


def test_a_growth_right_after_a_fork_keeps_the_copied_prefix(engine: Engine) -> None:
    """48 tokens copied and the first prompt chunk (16) fill the bucket of 64 exactly: the
    next chunk already needs the next bucket."""
    prompt = prompt_ids(engine, 72, seed=20)
    _, donor = _donor(engine, [*prompt[:48], *prompt_ids(engine, 20, seed=21)])
    session, tokens, _ = _forked(engine, prompt, greedy(40))
    assert tokens == 48 and session.cache.capacity == 64
    got_tokens, got_logits, capacities = decode(engine, session)
    assert capacities == [64, 128]
    want_tokens, want_logits, _ = decode(engine, engine.new_session(prompt, greedy(40)))
    assert got_tokens == want_tokens
    assert [x.tobytes() for x in got_logits] == [x.tobytes() for x in want_logits]
    donor.release()


def test_a_fork_of_a_whole_prompt_has_room_for_the_first_new_token(engine: Engine) -> None:
    """What is left of the prompt fits one chunk: the first bucket holds the first new
    token too (a bucket exactly as long as the prompt would grow, copying again, at once)."""
    prompt = prompt_ids(engine, 64, seed=22)
    _, donor = _donor(engine, prompt)
    session, tokens, _ = _forked(engine, prompt, greedy(20))
    assert tokens == 62 and session.cache.capacity == 128
    assert decode(engine, session)[2] == [128]
    donor.release()


def test_the_same_prompt_again_copies_all_but_its_last_two_tokens(engine: Engine) -> None:
    """What ``n`` > 1 choices do: one prefill, then each choice samples with its own seed.
    The last two tokens are prefilled (one alone would take onnxruntime's one-token path,
    whose logits differ in the last bits from those of a chunk's last row)."""
    prompt = prompt_ids(engine, 48, seed=30)  # ends on a block boundary
    _, donor = _donor(engine, prompt)
    for seed in (1, 2, 3):
        params = SamplingParams(max_new_tokens=40, temperature=0.9, top_k=40, seed=seed)
        session, tokens, _ = _forked(engine, prompt, params)
        assert tokens == 46
        got = decode(engine, session)
        want = decode(engine, engine.new_session(prompt, params))
        assert got[0] == want[0]
        assert [x.tobytes() for x in got[1]] == [x.tobytes() for x in want[1]]
    donor.release()


def test_a_kept_prefix_outlives_its_session_and_serves_later_prompts(engine: Engine) -> None:
    cache = engine.prefix
    assert cache is not None
    system = prompt_ids(engine, 33, seed=40)
    holder, donor = _donor(engine, [*system, *prompt_ids(engine, 9, seed=41)])
    cache.lookup(cache.key([*system, 1, 2, 3]))  # another item asked for the same blocks
    assert cache.leave(holder, keep=True) is False  # the cache keeps the donor's row
    cache.settle()  # (the scheduler does this under the growth lock)
    assert donor.cache.capacity == 0 and cache.bytes == 32 * engine.kv_spec.bytes_per_token
    later = [*system, *prompt_ids(engine, 20, seed=42)]
    session, tokens, _ = _forked(engine, later, greedy(50))
    assert tokens == 32
    got = decode(engine, session)
    want = decode(engine, engine.new_session(later, greedy(50)))
    assert got[0] == want[0]
    assert [x.tobytes() for x in got[1]] == [x.tobytes() for x in want[1]]
    cache.clear()
    assert cache.bytes == 0 and engine.budget.used == 0


@pytest.mark.parametrize("length", [128, 129], ids=["last-chunk-full", "last-chunk-one-token"])
def test_a_fork_of_any_length_takes_what_keeps_every_logit_exact(
    engine: Engine, length: int
) -> None:
    """Whatever a match offers (here every length from 1 to the whole prompt), the session
    starts on what keeps its logits bit-equal to a whole prefill's; with a prompt whose own
    last chunk is one token (129 = 8 x 16 + 1), on a multiple of the chunk or all but one."""
    prompt = prompt_ids(engine, length, seed=50)
    holder, donor = _donor(engine, prompt, n_new=1)
    # 129: its own last token ran alone, so the copy stops before it.
    assert holder.exact == 128
    want_tokens, want_logits, _ = decode(engine, engine.new_session(prompt, greedy(12)))
    assert engine.prefix is not None
    key = engine.prefix.key(prompt)
    chosen = set()
    for match in range(1, length + 1, 3):
        session = engine.new_session(prompt, greedy(12))
        tokens = session.fork_tokens(min(match, holder.exact))
        chosen.add(tokens)
        if tokens == 0:
            session.release()
            continue
        session.start_from(engine.prefix, holder, key, tokens)
        got_tokens, got_logits, _ = decode(engine, session)
        assert got_tokens == want_tokens, (match, tokens)
        assert [x.tobytes() for x in got_logits] == [x.tobytes() for x in want_logits], tokens
    if length == 129:
        assert chosen <= {0, 16, 32, 48, 64, 80, 96, 112, 128}
    else:
        assert all((length - t - 1) % 16 for t in chosen)
    donor.release()
