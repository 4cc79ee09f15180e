"""What a test compares a daemon's results with: the same item decoded alone in-process."""

from __future__ import annotations

import numpy as np

from kvmux.client import Item, ItemResult
from kvmux.daemon.engine import Engine, SamplingParams


def decode_alone(reference: Engine, item: Item) -> list[int]:
    """The tokens ``item`` gets from the engine in this process, with no daemon around it."""
    prompt: str | list[int] = (
        item.prompt if item.prompt is not None else list(item.prompt_tokens or [])
    )
    params = SamplingParams(
        max_new_tokens=item.max_new_tokens,
        temperature=item.temperature,
        top_k=item.top_k,
        top_p=item.top_p,
        seed=item.seed,
        stop=tuple(item.stop),
        ignore_eos=item.ignore_eos,
    )
    return reference.generate(prompt, params, max_context=item.max_context).token_ids


def token_prompt(n: int, seed: int, vocab: int = 259) -> list[int]:
    rng = np.random.default_rng(seed)
    return [int(t) for t in rng.integers(3, vocab, size=n)]


def ok_tokens(results: list[ItemResult]) -> dict[str, list[int]]:
    """custom_id -> token ids, asserting each item succeeded."""
    out = {}
    for r in results:
        assert r.status == "ok", (r.custom_id, r.error)
        out[r.custom_id] = r.token_ids
    return out
