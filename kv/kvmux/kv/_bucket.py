"""Bucket policy: KV capacities are powers of two above a floor, below a cap."""

from __future__ import annotations

import os

from ._errors import KvConfigError

DEFAULT_MIN_BUCKET = 256
MIN_BUCKET_ENV = "KVMUX_KV_MIN_BUCKET"


def _positive_int(raw: object, what: str) -> int:
    if isinstance(raw, bool):
        raise KvConfigError(f"{what} must be a positive integer, got {raw!r}")
    if isinstance(raw, str):
        text = raw.strip()
        if not text.isdigit():
            raise KvConfigError(f"{what} must be a positive integer, got {raw!r}")
        value = int(text)
    elif isinstance(raw, int):
        value = raw
    else:
        raise KvConfigError(f"{what} must be a positive integer, got {raw!r}")
    if value <= 0:
        raise KvConfigError(f"{what} must be a positive integer, got {raw!r}")
    return value


def resolve_min_bucket(configured: int | None = None) -> int:
    """The bucket floor: env ``KVMUX_KV_MIN_BUCKET``, else config, else 256.

    The env var overrides in both directions (it may lower the floor too). An
    invalid value is an error, never a silent fallback to the default.
    """
    raw = os.environ.get(MIN_BUCKET_ENV)
    if raw is not None:
        return _positive_int(raw, f"env {MIN_BUCKET_ENV}")
    if configured is not None:
        return _positive_int(configured, "kv.min_bucket")
    return DEFAULT_MIN_BUCKET


def capacity_bucket(
    required: int, hard_max: int | None = None, min_bucket: int | None = None
) -> int:
    """Smallest power of two >= ``required``, at least ``min_bucket``, at most ``hard_max``.

    ``hard_max=None`` means unbounded. ``min_bucket=None`` resolves through
    :func:`resolve_min_bucket` (env, then the default).
    """
    if isinstance(required, bool) or not isinstance(required, int) or required < 0:
        raise ValueError(f"required must be a non-negative integer, got {required!r}")
    floor = (
        resolve_min_bucket(None) if min_bucket is None else _positive_int(min_bucket, "min_bucket")
    )
    bucket = max(1 << max(required - 1, 0).bit_length(), floor)
    if hard_max is not None:
        bucket = min(bucket, _positive_int(hard_max, "hard_max"))
    return bucket
