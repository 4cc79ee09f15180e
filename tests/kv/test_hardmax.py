from __future__ import annotations

import pytest

from kvmux.kv import HardMax, KvConfigError, resolve_hard_max


@pytest.mark.parametrize(
    ("cap", "model_max", "expected"),
    [
        (1024, 4096, HardMax(1024, "explicit cap 1024", 4096)),
        (4096, 4096, HardMax(4096, "explicit cap 4096", 4096)),
        (9000, 4096, HardMax(4096, "explicit cap 9000 clamped by model max_length (4096)", 4096)),
        (None, 4096, HardMax(4096, "model max_length (4096)", 4096)),
        (1024, None, HardMax(1024, "explicit cap 1024", None)),
        (None, None, HardMax(None, "unbounded (model declares no maximum)", None)),
    ],
)
def test_resolution_and_source(cap: int | None, model_max: int | None, expected: HardMax) -> None:
    assert resolve_hard_max(cap, model_max) == expected


def test_cap_label_names_where_the_cap_came_from() -> None:
    got = resolve_hard_max(9000, 2048, cap_label="config kv.max_len")
    assert got.source == "config kv.max_len 9000 clamped by model max_length (2048)"
    assert got.value == 2048


@pytest.mark.parametrize("cap", [0, -5])
def test_non_positive_cap_is_an_error(cap: int) -> None:
    with pytest.raises(KvConfigError, match="positive"):
        resolve_hard_max(cap, 4096)


def test_non_positive_model_max_is_an_error() -> None:
    with pytest.raises(KvConfigError, match="model max_length"):
        resolve_hard_max(None, 0)
