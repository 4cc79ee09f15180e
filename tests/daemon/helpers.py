"""What a test compares a daemon's results with: the same item decoded alone in-process."""

from __future__ import annotations

import numpy as np

from kvmux.client import Item, ItemResult
from kvmux.daemon.engine import Engine
from kvmux.daemon.scheduler import item_params, item_prompt


def decode_alone(reference: Engine, item: Item) -> list[int]:
    """The tokens ``item`` gets from the engine in this process, with no daemon around it."""
    return reference.generate(
        item_prompt(reference, item), item_params(item), max_context=item.max_context
    ).token_ids


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
