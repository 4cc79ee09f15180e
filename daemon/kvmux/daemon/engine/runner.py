"""The model runner: binds rows of KV buffers and runs the model on them; owns no sequence state.

A run is either a decode batch (one token for each of ``n`` adjacent rows of
one placement group, bound by pointer offset as one ``[n, kv_heads, cap,
head]`` buffer) or one row's prompt chunk. onnxruntime refuses prompt rows
mixed with decode rows, so no run holds both.
"""

from __future__ import annotations

import operator
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from kvmux.kv import Placement, failpoints

from ..model import ModelSpec
from .runtime import OrtSession

failpoints.register("engine.run")

# Bindings are reused while the same rows of the same buffers run again (the
# steady state of a decode loop); a few dozen spans cover any ready set.
_MAX_BINDINGS = 64
# A mask width that changes costs onnxruntime a re-plan of the run (a step at
# N=1 on `small` 8.9 ms with the width following every token, 8.3 ms at a
# fixed width), so the width grows in steps of this many tokens.
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
    mask: Any  # room for the rows' mask at up to the full capacity, flat
    graph_options: Any = None
    mask_width: int = 0
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
    ) -> None:
        self.ort = ort
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
    @staticmethod
    def check(rows: Sequence[RowInput]) -> list[Placement]:
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
        longest = max(start + len(r.tokens) for r, start in zip(rows, starts, strict=True))
        width = min(-(-longest // _MASK_STEP) * _MASK_STEP, p0.capacity)
        if n_tok > 1 and n_rows > 1:
            # A mask wider than the prompts reads as past context, which
            # onnxruntime refuses in a batch of prompts.
            width = n_tok
        self._bind_mask(bound, p0, n_rows, width, cache0)
        if self.device == "cuda":
            # Inputs were written on CuPy's stream; onnxruntime runs on its own
            # (non-blocking) stream and must not read them before they land.
            self.xp.cuda.get_current_stream().synchronize()
        try:
            failpoints.hit("engine.run", [r.key for r in rows])
            self.ort.session.run_with_iobinding(bound.io, run_options)
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

    def _bind_mask(self, bound: _Bound, p: Placement, n_rows: int, width: int, cache: Any) -> None:
        """Bind the rows' mask only as wide as the longest row, as onnxruntime-genai does.

        The KV buffers stay bound at the bucket's capacity, but GQA's work follows
        the mask's width (total_sequence_length): on `small`, 16 rows of 20
        tokens cost 25.2 ms per step with a mask 21 wide and 27.3 ms at 256.
        A captured CUDA graph needs fixed shapes and addresses, so with graphs
        the cache's own mask rows are bound in place at full width.
        """
        mask = p.mask
        if self.graphs:
            width = p.capacity
        else:
            dst = bound.mask[: n_rows * width].reshape(n_rows, width)
            dst[...] = mask[p.row : p.row + n_rows, :width]
        if bound.mask_width != width:
            # An address costs a few microseconds (ctypes on the host): taken only to bind.
            if self.graphs:
                ptr = cache.ptr(mask) + p.row * p.capacity * mask.dtype.itemsize
            else:
                ptr = cache.ptr(bound.mask)
            bound.io.bind_input(
                self.spec.attention_mask_name,
                self.device,
                self.device_id,
                mask.dtype,
                (n_rows, width),
                ptr,
            )
            bound.mask_width = width

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
        mask = xp.zeros(n_rows * p.capacity, dtype=p.mask.dtype)
        self._bind_kv(io, p, n_rows, cache)
        self._bind_io(io, ids, pos, logits, cache)
        bound = _Bound(io, ids, pos, logits, mask)
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
