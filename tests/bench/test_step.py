"""``bench.bench_step`` measures what it says: the run is timed inside each step, a no-op
run skips onnxruntime entirely, and the engine is left as it was."""

from __future__ import annotations

from pathlib import Path

from bench.bench_step import measure
from kvmux.daemon.engine import Engine, EngineOptions


def test_the_run_is_timed_or_skipped_and_the_engine_restored(tiny_model: Path) -> None:
    engine = Engine(tiny_model, EngineOptions(min_bucket=1024, intra_op_threads=1))
    ort = engine.runner.ort
    runs = engine.runner.runs
    real = measure(engine, 4, 20, skip=False)
    assert real["run_us"] > 0 and real["python_us"] > 0
    noop = measure(engine, 4, 20, skip=True)
    assert noop["run_us"] == 0 and noop["step_us"] > 0
    # Two measurements, each: one run of first prompts, one decode step, then the timed
    # steps (one run each: four rows of one cohort), whether onnxruntime ran or not.
    assert engine.runner.runs - runs == 2 * (2 + 20)
    assert engine.runner.ort is ort
    assert engine.budget.used == 0
