"""``python -m kvmux.daemon.model`` / ``kvmux-model``."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvmux.daemon.model.__main__ import main


def test_info_prints_the_spec(tiny_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["info", str(tiny_dir)]) == 0
    out = capsys.readouterr().out
    assert "layers:            2" in out
    assert "4 q / 2 kv, head_size 16" in out
    assert "context_length:    2048" in out


def test_info_on_a_bad_folder_fails_clearly(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["info", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "genai_config.json" in err and str(tmp_path) in err


def test_build_writes_a_loadable_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["build", "tiny", str(tmp_path / "m"), "--dtype", "float16"]) == 0
    assert "kv dtype:          float16" in capsys.readouterr().out


def test_build_rejects_unknown_size(tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["build", "medium", str(tmp_path)])
    assert exc.value.code == 2
