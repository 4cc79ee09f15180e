"""The one thread that runs the model, so the event loop never blocks on onnxruntime."""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import ParamSpec, TypeVar

import anyio

P = ParamSpec("P")
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
        future = self._executor.submit(lambda: ctx.run(fn, *args, **kwargs))
        with anyio.CancelScope(shield=True):
            try:
                if beside is not None:
                    beside()
            finally:  # the model thread's work is awaited whatever beside() did
                result = await asyncio.wrap_future(future)
        return result

    def close(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)
