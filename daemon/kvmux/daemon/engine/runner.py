"""The model runner: binds rows of KV buffers and runs the model on them; owns no sequence state.

A run is either a decode batch (one token for each of ``n`` adjacent rows of
one placement group, bound by pointer offset as one ``[n, kv_heads, cap,
head]`` buffer) or one row's prompt chunk. onnxruntime refuses prompt rows
mixed with decode rows, so no run holds both.
"""

from __future__ import annotations

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


@dataclass(frozen=True, slots=True)
class RowInput:
    """One row of a run: its cache, the tokens to feed, and a key naming it (a session id)."""

    cache: RowCache
    tokens: Sequence[int]
    key: str = ""


@dataclass(slots=True)
class _Bound:
    io: Any
    ids: Any
    pos: Any
    logits: Any
    mask: Any  # room for the rows' mask at up to the full capacity, flat
    graph_options: Any = None
    mask_width: int = 0


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
        adjacent rows, and a prompt chunk only alone.
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
            places.append(r.cache.placement())
        if len(rows) > 1:
            first = places[0]
            for i, (r, p) in enumerate(zip(rows, places, strict=True)):
                if len(r.tokens) != 1:
                    raise RowsNotRunnable("a prompt chunk runs alone, never with other rows")
                if p.group != first.group or p.row != first.row + i:
                    raise RowsNotRunnable("rows of one run must be adjacent rows of one group")
        return places

    # -- the run -------------------------------------------------------------------
    def run(self, rows: Sequence[RowInput]) -> np.ndarray[Any, Any]:
        """Feed each row its tokens; return the last position's logits, ``[rows, vocab]`` float32.

        Each row's cache has counted the tokens when this returns; if the run
        fails, every row is truncated back to where it was and the error raised.
        """
        places = self.check(rows)
        p0 = places[0]
        n_rows, n_tok = len(rows), len(rows[0].tokens)
        cache0 = rows[0].cache
        if n_tok == 1:
            bound = self._decode_binding(p0, n_rows, cache0)
            for i, r in enumerate(rows):
                bound.ids[i, 0] = r.tokens[0]
                bound.pos[i, 0] = r.cache.valid_len
        else:
            bound = self._chunk_binding(p0, rows[0].tokens, cache0)
        starts = [r.cache.valid_len for r in rows]
        run_options = self._no_graph
        if self.graphs and n_tok == 1:
            if bound.graph_options is None or not all(r.cache.capture_valid for r in rows):
                self._graph_ids += 1
                bound.graph_options = self.run_options(self._graph_ids)
            run_options = bound.graph_options
        for r in rows:
            r.cache.advance(n_tok)
        longest = max(r.cache.valid_len for r in rows)
        width = min(-(-longest // _MASK_STEP) * _MASK_STEP, p0.capacity)
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
        last = bound.logits[:, -1, :]
        if self.device == "cuda":
            last = self.xp.asnumpy(last)
        return np.asarray(last, dtype=np.float32)

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
            ptr = cache.ptr(mask) + p.row * p.capacity * mask.dtype.itemsize
        else:
            dst = bound.mask[: n_rows * width].reshape(n_rows, width)
            dst[...] = mask[p.row : p.row + n_rows, :width]
            ptr = cache.ptr(bound.mask)
        if bound.mask_width != width:
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

    def _chunk_binding(self, p: Placement, tokens: Sequence[int], cache: RowCache) -> _Bound:
        xp, spec = self.xp, self.spec
        n, start = len(tokens), cache.valid_len
        io = self.ort.session.io_binding()
        ids = xp.asarray(np.asarray([list(tokens)], dtype=spec.input_ids_dtype))
        pos = xp.asarray(np.arange(start, start + n, dtype=np.int64)[None, :])
        logits = xp.empty((1, n, spec.vocab_size), dtype=spec.logits_dtype)
        mask = xp.zeros(p.capacity, dtype=p.mask.dtype)
        self._bind_kv(io, p, 1, cache)
        self._bind_io(io, ids, pos, logits, cache)
        return _Bound(io, ids, pos, logits, mask)

    def forget(self, group: int) -> None:
        """Drop bindings of buffers that are gone (their pointers must not be run again)."""
        for key in [k for k in self._bound if k[0] == group]:
            del self._bound[key]
