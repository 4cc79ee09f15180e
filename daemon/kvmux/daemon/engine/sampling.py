"""Sampling parameters and the per-item sampler.

Greedy, temperature, top-k, top-p, min-p and a seed, plus vLLM's penalties,
``min_tokens`` and raw logprobs, in vLLM's order: logprobs are taken from the
model's raw logits; then EOS and stop token ids are masked while fewer than
``min_new_tokens`` tokens exist; then the penalties apply (so greedy decoding
with penalties is the argmax of the penalized logits); then temperature, min-p,
top-k and top-p shape the distribution a token is drawn from. Parameters at
their neutral value add no work to a step.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from kvmux.client.protocol import DEFAULT_MAX_NEW_TOKENS

from ..model import SearchDefaults
from .errors import BadPrompt
from .structured import StructuredSpec


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """What an item asks for; ``None`` means "the model's declared default"."""

    max_new_tokens: int | None = None
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    min_new_tokens: int = 0
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    logprobs: int | None = None
    skip_special_tokens: bool = True
    #: The grammar its output must match (structured outputs); None: free text.
    structured: StructuredSpec | None = None

    def validate(self) -> None:
        problems = []
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            problems.append(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature is not None and not 0.0 <= self.temperature <= 100.0:
            problems.append(f"temperature must be in [0, 100], got {self.temperature}")
        if self.top_k is not None and self.top_k < 0:
            problems.append(f"top_k must be >= 0 (0: off), got {self.top_k}")
        if self.top_p is not None and not 0.0 < self.top_p <= 1.0:
            problems.append(f"top_p must be in (0, 1], got {self.top_p}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            problems.append(f"seed must be in [0, 2**63), got {self.seed}")
        if any(not s for s in self.stop):
            problems.append("stop strings must not be empty")
        if self.min_new_tokens < 0:
            problems.append(f"min_new_tokens must be >= 0, got {self.min_new_tokens}")
        if self.max_new_tokens is not None and self.min_new_tokens > self.max_new_tokens:
            problems.append(
                f"min_new_tokens ({self.min_new_tokens}) must be <= max_new_tokens "
                f"({self.max_new_tokens})"
            )
        if self.min_p is not None and not 0.0 <= self.min_p <= 1.0:
            problems.append(f"min_p must be in [0, 1], got {self.min_p}")
        if self.repetition_penalty is not None and not 0.0 < self.repetition_penalty <= 100.0:
            problems.append(
                f"repetition_penalty must be in (0, 100] (1: off), got {self.repetition_penalty}"
            )
        for name, value in (
            ("presence_penalty", self.presence_penalty),
            ("frequency_penalty", self.frequency_penalty),
        ):
            if value is not None and not -2.0 <= value <= 2.0:
                problems.append(f"{name} must be in [-2, 2] (0: off), got {value}")
        if any(t < 0 for t in self.stop_token_ids):
            problems.append("stop_token_ids must be >= 0")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            problems.append(f"logprobs must be in [0, 20], got {self.logprobs}")
        if problems:
            raise BadPrompt("; ".join(problems), {"problems": problems})


@dataclass(frozen=True, slots=True)
class ResolvedSampling:
    """Item parameters with the model's defaults filled in; what a session actually uses."""

    greedy: bool
    temperature: float
    top_k: int
    top_p: float
    seed: int
    max_new_tokens: int
    stop: tuple[str, ...]
    ignore_eos: bool
    min_new_tokens: int = 0
    min_p: float = 0.0  # 0: off
    repetition_penalty: float = 1.0  # 1: off
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop_token_ids: frozenset[int] = frozenset()
    logprobs: int | None = None  # None: none; k: the chosen token's and the top k
    skip_special_tokens: bool = True
    structured: StructuredSpec | None = None

    @property
    def penalized(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )


MIN_TEMPERATURE = 1e-5
"""Temperatures below this decode greedily (see :func:`resolve_sampling`)."""


def resolve_sampling(params: SamplingParams, search: SearchDefaults) -> ResolvedSampling:
    """Model-declared ``search`` values are canonical; kvmux constants only fill gaps.

    An item's explicit ``temperature`` > 0 asks for sampling even when the model
    declares ``do_sample: false``; a temperature below :data:`MIN_TEMPERATURE`
    (0 included) is greedy: dividing logits by it would overflow to inf and
    give NaN probabilities, and argmax is what such a temperature means.
    """
    params.validate()
    if params.temperature is not None:
        temperature = params.temperature
        greedy = temperature < MIN_TEMPERATURE
    else:
        temperature = search.temperature
        greedy = not search.do_sample or temperature < MIN_TEMPERATURE
    top_k = search.top_k if params.top_k is None else params.top_k
    top_p = search.top_p if params.top_p is None else params.top_p
    max_new = params.max_new_tokens or DEFAULT_MAX_NEW_TOKENS
    if params.min_new_tokens > max_new:
        raise BadPrompt(
            f"min_new_tokens ({params.min_new_tokens}) must be <= max_new_tokens ({max_new})",
            {"min_new_tokens": params.min_new_tokens, "max_new_tokens": max_new},
        )
    repetition = params.repetition_penalty
    if repetition is None:
        repetition = search.repetition_penalty if search.repetition_penalty > 0.0 else 1.0
    seed = params.seed
    if seed is None:
        seed = search.random_seed if search.random_seed >= 0 else secrets.randbits(63)
    return ResolvedSampling(
        greedy=greedy,
        temperature=temperature if not greedy else 0.0,
        top_k=max(top_k, 0),
        top_p=top_p if 0.0 < top_p <= 1.0 else 1.0,
        seed=seed,
        max_new_tokens=max_new,
        stop=params.stop,
        ignore_eos=params.ignore_eos,
        min_new_tokens=params.min_new_tokens,
        min_p=params.min_p or 0.0,
        repetition_penalty=repetition,
        presence_penalty=params.presence_penalty or 0.0,
        frequency_penalty=params.frequency_penalty or 0.0,
        stop_token_ids=frozenset(params.stop_token_ids),
        logprobs=params.logprobs,
        skip_special_tokens=params.skip_special_tokens,
        structured=params.structured,
    )


@dataclass(frozen=True, slots=True)
class StepLogprobs:
    """The chosen token of one step with its raw log-probability, and the ``k`` most
    likely tokens (id, log-probability), most likely first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]


def step_logprobs(logits: npt.NDArray[np.floating], token: int, k: int) -> StepLogprobs:
    """Log-softmax of the model's raw logits (vLLM's default "raw logprobs")."""
    x = logits.astype(np.float64)
    x = x - np.max(x)
    lp = x - np.log(np.sum(np.exp(x)))
    top: tuple[tuple[int, float], ...] = ()
    if k > 0:
        k = min(k, lp.shape[0])
        part = np.argpartition(-lp, k - 1)[:k]
        # Most likely first; equal ones by id, so the order is reproducible.
        order = part[np.lexsort((part, -lp[part]))]
        top = tuple((int(i), float(lp[i])) for i in order)
    return StepLogprobs(int(token), float(lp[token]), top)


class Sampler:
    """Draws tokens for one item; its own seeded generator makes it reproducible.

    It sees every token it draws, so it keeps the counts the penalties need
    (only when a penalty is set): ``_seen`` marks prompt and output tokens
    (repetition), ``_counts`` counts output tokens (presence, frequency).
    """

    def __init__(
        self,
        cfg: ResolvedSampling,
        prompt_ids: Sequence[int] = (),
        eos_token_ids: Sequence[int] = (),
    ) -> None:
        self.cfg = cfg
        # Made at the first draw: a greedy item never draws, and a generator costs
        # more to seed than a whole decode step of a small model.
        self._rng: np.random.Generator | None = None
        self._drawn = 0
        self._prompt_ids = prompt_ids
        self._counts: npt.NDArray[np.int64] | None = None
        self._seen: npt.NDArray[np.bool_] | None = None
        #: The ids that end the item: its stop token ids, and EOS unless it ignores EOS.
        self.ends = cfg.stop_token_ids | (
            frozenset() if cfg.ignore_eos else frozenset(eos_token_ids)
        )
        # Masked while fewer than min_new_tokens tokens exist (None: no minimum).
        self._held_off = np.array(sorted(self.ends), dtype=np.int64) if cfg.min_new_tokens else None
        self._penalized = cfg.penalized
        #: Nothing to track: a draw is exactly what it was before these parameters existed.
        self.plain = not self._penalized and self._held_off is None

    def __call__(self, logits: npt.NDArray[np.floating]) -> int:
        if self.plain:
            return self._draw(logits)
        return self.record(self._draw(self._shaped(logits)))

    def record(self, token: int) -> int:
        """Count ``token`` as drawn (the penalties and min_tokens see it from the next
        draw on); :func:`draw_many` leaves this to whoever takes its tokens."""
        if self.plain:
            return token
        self._drawn += 1
        if self._penalized:
            assert self._counts is not None and self._seen is not None
            self._counts[token] += 1
            self._seen[token] = True
        return token

    def _shaped(self, logits: npt.NDArray[np.floating]) -> npt.NDArray[np.floating]:
        """The logits after min_tokens and the penalties (the raw ones when neither is set)."""
        x = logits
        if self._held_off is not None and self._drawn < self.cfg.min_new_tokens:
            x = x.astype(np.float64)
            x[self._held_off[self._held_off < x.shape[0]]] = -np.inf
        if self._penalized:
            x = self._penalize(x)
        return x

    def _penalize(self, logits: npt.NDArray[np.floating]) -> npt.NDArray[np.float64]:
        """vLLM's ``apply_penalties``: repetition over prompt and output tokens (positive
        logits divided, negative multiplied), then frequency and presence over output."""
        cfg = self.cfg
        n = logits.shape[0]
        if self._counts is None or self._seen is None:
            self._counts = np.zeros(n, dtype=np.int64)
            self._seen = np.zeros(n, dtype=np.bool_)
            ids = np.asarray(self._prompt_ids, dtype=np.int64)
            self._seen[ids[(ids >= 0) & (ids < n)]] = True
        x = logits.astype(np.float64)
        if cfg.repetition_penalty != 1.0:
            r = np.where(self._seen, cfg.repetition_penalty, 1.0)
            x = np.where(x > 0, x / r, x * r)
        if cfg.frequency_penalty != 0.0:
            x -= cfg.frequency_penalty * self._counts
        if cfg.presence_penalty != 0.0:
            x -= cfg.presence_penalty * (self._counts > 0)
        return x

    def _random(self) -> float:
        if self._rng is None:
            self._rng = np.random.default_rng(self.cfg.seed)
        return float(self._rng.random())

    def _draw(self, logits: npt.NDArray[np.floating]) -> int:
        if self.cfg.greedy:
            return int(logits.argmax())
        cdf = self._cdf(logits)
        return int(
            min(np.searchsorted(cdf, self._random() * cdf[-1], side="right"), cdf.shape[0] - 1)
        )

    def _cdf(self, logits: npt.NDArray[np.floating]) -> npt.NDArray[np.float64]:
        """The cumulative distribution a draw from ``logits`` searches: temperature, top-k,
        min-p and top-p applied (not normalized: the draw scales by its last value)."""
        x = logits.astype(np.float64) / self.cfg.temperature
        k = self.cfg.top_k
        if 0 < k < x.shape[0]:
            kth = np.partition(x, -k)[-k]
            x = np.where(x < kth, -np.inf, x)
        x = x - np.max(x)
        probs = np.exp(x)
        probs /= probs.sum()
        if self.cfg.min_p > 0.0:
            # Relative to the top probability, which top-k never removes: the
            # same tokens survive as with vLLM's min-p before its top-k.
            probs = np.where(probs < self.cfg.min_p * probs.max(), 0.0, probs)
            probs /= probs.sum()
        if self.cfg.top_p < 1.0:
            order = np.argsort(-probs, kind="stable")
            cum = np.cumsum(probs[order])
            keep = int(np.searchsorted(cum, self.cfg.top_p)) + 1
            mask = np.zeros_like(probs, dtype=bool)
            mask[order[:keep]] = True
            probs = np.where(mask, probs, 0.0)
            probs /= probs.sum()
        return np.cumsum(probs)


CHUNK_VALUES = 1 << 16
"""Logits a block's arithmetic works on at once (512 KiB of float64, a core's L2): a
wide vocabulary is drawn some rows at a time, or every pass over the block would
leave the cache (slower than row by row, with ``small``'s 4,096 ids)."""


class Draws:
    """The tokens of a fixed list of rows (a span's host rows), each by its own sampler,
    drawn from one ``[rows, vocab]`` block of logits in a fixed number of array
    operations per step (plus one per row that penalties or min_tokens shape): exactly
    the token ``samplers[i](logits[i])`` gives, whatever the other rows are. The rows'
    parameters are gathered once, here, not at every step.

    The tokens are not recorded: :meth:`Sampler.record` each one where it is accepted.
    Each sampling row's generator gives one number per draw, as alone, and only after
    all the arithmetic: a caller that falls back to drawing row by row after an error
    draws the same tokens.
    """

    def __init__(self, samplers: Sequence[Sampler]) -> None:
        self.samplers = list(samplers)
        self._shaping = [(i, s) for i, s in enumerate(self.samplers) if not s.plain]
        greedy = [i for i, s in enumerate(self.samplers) if s.cfg.greedy]
        sampled = [i for i, s in enumerate(self.samplers) if not s.cfg.greedy]
        self._greedy = np.asarray(greedy, dtype=np.int64)
        self._sampled = np.asarray(sampled, dtype=np.int64)
        self._drawers = [self.samplers[i] for i in sampled]
        self._chunks: list[tuple[int, int, SampledRows]] = []
        self._vocab = -1

    def __call__(self, logits: npt.NDArray[np.floating]) -> npt.NDArray[np.int64]:
        n, vocab = logits.shape
        if n != len(self.samplers):
            raise ValueError(f"{n} rows of logits for {len(self.samplers)} samplers")
        x = np.array(logits, dtype=np.float64, order="C")
        for i, sampler in self._shaping:
            x[i] = sampler._shaped(logits[i])
        tokens = np.empty(n, dtype=np.int64)
        if len(self._greedy):
            tokens[self._greedy] = x[self._greedy].argmax(axis=1)
        drawers = self._drawers
        if not drawers:
            return tokens
        if vocab != self._vocab:
            step = max(1, CHUNK_VALUES // vocab)
            cfgs = [s.cfg for s in drawers]
            self._chunks = [
                (a, min(a + step, len(cfgs)), SampledRows(cfgs[a : a + step], vocab))
                for a in range(0, len(cfgs), step)
            ]
            self._vocab = vocab
        xs = x if len(drawers) == n else x[self._sampled]
        cdf = np.empty_like(xs)
        for a, b, rows in self._chunks:
            rows.cdf(xs[a:b], out=cdf[a:b])
        u = np.fromiter((s._random() for s in drawers), np.float64, len(drawers))
        # searchsorted's place in a sorted row is the count of what lies at or below it;
        # a NaN row (a NaN or +inf logit, or none allowed) is NaN throughout, which
        # searchsorted puts past the end.
        picked = np.minimum((cdf <= (u * cdf[:, -1])[:, None]).sum(axis=1), vocab - 1)
        picked[np.isnan(cdf[:, -1])] = vocab - 1
        tokens[self._sampled] = picked
        return tokens


def draw_many(
    samplers: Sequence[Sampler], logits: npt.NDArray[np.floating]
) -> npt.NDArray[np.int64]:
    """Row ``i``'s token drawn from ``logits[i]`` by ``samplers[i]`` (see :class:`Draws`)."""
    return Draws(samplers)(logits)


class SampledRows:
    """The parameters of some sampling rows as columns, to turn their logits into the
    cumulative distributions their draws search, all rows at once: row ``i`` bit for
    bit what ``Sampler(cfgs[i])._cdf`` gives for it alone.

    Bit for bit because each operation is as alone: elementwise ones are, a row's max,
    partition value and stable order do not depend on rounding, cumulative sums along
    a row add in the row's order, and NumPy sums each row of a C-contiguous block as it
    sums that row alone (pairwise, by the same blocks; tested). Top-k, min-p and top-p
    work on the rows that take them (all of them at once when all do)."""

    def __init__(self, cfgs: Sequence[ResolvedSampling], vocab: int) -> None:
        n = len(cfgs)
        self.n = n
        temperature = np.array([c.temperature for c in cfgs], dtype=np.float64)
        # One temperature for all (the common case) divides by a scalar: the same
        # quotients, by a faster loop than a broadcast column.
        same = bool((temperature == temperature[0]).all())
        self._temperature = float(temperature[0]) if same else temperature[:, None]
        ks = np.array([c.top_k if 0 < c.top_k < vocab else 0 for c in cfgs], dtype=np.int64)
        self._top_k = [(k, ks == k) for k in sorted(set(ks.tolist()) - {0})]
        min_p = np.array([c.min_p for c in cfgs], dtype=np.float64)
        self._min_p = _rows(min_p > 0.0), min_p[min_p > 0.0][:, None]
        top_p = np.array([c.top_p for c in cfgs], dtype=np.float64)
        self._top_p = _rows(top_p < 1.0), top_p[top_p < 1.0][:, None]
        self._ranks = np.arange(vocab)[None, :]

    def cdf(
        self, logits: npt.NDArray[np.float64], out: npt.NDArray[np.float64] | None = None
    ) -> npt.NDArray[np.float64]:
        """From these rows' float64 ``logits`` (left as they are)."""
        x = np.ascontiguousarray(logits / self._temperature)
        if self._top_k:
            # A row with at most k ids above -inf (a grammar's masked row, mostly) keeps
            # them all: its k-th largest is -inf, below which nothing lies. Selecting in
            # a row of mostly equal values is what costs; those rows skip it.
            above = (x > -np.inf).sum(axis=1)
        for k, takes in self._top_k:
            cut = takes & (above > k)
            if cut.all():
                kth = np.partition(x, -k, axis=1)[:, -k, None]
                x = np.where(x < kth, -np.inf, x)
            elif cut.any():
                which = np.flatnonzero(cut)
                sub = x[which]
                kth = np.partition(sub, -k, axis=1)[:, -k, None]
                x[which] = np.where(sub < kth, -np.inf, sub)
        x -= x.max(axis=1, keepdims=True)
        flat = x.reshape(-1)  # a view: x is C-contiguous
        live = np.flatnonzero(flat != -np.inf)
        if 2 * len(live) < flat.size:
            # Top-k and grammars leave most ids at -inf, whose exp (0) takes libm a slow
            # path: only the others are computed, each as it would be in place.
            values = np.exp(flat[live])
            flat.fill(0.0)
            flat[live] = values
            probs = x
        else:
            probs = np.exp(x, out=x)
        probs /= probs.sum(axis=1, keepdims=True)
        rows, min_p = self._min_p
        if len(min_p):
            sub = probs if rows is None else probs[rows]
            sub = np.where(sub < min_p * sub.max(axis=1, keepdims=True), 0.0, sub)
            sub /= sub.sum(axis=1, keepdims=True)
            if rows is None:
                probs = sub
            else:
                probs[rows] = sub
        rows, top_p = self._top_p
        if len(top_p):
            sub = probs if rows is None else probs[rows]
            order = np.argsort(-sub, axis=1, kind="stable")
            cum = np.cumsum(np.take_along_axis(sub, order, axis=1), axis=1)
            keep = (cum < top_p).sum(axis=1, keepdims=True) + 1  # searchsorted
            mask = np.empty(sub.shape, dtype=np.bool_)
            np.put_along_axis(mask, order, self._ranks < keep, axis=1)
            sub = np.where(mask, sub, 0.0)
            sub /= sub.sum(axis=1, keepdims=True)
            if rows is None:
                probs = sub
            else:
                probs[rows] = sub
        return np.cumsum(probs, axis=1, out=out)


def _rows(takes: npt.NDArray[np.bool_]) -> npt.NDArray[np.int64] | None:
    """The rows that take a step; None when all do (it works on the block in place)."""
    return None if takes.all() else np.flatnonzero(takes)


def cdf_many(
    cfgs: Sequence[ResolvedSampling], x: npt.NDArray[np.float64]
) -> npt.NDArray[np.float64]:
    """Row ``i`` of the float64 logits ``x`` to the cumulative distribution
    ``Sampler(cfgs[i])._cdf(x[i])`` gives, bit for bit (see :class:`SampledRows`)."""
    return SampledRows(cfgs, x.shape[1]).cdf(x)
