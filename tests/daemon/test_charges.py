"""Nothing stays charged, whatever failed (issue 28).

A job of items that grow (first bucket 4), share a prompt prefix (so they fork from the
prefix cache) and mix greedy and sampled rows runs through a daemon while one seam at a
time fails with a plain ``RuntimeError``, the kind no code path planned for (not the
fault-injection type): every growth step, a fork, a row's release, a run, a step, token
acceptance. Under ``fail`` and under ``wait``. Once every item has ended, the KV
charged for sessions is zero, every cohort is gone but the prefix cache's kept rows
(charged, and reported apart), and the same job then runs clean on the same daemon.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvmux.client import Item
from kvmux.daemon.engine import Engine
from kvmux.kv import failpoints

from .conftest import connected, make_config, running
from .helpers import decode_alone, token_prompt

pytestmark = pytest.mark.anyio

SEAMS = [
    "kv.allocate",
    "kv.copy_prefix",
    "kv.build_mask",
    "kv.invalidate_capture",
    "kv.fork",
    "kv.clear_row",
    "engine.run",
    "engine.step",
    "engine.accept",
]


def _items() -> list[Item]:
    shared = token_prompt(40, seed=77)
    items = []
    for i in range(10):
        items.append(
            Item(
                custom_id=f"i{i}",
                prompt_tokens=shared + token_prompt(3 + i, seed=i),
                max_new_tokens=20 + 5 * i,
                temperature=0.0 if i % 3 else 0.8,
                seed=i,
                ignore_eos=True,
            )
        )
    return items


@pytest.mark.parametrize("policy", ["fail", "wait"])
@pytest.mark.parametrize("seam", SEAMS)
async def test_no_kv_stays_charged_after_a_failure_at_any_seam(
    tiny_model: Path, sock_dir: Path, reference: Engine, seam: str, policy: str
) -> None:
    cfg = make_config(
        tiny_model,
        sock_dir,
        kv={"min_bucket": 4, "prefix_block": 8},
        scheduler={"on_growth_failure": policy, "growth_retries": 2, "max_active_sessions": 6},
        # An internal error's traceback is rendered with its locals on a test's console,
        # which can hold the loop past the tests' 1 s client timeout: not what is tested.
        server={"client_timeout": 30.0, "heartbeat_interval": 1.0},
    )
    items = _items()
    async with running(cfg) as daemon, connected(daemon) as client:
        engine = daemon.engine
        assert engine is not None and engine.prefix is not None
        failpoints.arm(seam, 3, error=RuntimeError)
        try:
            results = await (await client.submit(items)).results()
        finally:
            failpoints.disarm()
        assert sorted(r.custom_id for r in results) == sorted(i.custom_id for i in items)
        status = await client.status()
        assert status.kv_bytes_in_use == 0, (seam, status.kv_bytes_in_use)
        assert engine.session_kv_bytes() == 0
        assert engine.budget.used == engine.prefix.bytes  # kept prefixes only, reported apart
        assert engine.pool.cohorts() == []
        # The daemon is whole: the same job runs clean, each token as decoded alone.
        again = await (await client.submit(items)).results()
        assert all(r.status == "ok" for r in again), [r.error for r in again]
        by_id = {r.custom_id: r.token_ids for r in again}
        for item in items:
            if item.temperature == 0.0:
                assert by_id[item.custom_id] == decode_alone(reference, item)
        assert (await client.status()).kv_bytes_in_use == 0
