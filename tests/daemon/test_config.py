"""The daemon config: shipped files decode, defaults, and errors that name the key."""

from __future__ import annotations

import tomllib
from pathlib import Path

import msgspec
import pytest

from kvmux.daemon.config import (
    EX_CONFIG,
    Config,
    ConfigError,
    active_sessions,
    load_config,
    parse_config,
)

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
CONFIG_FILES = sorted(CONFIGS.glob("*.toml"))


def test_configs_folder_holds_the_shipped_files() -> None:
    names = {p.name for p in CONFIG_FILES}
    assert {"kvmuxd.toml", "local.toml"} <= names
    assert len(CONFIG_FILES) >= 2


@pytest.mark.parametrize("path", CONFIG_FILES, ids=lambda p: p.name)
def test_every_shipped_config_decodes(path: Path) -> None:
    assert isinstance(load_config(path), Config)


def test_production_config_lists_every_key() -> None:
    raw = tomllib.loads((CONFIGS / "kvmuxd.toml").read_text(encoding="utf-8"))
    expected = {
        table.name: {f.name for f in msgspec.structs.fields(table.type)}
        for table in msgspec.structs.fields(Config)
    }
    assert {name: set(keys) for name, keys in raw.items()} == expected


def test_production_config_values() -> None:
    cfg = load_config(CONFIGS / "kvmuxd.toml")
    # The service serves a real model, as the quickstart does: not tiny's random weights.
    assert cfg.model.name == "smollm2"
    assert cfg.model.path == ""
    assert cfg.server.endpoint == "ipc:///run/kvmux/kvmuxd.sock"
    assert cfg.model.cache_dir == "/var/lib/kvmux/models"
    assert cfg.log.format == "json"
    # everything else is at its default
    assert cfg.scheduler == Config().scheduler
    assert cfg.kv == Config().kv
    assert cfg.budget == Config().budget
    # HTTP is on in the shipped config, on loopback; every other [http] key at its default.
    assert cfg.http == msgspec.structs.replace(Config().http, listen="127.0.0.1:8000")


def test_local_config_values() -> None:
    cfg = load_config(CONFIGS / "local.toml")
    assert cfg.model.name == "smollm2"
    assert cfg.model.path == ""
    assert cfg.server.endpoint == ""
    assert cfg.log.format == "auto"
    default = active_sessions(Config().scheduler, "cpu").max_active_sessions
    assert 0 < cfg.scheduler.max_active_sessions < default


def test_active_sessions_default_by_provider() -> None:
    """0 (the default) is 16 on the CPU and 256 with CUDA; a number given is kept."""
    auto = Config().scheduler
    assert auto.max_active_sessions == 0
    assert active_sessions(auto, "cpu").max_active_sessions == 16
    assert active_sessions(auto, "cuda").max_active_sessions == 256
    given = parse_config("[scheduler]\nmax_active_sessions = 7\n").scheduler
    assert active_sessions(given, "cuda").max_active_sessions == 7
    assert Config().model.cuda_graph  # on with CUDA; the CPU provider has no graphs


def test_empty_config_is_the_defaults() -> None:
    cfg = parse_config("")
    assert cfg == Config()
    assert cfg.model.name == "tiny"
    assert cfg.model.provider == "cpu"
    assert cfg.server.endpoint == ""
    assert cfg.server.max_message_bytes == 16 * 1024 * 1024
    assert cfg.kv.min_bucket == 256
    assert cfg.scheduler.max_active_sessions == 0  # by provider: see active_sessions
    assert cfg.scheduler.on_growth_failure == "wait"
    assert cfg.jobs.retention == 3600.0
    assert cfg.log.level == "info"
    assert cfg.shutdown.grace == 30.0
    assert cfg.metrics.listen == ""


def test_values_decode_and_ints_are_accepted_for_floats() -> None:
    cfg = parse_config(
        b"[server]\nheartbeat_interval = 1\nclient_timeout = 3\n[shutdown]\ngrace = 0\n"
    )
    assert cfg.server.heartbeat_interval == 1.0
    assert cfg.server.client_timeout == 3.0
    assert cfg.shutdown.grace == 0.0


def test_config_is_frozen() -> None:
    cfg = parse_config("")
    with pytest.raises(AttributeError):
        cfg.kv.min_bucket = 1  # type: ignore[misc]


def _error(text: str) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        parse_config(text, source="/etc/kvmux/kvmuxd.toml")
    return info.value


@pytest.mark.parametrize(
    ("text", "key", "fragment"),
    [
        ("[scheduler]\nmax_active_sessions = -1", "scheduler.max_active_sessions", ">= 0"),
        ("[scheduler]\nmax_active_sessions = 'many'", "scheduler.max_active_sessions", "`int`"),
        ("[scheduler]\non_growth_failure = 'retry'", "scheduler.on_growth_failure", "'retry'"),
        ("[server]\nmax_message_bytes = 1023", "server.max_message_bytes", ">= 1024"),
        ("[server]\nheartbeat_interval = 0.0", "server.heartbeat_interval", "> 0"),
        ("[kv]\nmax_len = -1", "kv.max_len", ">= 0"),
        ("[kv]\nmin_bucket = true", "kv.min_bucket", "`bool`"),
        ("[model]\nprovider = 'rocm'", "model.provider", "'rocm'"),
        ("[model]\ndevice_id = -1", "model.device_id", ">= 0"),
        ("[log]\nlevel = 'trace'", "log.level", "'trace'"),
        ("[jobs]\nretention = 0", "jobs.retention", "> 0"),
        ("[shutdown]\ngrace = -1.0", "shutdown.grace", ">= 0"),
        ("[shutdown]\ngrace = inf", "shutdown.grace", "finite"),
        ("kv = 3", "kv", "`object`"),
    ],
)
def test_type_and_range_errors_name_the_key(text: str, key: str, fragment: str) -> None:
    err = _error(text)
    assert err.key == key
    assert err.path == "/etc/kvmux/kvmuxd.toml"
    assert fragment in err.message
    assert str(err) == f"/etc/kvmux/kvmuxd.toml: {key}: {err.message}"
    assert " - at `$" not in str(err)


def test_error_reads_like_the_documented_example() -> None:
    err = _error("[scheduler]\nmax_active_sessions = -1")
    assert str(err) == "/etc/kvmux/kvmuxd.toml: scheduler.max_active_sessions: Expected `int` >= 0"


def test_unknown_key_in_a_table_is_named() -> None:
    err = _error("[kv]\nmin_bukcet = 16")
    assert err.key == "kv.min_bukcet"
    assert "unknown key" in err.message
    assert "kv.min_bukcet" in str(err)


def test_kebab_case_keys_are_unknown() -> None:
    err = _error("[scheduler]\nmax-active-sessions = 2")
    assert err.key == "scheduler.max-active-sessions"


def test_unknown_key_at_top_level_is_named() -> None:
    err = _error("verbose = true")
    assert err.key == "verbose"
    assert "unknown key" in err.message


def test_unknown_table_is_named() -> None:
    err = _error("[gpu]\nenabled = true")
    assert err.key == "gpu"


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ("[model]\npath = '/models/phi'\nname = 'small'", "model.name"),
        ("[model]\nname = 'llama'", "model.name"),
        ("[model]\nname = ''", "model.name"),
        ("[server]\nheartbeat_interval = 5.0\nclient_timeout = 5.0", "server.client_timeout"),
        ("[server]\nheartbeat_interval = 20.0", "server.client_timeout"),
        ("[scheduler]\nmax_queued_items = 10\nmax_job_items = 11", "scheduler.max_job_items"),
        ("[scheduler]\nmax_queued_items = 10\nmax_job_items = 6", "scheduler.max_job_items"),
        (
            "[scheduler]\nmax_queued_items = 10\nmax_queued_per_owner = 11",
            "scheduler.max_queued_per_owner",
        ),
        ("[server]\noperator_keys = ['short']", "server.operator_keys"),
        ("[metrics]\nlisten = '0.0.0.0:9464'", "metrics.listen"),
        ("[metrics]\nlisten = '10.1.2.3:9464'", "metrics.listen"),
        ("[metrics]\nlisten = 'example.com:9464'", "metrics.listen"),
        ("[metrics]\nlisten = '127.0.0.1'", "metrics.listen"),
        ("[metrics]\nlisten = '127.0.0.1:0'", "metrics.listen"),
        ("[metrics]\nlisten = '127.0.0.1:http'", "metrics.listen"),
        ("[server]\nendpoint = '/run/kvmux.sock'", "server.endpoint"),
        ("[server]\nendpoint = 'udp://127.0.0.1:5555'", "server.endpoint"),
    ],
)
def test_cross_field_rules_name_the_key(text: str, key: str) -> None:
    err = _error(text)
    assert err.key == key
    assert str(err).startswith(f"/etc/kvmux/kvmuxd.toml: {key}: ")


def test_non_loopback_metrics_explains_why() -> None:
    err = _error("[metrics]\nlisten = '0.0.0.0:9464'")
    assert "loopback" in err.message
    assert "authentication" in err.message


@pytest.mark.parametrize(
    "text",
    [
        "[model]\npath = '/models/phi'",
        "[model]\npath = '/models/phi'\nname = ''",
        "[model]\nname = 'small'",
        "[server]\nheartbeat_interval = 1.0\nclient_timeout = 1.5",
        "[scheduler]\nmax_queued_items = 10\nmax_job_items = 5",
        "[scheduler]\nmax_queued_items = 10\nmax_queued_per_owner = 10\nmax_job_items = 10",
        "[metrics]\nlisten = '127.0.0.1:9464'",
        "[metrics]\nlisten = '127.9.9.9:9464'",
        "[metrics]\nlisten = 'localhost:9464'",
        "[metrics]\nlisten = '[::1]:9464'",
        "[server]\nendpoint = 'ipc:///tmp/k.sock'",
        "[server]\nendpoint = 'tcp://127.0.0.1:5555'",
        "[server]\nendpoint = 'inproc://kvmux'",
    ],
)
def test_cross_field_rules_accept_valid_settings(text: str) -> None:
    assert isinstance(parse_config(text), Config)


def test_toml_syntax_error_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "broken.toml"
    path.write_text("[kv\nmin_bucket = 16\n", encoding="utf-8")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    err = info.value
    assert err.path == str(path)
    assert err.key is None
    assert str(err).startswith(f"{path}: ")
    assert "line 1" in err.message


def test_invalid_utf8_is_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "latin1.toml"
    path.write_bytes(b"[log]\nfile = '\xff'\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert info.value.path == str(path)


def test_missing_file_names_the_path(tmp_path: Path) -> None:
    path = tmp_path / "nope" / "kvmuxd.toml"
    with pytest.raises(ConfigError) as info:
        load_config(str(path))
    err = info.value
    assert err.path == str(path)
    assert err.key is None
    assert str(path) in str(err)
    assert "No such file" in err.message


def test_load_config_reads_a_file(tmp_path: Path) -> None:
    path = tmp_path / "kvmuxd.toml"
    path.write_text("[kv]\nmin_bucket = 16\nmax_len = 2048\n", encoding="utf-8")
    cfg = load_config(path)
    assert cfg.kv.min_bucket == 16
    assert cfg.kv.max_len == 2048
    assert cfg.kv.memory_budget == 0


def test_parse_config_names_its_source() -> None:
    with pytest.raises(ConfigError, match=r"^<string>: kv\.min_bucket: "):
        parse_config("[kv]\nmin_bucket = 0")


def test_ex_config_is_sysexits_value() -> None:
    assert EX_CONFIG == 78


def test_check_config_catches_what_the_daemon_would_refuse_at_start(
    tmp_path: Path, tiny_model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from kvmux.daemon.__main__ import main

    missing = tmp_path / "missing.toml"
    missing.write_text(f'[model]\npath = "{tmp_path / "no-such-model"}"\n')
    not_a_model = tmp_path / "empty.toml"
    not_a_model.write_text(f'[model]\npath = "{tmp_path}"\n')
    good = tmp_path / "good.toml"
    good.write_text(f'[model]\npath = "{tiny_model}"\n')
    assert main(["--config", str(missing), "--check-config"]) == EX_CONFIG
    assert "model.path: " in (err := capsys.readouterr().err) and "does not exist" in err
    assert main(["--config", str(not_a_model), "--check-config"]) == EX_CONFIG
    assert "holds no genai_config.json" in capsys.readouterr().err
    assert main(["--config", str(good), "--check-config"]) == 0
    assert "is valid" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("text", "key", "suggestion"),
    [
        ("[kv]\nmax_length = 512\n", "kv.max_length", "kv.max_len"),
        ("[scheduler]\nmax_new_token = 5\n", "scheduler.max_new_token", "scheduler.max_new_tokens"),
        ("[modle]\nname = 'tiny'\n", "modle", "model"),
    ],
)
def test_a_misspelled_key_gets_the_nearest_name(text: str, key: str, suggestion: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(text, source="kvmuxd.toml")
    assert info.value.key == key
    assert f"(did you mean `{suggestion}`?)" in info.value.message


def test_an_unknown_key_like_nothing_gets_no_suggestion() -> None:
    with pytest.raises(ConfigError) as info:
        parse_config("[kv]\nzzzzzz = 1\n")
    assert info.value.message == "unknown key in [kv]"


@pytest.mark.parametrize(
    ("written", "expected"),
    [
        ('"256MiB"', 256 * 2**20),
        ('"1 GiB"', 2**30),
        ('"16MB"', 16_000_000),
        ('"1.5KiB"', 1536),
        ('"4096"', 4096),
        ("4096", 4096),
    ],
)
def test_sizes_take_units(written: str, expected: int) -> None:
    cfg = parse_config(f"[kv]\nmemory_budget = {written}\n[http]\nmax_body_bytes = {written}\n")
    assert cfg.kv.memory_budget == expected
    assert cfg.http.max_body_bytes == expected


@pytest.mark.parametrize("written", ['"256 MiBs"', '"lots"', '"-1MiB"'])
def test_a_size_that_is_not_one_names_the_units(written: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(f"[kv]\nmemory_budget = {written}\n")
    assert info.value.key == "kv.memory_budget"
    assert "MiB" in info.value.message and "bytes" in info.value.message


def test_a_size_with_a_unit_is_still_checked_against_its_range() -> None:
    with pytest.raises(ConfigError) as info:
        parse_config('[http]\nmax_body_bytes = "1kB"\n')
    assert info.value.key == "http.max_body_bytes"
    assert ">= 1024" in info.value.message


def test_only_sizes_take_units() -> None:
    """A count is not a size: "16MiB" items is still a type error naming the key."""
    with pytest.raises(ConfigError) as info:
        parse_config('[scheduler]\nmax_queued_items = "16MiB"\n')
    assert info.value.key == "scheduler.max_queued_items"
    assert "Expected `int`, got `str`" in info.value.message
