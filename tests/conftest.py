"""Suite-wide fixtures and the rule that GPU tests say why they skipped."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvmux.daemon.model import ensure_builtin
from kvmux.kv import cuda_unavailable_reason, failpoints


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    gpu_items = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu_items:
        return
    reason = cuda_unavailable_reason()
    if reason is None:
        return
    for item in gpu_items:
        item.add_marker(pytest.mark.skip(reason=f"gpu test, no usable CUDA here: {reason}"))


@pytest.fixture(autouse=True)
def _no_leftover_failpoints() -> Iterator[None]:
    """A test that arms a failpoint must not leak it into the next test."""
    failpoints.disarm()
    yield
    failpoints.disarm()


@pytest.fixture(scope="session", autouse=True)
def _private_state_home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Daemons started without an explicit jobs.journal keep it under $XDG_STATE_HOME:
    a folder of this test run's, not the home directory of whoever runs the tests."""
    import os

    saved = os.environ.get("XDG_STATE_HOME")
    os.environ["XDG_STATE_HOME"] = str(tmp_path_factory.mktemp("state"))
    yield
    if saved is None:
        del os.environ["XDG_STATE_HOME"]
    else:
        os.environ["XDG_STATE_HOME"] = saved


@pytest.fixture(scope="session", autouse=True)
def _daemons_die_with_the_tests() -> Iterator[None]:
    """Every kvmuxd a test starts (its environment inherits this) dies with the process
    that started it: a test run killed from outside leaves no daemon behind."""
    import os

    from kvmux.daemon.__main__ import DIE_WITH_PARENT_ENV

    saved = os.environ.get(DIE_WITH_PARENT_ENV)
    os.environ[DIE_WITH_PARENT_ENV] = "1"
    yield
    if saved is None:
        del os.environ[DIE_WITH_PARENT_ENV]
    else:
        os.environ[DIE_WITH_PARENT_ENV] = saved


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The built-in tiny model, built once per test run."""
    return ensure_builtin("tiny", tmp_path_factory.mktemp("models"))
