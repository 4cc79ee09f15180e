"""Shared fixtures: built-in model folders and a hand-written IOBinding decode loop."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest

from kvmux.daemon.model import ModelSpec, build_builtin, load_model


def _session(spec: ModelSpec) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.intra_op_num_threads = 2
    return ort.InferenceSession(str(spec.model_path), options, providers=["CPUExecutionProvider"])


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_builtin("tiny", tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="session")
def small_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_builtin("small", tmp_path_factory.mktemp("small"))


@pytest.fixture(scope="session")
def tiny_spec(tiny_dir: Path) -> ModelSpec:
    return load_model(tiny_dir)


@pytest.fixture(scope="session")
def tiny_session(tiny_spec: ModelSpec) -> ort.InferenceSession:
    return _session(tiny_spec)


class SharedKV:
    """One session's KV in one buffer per tensor, bound as both past and present."""

    def __init__(self, spec: ModelSpec, session: ort.InferenceSession, capacity: int) -> None:
        self.spec, self.session, self.capacity = spec, session, capacity
        shape = (1, spec.num_kv_heads, capacity, spec.head_size)
        self.keys = [np.zeros(shape, spec.kv_dtype) for _ in range(spec.num_layers)]
        self.values = [np.zeros(shape, spec.kv_dtype) for _ in range(spec.num_layers)]
        self.length = 0

    def step(self, token_ids: Sequence[int]) -> np.ndarray[Any, Any]:
        """Feed tokens; return the logits of the last one (float64 copy)."""
        n = len(token_ids)
        assert self.length + n <= self.capacity, "checked on the host, never by ORT"
        spec = self.spec
        binding = self.session.io_binding()
        binding.bind_cpu_input(spec.input_ids_name, np.array([token_ids], dtype=np.int64))
        mask = np.zeros((1, self.capacity), dtype=np.int64)
        mask[0, : self.length + n] = 1
        binding.bind_cpu_input(spec.attention_mask_name, mask)
        binding.bind_output(spec.logits_name, "cpu")
        for i in range(spec.num_layers):
            for past, present, buf in (
                (spec.past_key_names[i], spec.present_key_names[i], self.keys[i]),
                (spec.past_value_names[i], spec.present_value_names[i], self.values[i]),
            ):
                args = ("cpu", 0, spec.kv_dtype, buf.shape, buf.ctypes.data)
                binding.bind_input(past, *args)
                binding.bind_output(present, *args)
        self.session.run_with_iobinding(binding)
        self.length += n
        logits = binding.copy_outputs_to_cpu()[0]
        assert logits.shape == (1, n, spec.vocab_size)
        return np.array(logits[0, -1], dtype=np.float64)


def greedy_shared(
    spec: ModelSpec,
    session: ort.InferenceSession,
    prompt: Sequence[int],
    steps: int,
    capacity: int,
    chunk: int | None = None,
) -> np.ndarray[Any, Any]:
    """Prefill (one shot, or in chunks) then greedy-decode; logits of every step stacked."""
    kv = SharedKV(spec, session, capacity)
    chunk = chunk or len(prompt)
    for start in range(0, len(prompt), chunk):
        logits = kv.step(prompt[start : start + chunk])
    out = [logits]
    for _ in range(steps):
        logits = kv.step([int(np.argmax(logits))])
        out.append(logits)
    return np.stack(out)


def greedy_reference(
    spec: ModelSpec, session: ort.InferenceSession, prompt: Sequence[int], steps: int
) -> np.ndarray[Any, Any]:
    """No shared buffers: past of exact length, present fed back as the next past."""
    shape = (1, spec.num_kv_heads, 0, spec.head_size)
    past = {
        name: np.zeros(shape, spec.kv_dtype)
        for name in (*spec.past_key_names, *spec.past_value_names)
    }
    names = [o.name for o in session.get_outputs()]
    tokens = list(prompt)
    out = []
    length = 0
    for _ in range(steps + 1):
        length += len(tokens)
        feeds = {
            spec.input_ids_name: np.array([tokens], dtype=np.int64),
            spec.attention_mask_name: np.ones((1, length), dtype=np.int64),
            **past,
        }
        result = dict(zip(names, session.run(None, feeds), strict=True))
        logits = np.array(result[spec.logits_name][0, -1], dtype=np.float64)
        out.append(logits)
        for i in range(spec.num_layers):
            present_k = result[spec.present_key_names[i]]
            assert present_k.shape[2] == length
            past[spec.past_key_names[i]] = present_k
            past[spec.past_value_names[i]] = result[spec.present_value_names[i]]
        tokens = [int(np.argmax(logits))]
    return np.stack(out)


@pytest.fixture
def shared_kv() -> type[SharedKV]:
    return SharedKV


@pytest.fixture
def decode() -> Any:
    class Decode:
        shared = staticmethod(greedy_shared)
        reference = staticmethod(greedy_reference)
        session = staticmethod(_session)

    return Decode
