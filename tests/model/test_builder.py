"""Built-in model folders: genai's format, validated by load_model and by ORT, deterministic."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvmux.daemon.model import (
    BUILTIN_SIZES,
    ModelSpec,
    Tokenizer,
    build_builtin,
    check_session_io,
    ensure_builtin,
    load_model,
)
from kvmux.daemon.model import builder as builder_mod


def _hashes(folder: Path) -> dict[str, str]:
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.iterdir())
        if p.is_file()
    }


def test_tiny_genai_config_has_genai_builder_keys(tiny_dir: Path) -> None:
    cfg = json.loads((tiny_dir / "genai_config.json").read_text())
    model, decoder, search = cfg["model"], cfg["model"]["decoder"], cfg["search"]
    assert {
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "context_length",
        "vocab_size",
        "type",
        "decoder",
    } <= set(model)
    assert decoder["inputs"] == {
        "input_ids": "input_ids",
        "attention_mask": "attention_mask",
        "past_key_names": "past_key_values.%d.key",
        "past_value_names": "past_key_values.%d.value",
    }
    assert decoder["outputs"] == {
        "logits": "logits",
        "present_key_names": "present.%d.key",
        "present_value_names": "present.%d.value",
    }
    assert (decoder["head_size"], decoder["hidden_size"]) == (16, 64)
    assert (decoder["num_attention_heads"], decoder["num_key_value_heads"]) == (4, 2)
    assert decoder["num_hidden_layers"] == 2
    assert search["past_present_share_buffer"] is True
    assert search["do_sample"] is False
    assert model["context_length"] == search["max_length"] == 2048


def test_tiny_loads_and_matches_its_session(tiny_spec: ModelSpec, decode: Any) -> None:
    spec = tiny_spec
    assert (spec.num_layers, spec.num_attention_heads, spec.num_kv_heads) == (2, 4, 2)
    assert (spec.head_size, spec.hidden_size, spec.vocab_size) == (16, 64, 259)
    assert spec.context_length == 2048
    assert spec.kv_dtype == np.float32
    assert (spec.bos_token_id, spec.eos_token_ids, spec.pad_token_id) == (256, (257,), 258)
    assert spec.past_key_names == ("past_key_values.0.key", "past_key_values.1.key")
    assert spec.present_value_names == ("present.0.value", "present.1.value")
    assert not spec.has_position_ids
    assert spec.search.past_present_share_buffer
    assert spec.kv_bytes_per_token == 2 * 2 * 2 * 16 * 4
    session = decode.session(spec)
    check_session_io(spec, session.get_inputs(), session.get_outputs())


def test_small_loads_runs_and_tokenizes(small_dir: Path, decode: Any) -> None:
    spec = load_model(small_dir)
    size = BUILTIN_SIZES["small"]
    assert spec.num_layers == size.num_layers == 8
    assert (spec.num_attention_heads, spec.num_kv_heads, spec.head_size) == (8, 4, 64)
    assert spec.hidden_size == 512 and spec.context_length == 8192
    assert spec.vocab_size == 4096
    session = decode.session(spec)
    check_session_io(spec, session.get_inputs(), session.get_outputs())

    tok = Tokenizer(spec.tokenizer_path, bos_token_id=spec.bos_token_id)
    assert tok.vocab_size == spec.vocab_size
    text = "the session cache grows: 日本語 🙂 café"
    ids = tok.encode(text)
    assert len(ids) < len(text.encode()), "a trained BPE merges bytes"
    assert tok.decode(ids) == text
    logits = decode.shared(spec, session, tok.encode(text, add_bos=True), 3, capacity=256)
    assert logits.shape == (4, 4096) and np.isfinite(logits).all()
    assert len({int(np.argmax(row)) for row in logits}) > 1


def test_build_twice_is_byte_identical(tiny_dir: Path, tmp_path: Path) -> None:
    again = build_builtin("tiny", tmp_path / "again")
    hashes = _hashes(again)
    assert {"genai_config.json", "model.onnx", "tokenizer.json"} <= set(hashes)
    assert hashes == _hashes(tiny_dir)


def test_small_build_is_byte_identical_across_processes(small_dir: Path, tmp_path: Path) -> None:
    # BPE training runs in Rust with per-process hash seeds: build in another process.
    out = tmp_path / "small"
    subprocess.run(
        [sys.executable, "-m", "kvmux.daemon.model", "build", "small", str(out)],
        check=True,
        capture_output=True,
        timeout=120,
    )
    assert _hashes(out) == _hashes(small_dir)


def test_float16_builds_and_runs_on_cpu(tmp_path: Path, decode: Any) -> None:
    spec = load_model(build_builtin("tiny", tmp_path / "f16", dtype="float16"))
    assert spec.kv_dtype == np.float16 and spec.logits_dtype == np.float16
    session = decode.session(spec)
    check_session_io(spec, session.get_inputs(), session.get_outputs())
    prompt = list(range(30, 70))
    a = decode.shared(spec, session, prompt, 8, capacity=256)
    b = decode.shared(spec, session, prompt, 8, capacity=512)
    np.testing.assert_array_equal(a, b)
    assert np.isfinite(a).all() and a.std() > 1.0


def test_unknown_size_and_dtype_are_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="tiny"):
        build_builtin("huge", tmp_path)
    with pytest.raises(ValueError, match="float16"):
        build_builtin("tiny", tmp_path, dtype="bfloat16")


def test_ensure_builtin_builds_once(tmp_path: Path) -> None:
    first = ensure_builtin("tiny", tmp_path)
    load_model(first)
    stamp = (first / "model.onnx").stat().st_mtime_ns
    assert ensure_builtin("tiny", tmp_path) == first
    assert (first / "model.onnx").stat().st_mtime_ns == stamp
    assert [p.name for p in tmp_path.iterdir()] == [first.name], "no temp folders left"


def test_ensure_builtin_crash_leaves_no_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = builder_mod.build_builtin

    def crash(size: str, out_dir: Path, *, dtype: str = "float32", precision: str = "") -> Path:
        real(size, out_dir, dtype=dtype, precision=precision)
        (out_dir / "model.onnx").write_bytes(b"half")
        raise KeyboardInterrupt

    monkeypatch.setattr(builder_mod, "build_builtin", crash)
    with pytest.raises(KeyboardInterrupt):
        ensure_builtin("tiny", tmp_path)
    assert list(tmp_path.iterdir()) == []
    monkeypatch.undo()
    folder = ensure_builtin("tiny", tmp_path)
    load_model(folder)
