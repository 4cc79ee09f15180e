"""kvmux-model import-gguf on files written by ggml's own gguf library: what a good file
becomes, and the clear error each kind of bad file gets."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvmux.daemon.engine import Engine, EngineOptions, SamplingParams
from kvmux.daemon.model import GGUFImportError, Tokenizer, import_gguf, load_model
from kvmux.daemon.model.__main__ import main
from kvmux.daemon.model.gguf_import import read_tokenizer, sha256_of
from kvmux.daemon.model.smollm2 import GGUF_ENV, fetch_smollm2

from .gguf_fixture import CHAT_TEMPLATE, TinyShape, Vocab, random_weights, train_vocab, write_gguf

gguf = pytest.importorskip("gguf", reason="GGUF import needs the gguf package (cpu extra)")

SHAPE = TinyShape()


@pytest.fixture(scope="module")
def vocab() -> tuple[Any, Vocab]:
    return train_vocab()


def _llama(path: Path, vocab: Vocab, **kw: Any) -> Path:
    weights = random_weights(SHAPE, len(vocab.tokens), qkv_bias=False, tied=False)
    return write_gguf(path, "llama", SHAPE, weights, vocab, **kw)


@pytest.fixture(scope="module")
def good_file(tmp_path_factory: pytest.TempPathFactory, vocab: tuple[Any, Vocab]) -> Path:
    return _llama(tmp_path_factory.mktemp("gguf") / "good.gguf", vocab[1])


def test_a_good_file_imports_loads_and_decodes(good_file: Path, tmp_path: Path) -> None:
    folder = import_gguf(good_file, tmp_path / "m")
    spec = load_model(folder)
    assert (spec.num_layers, spec.num_attention_heads, spec.num_kv_heads) == (2, 4, 2)
    assert (spec.head_size, spec.hidden_size, spec.context_length) == (16, 64, 512)
    assert (spec.bos_token_id, spec.eos_token_ids, spec.pad_token_id) == (1, (2,), 0)
    assert (folder / "chat_template.jinja").read_text() == CHAT_TEMPLATE
    config = json.loads((folder / "tokenizer_config.json").read_text())
    assert (config["bos_token"], config["eos_token"]) == ("<|im_start|>", "<|im_end|>")
    engine = Engine(folder, EngineOptions(min_bucket=16))
    prompt = engine.render_chat([{"role": "user", "content": "the cache grows"}])
    assert prompt.startswith("<|im_start|>user\nthe cache grows<|im_end|>\n")
    ids = engine.encode(prompt)
    assert ids[0] == 1, "<|im_start|> is one special token, not split into bytes"
    done = engine.generate(ids, SamplingParams(max_new_tokens=12, temperature=0.0))
    assert len(done.token_ids) >= 1


def test_float16_import_runs(good_file: Path, tmp_path: Path) -> None:
    spec = load_model(import_gguf(good_file, tmp_path / "m", dtype="float16"))
    assert spec.kv_dtype == np.float16
    engine = Engine(spec.folder, EngineOptions(min_bucket=16))
    done = engine.generate([5, 6, 7, 8], SamplingParams(max_new_tokens=8, temperature=0.0))
    assert len(done.token_ids) >= 1


def test_the_tokenizer_reproduces_the_files_vocabulary(
    good_file: Path, vocab: tuple[Any, Vocab], tmp_path: Path
) -> None:
    source, v = vocab
    rebuilt = read_tokenizer(good_file).tokenizer
    assert rebuilt.get_vocab(with_added_tokens=True) == {t: i for i, t in enumerate(v.tokens)}
    folder = import_gguf(good_file, tmp_path / "m")
    tok = Tokenizer.from_folder(folder)
    texts = ["the session cache grows: 日本語 🙂 café", "def f(x): return x + 0x1f", "  a\n\nb"]
    for text in texts:
        ids = tok.encode(text)
        assert ids == source.encode(text).ids
        assert tok.decode(ids) == text
    assert tok.is_special(2) and tok.encode("<|im_end|>") == [2]


def test_a_file_that_adds_bos_gets_a_tokenizer_that_adds_it(
    vocab: tuple[Any, Vocab], tmp_path: Path
) -> None:
    rebuilt = read_tokenizer(_llama(tmp_path / "m.gguf", vocab[1], add_bos=True)).tokenizer
    assert rebuilt.encode("the cache").ids[0] == 1
    assert (
        rebuilt.encode("the cache", add_special_tokens=False).ids
        == vocab[0].encode("the cache").ids
    )


def test_not_a_gguf_file(tmp_path: Path) -> None:
    path = tmp_path / "model.gguf"
    path.write_text("this is a text file, not a model\n" * 10)
    with pytest.raises(GGUFImportError, match=r"is not a GGUF file \(it starts with b'this'"):
        import_gguf(path, tmp_path / "out")
    assert not (tmp_path / "out" / "genai_config.json").exists()


def test_a_truncated_file(good_file: Path, tmp_path: Path) -> None:
    path = tmp_path / "cut.gguf"
    data = good_file.read_bytes()
    path.write_bytes(data[: len(data) - 1000])
    with pytest.raises(GGUFImportError, match="is truncated or damaged: the gguf reader says"):
        import_gguf(path, tmp_path / "out")
    path.write_bytes(data[:200])  # cut inside the metadata
    with pytest.raises(GGUFImportError, match=r"is truncated .* \(the file has 200 bytes\)"):
        import_gguf(path, tmp_path / "out")


def test_an_unknown_architecture(vocab: tuple[Any, Vocab], tmp_path: Path) -> None:
    weights = random_weights(SHAPE, len(vocab[1].tokens), qkv_bias=False, tied=False)
    path = write_gguf(tmp_path / "m.gguf", "gemma3", SHAPE, weights, vocab[1])
    with pytest.raises(GGUFImportError, match="architecture 'gemma3' is not supported"):
        import_gguf(path, tmp_path / "out")


def test_a_missing_tensor(vocab: tuple[Any, Vocab], tmp_path: Path) -> None:
    path = _llama(tmp_path / "m.gguf", vocab[1], skip=["blk.1.attn_v.weight"])
    with pytest.raises(GGUFImportError, match=r"tensor 'blk.1.attn_v.weight' missing \(llama\)"):
        import_gguf(path, tmp_path / "out")


def test_a_checksum_that_does_not_match(good_file: Path, tmp_path: Path) -> None:
    with pytest.raises(GGUFImportError, match=f"SHA-256 is {sha256_of(good_file)}, expected 0+"):
        import_gguf(good_file, tmp_path / "out", sha256="0" * 64)
    assert import_gguf(good_file, tmp_path / "ok", sha256=sha256_of(good_file).upper())


def test_smollm2_from_a_local_file_is_checked(
    good_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(GGUF_ENV, str(good_file))
    with pytest.raises(GGUFImportError, match=r"SHA-256 .* \(SmolLM2-135M-Instruct.Q4_1 from"):
        fetch_smollm2(tmp_path)
    assert not (tmp_path / "downloads").exists(), "a local file is never downloaded"


def test_a_tensor_type_the_library_cannot_dequantize(
    vocab: tuple[Any, Vocab], tmp_path: Path
) -> None:
    # Q8_1 is one of ggml's types gguf-py has no dequantization for.
    q8_1 = gguf.GGMLQuantizationType.Q8_1
    block, size = gguf.GGML_QUANT_SIZES[q8_1]
    data = np.zeros((SHAPE.kv_heads * SHAPE.head, SHAPE.hidden // block * size), np.uint8)
    path = _llama(
        tmp_path / "m.gguf",
        vocab[1],
        skip=["blk.0.attn_v.weight"],
        raw={"blk.0.attn_v.weight": (data, q8_1)},
    )
    with pytest.raises(GGUFImportError, match=r"blk\.0\.attn_v\.weight is of type Q8_1, which"):
        import_gguf(path, tmp_path / "out")


def test_a_tokenizer_model_kvmux_does_not_know_is_refused_by_name(
    vocab: tuple[Any, Vocab], tmp_path: Path
) -> None:
    path = _llama(tmp_path / "m.gguf", vocab[1], tokenizer_model="rwkv")
    with pytest.raises(GGUFImportError, match="tokenizer model 'rwkv' is not supported"):
        import_gguf(path, tmp_path / "out")


def test_the_cli_imports_and_refuses(
    good_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["import-gguf", str(good_file), str(tmp_path / "m")]) == 0
    assert "layers:            2" in capsys.readouterr().out
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 10)
    assert main(["import-gguf", str(bad), str(tmp_path / "n")]) == 2
    assert f"GGUF file {bad}: " in capsys.readouterr().err


def test_build_smollm2_refuses_a_local_file_that_is_not_it(
    good_file: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv(GGUF_ENV, str(good_file))
    assert main(["build", "smollm2", str(tmp_path / "m")]) == 2
    assert f"GGUF file {good_file}: SHA-256 is {sha256_of(good_file)}" in capsys.readouterr().err
    assert not (tmp_path / "m").exists()
    monkeypatch.setenv(GGUF_ENV, str(tmp_path / "absent.gguf"))
    assert main(["build", "smollm2", str(tmp_path / "m")]) == 1
    assert f"{GGUF_ENV}={tmp_path / 'absent.gguf'} is not a file" in capsys.readouterr().err
