"""Drive a DecodeSession step by step, recording the logits every sample saw."""

from __future__ import annotations

from typing import Any

import numpy as np

from kvmux.daemon.engine import DecodeSession, Engine, SamplingParams


class RecordingSampler:
    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.logits: list[np.ndarray[Any, Any]] = []

    def __call__(self, logits: np.ndarray[Any, Any]) -> int:
        self.logits.append(logits.copy())
        return int(self.inner(logits))


def record(session: DecodeSession) -> RecordingSampler:
    """Route every token of ``session`` through a recording sampler (and so not through
    the engine's argmax for a whole run, which calls no sampler)."""
    rec = RecordingSampler(session.sampler)
    session.sampler = rec  # type: ignore[assignment]
    session.picks_argmax = False
    return rec


def decode(
    engine: Engine, session: DecodeSession, *, retry_failures: bool = False
) -> tuple[list[int], list[np.ndarray[Any, Any]], list[int]]:
    """Run to the end; return tokens, per-step logits and the capacities seen."""
    rec = record(session)
    capacities: list[int] = []
    try:
        while not session.finished:
            engine.step(session)
            if not capacities or capacities[-1] != session.cache.capacity:
                capacities.append(session.cache.capacity)
        # Every kept token was picked from recorded logits (none by a run's argmax).
        assert len(rec.logits) >= len(session.generated)
        return list(session.generated), rec.logits, capacities
    finally:
        session.release()


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)


def prompt_ids(engine: Engine, n: int, seed: int = 0) -> list[int]:
    rng = np.random.default_rng(seed)
    return [int(t) for t in rng.integers(3, engine.spec.vocab_size, size=n)]
