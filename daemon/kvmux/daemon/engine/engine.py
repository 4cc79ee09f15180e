"""The decode engine: one model, one onnxruntime session, many decode sessions."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import structlog

from kvmux.kv import (
    ArrayKvCache,
    CudaKvCache,
    HardMax,
    HostKvCache,
    KvSpec,
    MemoryBudget,
    MemoryInfo,
    classify_cause,
    cuda_memory,
    ensure_capacity,
    failpoints,
    host_memory,
    resolve_hard_max,
    resolve_min_bucket,
)

from ..model import ModelFormatError, ModelSpec, Tokenizer, check_session_io, load_model
from .errors import BadPrompt, RunFailed
from .runtime import OrtSession, create_session
from .sampling import ResolvedSampling, SamplingParams, resolve_sampling
from .session import Completion, DecodeSession, StepOutput

log = structlog.get_logger("kvmux.engine")
failpoints.register("engine.run")
failpoints.register("engine.step")

_KV_DTYPES = {np.dtype(np.float32): "float32", np.dtype(np.float16): "float16"}


@dataclass(frozen=True, slots=True)
class Admission:
    """An item that passed validation: what a session needs, no memory taken yet."""

    prompt_ids: list[int]
    sampling: ResolvedSampling
    hard_max: HardMax


@dataclass(frozen=True, slots=True)
class EngineOptions:
    """How the engine runs the model (the daemon fills these from its config)."""

    provider: str = "cpu"
    device_id: int = 0
    intra_op_threads: int = 0
    prefill_chunk: int = 256
    min_bucket: int | None = None
    max_len: int | None = None
    cuda_graph: bool = False

    def __post_init__(self) -> None:
        if self.prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1, got {self.prefill_chunk}")


class Engine:
    """Loads a model folder and creates :class:`DecodeSession` objects on it.

    On CPU the KV buffers are :class:`~kvmux.kv.HostKvCache`; with the CUDA
    provider they are :class:`~kvmux.kv.CudaKvCache`, bound by device pointer.
    Every session's buffers are charged to one :class:`~kvmux.kv.MemoryBudget`
    so KV bytes in use are known across sessions.
    """

    def __init__(
        self,
        model_dir: Path,
        options: EngineOptions | None = None,
        *,
        budget: MemoryBudget | None = None,
    ) -> None:
        self.options = options or EngineOptions()
        self.spec: ModelSpec = load_model(Path(model_dir))
        self.tokenizer = Tokenizer.from_folder(
            self.spec.folder, bos_token_id=self.spec.bos_token_id
        )
        self.ort: OrtSession = create_session(
            self.spec.model_path,
            provider=self.options.provider,
            device_id=self.options.device_id,
            intra_op_threads=self.options.intra_op_threads,
            cuda_graph=self.options.cuda_graph,
        )
        check_session_io(self.spec, self.ort.session.get_inputs(), self.ort.session.get_outputs())
        self.on_cuda = "CUDAExecutionProvider" in self.ort.providers
        if self.ort.fell_back:
            log.warning(
                "cuda_fallback_to_cpu",
                requested="cuda",
                providers=list(self.ort.providers),
                hint="onnxruntime-gpu could not use CUDA (no driver/device or a CUDA/cuDNN "
                "mismatch); this engine runs on the CPU",
            )
        self.device_id = self.options.device_id if self.on_cuda else 0
        kv_dtype = _KV_DTYPES.get(np.dtype(self.spec.kv_dtype))
        if kv_dtype is None:
            raise ModelFormatError(
                self.spec.folder,
                f"KV dtype {self.spec.kv_dtype} is not supported (float32 or float16 expected)",
            )
        self.kv_spec = KvSpec(
            num_layers=self.spec.num_layers,
            kv_heads=self.spec.num_kv_heads,
            head_dim=self.spec.head_size,
            dtype=kv_dtype,
        )
        self.min_bucket = resolve_min_bucket(self.options.min_bucket)
        switch = self.spec.features.length_switch
        if switch is not None and self.min_bucket > switch:
            raise ModelFormatError(
                self.spec.folder,
                f"kv.min_bucket {self.min_bucket} is above {switch}, the length past which "
                f"{self.spec.model_path.name} switches to its long rotary factors (it reads "
                "the mask's width, which is the bucket): set kv.min_bucket <= "
                f"{switch} so the switch happens at the Generator's step",
            )
        self.budget = budget if budget is not None else MemoryBudget()
        self._ids = itertools.count(1)
        self._graph_ids = itertools.count(1)
        self._no_graph = self.run_options(-1)

    def run_options(self, graph_id: int) -> Any:
        """Run options naming a CUDA graph id (-1: run without a graph)."""
        ro = self.ort.ort.RunOptions()
        ro.add_run_config_entry("gpu_graph_id", str(graph_id))
        return ro

    def next_graph_id(self) -> int:
        """A fresh CUDA graph id: a graph is bound to buffer addresses, so every
        (session, buffer generation) pair needs its own."""
        return next(self._graph_ids)

    @property
    def graphs_enabled(self) -> bool:
        return self.on_cuda and self.options.cuda_graph

    @property
    def fell_back_to_cpu(self) -> bool:
        return self.ort.fell_back

    # -- sessions -------------------------------------------------------------
    def hard_max_for(self, max_context: int | None) -> HardMax:
        """An item's ceiling: the smaller explicit cap (item, config), clamped by the model."""
        caps = [(max_context, "item max_context"), (self.options.max_len, "config kv.max_len")]
        given = [(v, label) for v, label in caps if v is not None]
        model = "model max_length"
        if self.spec.features.context_cap is not None:
            model = "model max_length, capped by its sliding window, which its graph ignores"
        if not given:
            return resolve_hard_max(None, self.spec.context_length, model_label=model)
        cap, label = min(given)
        return resolve_hard_max(cap, self.spec.context_length, cap_label=label, model_label=model)

    def encode(self, prompt: str | list[int]) -> list[int]:
        """Prompt text or ids to ids; every id checked against the vocabulary."""
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
        else:
            ids = list(prompt)
            vocab = self.spec.vocab_size
            bad = [
                t
                for t in ids
                if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab
            ]
            if bad:
                raise BadPrompt(
                    f"prompt token ids outside the vocabulary [0, {vocab}): {bad[:8]}",
                    {"bad_token_ids": bad[:8], "vocab_size": vocab},
                )
        if not ids:
            raise BadPrompt("prompt is empty")
        return ids

    def new_cache(self, hard_max: HardMax) -> ArrayKvCache:
        if self.on_cuda:
            return CudaKvCache(
                self.kv_spec,
                hard_max,
                device_id=self.device_id,
                min_bucket=self.min_bucket,
                budget=self.budget,
            )
        return HostKvCache(self.kv_spec, hard_max, min_bucket=self.min_bucket, budget=self.budget)

    def admit(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        *,
        max_context: int | None = None,
    ) -> Admission:
        """Validate one item without taking KV memory: its ids, sampling and ceiling.

        Raises :class:`BadPrompt`, or :class:`~kvmux.kv.CapacityExceeded` if the
        prompt alone is over the item's hard maximum.
        """
        if max_context is not None and max_context <= 0:
            raise BadPrompt(f"max_context must be positive, got {max_context}")
        ids = self.encode(prompt)
        sampling = resolve_sampling(params or SamplingParams(), self.spec.search)
        hard_max = self.hard_max_for(max_context)
        if hard_max.value is not None and len(ids) > hard_max.value:
            # A cache of capacity 0 holds no memory; the driver raises the
            # error with its full diagnostics before allocating anything.
            ensure_capacity(self.new_cache(hard_max), len(ids))
        return Admission(ids, sampling, hard_max)

    def open_session(self, admission: Admission, session_id: str | None = None) -> DecodeSession:
        """A decode session for an admitted item; its cache starts empty (capacity 0)."""
        sid = session_id or f"s{next(self._ids)}"
        return DecodeSession(
            self, admission.prompt_ids, admission.sampling, self.new_cache(admission.hard_max), sid
        )

    def new_session(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        *,
        max_context: int | None = None,
        session_id: str | None = None,
    ) -> DecodeSession:
        """:meth:`admit` and :meth:`open_session` in one call."""
        return self.open_session(self.admit(prompt, params, max_context=max_context), session_id)

    def step_many(
        self, sessions: Sequence[DecodeSession], steps: int = 1
    ) -> list[StepOutput | Exception]:
        """``steps`` steps of each ready session, merged per session; a failure is its entry.

        A session that finishes or fails stops there; the others go on. The
        caller makes sure each session has room for ``steps`` tokens. The
        scheduler hands over the whole ready set, so running several sessions
        as one batched model run is a change here, not there.
        """
        out: list[StepOutput | Exception] = [StepOutput() for _ in sessions]
        live = list(range(len(sessions)))
        for _ in range(steps):
            still = []
            for i in live:
                try:
                    failpoints.hit("engine.step")
                    step = sessions[i].step()
                except Exception as exc:  # noqa: BLE001 - the scheduler fails that item alone
                    out[i] = exc
                    continue
                merged = out[i]
                assert isinstance(merged, StepOutput)
                merged.token_ids.extend(step.token_ids)
                merged.text += step.text
                if step.finished:
                    merged.finished, merged.finish_reason = True, step.finish_reason
                else:
                    still.append(i)
            live = still
        return out

    def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        *,
        max_context: int | None = None,
    ) -> Completion:
        """Decode one item to the end in this thread (tests, benchmarks, the CLI's demo)."""
        session = self.new_session(prompt, params, max_context=max_context)
        try:
            while not session.finished:
                session.step()
            return session.completion()
        finally:
            session.release()

    def memory(self) -> MemoryInfo | None:
        """Memory as growth errors report it: the KV budget if one is set, else the device's."""
        budget = self.budget.memory()
        if budget is not None:
            return budget
        try:
            return cuda_memory(self.device_id) if self.on_cuda else host_memory()
        except Exception:  # noqa: BLE001 - a status probe must not fail the caller
            return None

    # -- runs -------------------------------------------------------------------
    def run(self, io: Any, run_options: Any = None) -> None:
        failpoints.hit("engine.run")
        self.ort.session.run_with_iobinding(io, run_options or self._no_graph)

    def translate_run_error(self, exc: Exception, session: DecodeSession, n: int) -> RunFailed:
        cause = classify_cause(exc)
        mem = session.cache.memory()
        return RunFailed(
            f"model run of {n} token(s) failed ({cause}): {type(exc).__name__}: {exc}. "
            "The session was rolled back to before this step and can be retried.",
            {
                "cause": cause,
                "cause_message": f"{type(exc).__name__}: {exc}",
                "tokens": n,
                "valid_len": session.cache.valid_len,
                "capacity": session.cache.capacity,
                "device_free_bytes": None if mem is None else mem.free,
                "device_total_bytes": None if mem is None else mem.total,
                "session_unchanged": True,
            },
        )
