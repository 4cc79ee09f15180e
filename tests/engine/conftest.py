from __future__ import annotations

from pathlib import Path

import pytest

from kvmux.daemon.engine import Engine, EngineOptions


@pytest.fixture(scope="session")
def engine(tiny_model: Path) -> Engine:
    """min_bucket 4: a 200-token decode grows 4 -> 8 -> ... -> 256."""
    return Engine(tiny_model, EngineOptions(min_bucket=4, intra_op_threads=1))


@pytest.fixture(scope="session")
def big_buffer_engine(tiny_model: Path) -> Engine:
    """min_bucket 256: the same decode in one buffer that never grows."""
    return Engine(tiny_model, EngineOptions(min_bucket=256, intra_op_threads=1))
