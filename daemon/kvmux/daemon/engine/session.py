"""One decode session: an onnxruntime run per step over a growing, shared KV buffer."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from kvmux.kv import ArrayKvCache, GrowthResult, ensure_capacity

from .sampling import ResolvedSampling, Sampler
from .text import TextStream

if TYPE_CHECKING:
    from .engine import Engine


@dataclass(slots=True)
class StepOutput:
    """What one step produced: new token ids (none while prefilling), text, and the end."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finished: bool = False
    finish_reason: str | None = None


@dataclass(frozen=True, slots=True)
class Completion:
    """A finished session's result."""

    text: str
    token_ids: list[int]
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    seed: int


class DecodeSession:
    """Prefill (in chunks), then one token per step, on a :mod:`kvmux.kv` cache.

    The same buffer is bound as ``past_key_values.i.*`` and ``present.i.*``: the
    model writes only the new rows. Before every run the host checks that the
    step fits the capacity and grows through :func:`kvmux.kv.ensure_capacity`
    if it does not — the run itself never writes past a buffer. A caller that
    grows first (through :meth:`ensure_capacity`, e.g. under a growth lock)
    makes that check a no-op.
    """

    def __init__(
        self,
        engine: Engine,
        prompt_ids: list[int],
        sampling: ResolvedSampling,
        cache: ArrayKvCache,
        session_id: str = "",
    ) -> None:
        self.engine = engine
        self.session_id = session_id
        self.prompt_ids = prompt_ids
        self.sampling = sampling
        self.cache = cache
        self.sampler = Sampler(sampling)
        self.stream = TextStream(engine.tokenizer.incremental_decoder(), sampling.stop)
        self.generated: list[int] = []
        self.finished = False
        self.finish_reason: str | None = None
        self._prompt_pos = 0
        self._pending: int | None = None
        self._io = engine.ort.session.io_binding()
        self._bound_generation = -1
        self._graph_options: Any = None
        self._decode_io_bound = False
        self._xp = cache.xp
        self._device = "cuda" if engine.on_cuda else "cpu"
        spec = engine.spec
        self._logits_1 = self._xp.empty((1, 1, spec.vocab_size), dtype=spec.logits_dtype)
        self._ids_1 = self._xp.empty((1, 1), dtype=spec.input_ids_dtype)
        self._pos_1 = self._xp.empty((1, 1), dtype=np.int64)

    # -- what the scheduler asks -----------------------------------------
    @property
    def prefilling(self) -> bool:
        return self._prompt_pos < len(self.prompt_ids)

    def next_chunk_len(self) -> int:
        if self.prefilling:
            return min(len(self.prompt_ids) - self._prompt_pos, self.engine.options.prefill_chunk)
        return 1

    def required_capacity(self) -> int:
        return self.cache.valid_len + self.next_chunk_len()

    def at_hard_max(self) -> bool:
        hard = self.cache.hard_max.value
        return hard is not None and self.required_capacity() > hard

    def ensure_capacity(self) -> GrowthResult:
        return ensure_capacity(self.cache, self.required_capacity())

    # -- one step -----------------------------------------------------------
    def step(self) -> StepOutput:
        if self.finished:
            raise RuntimeError(f"session {self.session_id} already finished")
        if not self.prefilling and self.at_hard_max():
            # The context is full: stop like a length limit (as vLLM does at
            # max_model_len). Prompts over the limit were refused at admission.
            return self._finish("length")
        if self.required_capacity() > self.cache.capacity:
            self.ensure_capacity()
        if self.prefilling:
            n = self.next_chunk_len()
            chunk = self.prompt_ids[self._prompt_pos : self._prompt_pos + n]
            logits = self._run(chunk)
            self._prompt_pos += n
            if self.prefilling:
                return StepOutput()
        else:
            assert self._pending is not None
            logits = self._run([self._pending])
        token = self.sampler(logits)
        return self._accept(token)

    def _accept(self, token: int) -> StepOutput:
        eos = self.engine.spec.eos_token_ids
        if token in eos and not self.sampling.ignore_eos:
            return self._finish("stop")
        self.generated.append(token)
        text = self.stream.push(token)
        if self.stream.stopped:
            return self._finish("stop", [token], text)
        if len(self.generated) >= self.sampling.max_new_tokens:
            return self._finish("length", [token], text)
        self._pending = token
        return StepOutput([token], text)

    def _finish(self, reason: str, tokens: list[int] | None = None, text: str = "") -> StepOutput:
        self.finished = True
        self.finish_reason = reason
        return StepOutput(tokens or [], text + self.stream.finish(), True, reason)

    def completion(self) -> Completion:
        if not self.finished or self.finish_reason is None:
            raise RuntimeError(f"session {self.session_id} has not finished")
        return Completion(
            text=self.stream.text,
            token_ids=list(self.generated),
            finish_reason=self.finish_reason,
            prompt_tokens=len(self.prompt_ids),
            completion_tokens=len(self.generated),
            seed=self.sampling.seed,
        )

    def release(self) -> None:
        """Give the KV buffers back (to the budget and the allocator)."""
        self.cache.release()
        self._io.clear_binding_inputs()
        self._io.clear_binding_outputs()
        self._bound_generation = -1
        self._decode_io_bound = False

    # -- the run ------------------------------------------------------------
    def _bind_cache(self) -> None:
        spec, cache, io, dev = self.engine.spec, self.cache, self._io, self._device
        shape = cache.spec.buffer_shape(cache.capacity)
        kv_type = spec.kv_dtype
        for layer in range(spec.num_layers):
            k, v = cache.key_ptr(layer), cache.value_ptr(layer)
            io.bind_input(spec.past_key_names[layer], dev, self.engine.device_id, kv_type, shape, k)
            io.bind_input(
                spec.past_value_names[layer], dev, self.engine.device_id, kv_type, shape, v
            )
            io.bind_output(
                spec.present_key_names[layer], dev, self.engine.device_id, kv_type, shape, k
            )
            io.bind_output(
                spec.present_value_names[layer], dev, self.engine.device_id, kv_type, shape, v
            )
        io.bind_input(
            spec.attention_mask_name,
            dev,
            self.engine.device_id,
            cache.mask.dtype,
            cache.mask.shape,
            cache.mask_ptr(),
        )
        self._bound_generation = cache.capture_generation

    def _run(self, tokens: list[int]) -> np.ndarray[Any, Any]:
        """Run the model on ``tokens``; return the last position's logits (float32, host)."""
        engine, spec, cache, io, dev = (
            self.engine,
            self.engine.spec,
            self.cache,
            self._io,
            self._device,
        )
        n = len(tokens)
        start = cache.valid_len
        if cache.valid_len + n > cache.capacity:
            raise RuntimeError("internal: step does not fit the KV capacity")  # checked above
        if self._bound_generation != cache.capture_generation:
            self._bind_cache()
        xp = self._xp
        if n == 1:
            ids, logits, pos = self._ids_1, self._logits_1, self._pos_1
            ids[0, 0] = tokens[0]
            pos[0, 0] = start
        else:
            ids = xp.asarray(np.asarray([tokens], dtype=spec.input_ids_dtype))
            logits = xp.empty((1, n, spec.vocab_size), dtype=spec.logits_dtype)
            pos = xp.asarray(np.arange(start, start + n, dtype=np.int64)[None, :])
        # A decode step's buffers never move, so they are bound once; a prefill
        # chunk binds its own and the next decode step binds them back.
        if n != 1 or not self._decode_io_bound:
            did = engine.device_id
            io.bind_input(spec.input_ids_name, dev, did, ids.dtype, ids.shape, cache.ptr(ids))
            if spec.position_ids_name is not None:
                io.bind_input(
                    spec.position_ids_name, dev, did, pos.dtype, pos.shape, cache.ptr(pos)
                )
            io.bind_output(
                spec.logits_name, dev, did, logits.dtype, logits.shape, cache.ptr(logits)
            )
            self._decode_io_bound = n == 1
        run_options = None
        if n == 1 and engine.graphs_enabled:
            # Growth invalidated the capture (new addresses, new mask width):
            # the first run under a fresh graph id captures, later ones replay.
            if not cache.capture_valid or self._graph_options is None:
                self._graph_options = engine.run_options(engine.next_graph_id())
            run_options = self._graph_options
        cache.advance(n)
        if dev == "cuda":
            # Inputs were written on CuPy's stream; onnxruntime runs on its own
            # (non-blocking) stream and must not read them before they land.
            xp.cuda.get_current_stream().synchronize()
        try:
            engine.run(io, run_options)
        except Exception as exc:
            cache.truncate(start)
            raise engine.translate_run_error(exc, self, n) from exc
        if run_options is not None:
            cache.capture_valid = True
        last = logits[0, -1]
        if dev == "cuda":
            last = xp.asnumpy(last)
        return np.asarray(last, dtype=np.float32)

    def __repr__(self) -> str:
        return (
            f"DecodeSession({self.session_id!r}, prompt={len(self.prompt_ids)}, "
            f"generated={len(self.generated)}, capacity={self.cache.capacity})"
        )
