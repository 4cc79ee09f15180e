"""Fixtures for tests that compare kvmux against onnxruntime-genai.

These need the optional stack (torch==2.13.0 CPU, transformers,
tokenizers, onnxruntime-genai==0.18.0); the project's own venv does not have
it. Where it is missing, every test using ``genai_model_dir`` is skipped with
a reason that says so.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from .matrix import Export

_WHY = "needs the onnxruntime-genai peer stack (see tests/genai/genai_fixture.py): "


def require_genai_stack() -> None:
    """Skip, naming the missing package, unless the builder's whole stack imports."""
    pytest.importorskip("onnxruntime_genai", reason=_WHY + "onnxruntime_genai is not importable")
    pytest.importorskip("torch", reason=_WHY + "torch is not importable")
    pytest.importorskip("transformers", reason=_WHY + "transformers is not importable")
    pytest.importorskip("tokenizers", reason=_WHY + "tokenizers is not importable")
    pytest.importorskip(
        "onnx_ir", reason=_WHY + "onnx_ir (needed by the genai builder) is not importable"
    )


@pytest.fixture(scope="session")
def genai_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A genai-builder export (fp32, cpu) of a seeded random tiny Llama.

    The folder holds genai_config.json, model.onnx (+ .data) and tokenizer
    files; build + export take about 10 s, once per session.
    """
    require_genai_stack()
    from . import genai_fixture as gf

    root = tmp_path_factory.mktemp("genai")
    hf_dir = gf.build_hf_llama(root / "hf", seed=0)
    return gf.export_with_genai_builder(hf_dir, root / "onnx")


#: The matrix entries the default test run decodes (the whole matrix runs in
#: CI as python -m bench.model_matrix --check): one of each outcome kvmux has.
MATRIX_SUBSET = (
    ("llama", "int4"),
    ("gemma2", "fp32"),
    ("gemma2-fullkv", "fp32"),
    ("gemma2-fullkv", "int4"),
    ("mistral", "fp32"),
    ("phi3-longrope", "fp32"),
    ("qwen2", "fp16"),
    ("lfm2", "fp32"),
)


@pytest.fixture(scope="session")
def matrix_exports() -> dict[tuple[str, str], Export]:
    """The subset's builder exports, from the matrix cache (one worker exports what is missing)."""
    require_genai_stack()
    from . import matrix as m

    exports = m.export_all([(m.BY_NAME[f], p) for f, p in MATRIX_SUBSET])
    return {(e.family.name, e.precision): e for e in exports}
