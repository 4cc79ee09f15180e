"""``model.precision = "int4"``: the daemon serves tiny with its weights quantized (MatMulNBits),
and a quantized model grows and batches as the float one does: every item's tokens equal
what the same int4 folder decodes alone in one big buffer."""

from __future__ import annotations

from pathlib import Path

import onnx
import pytest
from msgspec.structs import replace

from kvmux.client import Item
from kvmux.daemon.engine import Engine, EngineOptions
from kvmux.daemon.model import ensure_builtin

from .conftest import PREFILL_CHUNK, connected, make_config, running
from .helpers import decode_alone, ok_tokens, token_prompt

pytestmark = pytest.mark.anyio


async def test_tiny_at_int4_grows_and_batches_like_float(
    tmp_path: Path, sock_dir: Path, tiny_model: Path
) -> None:
    cache = tmp_path / "models"
    cfg = make_config(tiny_model, sock_dir, kv={"min_bucket": 16})
    model = replace(cfg.model, path="", name="tiny", precision="int4", cache_dir=str(cache))
    cfg = replace(cfg, model=model)
    # Prompts of 5..40 tokens and up to 120 new ones: sessions cross 16, 32, 64 and 128
    # together, in one cohort's batched runs.
    items = [
        Item(
            custom_id=str(i),
            prompt_tokens=token_prompt(5 + 5 * i, seed=i),
            max_new_tokens=40 + 10 * i,
            temperature=0.0,
            ignore_eos=True,
        )
        for i in range(8)
    ]
    async with running(cfg) as daemon, connected(daemon) as client:
        results = await (await client.submit(items)).results()
        status = await client.status()
        assert daemon.engine is not None
        runner = daemon.engine.runner
        assert runner.rows_run > runner.runs, "runs held several rows"
    folder = ensure_builtin("tiny", cache, precision="int4")
    ops = {n.op_type for n in onnx.load(str(folder / "model.onnx")).graph.node}
    assert "MatMulNBits" in ops and "MatMul" not in ops - {"MatMulNBits"}
    reference = Engine(
        folder, EngineOptions(min_bucket=256, intra_op_threads=1, prefill_chunk=PREFILL_CHUNK)
    )
    float_reference = Engine(tiny_model, EngineOptions(min_bucket=256, intra_op_threads=1))
    got = ok_tokens(results)
    differ = 0
    for item in items:
        assert got[item.custom_id] == decode_alone(reference, item), item.custom_id
        differ += got[item.custom_id] != decode_alone(float_reference, item)
    assert differ > 0, "int4 weights decode differently from float ones: the folder is quantized"
    assert status.kv_bytes_in_use == 0
