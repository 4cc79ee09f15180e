"""The decode engine: one model, one onnxruntime session, many decode sessions."""

from __future__ import annotations

import itertools
import operator
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import structlog

from kvmux.kv import (
    CohortPool,
    CudaStorage,
    HardMax,
    KvCache,
    KvSpec,
    MemoryBudget,
    MemoryInfo,
    Placement,
    PrefixCache,
    RowKvCache,
    classify_cause,
    ensure_capacity,
    failpoints,
    resolve_hard_max,
    resolve_min_bucket,
)

from ..model import (
    ChatTemplate,
    ChatTemplateError,
    ModelFormatError,
    ModelSpec,
    Tokenizer,
    check_session_io,
    load_chat_template,
    load_model,
)
from .batching import plan, split_failed
from .errors import BadPrompt, RunFailed
from .runner import DecodeSpan, ModelRunner, RowInput
from .runtime import OrtSession, create_session
from .sampling import Draws, ResolvedSampling, Sampler, SamplingParams, resolve_sampling
from .session import Completion, DecodeSession, StepOutput
from .structured import (
    Filling,
    GrammarCompiler,
    MaskFiller,
    Matcher,
    allocate_bitmask,
    apply_bitmask,
)

log = structlog.get_logger("kvmux.engine")
failpoints.register("engine.step")

_KV_DTYPES = {np.dtype(np.float32): "float32", np.dtype(np.float16): "float16"}
# generate's steps per call: more than any item takes (its end returns the call).
_GENERATE_STEPS = 1 << 30


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
    #: Rows of one cohort buffer: the most sessions of one bucket one run decodes.
    rows_per_cohort: int = 256
    #: The most rows of one run; 1 decodes every session in a run of its own.
    max_batch: int = 256
    #: A chat template file that overrides the model's own (config model.chat_template).
    chat_template: Path | None = None
    #: Keep prompt KV for sessions whose prompts begin alike (config kv.prefix_cache);
    #: the scheduler uses it, ``generate`` and ``new_session`` do not.
    prefix_cache: bool = True
    prefix_block: int = 16
    prefix_cache_bytes: int = 1 << 30
    prefix_scope: Literal["owner", "shared"] = "owner"

    def __post_init__(self) -> None:
        if self.prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1, got {self.prefill_chunk}")
        if self.prefix_block < 1 or self.prefix_cache_bytes < 0:
            raise ValueError(
                f"prefix_block must be >= 1 and prefix_cache_bytes >= 0, got "
                f"{self.prefix_block} and {self.prefix_cache_bytes}"
            )
        if self.rows_per_cohort < 1 or self.max_batch < 1:
            raise ValueError(
                f"rows_per_cohort and max_batch must be >= 1, got "
                f"{self.rows_per_cohort} and {self.max_batch}"
            )


@dataclass(slots=True)
class _Row(RowInput):
    """A row of a step: which of the step's fed sessions it is, and whether its
    token is the argmax of its logits."""

    index: int = 0
    picks_argmax: bool = False


@dataclass(slots=True)
class _Planned:
    """One step's rows, their placements and its runs (lists of those rows);
    ``reusable`` when every row decodes (a plan the next step may reuse)."""

    places: list[Placement]
    rows: list[_Row]
    runs: list[list[_Row]]
    reusable: bool
    #: The decode span of each run (by index) that last decoded its rows.
    spans: dict[int, DecodeSpan] = field(default_factory=dict)
    #: What each span's steps need of its sessions, gathered once for the span.
    rows_of: dict[int, _SpanRows] = field(default_factory=dict)


class Engine:
    """Loads a model folder, creates :class:`DecodeSession` objects on it and steps them.

    A session's KV is a row of a cohort (:class:`~kvmux.kv.CohortPool`, cohorts
    per bucket capacity), so the ready sessions of one bucket decode in one
    run: in host memory on CPU, in device memory (:class:`~kvmux.kv.CudaStorage`,
    bound by device pointer) with the CUDA provider. Every session's KV is
    charged to one :class:`~kvmux.kv.MemoryBudget`: per row in use on the host,
    per cohort allocated on a device (whose memory is not lazily backed).
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
        # Compiled once here; rendered per request on the thread that tokenizes.
        self.chat_template: ChatTemplate | None = load_chat_template(
            self.spec.folder, self.options.chat_template
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
        self.pool = CohortPool(
            self.kv_spec,
            storage=CudaStorage(self.device_id) if self.on_cuda else None,
            rows_per_cohort=self.options.rows_per_cohort,
            min_bucket=self.min_bucket,
            budget=self.budget,
        )
        self.prefix = self._prefix_cache(switch)
        self._ids = itertools.count(1)
        self.runner = ModelRunner(
            self.ort,
            self.spec,
            xp=self.pool.xp,
            device="cuda" if self.on_cuda else "cpu",
            device_id=self.device_id,
            graphs=self.graphs_enabled,
            exclusive=self.pool.storage.exclusive,
        )
        self._planned: _Planned | None = None
        #: Structured outputs' grammars for this model's tokenizer (built on first use).
        self.structured = GrammarCompiler.for_model(self.spec)
        # Fills a step's grammar masks beside its run.
        self._masks = MaskFiller(self.structured)

    def _prefix_cache(self, switch: int | None) -> PrefixCache | None:
        opts = self.options
        if not opts.prefix_cache:
            return None
        if switch is not None:
            # Its rotary factors follow the width of the run that computed a token
            # (see ModelFormatError above), so a prefix's KV depends on where the
            # prompt it came from ended: another prompt's copy may not be its own.
            log.info(
                "prefix_cache_off",
                reason=f"{self.spec.model_path.name} switches rotary factors past {switch} "
                "tokens, so cached KV depends on the prompt it was computed for",
            )
            return None
        return PrefixCache(
            self.kv_spec,
            budget=self.budget,
            storage=self.pool.storage,
            block=opts.prefix_block,
            max_bytes=opts.prefix_cache_bytes,
            scope=opts.prefix_scope,
        )

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

    def render_chat(self, messages: Sequence[Mapping[str, str]]) -> str:
        """The prompt text of a chat, rendered with the model's template.

        The text is tokenized like any text prompt, with no special tokens added:
        the template writes the ones the model wants (transformers tokenizes a
        rendered chat with ``add_special_tokens=False`` too)."""
        if self.chat_template is None:
            raise BadPrompt(
                f"the model {self.spec.folder.name!r} has no chat template (no "
                "chat_template.jinja beside its tokenizer, no chat_template in its "
                'tokenizer_config.json): set model.chat_template = "FILE" in kvmuxd.toml '
                "to a Jinja chat template, or send `prompt` text instead of `messages`",
                {"fix": 'model.chat_template = "FILE"'},
            )
        try:
            return self.chat_template.render(messages)
        except ChatTemplateError as exc:
            raise BadPrompt(str(exc), {"chat_template": self.chat_template.origin}) from exc

    def new_cache(self, hard_max: HardMax) -> KvCache:
        return self.pool.new_cache(hard_max)

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
        params = params or SamplingParams()
        vocab = self.spec.vocab_size
        bad = [t for t in params.stop_token_ids if not 0 <= t < vocab]
        if bad:
            raise BadPrompt(
                f"stop_token_ids outside the vocabulary [0, {vocab}): {bad[:8]}",
                {"bad_token_ids": bad[:8], "vocab_size": vocab},
            )
        sampling = resolve_sampling(params, self.spec.search)
        if sampling.structured is not None:
            self.structured.compile(sampling.structured)  # refused here, before any session
        hard_max = self.hard_max_for(max_context)
        self.refuse_over_hard_max(hard_max, len(ids))
        return Admission(ids, sampling, hard_max)

    def refuse_over_hard_max(self, hard_max: HardMax, tokens: int) -> None:
        """:class:`~kvmux.kv.CapacityExceeded` if ``tokens`` do not fit ``hard_max``."""
        if hard_max.value is not None and tokens > hard_max.value:
            # A cache of capacity 0 holds no memory; the driver raises the
            # error with its full diagnostics before allocating anything.
            ensure_capacity(self.new_cache(hard_max), tokens)

    def open_session(self, admission: Admission, session_id: str | None = None) -> DecodeSession:
        """A decode session for an admitted item; its cache starts empty (capacity 0)."""
        sid = session_id or f"s{next(self._ids)}"
        sampling = admission.sampling
        spec = sampling.structured
        return DecodeSession(
            admission.prompt_ids,
            sampling,
            self.new_cache(admission.hard_max),
            tokenizer=self.tokenizer,
            eos_token_ids=self.spec.eos_token_ids,
            prefill_chunk=self.options.prefill_chunk,
            grammar=None if spec is None else self.structured.matcher(spec),
            session_id=sid,
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

    def step(self, session: DecodeSession) -> StepOutput:
        """One step of one session alone (tests, the CLI); its failure is raised."""
        if session.finished:
            raise RuntimeError(f"session {session.session_id} already finished")
        (out,) = self.step_many([session])
        if isinstance(out, Exception):
            raise out
        return out

    def step_many(
        self,
        sessions: Sequence[DecodeSession],
        steps: int = 1,
        *,
        launching: Callable[[], object] | None = None,
        halt: threading.Event | None = None,
        ends_after: float | None = None,
    ) -> list[StepOutput | Exception]:
        """``steps`` steps of each session, merged per session; a failure is its entry.

        ``launching`` is called once, when the call's first run is planned and about
        to start (not at all if no session has a step to take): what another thread
        does from then on overlaps the run, which holds no GIL, rather than this
        call's own Python.

        Once ``halt`` is set, the call returns after the step under way (at least one
        step is taken): each session has taken as many steps as the others, or fewer
        where it ended, and goes on from there in the next call as it would have.
        Past ``ends_after`` (a ``time.perf_counter()`` value), it also returns after a
        step in which a session finished or failed: its slot is wanted.

        Each step, the decode rows of one cohort that sit in adjacent rows run
        as one batch; every prompt chunk runs alone. A session that finishes or
        fails stops there; the others go on, with the tokens they would have
        had alone. A session whose step does not fit its bucket grows here, on
        this thread (the daemon grows sessions before, under its growth lock).

        While every session decodes, each run's rows take their steps as a
        :class:`DecodeSpan` (array operations whose count does not follow the
        rows), as many as fit their buckets and lengths; a span stops early at
        the step where one of its rows ends.
        """
        acc = [StepOutput() for _ in sessions]
        errors: list[Exception | None] = [None] * len(sessions)
        left = [steps] * len(sessions)
        live = list(range(len(sessions)))
        went = False  # a step was taken: a halt may end the call
        while live:
            if went and halt is not None and halt.is_set():
                break
            went = True
            fed: list[tuple[int, DecodeSession, list[int]]] = []
            for i in live:
                session = sessions[i]
                try:
                    failpoints.hit("engine.step")
                    tokens = session.feed(acc[i])
                except Exception as exc:  # noqa: BLE001 - the scheduler fails that item alone
                    errors[i] = exc
                    continue
                if tokens is not None:
                    fed.append((i, session, tokens))
            self._planned = planned = self._plan(fed, self._planned)
            if launching is not None and planned.runs:
                launching()
                launching = None
            for k, run in enumerate(planned.runs):
                if planned.reusable:
                    self._decode_span(planned, k, fed, acc, errors, left, halt)
                else:
                    self._run_once(run, fed, acc, errors)
                    for row in run:
                        left[fed[row.index][0]] -= 1
            going = [i for i in live if errors[i] is None and not acc[i].finished]
            if (
                ends_after is not None
                and len(going) < len(live)
                and time.perf_counter() >= ends_after
            ):
                break
            live = [i for i in going if left[i] > 0]
        return [a if e is None else e for a, e in zip(acc, errors, strict=True)]

    def _run_once(
        self,
        run: list[_Row],
        fed: Sequence[tuple[int, DecodeSession, list[int]]],
        acc: list[StepOutput],
        errors: list[Exception | None],
        failed: Exception | None = None,
    ) -> None:
        """One run of ``run``'s rows (split until only a failing row fails); each row's
        session takes what its logits give. ``failed``: the run has failed already
        with it (it is split at once)."""
        results: list[np.ndarray[Any, Any] | Exception]
        picks = None
        masks = _NO_MASKS
        try:
            if failed is not None:
                raise failed
            masks = _RunMasks.start(self, run, fed)
            logits = self.runner.run(run)
        except Exception as exc:  # noqa: BLE001 - split until only the failing row fails
            results = split_failed(run, self._run_rows, exc)
            masked: frozenset[int] = frozenset()
        else:
            masked = masks.apply(logits)
            results = list(logits)
            if any(r.picks_argmax for r in run):
                # One argmax for the run instead of one per row.
                picks = logits.argmax(axis=1).tolist()
        finally:
            masks.wait()  # the matchers are the sessions' again only after the fill
        for j, row in enumerate(run):
            i, session, tokens = fed[row.index]
            result = results[j]
            try:
                if isinstance(result, Exception):
                    raise self.translate_run_error(result, session, len(tokens))
                pick = None if picks is None else picks[j]
                session.took(len(tokens), result, acc[i], pick, masked=j in masked)
            except Exception as exc:  # noqa: BLE001 - that item fails alone
                errors[i] = exc

    def _decode_span(
        self,
        planned: _Planned,
        k: int,
        fed: Sequence[tuple[int, DecodeSession, list[int]]],
        acc: list[StepOutput],
        errors: list[Exception | None],
        left: list[int],
        halt: threading.Event | None = None,
    ) -> None:
        """Decode steps of one run's rows as a :class:`DecodeSpan`: as many as every row
        has room, length and steps left for, fewer when a row ends or ``halt`` is set
        (after one step at least). The host work per
        step is a fixed number of array operations, plus the rows that need their
        logits on the host (sampling, penalties, logprobs, stop strings). A run that
        fails at its first step goes the one-run way (split until the failing row
        fails alone); later, it ends the span, whose steps so far stand.

        The span is kept with the plan: while the next call decodes the same rows
        (the plan is reused) and nothing else ran them, it goes on from its own
        arrays, with no row read again."""
        run = planned.runs[k]
        index = [fed[row.index][0] for row in run]
        sessions = [fed[row.index][1] for row in run]
        steps = min(min(left[i] for i in index), min(s.ahead for s in sessions))
        if steps < 1:  # cannot be, by feed(); the one-run way is always right
            self._run_once(run, fed, acc, errors)
            for i in index:
                left[i] -= 1
            return
        host = [j for j, s in enumerate(sessions) if not s.on_device]
        span = planned.spans.get(k)
        if span is None or not span.current():
            try:
                span = planned.spans[k] = DecodeSpan(self.runner, run, host)
            except Exception as exc:  # noqa: BLE001 - the one-run way says which row cannot run
                planned.spans.pop(k, None)
                self._run_once(run, fed, acc, errors, exc)
                for i in index:
                    left[i] -= 1
                return
        gathered = planned.rows_of.get(k)
        if gathered is None or gathered.span is not span:
            gathered = planned.rows_of[k] = _SpanRows(span, sessions, host, self.structured.words)
        ends, matchers, constrained = gathered.ends, gathered.matchers, gathered.constrained
        together, bitmask = gathered.together, gathered.bitmask
        out = np.empty((steps, len(run)), dtype=np.int64)
        ended: np.ndarray[Any, Any] | None = None
        failed: Exception | None = None
        chosen = np.empty(len(host), dtype=np.int64)
        while span.steps < steps:
            if span.steps and halt is not None and halt.is_set():
                break
            failpoints.delay("engine.step")  # a slowed step slows each step of the span
            filling = None
            if bitmask is not None:
                filling = self._masks.start(matchers, bitmask)
            try:
                picks = span.step()
            except Exception as exc:  # noqa: BLE001 - see the docstring
                failed = exc
                break
            finally:
                mask_error = None if filling is None else filling.error()
            out[span.steps - 1] = picks
            stop = False
            if host:
                masked = bitmask is not None and mask_error is None
                if bitmask is not None and masked:
                    span.mask_host_rows(constrained, bitmask)
                host_logits = span.host_logits()
                if masked or not constrained:
                    drawn = together(host_logits)
                else:
                    drawn = gathered.unmasked()(host_logits)
                for h, (j, logits) in enumerate(zip(host, host_logits, strict=True)):
                    session = sessions[j]
                    try:
                        session.took(1, logits, acc[index[j]], masked=masked, drawn=drawn[h])
                    except Exception as exc:  # noqa: BLE001 - that item fails alone
                        errors[index[j]] = exc
                        stop = True
                        continue
                    stop = stop or session.finished
                    chosen[h] = session.pending
                span.choose(chosen)
            if ends is not None:
                hit = (picks[:, None] == ends).any(axis=1)
                if hit.any():
                    ended, stop = hit, True
            if stop:
                break
        taken = span.steps
        span.settle()
        if failed is not None and taken == 0:
            planned.spans.pop(k, None)
            self._run_once(run, fed, acc, errors, failed)
            for i in index:
                left[i] -= 1
            return
        columns = out[:taken].T.tolist()
        for j, session in enumerate(sessions):
            left[index[j]] -= taken
            if not session.on_device:
                continue
            end = ended is not None and bool(ended[j])
            tokens = columns[j][:-1] if end else columns[j]
            try:
                session.accept_run(tokens, end, acc[index[j]])
            except Exception as exc:  # noqa: BLE001 - that item fails alone
                errors[index[j]] = exc

    def _plan(
        self, fed: Sequence[tuple[int, DecodeSession, list[int]]], last: _Planned | None
    ) -> _Planned:
        """The step's rows and runs; the previous step's again (of this call or the last)
        while the same rows decode where they were (a run's steady state), with only
        their tokens new.

        Rows freed by sessions that left are filled by moving decode rows into
        them (across the cohorts of one bucket too), so the rows that run together
        stay adjacent; while every bucket's decode rows are one span already (the
        steady state) nothing is moved or even looked at.
        """
        places = [s.cache.placement() for _, s, _ in fed]
        # A prompt's last chunk may be one token too: decoding is past the prompt.
        decoding = all(len(tokens) == 1 and not s.prefilling for _, s, tokens in fed)
        if (
            decoding
            and last is not None
            and last.reusable
            and len(places) == len(last.places)
            and all(map(operator.is_, places, last.places))
        ):
            for row, (_, _, tokens) in zip(last.rows, fed, strict=True):
                row.tokens = tokens
            return last
        decode = [
            (k, s.cache)
            for k, (_, s, tokens) in enumerate(fed)
            if len(tokens) == 1 and isinstance(s.cache, RowKvCache)
        ]
        if len(decode) > 1 and not _one_span_per_bucket([places[k] for k, _ in decode]):
            self.pool.compact([cache for _, cache in decode])
            places = [s.cache.placement() for _, s, _ in fed]
        rows = [
            _Row(s.cache, tokens, s.session_id, p, k, s.picks_argmax)
            for k, ((_, s, tokens), p) in enumerate(zip(fed, places, strict=True))
        ]
        spans = plan(rows, self.options.max_batch, batch_prompts=not self.on_cuda)
        runs = [[rows[k] for k in run] for run in spans]
        # A plan with prompt chunks changes next step (they become decode rows).
        return _Planned(places, rows, runs, reusable=decoding)

    def _run_rows(self, rows: Sequence[RowInput]) -> list[np.ndarray[Any, Any]]:
        return list(self.runner.run(rows))

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
                # One call for all its steps (it returns when the session ends): a
                # call pays ~40 us of Python once, a step within it a fixed few lines.
                (out,) = self.step_many([session], _GENERATE_STEPS)
                if isinstance(out, Exception):
                    raise out
            return session.completion()
        finally:
            session.release()

    def session_kv_bytes(self) -> int:
        """KV bytes charged for sessions: the budget's, less the prefix cache's rows."""
        return self.budget.used - (0 if self.prefix is None else self.prefix.bytes)

    def memory(self) -> MemoryInfo | None:
        """Memory as growth errors report it: the KV budget if one is set, else the device's."""
        budget = self.budget.memory()
        if budget is not None:
            return budget
        try:
            return self.pool.storage.memory()
        except Exception:  # noqa: BLE001 - a status probe must not fail the caller
            return None

    # -- runs -------------------------------------------------------------------
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


def _ends_matrix(ends: Sequence[frozenset[int]]) -> np.ndarray[Any, Any] | None:
    """Each row's end ids as one ``[rows, most ends]`` array (-1 pads; no token is -1),
    or None when no row has any."""
    widest = max(map(len, ends), default=0)
    if widest == 0:
        return None
    out = np.full((len(ends), widest), -1, dtype=np.int64)
    for j, row in enumerate(ends):
        out[j, : len(row)] = sorted(row)
    return out


def _one_span_per_bucket(places: Sequence[Placement]) -> bool:
    """Whether the rows of each bucket capacity are adjacent rows of one group (one run
    binds them all); rows of one bucket spread over two cohorts can be moved together."""
    spans: dict[int, tuple[int, int, int, int]] = {}
    for p in places:
        group, lo, hi, n = spans.get(p.capacity, (p.group, p.row, p.row, 0))
        if group != p.group:
            return False
        spans[p.capacity] = (group, min(lo, p.row), max(hi, p.row), n + 1)
    return all(hi - lo + 1 == n for _, lo, hi, n in spans.values())


class _RunMasks:
    """The masks of a one-run step's constrained rows that take a token (a prompt's last
    chunk, a decode step off the span), filled in one call on llguidance's threads while
    the run goes on, then applied to the run's logits in one operation: row by row after
    the run, each row's fill would wait for the run and then for the rows before it."""

    def __init__(self, rows: Sequence[int] = (), filling: Filling | None = None) -> None:
        self.rows = rows
        self.filling = filling

    @classmethod
    def start(
        cls,
        engine: Engine,
        run: Sequence[_Row],
        fed: Sequence[tuple[int, DecodeSession, list[int]]],
    ) -> _RunMasks:
        rows: list[int] = []
        matchers: list[Matcher | None] = []
        for j, row in enumerate(run):
            _, session, tokens = fed[row.index]
            if session.grammar is not None and session.takes_token(len(tokens)):
                rows.append(j)
                matchers.append(session.grammar)
        if not rows:
            return _NO_MASKS
        bitmask = allocate_bitmask(len(rows), engine.structured.words)
        return cls(rows, engine._masks.start(matchers, bitmask))

    def apply(self, logits: np.ndarray[Any, Any]) -> frozenset[int]:
        """Mask ``logits`` (the run's, ``[rows, vocab]``, in place): the rows masked,
        none where the fill failed (each row then masks its own, so a matcher in error
        fails its item alone)."""
        if self.filling is None or self.filling.error() is not None:
            return frozenset()
        apply_bitmask(logits, self.filling.bitmask, np.asarray(self.rows, dtype=np.int64))
        return frozenset(self.rows)

    def wait(self) -> None:
        if self.filling is not None:
            self.filling.error()


_NO_MASKS = _RunMasks()


class _SpanRows:
    """What every step of ``span`` needs of its rows' sessions, gathered once: a span
    keeps its sessions (it is reused only while the plan is, its rows unmoved), and
    none of this changes during a session's life. Gathered at every call, a caller
    decoding one step a call had a wave's draws planned and its bitmask allocated
    again at every step."""

    def __init__(
        self, span: DecodeSpan, sessions: Sequence[DecodeSession], host: Sequence[int], words: int
    ) -> None:
        self.span = span
        self.ends = _ends_matrix([s.end_ids if s.on_device else frozenset() for s in sessions])
        # Host rows with a grammar: their masks are filled on llguidance's threads (no
        # GIL) while the run goes on, and applied to their logits in one operation.
        grammars = [sessions[j].grammar for j in host]
        self.constrained = [h for h, g in enumerate(grammars) if g is not None]
        # Row k of the bitmask is the mask of host row constrained[k].
        self.matchers: list[Matcher | None] = [grammars[h] for h in self.constrained]
        samplers = [sessions[j].sampler for j in host]
        # The host rows whose tokens are drawn together: a constrained row only from its
        # masked logits (when the fill failed it draws alone, masking its own row), and
        # only a sampler of this module's (a test's wrapper sees each of its rows' draws).
        self.together = _Together(
            samplers, [h for h, s in enumerate(samplers) if type(s) is Sampler]
        )
        self._unmasked: _Together | None = None
        self.bitmask = allocate_bitmask(len(self.constrained), words) if self.constrained else None

    def unmasked(self) -> _Together:
        """The rows drawn together at a step whose masks failed: the unconstrained ones."""
        if self._unmasked is None:
            self._unmasked = self.together.without(self.constrained)
        return self._unmasked


class _Together:
    """The host rows ``rows`` (indices into a span's host rows and their ``samplers``)
    whose tokens are drawn together (one :class:`Draws` a step); every other row
    draws alone when its session takes its logits."""

    def __init__(self, samplers: Sequence[Any], rows: Sequence[int]) -> None:
        self.samplers = samplers
        self.rows = list(rows)
        self._all = len(self.rows) == len(samplers)
        self._draws = Draws([samplers[h] for h in self.rows]) if self.rows else None

    def without(self, rows: Sequence[int]) -> _Together:
        drop = set(rows)
        return _Together(self.samplers, [h for h in self.rows if h not in drop])

    def __call__(self, logits: np.ndarray[Any, Any]) -> list[int | None]:
        """Each host row's token (None: it draws alone), from the host rows' ``logits``."""
        drawn: list[int | None] = [None] * len(self.samplers)
        if self._draws is None:
            return drawn
        try:
            tokens = self._draws(logits if self._all else logits[self.rows]).tolist()
        except Exception:  # noqa: BLE001 - no generator has moved: each row draws alone,
            # and so a row whose draw fails fails alone, as it would have.
            return drawn
        for h, token in zip(self.rows, tokens, strict=True):
            drawn[h] = token
        return drawn
