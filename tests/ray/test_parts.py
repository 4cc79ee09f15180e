"""kvmux.ray's parts without a cluster: the rows a stage takes, each replica's daemon config,
and the folders killed replicas leave behind."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

pytest.importorskip(
    "ray.data", reason="kvmux.ray needs the [ray] extra: pip install -e '.[cpu,test,ray]'"
)

from kvmux.client import protocol as p
from kvmux.daemon.config import parse_config, toml_config
from kvmux.ray._daemon import remove_orphaned_folders, replica_config
from kvmux.ray._formats import LineError, parse_line
from kvmux.ray._rows import entry, prepared_row

pytestmark = pytest.mark.ray

OPENAI = (
    '{"custom_id": "q", "method": "POST", "url": "/v1/chat/completions", '
    '"body": {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5, "n": 2}}'
)


def test_a_text_row_is_the_line_kvmux_submit_reads() -> None:
    e = entry({"line": 7, "text": OPENAI})
    assert e.refused is None and e.custom_id == "q" and e.line == 7
    assert e.items == parse_line(OPENAI, 7)
    assert [i.choice for i in e.items] == [0, 1]


def test_a_row_of_fields_reads_nulls_as_not_given() -> None:
    # What read_json gives a row when another line of the file had more keys.
    row = {"line": 3, "custom_id": "a", "prompt": "Hi", "max_tokens": 4, "seed": None, "n": None}
    e = entry(row)
    assert e.refused is None
    assert e.items == parse_line('{"custom_id": "a", "prompt": "Hi", "max_tokens": 4}', 3)


def test_a_prepared_row_gives_back_the_same_entry() -> None:
    items = parse_line(OPENAI, 9)
    e = entry(prepared_row(9, "q", items, None, index=40))
    assert (e.line, e.custom_id, e.items, e.index, e.refused) == (9, "q", items, 40, None)
    refused = entry(prepared_row(4, "line-4", [], LineError(4, "not valid JSON"), index=0))
    assert refused.refused is not None and str(refused.refused) == "line 4: not valid JSON"
    assert refused.items == [] and refused.custom_id == "line-4"


def test_a_line_that_does_not_parse_is_refused_not_raised() -> None:
    e = entry({"line": 2, "text": '{"custom_id": "x", "prompt": "a", "max_tokens": -1}'})
    assert e.items == [] and e.custom_id == "x"
    assert e.refused is not None and "max_tokens" in e.refused.reason


@pytest.mark.parametrize("line", [None, 0, True, "3"])
def test_a_row_without_a_line_number_is_a_pipeline_error(line: object) -> None:
    row = {"text": '{"prompt": "a"}'} if line is None else {"line": line, "text": '{"prompt": "a"}'}
    with pytest.raises(ValueError, match="`line` column"):
        entry(row)


def test_each_replica_gets_its_own_socket_journal_and_threads(tmp_path: Path) -> None:
    user = toml_config(
        {
            "model": {"name": "tiny", "intra_op_threads": 0},
            "server": {"endpoint": "ipc:///run/kvmux/kvmuxd.sock"},
            "jobs": {"journal": "/var/lib/kvmux/jobs.sqlite3"},
            "metrics": {"listen": "127.0.0.1:9464"},
        }
    )
    tables = replica_config(user, tmp_path, threads=2, gpu=True)
    assert tables["server"]["endpoint"] == f"ipc://{tmp_path}/kvmuxd.sock"
    assert tables["jobs"]["journal"] == str(tmp_path / "jobs.sqlite3")
    assert tables["metrics"]["listen"] == ""
    assert tables["model"] == {"name": "tiny", "intra_op_threads": 2, "device_id": 0}
    parse_config(toml_config(tables))  # what the daemon will read is a valid config
    # Threads the user chose stay theirs; an empty config is kvmuxd's defaults.
    mine = replica_config("[model]\nintra_op_threads = 3\n", tmp_path, threads=1)
    assert mine["model"]["intra_op_threads"] == 3
    assert "device_id" not in replica_config("", tmp_path, threads=1)["model"]


def test_folders_of_dead_replicas_are_removed_and_no_others(tmp_path: Path) -> None:
    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    dead = tmp_path / f"kvmux-ray-{gone.stdout.strip()}-abc"
    alive = tmp_path / f"kvmux-ray-{os.getpid()}-def"
    other = tmp_path / "kvmux-ray-notapid"
    for folder in (dead, alive, other):
        folder.mkdir()
        (folder / "jobs.sqlite3").write_bytes(b"")
    remove_orphaned_folders(tmp_path)
    assert sorted(f.name for f in tmp_path.iterdir()) == sorted([alive.name, other.name])


def test_items_travel_as_msgpack_unchanged() -> None:
    items = [p.Item(custom_id="a", prompt="x", seed=2**62, stop=["\n"], line=5)]
    row = prepared_row(5, "a", items, None, index=0)
    assert msgspec.msgpack.decode(row["items"], type=list[p.Item]) == items
