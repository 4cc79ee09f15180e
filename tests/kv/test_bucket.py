from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvmux.kv import (
    DEFAULT_MIN_BUCKET,
    MIN_BUCKET_ENV,
    KvConfigError,
    capacity_bucket,
    resolve_min_bucket,
)


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(MIN_BUCKET_ENV, raising=False)


@pytest.mark.parametrize(
    ("required", "expected"),
    [(0, 256), (1, 256), (128, 256), (256, 256), (257, 512), (5000, 8192), (8192, 8192)],
)
def test_bucket_table(required: int, expected: int) -> None:
    assert capacity_bucket(required) == expected


def test_default_floor_is_256() -> None:
    assert DEFAULT_MIN_BUCKET == 256
    assert resolve_min_bucket() == 256


def test_capped_at_hard_max() -> None:
    assert capacity_bucket(5000, hard_max=6000) == 6000
    assert capacity_bucket(100, hard_max=200) == 200
    assert capacity_bucket(300, hard_max=4096) == 512


@given(
    required=st.integers(min_value=0, max_value=1 << 22),
    hard_max=st.one_of(st.none(), st.integers(min_value=1, max_value=1 << 22)),
    min_bucket=st.integers(min_value=1, max_value=4096),
)
def test_bucket_within_bounds(required: int, hard_max: int | None, min_bucket: int) -> None:
    got = capacity_bucket(required, hard_max, min_bucket)
    if hard_max is not None:
        assert got <= hard_max
        if required <= hard_max:
            assert got >= required
    else:
        assert got >= required
        assert got >= min_bucket
        # Either the floor or a power of two.
        assert got == min_bucket or got & (got - 1) == 0
        # Never more than twice what was needed (above the floor).
        assert got < 2 * max(required, 1) or got == min_bucket


@given(
    a=st.integers(min_value=0, max_value=1 << 20),
    b=st.integers(min_value=0, max_value=1 << 20),
    min_bucket=st.sampled_from([1, 4, 16, 256, 1000]),
)
def test_bucket_monotonic(a: int, b: int, min_bucket: int) -> None:
    lo, hi = sorted((a, b))
    assert capacity_bucket(lo, None, min_bucket) <= capacity_bucket(hi, None, min_bucket)


def test_env_override_lowers_and_raises_floor(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(MIN_BUCKET_ENV, "4")
    assert capacity_bucket(0) == 4
    assert capacity_bucket(5) == 8
    # The env var wins over a configured value, in both directions.
    assert resolve_min_bucket(512) == 4
    monkeypatch.setenv(MIN_BUCKET_ENV, "1024")
    assert capacity_bucket(300) == 1024
    assert resolve_min_bucket(16) == 1024


def test_config_floor_used_without_env() -> None:
    assert resolve_min_bucket(16) == 16
    assert capacity_bucket(0, min_bucket=16) == 16


@pytest.mark.parametrize("raw", ["0", "-4", "abc", "", "2.5", " "])
def test_invalid_env_is_an_error(monkeypatch: pytest.MonkeyPatch, raw: str) -> None:
    monkeypatch.setenv(MIN_BUCKET_ENV, raw)
    with pytest.raises(KvConfigError, match=MIN_BUCKET_ENV):
        capacity_bucket(10)


@pytest.mark.parametrize("bad", [0, -1, True])
def test_invalid_min_bucket_argument(bad: int) -> None:
    with pytest.raises(KvConfigError):
        capacity_bucket(10, min_bucket=bad)
    with pytest.raises(KvConfigError):
        resolve_min_bucket(bad)


@pytest.mark.parametrize("bad", [-1, True, 1.5])
def test_invalid_required(bad: int) -> None:
    with pytest.raises(ValueError, match="required"):
        capacity_bucket(bad)
