"""The Ray Data stage: an actor that owns one kvmuxd and runs each batch of lines on it."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from typing import Any

import msgspec

from kvmux.client import Client, DaemonUnreachable, NotReady, ShuttingDown
from kvmux.client import protocol as p

from ._daemon import Daemon, DaemonFailed, exited
from ._formats import Format, ResultSink, is_rejected
from ._rows import OUTPUT_COLUMNS, Entry, entry

# Errors that end items because their daemon stopped, not because of what they asked:
# such an item runs again on the next daemon.
_STOPPED = frozenset({"shutdown", "cancelled"})
# Failures of the connection to the daemon, which mean a new daemon is needed.
_LOST = (DaemonUnreachable, NotReady, ShuttingDown, TimeoutError)

log = logging.getLogger("kvmux.ray")


class _Lost(Exception):
    """The daemon went away before the job ended."""


class KvmuxReplica:
    """A Ray Data stage: one kvmuxd per actor, every batch of lines a job on it.

    Use it as ``map_batches``' callable class over a pool of actors, one per
    GPU (or per share of CPUs)::

        ds.map_batches(
            KvmuxReplica,
            fn_constructor_kwargs={"config": toml_text, "format": "kvmux", "threads": 1},
            compute=ray.data.ActorPoolStrategy(size=4),
            batch_size=64,
            batch_format="pyarrow",
            num_gpus=1,  # or num_cpus=C with threads=C
        )

    or through :func:`kvmux.ray.build_processor`. Rows are described in
    :mod:`kvmux.ray._rows`: batch-file lines in; out, the result lines
    ``kvmux submit`` writes (``format`` "kvmux" or "openai").

    The daemon (``config``: a kvmuxd TOML config's text) is this actor's child:
    it gets its own socket and journal, ``threads`` onnxruntime threads where
    the config leaves them to onnxruntime, and with ``gpu`` the first of the
    devices Ray made visible. If it dies, the items of every batch without a
    result yet run again on a new one (greedy and seeded items give the same
    tokens); after ``max_restarts`` deaths within one batch the batch fails.
    An item that fails in the daemon (a growth it could not make, a line it
    refused) is a result like any other, never a retry. If the actor itself
    dies, the daemon dies with it and Ray runs the batch again.
    """

    def __init__(
        self,
        config: str = "",
        *,
        format: Format = "kvmux",
        threads: int = 0,
        gpu: bool = False,
        max_restarts: int = 3,
        startup_timeout: float = 300.0,
        tmp_dir: str | None = None,
    ) -> None:
        self.format: Format = format
        self.max_restarts = max_restarts
        self.node = _node_id()
        self.replica = f"{self.node[:12]}:{os.getpid()}"
        self._daemon = Daemon(
            config, threads=threads, gpu=gpu, root=tmp_dir, startup_timeout=startup_timeout
        )
        # The actor is not ready until its daemon is: Ray Data sends no batch to it
        # before, and a daemon that cannot start fails here, where Ray reports it.
        asyncio.run(self._daemon.start())
        self._client: Client | None = None
        self._client_generation = 0
        self._lock: asyncio.Lock | None = None

    def __del__(self) -> None:
        daemon = getattr(self, "_daemon", None)
        if daemon is not None:
            daemon.stop()

    async def __call__(self, batch: Any) -> dict[str, list[Any]]:
        if not hasattr(batch, "to_pylist"):
            raise TypeError(
                f"KvmuxReplica takes pyarrow batches (map_batches(..., batch_format="
                f'"pyarrow")), got {type(batch).__name__}'
            )
        rows: list[dict[str, Any]] = batch.to_pylist()
        entries = [entry(row) for row in rows]
        # Sent under the row's position in this batch as its line, each result
        # finds its row again, whichever job (after a restart) it came from.
        items = [
            msgspec.structs.replace(item, line=k + 1)
            for k, e in enumerate(entries)
            for item in e.items
        ]
        results = await self._decode(items) if items else {}
        return self._outputs(entries, results)

    # -- decoding ----------------------------------------------------------------
    async def _decode(self, items: list[p.Item]) -> dict[tuple[int, int], p.ItemResult]:
        done: dict[tuple[int, int], p.ItemResult] = {}
        losses = 0
        while True:
            todo = [it for it in items if (it.line or 0, it.choice) not in done]
            if not todo:
                return done
            generation = self._daemon.generation
            try:
                client = await self._connected()
                generation = self._client_generation
                await self._job(client, todo, done)
            except (_Lost, *_LOST) as exc:
                losses += 1
                if losses > self.max_restarts:
                    raise DaemonFailed(
                        f"kvmuxd went away {losses} times during one batch (last: {exc}); "
                        f"its log:\n{self._daemon.log_tail()}"
                    ) from exc
                await self._restart(generation)

    async def _job(
        self, client: Client, todo: list[p.Item], done: dict[tuple[int, int], p.ItemResult]
    ) -> None:
        """Run ``todo`` as one job, putting each result that counts into ``done``;
        :class:`_Lost` if the daemon went away first."""
        proc = self._daemon.proc
        assert proc is not None
        jobs: list[Any] = []

        async def run() -> list[p.ItemResult]:
            # Results only: no token updates are built or sent for a Ray batch.
            job = await client.submit_stream(
                todo, name="kvmux-ray", format=self.format, keep_results=True, stream=False
            )
            jobs.append(job)
            return await job.results()

        work = asyncio.ensure_future(run())
        death = asyncio.ensure_future(exited(proc))
        try:
            await asyncio.wait({work, death}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            death.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await death
        lost: BaseException | None = None
        if not work.done():
            work.cancel()
            with contextlib.suppress(asyncio.CancelledError, *_LOST):
                await work
            lost = _Lost(f"kvmuxd {self._daemon.describe_exit()}")
        else:
            lost = work.exception()
            if lost is not None and not isinstance(lost, _LOST):
                raise lost
        if lost is None:
            results = work.result()
        else:
            # What finished before the daemon went away counts; the rest runs again.
            results = list(jobs[0].results_by_index.values()) if jobs else []
        stopped = 0
        for r in results:
            if r.error is not None and r.error.code in _STOPPED:
                stopped += 1
            else:
                done[(r.line or 0, r.choice)] = r
        if lost is None:
            # A line the client would not send (an item over the daemon's message
            # size) comes back once, as its first choice: that refusal is every
            # choice's result, or the line would be sent again forever.
            refused = {r.line: r for r in results if is_rejected(r)}
            for it in todo:
                if it.line in refused:
                    done.setdefault((it.line or 0, it.choice), refused[it.line])
        if lost is not None:
            raise _Lost(str(lost)) from lost
        if stopped:
            raise _Lost(f"kvmuxd stopped {stopped} item(s) before they finished")

    async def _connected(self) -> Client:
        async with self._guard():
            if not self._daemon.alive():
                # It died between batches: found now, not after a request's timeout.
                raise _Lost(f"kvmuxd is not running ({self._daemon.describe_exit()})")
            if self._client is None or self._client_generation != self._daemon.generation:
                await self._drop_client()
                client = Client(self._daemon.endpoint, name="kvmux-ray")
                await client.connect()
                self._client, self._client_generation = client, self._daemon.generation
            return self._client

    async def _restart(self, generation: int) -> None:
        """A new daemon, unless another batch started one since ``generation`` failed."""
        async with self._guard():
            if self._daemon.generation != generation:
                return
            await self._drop_client()
            log.warning(
                "kvmuxd (pid %s) went away (%s); starting a new one: the items without a "
                "result run again",
                self._daemon.pid,
                self._daemon.describe_exit(),
            )
            await self._daemon.start()

    async def _drop_client(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            with contextlib.suppress(*_LOST):
                await client.close()

    def _guard(self) -> asyncio.Lock:
        # Made on first use: it belongs to the event loop Ray runs batches on.
        if self._lock is None:
            self._lock = asyncio.Lock()
        return self._lock

    # -- writing -----------------------------------------------------------------
    def _outputs(
        self, entries: list[Entry], results: dict[tuple[int, int], p.ItemResult]
    ) -> dict[str, list[Any]]:
        columns: dict[str, list[Any]] = {name: [] for name in OUTPUT_COLUMNS}
        lines: list[tuple[bytes, bool]] = []
        model = self._client.welcome.model if self._client and self._client.welcome else ""
        sink = ResultSink(
            self.format,
            lambda data: lines.append((data, True)),
            lambda data: lines.append((data, False)),
            model=model,
        )
        for k, e in enumerate(entries):
            start = len(lines)
            got: list[p.ItemResult] = []
            if e.refused is not None:
                sink.refused(e.refused)
            else:
                for n, item in enumerate(e.items):
                    r = results[(k + 1, item.choice)]
                    index = r.index if e.index is None else e.index + n
                    got.append(msgspec.structs.replace(r, line=e.line, index=index))
                if is_rejected(got[0]):
                    got = got[:1]  # one refusal for the line, as for a line that did not parse
                for r in got:
                    sink.result(r)
            written = lines[start:]
            for j, (data, ok) in enumerate(written):
                # kvmux's format writes a line per result; OpenAI's one per input line.
                one = [got[j]] if self.format == "kvmux" and len(written) == len(got) else got
                columns["custom_id"].append(e.custom_id)
                columns["line"].append(e.line)
                columns["choice"].append(one[0].choice if len(one) == 1 else 0)
                columns["ok"].append(ok)
                columns["tokens"].append(sum(r.usage.completion_tokens for r in one if r.usage))
                columns["output"].append(data.rstrip(b"\n").decode())
                columns["node"].append(self.node)
                columns["replica"].append(self.replica)
        return columns


def _node_id() -> str:
    import ray

    try:
        return str(ray.get_runtime_context().get_node_id())
    except Exception:  # noqa: BLE001 - outside a Ray worker there is no node to name
        return ""
