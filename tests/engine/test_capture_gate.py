"""No device work of another thread overlaps a run that may capture a CUDA graph (issue 28).

onnxruntime captures in ``cudaStreamCaptureModeGlobal``: a cudaMalloc, memset or
synchronizing copy issued by any other thread meanwhile fails and breaks the capture.
kvmuxd's growths, releases and prefix forks run on other threads than the model, so
the storage seam makes overlap impossible: every device call of a storage runs inside
its ``on_device``, which takes the lock the runner holds (``exclusive``) for a graph run.

Shown through the seam on CPU: the device-like storage of the kv tests (CudaStorage's
semantics over NumPy), a runner with graphs on (onnxruntime's CPU provider ignores the
graph id), and a graph run held open while another thread grows a session. With the
gate the growth's allocation and copies wait for the run; without it (the runner given
no lock, as before) they land inside it, which is what the test must catch.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import pytest

from kvmux.daemon.engine import Engine, EngineOptions, SamplingParams
from kvmux.daemon.engine.runner import ModelRunner
from kvmux.kv import CohortBuffers, CohortPool, KvSpec

from ..kv.fake_device import FakeDeviceStorage


class _WatchedDevice(FakeDeviceStorage):
    """Counts device work issued while a graph run is in flight."""

    def __init__(self) -> None:
        super().__init__()
        self.capturing = False
        self.during_capture: list[str] = []

    def allocate(self, spec: KvSpec, capacity: int, rows: int) -> CohortBuffers:
        if self.capturing:
            self.during_capture.append("allocate")
        return super().allocate(spec, capacity, rows)

    def synchronize(self) -> None:
        if self.capturing:
            self.during_capture.append("synchronize")
        super().synchronize()


class _SlowGraphRuns:
    """onnxruntime's session as the runner calls it; a graph run stays open a while."""

    def __init__(self, session: Any, device: _WatchedDevice, no_graph: Any) -> None:
        self._session = session
        self._device = device
        self._no_graph = no_graph
        self.started = threading.Event()
        self.graph_runs = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._session, name)

    def run_with_iobinding(self, io: Any, run_options: Any = None) -> None:
        if run_options is self._no_graph:
            self._session.run_with_iobinding(io, run_options)
            return
        self.graph_runs += 1
        self._device.capturing = True
        try:
            self.started.set()
            time.sleep(0.3)  # a capture in flight: the window another thread could hit
            self._session.run_with_iobinding(io, run_options)
        finally:
            self._device.capturing = False


@pytest.mark.parametrize("gated", [True, False], ids=["gate", "no-gate"])
def test_a_growth_on_another_thread_waits_for_a_graph_capture(
    tiny_model: Path, gated: bool
) -> None:
    engine = Engine(tiny_model, EngineOptions(min_bucket=16, intra_op_threads=1))
    device = _WatchedDevice()
    engine.pool = CohortPool(engine.kv_spec, storage=device, min_bucket=16, budget=engine.budget)
    runner = ModelRunner(
        engine.ort,
        engine.spec,
        xp=engine.pool.xp,
        device="cpu",
        device_id=0,
        graphs=True,
        exclusive=device.exclusive if gated else nullcontext,
    )
    slow = _SlowGraphRuns(engine.ort.session, device, runner._no_graph)
    runner.ort = dataclasses.replace(engine.ort, session=slow)
    engine.runner = runner
    params = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)
    decoding = engine.new_session([5, 6, 7], params)
    growing = engine.new_session([9, 10, 11, 12], params)
    engine.step_many([decoding])  # its prompt: no graph, nothing held
    grew: list[object] = []

    def grow() -> None:
        slow.started.wait(10)
        grew.append(growing.ensure_capacity())  # a first allocation and its zeroing sync

    other = threading.Thread(target=grow)
    other.start()
    try:
        (out,) = engine.step_many([decoding])  # a decode step: a graph run, held open
    finally:
        other.join(10)
    assert not isinstance(out, Exception) and len(out.token_ids) == 1
    assert slow.graph_runs == 1 and len(grew) == 1 and growing.capacity == 16
    if gated:
        assert device.during_capture == []
    else:  # the test can fail: without the gate the growth lands inside the capture
        assert "allocate" in device.during_capture
    decoding.release()
    growing.release()
    assert engine.budget.used == 0
