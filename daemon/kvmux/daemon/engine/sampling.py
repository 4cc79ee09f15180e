"""Sampling parameters and the per-item sampler: greedy, temperature, top-k, top-p, seed."""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from ..model import SearchDefaults
from .errors import BadPrompt

DEFAULT_MAX_NEW_TOKENS = 128  # kvmux's fallback when neither item nor model says


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
    )


class Sampler:
    """Draws tokens for one item; its own seeded generator makes it reproducible."""

    def __init__(self, cfg: ResolvedSampling) -> None:
        self.cfg = cfg
        self._rng = np.random.default_rng(cfg.seed)

    def __call__(self, logits: npt.NDArray[np.floating]) -> int:
        if self.cfg.greedy:
            return int(np.argmax(logits))
        x = logits.astype(np.float64) / self.cfg.temperature
        k = self.cfg.top_k
        if 0 < k < x.shape[0]:
            kth = np.partition(x, -k)[-k]
            x = np.where(x < kth, -np.inf, x)
        x = x - np.max(x)
        probs = np.exp(x)
        probs /= probs.sum()
        if self.cfg.top_p < 1.0:
            order = np.argsort(-probs, kind="stable")
            cum = np.cumsum(probs[order])
            keep = int(np.searchsorted(cum, self.cfg.top_p)) + 1
            mask = np.zeros_like(probs, dtype=bool)
            mask[order[:keep]] = True
            probs = np.where(mask, probs, 0.0)
            probs /= probs.sum()
        cdf = np.cumsum(probs)
        return int(
            min(
                np.searchsorted(cdf, self._rng.random() * cdf[-1], side="right"), probs.shape[0] - 1
            )
        )
