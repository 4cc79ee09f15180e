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


def test_info_takes_a_builtin_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("KVMUX_MODEL_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)  # no folder named tiny here
    assert main(["info", "tiny"]) == 0
    out = capsys.readouterr().out
    assert f"folder:            {tmp_path / 'cache'}" in out
    assert "precision:         fp32" in out


def test_version_and_every_command_has_a_description_and_examples(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.startswith("kvmux-model ")
    for command in ("build", "import-gguf", "info"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        text = capsys.readouterr().out
        assert "examples:" in text and f"kvmux-model {command} " in text.split("examples:")[1]
    with pytest.raises(SystemExit):
        main(["build", "--help"])
    assert "(default: float32)" in capsys.readouterr().out
