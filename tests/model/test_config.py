"""load_model / check_session_io: what real genai folders need; errors that say what is wrong."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvmux.daemon.model import IOInfo, ModelFormatError, ModelSpec, check_session_io, load_model


@pytest.fixture
def folder(tiny_dir: Path, tmp_path: Path) -> Path:
    """A private copy of the tiny folder to damage."""
    return Path(shutil.copytree(tiny_dir, tmp_path / "model"))


def edit_config(folder: Path, change: Callable[[dict[str, Any]], None]) -> None:
    path = folder / "genai_config.json"
    cfg = json.loads(path.read_text())
    change(cfg)
    path.write_text(json.dumps(cfg))


def test_missing_config_names_folder_and_file(folder: Path) -> None:
    (folder / "genai_config.json").unlink()
    with pytest.raises(ModelFormatError) as exc:
        load_model(folder)
    msg = str(exc.value)
    assert str(folder) in msg and "missing genai_config.json" in msg
    assert exc.value.folder == folder


def test_missing_key_is_named(folder: Path) -> None:
    edit_config(folder, lambda c: c["model"]["decoder"].pop("num_hidden_layers"))
    with pytest.raises(ModelFormatError, match=r"missing key 'model\.decoder\.num_hidden_layers'"):
        load_model(folder)


def test_missing_model_file_and_tokenizer(folder: Path) -> None:
    (folder / "tokenizer.json").unlink()
    with pytest.raises(ModelFormatError, match=r"missing tokenizer\.json"):
        load_model(folder)
    edit_config(folder, lambda c: c["model"]["decoder"].update(filename="other.onnx"))
    with pytest.raises(ModelFormatError, match=r"missing other\.onnx"):
        load_model(folder)


def test_kv_heads_mismatch_with_graph(folder: Path) -> None:
    edit_config(folder, lambda c: c["model"]["decoder"].update(num_key_value_heads=4))
    with pytest.raises(ModelFormatError) as exc:
        load_model(folder)
    # Every past and present tensor of every layer is named.
    assert len(exc.value.problems) == 2 * 2 * 2
    msg = str(exc.value)
    assert "'past_key_values.0.key' has 2 heads (dim 1)" in msg
    assert "expected num_key_value_heads = 4" in msg
    assert "'present.1.value'" in msg


def test_wrong_types_and_inconsistent_heads(folder: Path) -> None:
    edit_config(folder, lambda c: c["model"]["decoder"].update(num_key_value_heads=3))
    with pytest.raises(ModelFormatError, match="not a multiple of num_key_value_heads 3"):
        load_model(folder)
    edit_config(folder, lambda c: c["model"]["decoder"].update(num_key_value_heads="2"))
    with pytest.raises(ModelFormatError, match="num_key_value_heads is '2', expected an integer"):
        load_model(folder)
    edit_config(folder, lambda c: c["model"]["decoder"].update(num_key_value_heads=2))
    load_model(folder)
    edit_config(folder, lambda c: c["model"].update(eos_token_id=9999))
    with pytest.raises(ModelFormatError, match="outside the vocabulary"):
        load_model(folder)


def test_layer_pattern_without_placeholder(folder: Path) -> None:
    edit_config(folder, lambda c: c["model"]["decoder"]["inputs"].update(past_key_names="past"))
    with pytest.raises(ModelFormatError, match="containing %d"):
        load_model(folder)


def test_genai_builder_style_config_with_extras_and_defaults(folder: Path) -> None:
    """What a real export looks like: extra keys, eos as a list, optional keys left out."""

    def real_export(c: dict[str, Any]) -> None:
        c["model"]["eos_token_id"] = [257, 258]
        c["model"]["decoder"]["session_options"]["provider_options"] = [{"cuda": {}}]
        c["model"]["decoder"]["sliding_window"] = None
        c["model"]["prompt_templates"] = {"user": "<|user|>{Content}"}
        c["model"]["sep_token_id"] = 0
        c["search"]["random_seed"] = 7
        c["search"].pop("temperature")
        c["search"].pop("top_k")
        c["future_section"] = {"anything": True}
        # Optional in genai: IO names default to genai's defaults.
        del c["model"]["decoder"]["inputs"]
        del c["model"]["decoder"]["outputs"]
        del c["model"]["pad_token_id"]

    edit_config(folder, real_export)
    spec = load_model(folder)
    assert spec.eos_token_ids == (257, 258)
    assert spec.pad_token_id is None
    assert spec.past_value_names == ("past_key_values.0.value", "past_key_values.1.value")
    assert spec.present_key_names == ("present.0.key", "present.1.key")
    assert spec.search.random_seed == 7
    assert spec.search.temperature == 1.0  # genai's default
    assert spec.search.top_k == 0


def test_context_length_falls_back_to_max_length_then_none(folder: Path) -> None:
    edit_config(folder, lambda c: c["model"].pop("context_length"))
    spec = load_model(folder)
    assert spec.context_length == 2048
    assert "search.max_length" in spec.context_length_source
    edit_config(folder, lambda c: c["search"].pop("max_length"))
    spec = load_model(folder)
    assert spec.context_length is None and spec.search.max_length is None


def test_model_declared_search_values_win(folder: Path) -> None:
    edit_config(folder, lambda c: c["search"].update(temperature=0.3, top_p=0.9, do_sample=True))
    search = load_model(folder).search
    assert (search.temperature, search.top_p, search.do_sample) == (0.3, 0.9, True)


def _session_io(spec: ModelSpec) -> tuple[list[IOInfo], list[IOInfo]]:
    kv = ("batch_size", spec.num_kv_heads, "past_sequence_length", spec.head_size)
    inputs = [
        IOInfo("input_ids", ("batch_size", "sequence_length"), "tensor(int64)"),
        IOInfo("attention_mask", ("batch_size", "total_sequence_length"), "tensor(int64)"),
        *(IOInfo(n, kv, "tensor(float)") for n in spec.past_key_names + spec.past_value_names),
    ]
    outputs = [
        IOInfo("logits", ("batch_size", "sequence_length", spec.vocab_size), "tensor(float)"),
        *(
            IOInfo(n, kv, "tensor(float)")
            for n in spec.present_key_names + spec.present_value_names
        ),
    ]
    return inputs, outputs


def test_check_session_io_accepts_symbolic_dims(tiny_spec: ModelSpec) -> None:
    inputs, outputs = _session_io(tiny_spec)
    inputs[2] = IOInfo(inputs[2].name, ("b", None, "s", None), "tensor(float)")
    check_session_io(tiny_spec, inputs, outputs)


def test_check_session_io_names_every_mismatch(tiny_spec: ModelSpec) -> None:
    inputs, outputs = _session_io(tiny_spec)
    inputs = [i for i in inputs if i.name != "past_key_values.1.value"]
    inputs[2] = IOInfo("past_key_values.0.key", ("b", 8, "s", 16), "tensor(float)")
    outputs[1] = IOInfo("present.0.key", ("b", 2, "s", 32), "tensor(float16)")
    with pytest.raises(ModelFormatError) as exc:
        check_session_io(tiny_spec, inputs, outputs)
    problems = exc.value.problems
    assert any("no input 'past_key_values.1.value'" in p for p in problems)
    assert any("'past_key_values.0.key' has 8 heads" in p for p in problems)
    assert any("'present.0.key' has head size 32" in p for p in problems)
    assert any("'present.0.key' is tensor(float16)" in p for p in problems)
    assert len(problems) == 4


def test_check_session_io_rejects_inputs_it_cannot_feed(tiny_spec: ModelSpec) -> None:
    inputs, outputs = _session_io(tiny_spec)
    inputs.append(IOInfo("cache_indirection", ("b", 1, "s"), "tensor(int32)"))
    with pytest.raises(ModelFormatError, match="cannot feed: cache_indirection"):
        check_session_io(tiny_spec, inputs, outputs)


def test_check_session_io_dtype_must_match_spec(tiny_spec: ModelSpec) -> None:
    inputs, outputs = _session_io(tiny_spec)
    f16 = [
        IOInfo(i.name, i.shape, "tensor(float16)") if "key" in i.name or "value" in i.name else i
        for i in (*inputs, *outputs)
    ]
    with pytest.raises(ModelFormatError, match="KV dtype is float16, expected float32"):
        check_session_io(tiny_spec, f16[: len(inputs)], f16[len(inputs) :])
    assert tiny_spec.kv_dtype == np.float32
