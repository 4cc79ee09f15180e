"""SentencePiece vocabularies (``tokenizer.ggml.model = "llama"``) in a GGUF file: a BPE
trained by the sentencepiece package, written as llama.cpp's convert_hf_to_gguf.py writes
one, must encode as llama.cpp does and decode back.

llama.cpp (llama-vocab.cpp, ``LLAMA_VOCAB_TYPE_SPM``) cuts the text at special and
user-defined tokens and encodes each stretch between them on its own, a space put first
when the file says so: that is sentencepiece's own encoding of each stretch, the reference
here (``_llama_cpp``). llama-server's /tokenize on the Llama file gave the same ids for all
of ``TEXTS`` (checked by hand). transformers' GGUF conversion agrees on Gemma's vocabulary
(no space prefix); on Llama's it departs from llama.cpp on two texts (``HF_DIFFERS``): it
puts no space after a special token, and turns the prefix plus two leading spaces into two
"▁", not three. GGUF being llama.cpp's format, kvmux follows llama.cpp there.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from kvmux.daemon.model import GGUFImportError, Tokenizer, import_gguf, load_model
from kvmux.daemon.model.gguf_tokenizer import read_tokenizer

from .gguf_fixture import (
    TinyShape,
    random_weights,
    sentencepiece_vocab,
    train_sentencepiece,
    with_metadata,
    write_sentencepiece_gguf,
)

gguf = pytest.importorskip("gguf", reason="GGUF import needs the gguf package (cpu extra)")
pytest.importorskip(
    "sentencepiece", reason="the vocabulary is trained by sentencepiece (test extra)"
)

SHAPE = TinyShape()
USER = "<tool>"
TEXTS = [
    "the session cache grows",
    "  two leading spaces and a trailing one ",
    "café, naïve, Ærøskøbing: accents",
    "日本語のテキストと中文",
    "emoji 🙂🚀 and a ZWJ 👩‍💻",
    "digits 1234567890 and 3.14159",
    "line one\nline two\n\n\ttabbed",
    "before</s>after",
    f"a {USER} call and <s> inside",
    "",
]
SPECIAL = re.compile(f"({re.escape(USER)}|<s>|</s>)")
HF_DIFFERS = {TEXTS[1], TEXTS[7], TEXTS[8]}
# Gemma's layout: pad, eos, bos, unk first, and no space put before the text.
GEMMA_IDS = {"pad": 0, "eos": 1, "bos": 2, "unk": 3}


@pytest.fixture(scope="module")
def llama_sp() -> Any:
    return train_sentencepiece(user_defined=[USER])


@pytest.fixture(scope="module")
def gemma_sp() -> Any:
    return train_sentencepiece(add_dummy_prefix=False, user_defined=[USER], ids=GEMMA_IDS)


def _file(path: Path, arch: str, sp: Any, **kw: Any) -> Path:
    vocab, scores = sentencepiece_vocab(sp, user_defined=[USER])
    weights = random_weights(SHAPE, len(vocab.tokens), qkv_bias=False, tied=False)
    return write_sentencepiece_gguf(path, arch, SHAPE, weights, vocab, scores, **kw)


def _llama_file(path: Path, sp: Any) -> Path:
    return _file(path, "llama", sp)


def _gemma_file(path: Path, sp: Any) -> Path:
    ids = {"padding": 0, "eos": 1, "bos": 2, "unknown": 3}
    # gemma2: the newest Gemma transformers reads from a GGUF file with its tokenizer.
    return _file(path, "gemma2", sp, add_space_prefix=False, add_bos=True, ids=ids)


def _transformers(path: Path) -> Any:
    pytest.importorskip("transformers", reason="the reference is transformers (genai extra)")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


def _llama_cpp(sp: Any, text: str, bos: int) -> list[int]:
    """llama.cpp's SPM encoding with sentencepiece doing each stretch between tokens."""
    ids = [bos]
    for part in SPECIAL.split(text):
        if SPECIAL.fullmatch(part):
            ids.append(sp.piece_to_id(part))
        elif part:
            ids += sp.encode(part)
    return ids


def _check(path: Path, sp: Any, bos: int, hf_differs: set[str]) -> None:
    ours = read_tokenizer(path).tokenizer
    theirs = _transformers(path)
    for text in TEXTS:
        ids = ours.encode(text).ids
        assert ids == _llama_cpp(sp, text, bos), text
        assert (ids == theirs.encode(text)) == (text not in hf_differs), text
        plain = ids[1:] if SPECIAL.search(text) is None else None
        if plain is not None:
            assert ours.decode(ids, skip_special_tokens=True) == text
            assert theirs.decode(ids, skip_special_tokens=True) == text
    # A character no piece covers becomes its UTF-8 bytes' tokens, and decodes back.
    ids = ours.encode("\U0001f9a9", add_special_tokens=False).ids
    pieces = [ours.id_to_token(i) for i in ids]
    assert [p for p in pieces if p.startswith("<0x")] == ["<0xF0>", "<0x9F>", "<0xA6>", "<0xA9>"]
    assert ours.decode(ids) == "\U0001f9a9"


@pytest.mark.genai
def test_a_llama_sentencepiece_vocabulary_encodes_as_transformers_and_sentencepiece(
    llama_sp: Any, tmp_path: Path
) -> None:
    _check(_llama_file(tmp_path / "llama.gguf", llama_sp), llama_sp, 1, HF_DIFFERS)


@pytest.mark.genai
def test_gemmas_vocabulary_encodes_as_transformers_and_sentencepiece(
    gemma_sp: Any, tmp_path: Path
) -> None:
    _check(_gemma_file(tmp_path / "gemma.gguf", gemma_sp), gemma_sp, 2, set())


def test_an_imported_llama_file_tokenizes_in_kvmux_as_llama_cpp(
    llama_sp: Any, tmp_path: Path
) -> None:
    spec = load_model(import_gguf(_llama_file(tmp_path / "m.gguf", llama_sp), tmp_path / "m"))
    assert spec.bos_token_id == 1
    tok = Tokenizer.from_folder(spec.folder, bos_token_id=spec.bos_token_id)
    for text in TEXTS:
        assert tok.encode(text, add_bos=True) == _llama_cpp(llama_sp, text, 1), text
    assert tok.is_special(2) and tok.is_special(1)


def test_a_sentencepiece_file_without_scores_is_refused(llama_sp: Any, tmp_path: Path) -> None:
    path = with_metadata(
        _llama_file(tmp_path / "m.gguf", llama_sp),
        tmp_path / "n.gguf",
        {},
        remove=["tokenizer.ggml.scores"],
    )
    with pytest.raises(GGUFImportError, match=r"needs tokenizer\.ggml\.scores"):
        read_tokenizer(path)


def test_scores_that_do_not_match_the_vocabulary_are_refused(llama_sp: Any, tmp_path: Path) -> None:
    path = with_metadata(
        _llama_file(tmp_path / "m.gguf", llama_sp),
        tmp_path / "n.gguf",
        {"tokenizer.ggml.scores": [0.0, -1.0]},
    )
    with pytest.raises(GGUFImportError, match="scores has 2 entries"):
        read_tokenizer(path)


def test_an_add_space_prefix_that_is_not_a_flag_is_refused(llama_sp: Any, tmp_path: Path) -> None:
    path = with_metadata(
        _llama_file(tmp_path / "m.gguf", llama_sp),
        tmp_path / "n.gguf",
        {"tokenizer.ggml.add_space_prefix": "yes"},
    )
    with pytest.raises(GGUFImportError, match="add_space_prefix is 'yes'"):
        read_tokenizer(path)
