"""The model runner: binds rows of KV buffers and runs the model on them; owns no sequence state.

A run is either a decode batch (one token for each of ``n`` adjacent rows of
one placement group, bound by pointer offset as one ``[n, kv_heads, cap,
head]`` buffer) or one row's prompt chunk. onnxruntime refuses prompt rows
mixed with decode rows, so no run holds both.
"""

from __future__ import annotations

import operator
from collections import OrderedDict
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from kvmux.kv import Placement, failpoints

from ..model import ModelSpec
from .runtime import OrtSession
from .structured import apply_bitmask

failpoints.register("engine.run")
failpoints.register("engine.capture")

# Bindings are reused while the same rows of the same buffers run again (the
# steady state of a decode loop); a few dozen spans cover any ready set.
_MAX_BINDINGS = 64
# A prompt chunk's mask is as wide as its rows' past and chunk, rounded up to a
# multiple of this: a width that changes costs onnxruntime a re-plan of the run.
_MASK_STEP = 32


class RowCache(Protocol):
    """What the runner needs of a KV cache (``ArrayKvCache`` and ``RowKvCache`` both are one)."""

    capture_valid: bool

    @property
    def valid_len(self) -> int: ...
    @property
    def capacity(self) -> int: ...
    def placement(self) -> Placement: ...
    def advance(self, n: int) -> None: ...
    def counted(self, n: int) -> None: ...
    def truncate(self, length: int) -> None: ...
    def ptr(self, array: Any) -> int: ...


@dataclass(slots=True)
class RowInput:
    """One row of a run: its cache, the tokens to feed, and a key naming it (a session id).

    ``place`` is the cache's placement when the caller has just read it (the
    engine does, once per step, for planning); None reads it from the cache.
    """

    cache: RowCache
    tokens: Sequence[int]
    key: str = ""
    place: Placement | None = None

    def placement(self) -> Placement:
        return self.cache.placement() if self.place is None else self.place


@dataclass(slots=True)
class _Bound:
    io: Any
    ids: Any
    pos: Any
    logits: Any
    mask: Any  # a prompt chunk's copy of its rows' mask (decode runs bind theirs in place)
    graph_options: Any = None
    mask_width: int = 0
    #: Counts the runs of :meth:`ModelRunner.run` on it (a span's inputs are stale after one).
    version: int = 0
    #: The placements :meth:`ModelRunner.check` last passed for these rows.
    checked: Sequence[Placement] = ()


class RowsNotRunnable(ValueError):
    """Rows that one run cannot hold (checked on the host, before onnxruntime sees them)."""


class ModelRunner:
    """Runs the model on rows of KV buffers; on failure rolls every row back and re-raises."""

    def __init__(
        self,
        ort: OrtSession,
        spec: ModelSpec,
        *,
        xp: Any,
        device: str,
        device_id: int,
        graphs: bool,
        exclusive: Callable[[], AbstractContextManager[Any]] = nullcontext,
    ) -> None:
        self.ort = ort
        self.exclusive = exclusive
        self.spec = spec
        self.xp = xp
        self.device = device
        self.device_id = device_id
        self.graphs = graphs
        self._bound: OrderedDict[tuple[int, int, int, int], _Bound] = OrderedDict()
        self._graph_ids = 0
        self._no_graph = self.run_options(-1)
        self.runs = 0
        self.rows_run = 0

    def run_options(self, graph_id: int) -> Any:
        """Run options naming a CUDA graph id (-1: run without a graph)."""
        ro = self.ort.ort.RunOptions()
        ro.add_run_config_entry("gpu_graph_id", str(graph_id))
        return ro

    # -- checks ------------------------------------------------------------------
    def check(self, rows: Sequence[RowInput]) -> list[Placement]:
        """Placements of ``rows`` if one run can hold them, else :class:`RowsNotRunnable`.

        onnxruntime fails the whole run for one bad row (and CUDA may not check
        at all), so every row is checked here: room for its tokens, one group,
        adjacent rows, and a prompt chunk with past only alone (first prompts,
        with no past, may share a run, right-padded).
        """
        if not rows:
            raise RowsNotRunnable("no rows")
        places = []
        for r in rows:
            if not r.tokens:
                raise RowsNotRunnable(f"row {r.key!r} has no tokens")
            if r.cache.capacity == 0 or r.cache.valid_len + len(r.tokens) > r.cache.capacity:
                raise RowsNotRunnable(
                    f"row {r.key!r}: {len(r.tokens)} token(s) do not fit "
                    f"(valid {r.cache.valid_len}, capacity {r.cache.capacity})"
                )
            places.append(r.placement())
        if len(rows) > 1:
            first = places[0]
            prompts = any(len(r.tokens) > 1 for r in rows)
            if prompts and self.device == "cuda":
                raise RowsNotRunnable("CUDA's GroupQueryAttention runs a prompt chunk alone")
            for i, (r, p) in enumerate(zip(rows, places, strict=True)):
                if prompts and r.cache.valid_len != 0:
                    # onnxruntime: "batch_size must be 1 when sequence_length > 1
                    # and past context is given"; first prompts (no past) batch.
                    raise RowsNotRunnable("a prompt chunk with past runs alone")
                if p.group != first.group or p.row != first.row + i:
                    raise RowsNotRunnable("rows of one run must be adjacent rows of one group")
        return places

    # -- the run -------------------------------------------------------------------
    def run(self, rows: Sequence[RowInput]) -> np.ndarray[Any, Any]:
        """Feed each row its tokens; return the last position's logits, ``[rows, vocab]`` float32.

        Each row's cache has counted the tokens when this returns; if the run
        fails, every row is truncated back to where it was and the error raised.
        """
        if not rows:
            raise RowsNotRunnable("no rows")
        n_rows, n_tok = len(rows), max(len(r.tokens) for r in rows)
        cache0 = rows[0].cache
        starts = [r.cache.valid_len for r in rows]
        if n_tok == 1:
            if not all(r.cache.capacity for r in rows):
                self.check(rows)  # raises: a cache with no row has no placement
            places = [r.placement() for r in rows]
            p0 = places[0]
            bound = self._decode_binding(p0, n_rows, cache0)
            if len(bound.checked) == n_rows and all(map(operator.is_, places, bound.checked)):
                # The rows this binding last checked, unmoved: only their room can have changed.
                for r, start in zip(rows, starts, strict=True):
                    if start >= r.cache.capacity or len(r.tokens) != 1:
                        self.check([r])
            else:
                self.check(rows)
                bound.checked = places
            self._put(bound.ids, [r.tokens[0] for r in rows])
            self._put(bound.pos, starts)
        else:
            p0 = self.check(rows)[0]
            bound = self._prompt_binding(p0, rows, cache0)
        run_options = self._no_graph
        if self.graphs and n_tok == 1:
            if bound.graph_options is None or not all(r.cache.capture_valid for r in rows):
                self._graph_ids += 1
                bound.graph_options = self.run_options(self._graph_ids)
            run_options = bound.graph_options
        for r in rows:
            r.cache.advance(len(r.tokens))
        if n_tok == 1:
            self.bind_mask_in_place(bound, p0, n_rows, cache0)
        else:
            longest = max(start + len(r.tokens) for r, start in zip(rows, starts, strict=True))
            width = min(-(-longest // _MASK_STEP) * _MASK_STEP, p0.capacity)
            if n_rows > 1:
                # A mask wider than the prompts reads as past context, which
                # onnxruntime refuses in a batch of prompts.
                width = n_tok
            self._bind_mask(bound, p0, n_rows, width)
        bound.version += 1
        try:
            failpoints.hit("engine.run", [r.key for r in rows])
            self.launch(bound.io, run_options)
        except BaseException:
            for r, start in zip(rows, starts, strict=True):
                r.cache.truncate(start)
            raise
        self.runs += 1
        self.rows_run += n_rows
        if run_options is not self._no_graph:
            for r in rows:
                r.cache.capture_valid = True
        if n_tok == 1 or n_rows == 1:
            last = bound.logits[:, -1, :]
        else:  # right-padded first prompts: each row's own last token
            last = bound.logits[self.xp.arange(n_rows), [len(r.tokens) - 1 for r in rows], :]
        if self.device == "cuda":
            last = self.xp.asnumpy(last)
        return np.asarray(last, dtype=np.float32)

    def launch(self, io: Any, run_options: Any) -> None:
        """One onnxruntime run of a bound IOBinding.

        A run that may capture a CUDA graph holds the storage's ``exclusive`` context:
        onnxruntime captures in ``cudaStreamCaptureModeGlobal``, where a cudaMalloc,
        a memset or a synchronizing copy issued by any other thread (a growth, a
        release, a prefix fork: all of them run inside the storage's ``on_device``,
        which takes the same lock) fails and breaks the capture.
        """
        if self.device == "cuda":
            # Inputs were written on CuPy's stream; onnxruntime runs on its own
            # (non-blocking) stream and must not read them before they land.
            self.xp.cuda.get_current_stream().synchronize()
        if run_options is self._no_graph:
            self.ort.session.run_with_iobinding(io, run_options)
        else:
            with self.exclusive():
                failpoints.hit("engine.capture")
                self.ort.session.run_with_iobinding(io, run_options)

    def _put(self, dst: Any, values: list[int]) -> None:
        """One value per row into a ``[rows, 1]`` input, in one copy."""
        if self.device == "cuda":
            host = np.asarray(values, dtype=dst.dtype).reshape(dst.shape)
            dst[...] = self.xp.asarray(host)
        else:
            dst[:, 0] = values

    # -- binding -------------------------------------------------------------------
    def _bind_kv(self, io: Any, p: Placement, n_rows: int, cache: RowCache) -> None:
        spec, dev, did = self.spec, self.device, self.device_id
        shape = (n_rows, spec.num_kv_heads, p.capacity, spec.head_size)
        kv_type = spec.kv_dtype
        row_bytes = spec.num_kv_heads * p.capacity * spec.head_size * np.dtype(kv_type).itemsize
        off = p.row * row_bytes
        for layer in range(spec.num_layers):
            k = cache.ptr(p.keys[layer]) + off
            v = cache.ptr(p.values[layer]) + off
            io.bind_input(spec.past_key_names[layer], dev, did, kv_type, shape, k)
            io.bind_input(spec.past_value_names[layer], dev, did, kv_type, shape, v)
            io.bind_output(spec.present_key_names[layer], dev, did, kv_type, shape, k)
            io.bind_output(spec.present_value_names[layer], dev, did, kv_type, shape, v)

    def _bind_mask(self, bound: _Bound, p: Placement, n_rows: int, width: int) -> None:
        """A prompt chunk's mask: a copy of its rows' mask, only as wide as its longest row."""
        mask = p.mask
        dst = bound.mask[: n_rows * width].reshape(n_rows, width)
        dst[...] = mask[p.row : p.row + n_rows, :width]
        if bound.mask_width != width:
            bound.io.bind_input(
                self.spec.attention_mask_name,
                self.device,
                self.device_id,
                mask.dtype,
                (n_rows, width),
                self.ptr(bound.mask),
            )
            bound.mask_width = width

    def bind_mask_in_place(self, bound: _Bound, p: Placement, n_rows: int, cache: Any) -> None:
        """A decode run's mask: its rows of the cohort's own mask, bound where they are at
        the bucket's full width (adjacent rows of ``[rows, capacity]`` are contiguous).

        Nothing is copied per step, the addresses stay fixed (what a captured CUDA
        graph needs) and the width is the bucket's, as the bare loop binds it; GQA
        reads only each row's valid length of the KV (FACTS: a step's cost follows
        the valid length, not the bound capacity).
        """
        if bound.mask_width != -1:
            mask = p.mask
            bound.io.bind_input(
                self.spec.attention_mask_name,
                self.device,
                self.device_id,
                mask.dtype,
                (n_rows, p.capacity),
                cache.ptr(mask) + p.row * p.capacity * mask.dtype.itemsize,
            )
            bound.mask_width = -1  # in place

    def ptr(self, array: Any) -> int:
        # An address costs a few microseconds (ctypes on the host): taken only to bind.
        return int(array.data.ptr) if self.device == "cuda" else int(array.ctypes.data)

    def _bind_io(self, io: Any, ids: Any, pos: Any, logits: Any, cache: RowCache) -> None:
        spec, dev, did = self.spec, self.device, self.device_id
        io.bind_input(spec.input_ids_name, dev, did, ids.dtype, ids.shape, cache.ptr(ids))
        if spec.position_ids_name is not None:
            io.bind_input(spec.position_ids_name, dev, did, pos.dtype, pos.shape, cache.ptr(pos))
        io.bind_output(spec.logits_name, dev, did, logits.dtype, logits.shape, cache.ptr(logits))

    def _decode_binding(self, p: Placement, n_rows: int, cache: RowCache) -> _Bound:
        key = (p.group, p.row, n_rows, p.capacity)
        bound = self._bound.get(key)
        if bound is not None:
            self._bound.move_to_end(key)
            return bound
        xp, spec = self.xp, self.spec
        io = self.ort.session.io_binding()
        ids = xp.empty((n_rows, 1), dtype=spec.input_ids_dtype)
        pos = xp.empty((n_rows, 1), dtype=np.int64)
        logits = xp.empty((n_rows, 1, spec.vocab_size), dtype=spec.logits_dtype)
        self._bind_kv(io, p, n_rows, cache)
        self._bind_io(io, ids, pos, logits, cache)
        bound = _Bound(io, ids, pos, logits, None)
        self._bound[key] = bound
        while len(self._bound) > _MAX_BINDINGS:
            self._bound.popitem(last=False)
        return bound

    def _prompt_binding(self, p: Placement, rows: Sequence[RowInput], cache: RowCache) -> _Bound:
        """Prompt chunks: one row's (after its past), or first prompts right-padded."""
        xp, spec = self.xp, self.spec
        n_rows, width = len(rows), max(len(r.tokens) for r in rows)
        start = cache.valid_len  # 0 for every row when there are several
        ids_h = np.zeros((n_rows, width), dtype=spec.input_ids_dtype)
        for i, r in enumerate(rows):
            ids_h[i, : len(r.tokens)] = r.tokens
        pos_h = np.broadcast_to(np.arange(start, start + width, dtype=np.int64), (n_rows, width))
        io = self.ort.session.io_binding()
        ids, pos = xp.asarray(ids_h), xp.asarray(np.ascontiguousarray(pos_h))
        logits = xp.empty((n_rows, width, spec.vocab_size), dtype=spec.logits_dtype)
        mask = xp.zeros(n_rows * p.capacity, dtype=p.mask.dtype)
        self._bind_kv(io, p, n_rows, cache)
        self._bind_io(io, ids, pos, logits, cache)
        return _Bound(io, ids, pos, logits, mask)

    def forget(self, group: int) -> None:
        """Drop bindings of buffers that are gone (their pointers must not be run again)."""
        for key in [k for k in self._bound if k[0] == group]:
            del self._bound[key]


class DecodeSpan:
    """``n`` adjacent rows of one cohort decoding together for some steps, each step a fixed
    number of array operations whatever ``n`` is (vLLM's persistent input buffers, in small).

    The rows' lengths and next tokens live in arrays on the runner's device; a step
    writes the positions, one scatter marks each row's new mask column, one run,
    one argmax: the picked ids stay on the device as the next step's input and only
    they cross to the host. Rows whose token the host chooses (sampling, penalties,
    logprobs, stop strings: :meth:`host_logits`, :meth:`choose`) have only their own
    logits copied. The caches count the tokens once, when the caller :meth:`settles`.
    """

    def __init__(
        self,
        runner: ModelRunner,
        rows: Sequence[RowInput],
        host: Sequence[int],
    ) -> None:
        xp = runner.xp
        cache0 = rows[0].cache
        p = rows[0].placement()
        n = len(rows)
        self.runner = runner
        self.n = n
        self.caches = [r.cache for r in rows]
        self.bound = bound = runner._decode_binding(p, n, cache0)
        if len(bound.checked) != n or not all(
            map(operator.is_, (r.placement() for r in rows), bound.checked)
        ):
            bound.checked = runner.check(rows)
        runner.bind_mask_in_place(bound, p, n, cache0)
        self.mask = p.mask
        self.rows = xp.arange(p.row, p.row + n)
        self.lens = xp.asarray(np.fromiter((c.valid_len for c in self.caches), np.int64, n))
        bound.ids[:, 0] = xp.asarray(np.fromiter((r.tokens[0] for r in rows), np.int64, n))
        self.host = np.asarray(host, dtype=np.int64)
        self._host_dev = xp.asarray(self.host)
        self.steps = 0
        self.run_options = runner._no_graph
        if runner.graphs:
            if bound.graph_options is None or not all(c.capture_valid for c in self.caches):
                runner._graph_ids += 1
                bound.graph_options = runner.run_options(runner._graph_ids)
            self.run_options = bound.graph_options
        self._keys = [r.key for r in rows]
        self._version = bound.version

    def current(self) -> bool:
        """Whether its arrays still hold its rows' state: nothing but this span ran them
        since, and no capture they rely on was invalidated."""
        if self.bound.version != self._version:
            return False
        return not self.runner.graphs or all(c.capture_valid for c in self.caches)

    def step(self) -> np.ndarray[Any, Any]:
        """One decode step of every row; returns the argmax of each row's logits (host ids).

        A run that fails leaves the rows as they were before this step, and raises."""
        runner, b = self.runner, self.bound
        b.pos[:, 0] = self.lens
        self.mask[self.rows, self.lens] = 1
        try:
            failpoints.hit("engine.run", self._keys)
            runner.launch(b.io, self.run_options)
        except BaseException:
            self.mask[self.rows, self.lens] = 0
            raise
        self.lens += 1
        self.steps += 1
        runner.runs += 1
        runner.rows_run += self.n
        picks = b.logits[:, 0, :].argmax(axis=1)
        b.ids[:, 0] = picks
        if runner.device == "cuda":
            return runner.xp.asnumpy(picks)  # type: ignore[no-any-return]
        return picks  # type: ignore[no-any-return]

    def mask_host_rows(self, which: Sequence[int], bitmask: np.ndarray[Any, Any]) -> None:
        """Forbid, in the last step's logits where they are, the tokens ``bitmask``
        (``int32 [len(which), words]``, llguidance's) forbids the host rows ``which``
        (indices into :attr:`host`). With CUDA only the bitmask crosses (one word per
        32 tokens of a row), and the rows' logits are masked on the device before the
        host copies them; the other rows' logits are not touched."""
        xp = self.runner.xp
        rows = xp.asarray(self.host[np.asarray(which, dtype=np.int64)])
        apply_bitmask(self.bound.logits[:, 0, :], xp.asarray(bitmask), rows, xp=xp)

    def host_logits(self) -> np.ndarray[Any, Any]:
        """The last step's logits of the host rows only, ``[len(host), vocab]`` float32."""
        last = self.bound.logits[self._host_dev, 0, :]
        if self.runner.device == "cuda":
            last = self.runner.xp.asnumpy(last)
        return np.asarray(last, dtype=np.float32)

    def choose(self, tokens: np.ndarray[Any, Any]) -> None:
        """The host rows' next input tokens, in :attr:`host` order (one copy)."""
        self.bound.ids[self._host_dev, 0] = self.runner.xp.asarray(tokens)

    def settle(self) -> None:
        """The caches count the steps taken (their mask columns are written already)."""
        steps = self.steps
        if steps:
            for c in self.caches:
                c.counted(steps)
            if self.run_options is not self.runner._no_graph:
                for c in self.caches:
                    c.capture_valid = True
        self.steps = 0
