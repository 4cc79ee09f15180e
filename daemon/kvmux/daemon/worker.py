"""The one thread that runs the model, so the event loop never blocks on onnxruntime."""

from __future__ import annotations

import asyncio
import contextvars
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import ParamSpec, TypeVar

import anyio

P = ParamSpec("P")
# The longest the loop blocks for the model thread to take a call it hands over with
# work beside it (a wake-up is ~0.1 ms; longer, it is busy, and the loop goes on).
_BEGIN_WAIT = 0.001
T = TypeVar("T")


class EngineWorker:
    """Runs calls one at a time on a dedicated thread, in the caller's context.

    A single thread keeps every onnxruntime run (and, on CUDA, every CuPy call
    of a step) on one thread and one stream. A call is awaited under a shielded
    scope: once it runs it finishes, so a cancelled caller never leaves a
    session half-stepped.
    """

    def __init__(self, name: str = "kvmux-engine") -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)

    async def run(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        return await self.run_beside(None, fn, *args, **kwargs)

    async def run_beside(
        self,
        beside: Callable[[], object] | None,
        fn: Callable[P, T],
        *args: P.args,
        **kwargs: P.kwargs,
    ) -> T:
        """:meth:`run`, calling ``beside()`` on the caller's thread once ``fn`` is handed
        to the model thread: work the call need not wait for overlaps it."""
        ctx = contextvars.copy_context()
        if beside is None:
            future = self._executor.submit(lambda: ctx.run(fn, *args, **kwargs))
        else:
            began = threading.Event()

            def call() -> T:
                began.set()
                return ctx.run(fn, *args, **kwargs)

            future = self._executor.submit(call)
        with anyio.CancelScope(shield=True):
            try:
                if beside is not None:
                    # Once the model thread has the call: started after beside(), it
                    # waited for the GIL while beside() ran (~1 ms at 16 sessions).
                    began.wait(_BEGIN_WAIT)
                    beside()
            finally:  # the model thread's work is awaited whatever beside() did
                result = await asyncio.wrap_future(future)
        return result

    def close(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)
