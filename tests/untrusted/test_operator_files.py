"""Files the operator owns (the config, the API keys file, the model folder's JSON, the job
journal's rows) holding what nobody should write there: a clear refusal at start naming
the file, never a traceback."""

from __future__ import annotations

import json
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvmux.client import Item
from kvmux.daemon.config import EX_CONFIG, ConfigError, parse_config
from kvmux.daemon.http.keys import ApiKeys
from kvmux.daemon.journal import Journal, JournalError
from kvmux.daemon.model.chat import CHAT_TEMPLATE_FILENAME, load_chat_template
from kvmux.daemon.model.config import load_model
from kvmux.daemon.model.errors import ModelFormatError

from .hostile import EXAMPLES, deep_msgpack, toml_values


def deep_toml(levels: int) -> str:
    return "[" * levels + "1" + "]" * levels


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(table=st.sampled_from(["server", "scheduler", "kv", "http", "log"]), value=toml_values())
def test_any_value_in_the_config_is_a_config_error_or_a_config(table: str, value: str) -> None:
    text = f'[model]\npath = "/nowhere"\n[{table}]\nsome-key = {value}\n'
    with pytest.raises(ConfigError) as exc:  # some-key is unknown: every value is refused
        parse_config(text)
    assert "some-key" in str(exc.value) or "TOML" in str(exc.value)


@pytest.mark.parametrize("levels", [1000, 3000])
def test_a_config_nested_thousands_deep_is_a_config_error(levels: int) -> None:
    with pytest.raises(ConfigError, match="nested too deep"):
        parse_config(f'[model]\npath = "/m"\n[http]\nserved-model-names = {deep_toml(levels)}\n')


def test_kvmuxd_exits_78_naming_a_deep_config(tmp_path: Path) -> None:
    cfg = tmp_path / "kvmuxd.toml"
    cfg.write_text(f'[model]\npath = "/m"\n[http]\nserved-model-names = {deep_toml(2000)}\n')
    proc = subprocess.run(
        [sys.executable, "-m", "kvmux.daemon", "--config", str(cfg)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == EX_CONFIG, proc.stderr
    assert "nested too deep" in proc.stderr + proc.stdout and str(cfg) in proc.stderr + proc.stdout
    assert "Traceback" not in proc.stderr + proc.stdout


def test_a_keys_file_nested_thousands_deep_is_a_config_error(tmp_path: Path) -> None:
    keys = tmp_path / "keys.toml"
    keys.write_text(f'[[key]]\nowner = "a"\nsha256 = {deep_toml(2000)}\n')
    with pytest.raises(ConfigError, match="nested too deep"):
        ApiKeys(str(keys)).load()


@pytest.mark.parametrize("name", ["genai_config.json", "tokenizer_config.json"])
def test_a_model_folder_json_nested_thousands_deep_is_a_format_error(
    tiny_model: Path, tmp_path: Path, name: str
) -> None:
    folder = tmp_path / "model"
    shutil.copytree(tiny_model, folder)
    original = (folder / name).read_text() if (folder / name).exists() else "{}"
    # The file's own object, with one member nested 3000 deep.
    (folder / name).write_text('{"x": ' + deep_toml(3000) + ", " + original.lstrip()[1:])
    (folder / CHAT_TEMPLATE_FILENAME).unlink(missing_ok=True)  # so tokenizer_config is read
    with pytest.raises(ModelFormatError, match="nested deeper than 128"):
        load_model(folder)
        load_chat_template(folder)


def _journal_with_one_job(path: Path) -> None:
    journal = Journal(path)
    journal.add_job("job-1", "alice", "j", False, [Item(custom_id="a", prompt="hi")])
    journal.flush()
    journal.close()


@pytest.mark.parametrize(
    "row", [b"\xc1 not msgpack", deep_msgpack(3000), msgspec.msgpack.encode({"prompt": 5})]
)
def test_a_journal_row_that_does_not_decode_is_a_clear_error_at_start(
    tmp_path: Path, row: bytes
) -> None:
    path = tmp_path / "jobs.sqlite3"
    _journal_with_one_job(path)
    with sqlite3.connect(path) as db:
        db.execute("UPDATE items SET item = ?", (row,))
    db.close()
    journal = Journal(path)
    try:
        with pytest.raises(JournalError, match=r"job job-1 item 0 cannot be read") as exc:
            journal.load()
        assert str(path) in str(exc.value) and "move it aside" in str(exc.value)
    finally:
        journal.close()


def test_kvmuxd_exits_78_naming_a_journal_row_it_cannot_read(
    tiny_model: Path, tmp_path: Path
) -> None:
    path = tmp_path / "jobs.sqlite3"
    _journal_with_one_job(path)
    with sqlite3.connect(path) as db:
        db.execute("UPDATE items SET item = ?", (deep_msgpack(3000),))
    db.close()
    cfg = tmp_path / "k.toml"
    cfg.write_text(
        f'[model]\npath = "{tiny_model}"\n[server]\nendpoint = "ipc://{tmp_path}/k.sock"\n'
        f'[jobs]\njournal = "{path}"\n[log]\nformat = "json"\n'
    )
    proc = subprocess.run(
        [sys.executable, "-m", "kvmux.daemon", "--config", str(cfg)],
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert proc.returncode == EX_CONFIG, proc.stdout + proc.stderr
    failure = [json.loads(line) for line in proc.stdout.splitlines() if "startup_failed" in line]
    assert failure and "job job-1 item 0 cannot be read" in failure[0]["error"]
    assert "Traceback" not in proc.stdout + proc.stderr
