"""Builder exports of other families: the Generator's tokens, a cap, or a clear refusal.

The default run decodes a subset of the matrix (conftest.MATRIX_SUBSET: one
entry per outcome); CI runs every family and precision with
``python -m bench.model_matrix --check``, which also keeps docs/models.md's table
honest. The refusals kvmux has for features no builder CPU export shows are
tested here on copies of an export with that feature switched on.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from kvmux.daemon.engine import Engine, EngineOptions, SamplingParams
from kvmux.daemon.model import ModelFormatError, load_model
from kvmux.daemon.model.__main__ import main as kvmux_model
from kvmux.kv import CapacityExceeded

from . import matrix as m
from .conftest import MATRIX_SUBSET

pytestmark = [pytest.mark.genai, pytest.mark.slow]

EXPECTED = {
    ("llama", "int4"): m.IDENTICAL,
    ("gemma2", "fp32"): m.REFUSED,
    ("gemma2-fullkv", "fp32"): m.IDENTICAL,
    ("gemma2-fullkv", "int4"): m.IDENTICAL,
    ("mistral", "fp32"): m.CAPPED,
    ("phi3-longrope", "fp32"): m.IDENTICAL,
    ("qwen2", "fp16"): m.REFUSED,
    ("lfm2", "fp32"): m.REFUSED,
}


@pytest.mark.parametrize(("family", "precision"), MATRIX_SUBSET)
def test_entry_decodes_like_the_generator_or_is_refused(
    matrix_exports: dict[tuple[str, str], m.Export], family: str, precision: str
) -> None:
    outcome = m.check(matrix_exports[(family, precision)])
    assert outcome.status == EXPECTED[(family, precision)], outcome.detail
    if outcome.status == m.IDENTICAL:
        assert outcome.new_tokens >= m.MIN_NEW
        assert outcome.growths >= m.MIN_GROWTHS
        assert outcome.distinct >= m.MIN_DISTINCT
        # Stronger than the tokens: every pick's logits are the Generator's, bit for bit.
        assert outcome.logit_diff == 0.0


def _copy_with_config(src: Path, dst: Path, edit: dict[str, object]) -> Path:
    """``src`` with its files linked and ``model.decoder`` keys of genai_config.json replaced."""
    dst.mkdir()
    for f in src.iterdir():
        if f.name != "genai_config.json":
            (dst / f.name).symlink_to(f)
    config = json.loads((src / "genai_config.json").read_text())
    config["model"]["decoder"].update(edit)
    (dst / "genai_config.json").write_text(json.dumps(config))
    return dst


def test_fp16_cpu_export_is_refused_naming_its_attention(
    matrix_exports: dict[tuple[str, str], m.Export],
) -> None:
    folder = matrix_exports[("qwen2", "fp16")].folder
    with pytest.raises(ModelFormatError) as err:
        load_model(folder)
    message = str(err.value)
    assert str(folder) in message
    assert "model.onnx attends with MultiHeadAttention" in message
    assert "needs com.microsoft.GroupQueryAttention in every layer" in message
    assert "-e cuda" in message  # what would be needed


def test_a_hybrid_model_is_refused_naming_its_state(
    matrix_exports: dict[tuple[str, str], m.Export],
) -> None:
    with pytest.raises(ModelFormatError) as err:
        load_model(matrix_exports[("lfm2", "fp32")].folder)
    (problem,) = err.value.problems  # the reason, not a list of IO mismatches
    assert problem.startswith(
        "model.onnx carries a recurrent state between steps (past.0.conv, past.2.conv)"
    )
    assert "would need per-layer state buffers" in problem


def test_kvmuxd_refuses_it_at_start_with_the_reason(
    matrix_exports: dict[tuple[str, str], m.Export], tmp_path: Path
) -> None:
    from kvmux.daemon.config import EX_CONFIG, toml_config

    cfg = tmp_path / "kvmuxd.toml"
    folder = matrix_exports[("qwen2", "fp16")].folder
    with tempfile.TemporaryDirectory(dir="/tmp") as short:  # ipc paths must be short
        sock = f"ipc://{short}/k.sock"
        cfg.write_text(toml_config({"model": {"path": str(folder)}, "server": {"endpoint": sock}}))
        proc = subprocess.run(
            [sys.executable, "-m", "kvmux.daemon", "--config", str(cfg)],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert proc.returncode == EX_CONFIG
    assert "startup_failed" in proc.stdout
    assert "model.onnx attends with MultiHeadAttention" in proc.stdout


def test_a_window_the_graph_ignores_caps_the_context(
    matrix_exports: dict[tuple[str, str], m.Export],
) -> None:
    folder = matrix_exports[("mistral", "fp32")].folder
    spec = load_model(folder)
    assert spec.features.declared_window == m.WINDOW
    assert spec.features.graph_window is None
    assert spec.context_length == m.WINDOW
    assert "no GroupQueryAttention in model.onnx applies" in spec.context_length_source
    engine = Engine(folder, EngineOptions(min_bucket=8))
    c = engine.generate([1, *range(40, 70)], SamplingParams(max_new_tokens=100, temperature=0))
    # The last token is sampled from the step at position 47: it attends to 48
    # positions, all inside the window, and needs no KV row of its own.
    assert (c.finish_reason, c.prompt_tokens + c.completion_tokens) == ("length", m.WINDOW + 1)
    with pytest.raises(CapacityExceeded, match="capped by its sliding window"):
        engine.admit(list(range(3, 3 + m.WINDOW + 1)))


def test_a_windowed_kv_ring_is_refused_naming_the_re_export(
    matrix_exports: dict[tuple[str, str], m.Export],
) -> None:
    """The builder's default for Gemma2's local layers: window-sized KV rings."""
    folder = matrix_exports[("gemma2", "fp32")].folder
    with pytest.raises(ModelFormatError) as err:
        load_model(folder)
    message = str(err.value)
    assert "keeps the KV of 2 windowed GroupQueryAttention layers in window-sized rings" in message
    assert "--extra_options windowed_kv_cache=false" in message


def test_the_window_applies_over_kvmux_s_full_prefix_buffer(
    matrix_exports: dict[tuple[str, str], m.Export],
) -> None:
    folder = matrix_exports[("gemma2-fullkv", "fp32")].folder
    features = load_model(folder).features
    # The re-export leaves genai_config.json's sliding_window out: the
    # Generator then binds full-length buffers too.
    assert (features.declared_window, features.graph_window) == (None, m.WINDOW)
    assert (features.windowed_layers, features.attention_layers) == (2, 4)
    assert features.context_cap is None


@pytest.mark.parametrize(
    ("edit", "needle"),
    [
        (
            {"slide_key_value_cache": True},
            "sliding_window.slide_key_value_cache is true: that model expects its runtime to "
            "slide a window-sized KV cache",
        ),
        ({"slide_inputs": True}, "sliding_window.slide_inputs is true"),
        (
            {"window_size": 32},
            "declares a sliding window of 32 but model.onnx's GroupQueryAttention nodes use "
            "local_window_size 48",
        ),
    ],
)
def test_a_window_kvmux_cannot_keep_is_refused(
    matrix_exports: dict[tuple[str, str], m.Export],
    tmp_path: Path,
    edit: dict[str, object],
    needle: str,
) -> None:
    src = matrix_exports[("gemma2-fullkv", "fp32")].folder
    # The section the builder writes for this model with its windowed KV cache.
    sw: dict[str, object] = {"window_size": 48, "slide_key_value_cache": False}
    sw |= {"slide_inputs": False, "layers": [0, 2], "cache_slack": 0}
    folder = _copy_with_config(src, tmp_path / "m", {"sliding_window": {**sw, **edit}})
    with pytest.raises(ModelFormatError, match=r"genai_config\.json") as err:
        load_model(folder)
    assert needle in str(err.value)


def test_a_longrope_switch_past_the_first_bucket_is_refused_at_engine_start(
    matrix_exports: dict[tuple[str, str], m.Export],
) -> None:
    folder = matrix_exports[("phi3-longrope", "fp32")].folder
    assert load_model(folder).features.length_switch == 64
    with pytest.raises(ModelFormatError, match=r"kv\.min_bucket 128 is above 64"):
        Engine(folder, EngineOptions(min_bucket=128))


def test_a_longrope_switch_off_the_buckets_is_refused(
    matrix_exports: dict[tuple[str, str], m.Export], tmp_path: Path
) -> None:
    """The same export with its switch moved to 48: a 64-wide mask would pass it at 33 tokens."""
    import onnx
    from onnx import numpy_helper

    src = matrix_exports[("phi3-longrope", "fp32")].folder
    folder = _copy_with_config(src, tmp_path / "m", {})
    model = onnx.load(str(src / "model.onnx"), load_external_data=False)
    (greater,) = [n for n in model.graph.node if n.op_type == "Greater"]
    (const,) = [n for n in model.graph.node if n.output[0] == greater.input[1]]
    value = const.attribute[0].t
    value.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(value) * 0 + 48, value.name))
    (folder / "model.onnx").unlink()
    onnx.save(model, str(folder / "model.onnx"))
    with pytest.raises(ModelFormatError) as err:
        load_model(folder)
    assert "switches its rotary caches when the attention mask is wider than 48" in str(err.value)


def test_info_shows_family_precision_window_and_features(
    matrix_exports: dict[tuple[str, str], m.Export], capsys: pytest.CaptureFixture[str]
) -> None:
    assert kvmux_model(["info", str(matrix_exports[("gemma2-fullkv", "int4")].folder)]) == 0
    out = capsys.readouterr().out
    assert "(family gemma2)" in out
    assert "precision:         int4, " in out and "MatMulNBits (block 32)" in out
    assert "GroupQueryAttention x 4, shared past/present buffer" in out
    assert "sliding window:    not declared in genai_config.json, applied by 2 of 4 GQA" in out
    assert "attention softcap: 50" in out
    assert "context cap:       none" in out


def test_info_names_the_refusal(
    matrix_exports: dict[tuple[str, str], m.Export], capsys: pytest.CaptureFixture[str]
) -> None:
    assert kvmux_model(["info", str(matrix_exports[("qwen2", "fp16")].folder)]) == 2
    assert "attends with MultiHeadAttention" in capsys.readouterr().err
