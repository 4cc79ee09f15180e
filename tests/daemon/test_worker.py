"""The model thread's hand-over: work beside a call runs once the thread has it."""

from __future__ import annotations

import threading

import anyio
import pytest

from kvmux.daemon import worker as worker_module
from kvmux.daemon.worker import EngineWorker

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def test_work_beside_a_call_runs_once_the_model_thread_has_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The call starts first: started after the work beside it, it waited for the GIL
    while that work ran (a turn's announcements held a run's first step ~1 ms). The
    wait is made long here so that only the order can decide."""
    monkeypatch.setattr(worker_module, "_BEGIN_WAIT", 30.0)
    worker = EngineWorker()
    started, beside_done = threading.Event(), threading.Event()
    seen: list[bool] = []

    def call() -> str:
        started.set()
        assert beside_done.wait(10), "the work beside never ran"
        return "ran"

    def beside() -> None:
        seen.append(started.is_set())
        beside_done.set()

    try:
        with anyio.fail_after(20):
            assert await worker.run_beside(beside, call) == "ran"
    finally:
        worker.close()
    assert seen == [True]


async def test_a_busy_model_thread_holds_the_work_beside_only_briefly() -> None:
    """When the thread is still busy with an earlier call, the work beside goes on after
    the short wait, without waiting for the thread: here the earlier call ends only
    once that work has run."""
    worker = EngineWorker()
    unblock = threading.Event()
    seen: list[str] = []

    def earlier() -> None:
        assert unblock.wait(10), "the work beside waited for the busy thread"

    def beside() -> None:
        seen.append("beside")
        unblock.set()

    try:
        with anyio.fail_after(20):
            async with anyio.create_task_group() as tg:
                tg.start_soon(worker.run, earlier)
                await anyio.sleep(0.05)  # the earlier call holds the thread
                await worker.run_beside(beside, lambda: seen.append("call"))
    finally:
        worker.close()
    assert seen == ["beside", "call"]
