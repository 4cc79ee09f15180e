"""Fixtures for tests that compare kvmux against onnxruntime-genai.

These need the optional stack (torch==2.13.0 CPU, transformers,
tokenizers, onnxruntime-genai==0.18.0); the project's own venv does not have
it. Where it is missing, every test using ``genai_model_dir`` is skipped with
a reason that says so.
"""

from __future__ import annotations

from pathlib import Path

import pytest

_WHY = "needs the onnxruntime-genai peer stack (see tests/genai/genai_fixture.py): "


@pytest.fixture(scope="session")
def genai_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A genai-builder export (fp32, cpu) of a seeded random tiny Llama.

    The folder holds genai_config.json, model.onnx (+ .data) and tokenizer
    files; build + export take about 10 s, once per session.
    """
    pytest.importorskip("onnxruntime_genai", reason=_WHY + "onnxruntime_genai is not importable")
    pytest.importorskip("torch", reason=_WHY + "torch is not importable")
    pytest.importorskip("transformers", reason=_WHY + "transformers is not importable")
    pytest.importorskip("tokenizers", reason=_WHY + "tokenizers is not importable")
    pytest.importorskip(
        "onnx_ir", reason=_WHY + "onnx_ir (needed by the genai builder) is not importable"
    )

    from . import genai_fixture as gf

    root = tmp_path_factory.mktemp("genai")
    hf_dir = gf.build_hf_llama(root / "hf", seed=0)
    return gf.export_with_genai_builder(hf_dir, root / "onnx")
