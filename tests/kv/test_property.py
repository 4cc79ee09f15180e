"""Random appends, growths and injected failures never change a valid row or leak budget."""

from __future__ import annotations

import numpy as np
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvmux.kv import (
    CapacityExceeded,
    GrowthFailed,
    HostKvCache,
    KvSpec,
    MemoryBudget,
    ensure_capacity,
    failpoints,
    resolve_hard_max,
)

SPEC = KvSpec(num_layers=2, kv_heads=1, head_dim=2, dtype="float16")
STEPS = ["kv.allocate", "kv.copy_prefix", "kv.build_mask", "kv.invalidate_capture"]


class KvMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        failpoints.disarm()
        self.budget = MemoryBudget(600 * SPEC.bytes_per_token)
        self.cache = HostKvCache(
            SPEC, resolve_hard_max(300, None), min_bucket=2, budget=self.budget
        )
        self.ref = np.empty((2 * SPEC.num_layers, 1, 0, 2), dtype=np.uint16)
        self.counter = 0

    @rule(n=st.integers(min_value=1, max_value=40), fail=st.sampled_from([None, *STEPS]))
    def append(self, n: int, fail: str | None) -> None:
        c = self.cache
        before = (c.capacity, c.valid_len, [id(k) for k in c.keys])
        if fail is not None:
            failpoints.arm(fail, 1)
        try:
            ensure_capacity(c, c.valid_len + n)
        except GrowthFailed:
            assert (c.capacity, c.valid_len, [id(k) for k in c.keys]) == before
            return
        except CapacityExceeded:
            assert c.valid_len + n > 300
            assert (c.capacity, c.valid_len, [id(k) for k in c.keys]) == before
            return
        finally:
            failpoints.disarm()
        count = n * 2 * SPEC.num_layers * 2
        flat = ((np.arange(count) + self.counter) % 65536).astype(np.uint16)
        rows = flat.reshape(2 * SPEC.num_layers, 1, n, 2)
        self.counter = (self.counter + 7919) % 65536
        pos = c.valid_len
        for i, buf in enumerate(c.keys + c.values):
            buf.view(np.uint16)[0, :, pos : pos + n, :] = rows[i]
        c.advance(n)
        self.ref = np.concatenate([self.ref, rows], axis=2)

    @rule(keep=st.integers(min_value=0, max_value=300))
    def truncate(self, keep: int) -> None:
        keep = min(keep, self.cache.valid_len)
        self.cache.truncate(keep)
        self.ref = self.ref[:, :, :keep, :]

    @rule()
    def release_and_restart(self) -> None:
        self.cache.release()
        assert self.budget.used == 0
        self.ref = self.ref[:, :, :0, :]

    @invariant()
    def rows_intact_and_budget_exact(self) -> None:
        c = self.cache
        n = c.valid_len
        assert n == self.ref.shape[2] and n <= c.capacity
        for i, buf in enumerate(c.keys + c.values):
            assert np.array_equal(buf.view(np.uint16)[0, :, :n, :], self.ref[i])
        assert self.budget.used == c.nbytes == c.capacity * SPEC.bytes_per_token
        assert int(c.mask.sum()) == n

    def teardown(self) -> None:
        failpoints.disarm()
        self.cache.release()
        assert self.budget.used == 0


TestKvMachine = KvMachine.TestCase
TestKvMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
