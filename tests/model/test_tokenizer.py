"""Tokenizer round trips and the streaming detokenizer."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kvmux.daemon.model import IncrementalDecoder, ModelSpec, Tokenizer

TEXTS = ["hello world", "日本語のテキスト", "emoji 🙂🚀👩‍👩‍👧", "mixed: café — naïve ✓ €5", ""]


@pytest.fixture(scope="module")
def tiny_tok(tiny_spec: ModelSpec) -> Tokenizer:
    return Tokenizer(tiny_spec.tokenizer_path, bos_token_id=tiny_spec.bos_token_id)


@pytest.fixture(scope="module")
def small_tok(small_dir: Path) -> Tokenizer:
    return Tokenizer.from_folder(small_dir, bos_token_id=0)


def stream(tok: Tokenizer, ids: list[int]) -> list[str]:
    dec = IncrementalDecoder(tok)
    return [dec.push(i) for i in ids] + [dec.flush()]


@pytest.mark.parametrize("text", TEXTS)
def test_tiny_is_one_token_per_byte(tiny_tok: Tokenizer, text: str) -> None:
    ids = tiny_tok.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert tiny_tok.decode(ids) == text
    with_bos = tiny_tok.encode(text, add_bos=True)
    assert with_bos == [256, *ids]
    assert tiny_tok.decode(with_bos) == text
    assert tiny_tok.vocab_size == 259 and tiny_tok.is_special(257)


def test_split_characters_are_held_until_complete(tiny_tok: Tokenizer) -> None:
    text = "a🙂日é"
    parts = stream(tiny_tok, list(text.encode("utf-8")))
    assert "\ufffd" not in "".join(parts)
    # 'a' alone, then 4 bytes -> one emoji on the 4th, 3 bytes -> one CJK char, 2 -> é.
    assert parts == ["a", "", "", "", "🙂", "", "", "日", "", "é", ""]


def test_incomplete_trailing_sequence_only_at_flush(tiny_tok: Tokenizer) -> None:
    dec = tiny_tok.incremental_decoder()
    emitted = dec.push_many([0x68, 0x69, 0xE6, 0x97])  # "hi" + 2 of 3 bytes of 日
    assert emitted == "hi"
    assert dec.flush() == "\ufffd"
    # The decoder is reusable after flush.
    assert dec.push_many(list(b"ok")) == "ok"


def test_truly_invalid_bytes_become_replacement(tiny_tok: Tokenizer) -> None:
    ids = [0x61, 0xFF, 0x62, 0xC3, 0x28]  # 0xFF invalid; 0xC3 followed by a non-continuation
    joined = "".join(stream(tiny_tok, ids))
    assert joined == tiny_tok.decode(ids) == "a\ufffdb\ufffd("


def test_special_tokens_produce_no_text(tiny_tok: Tokenizer) -> None:
    ids = [256, *"hé".encode(), 257, 258]
    assert "".join(stream(tiny_tok, ids)) == "hé" == tiny_tok.decode(ids)


def test_stream_equals_decode_for_random_bytes(tiny_tok: Tokenizer) -> None:
    rng = np.random.default_rng(3)
    text = "".join(TEXTS) * 3
    data = list(text.encode("utf-8"))
    for _ in range(20):
        ids = [int(b) for b in rng.permutation(data)[:50]]
        assert "".join(stream(tiny_tok, ids)) == tiny_tok.decode(ids)


@pytest.mark.parametrize("text", TEXTS)
def test_small_bpe_round_trips_and_streams(small_tok: Tokenizer, text: str) -> None:
    ids = small_tok.encode(text, add_bos=True)
    assert ids[:1] == [0]
    assert small_tok.decode(ids) == text
    parts = stream(small_tok, ids)
    assert "".join(parts) == text
    assert all("\ufffd" not in p for p in parts)


def test_small_streams_split_characters_across_tokens(small_tok: Tokenizer) -> None:
    # Rare characters fall back to byte tokens: find a token holding a partial character.
    text = "ꙮ𝄞"  # not in the training corpus
    ids = small_tok.encode(text)
    assert len(ids) > 2, "expected byte-level fallback tokens"
    parts = stream(small_tok, ids)
    assert "".join(parts) == text
    assert parts.count("") >= 2 and "\ufffd" not in "".join(parts)


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("seed", range(4))
def test_push_many_gives_the_text_of_one_push_at_a_time(
    small_tok: Tokenizer, seed: int, skip: bool
) -> None:
    """The daemon's loop decodes a chunk of a session's tokens with one ``push_many``:
    cut anywhere (split characters, special tokens, ids never seen), the text is the
    same as pushing one token at a time."""
    rng = np.random.default_rng(seed)
    ids = [int(t) for t in rng.integers(0, small_tok.vocab_size, 300)]
    ids[10:10] = small_tok.encode("naïve 🙂 日本語")
    ids[40:40] = [0]  # a special token among ordinary ones
    one = [small_tok.incremental_decoder(skip_special_tokens=skip) for _ in range(2)]
    want = "".join(one[0].push(t) for t in ids) + one[0].flush()
    many, got, start = one[1], "", 0
    for size in rng.integers(1, 12, 100):
        got += many.push_many(ids[start : start + int(size)])
        start += int(size)
    got += many.push_many(ids[start:]) + many.flush()
    assert got == want
    assert want == small_tok.decode(ids, skip_special_tokens=skip)
