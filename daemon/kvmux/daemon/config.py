"""The daemon's configuration: a TOML file decoded into frozen msgspec Structs.

Every table is a Struct whose fields carry their defaults and constraints, so
an empty file is a valid config and msgspec rejects bad types, out-of-range
values and unknown keys. :func:`load_config` and :func:`parse_config` turn
every failure into one :class:`ConfigError` naming the file and the dotted key
(``scheduler.max_active_sessions``); the daemon exits with :data:`EX_CONFIG`
on it, which the systemd unit lists in ``RestartPreventExitStatus``.
"""

from __future__ import annotations

import ipaddress
import json
import math
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Literal

import msgspec

__all__ = [
    "BUILTIN_MODELS",
    "EX_CONFIG",
    "BudgetConfig",
    "Config",
    "ConfigError",
    "HttpConfig",
    "JobsConfig",
    "KvConfig",
    "LogConfig",
    "MetricsConfig",
    "ModelConfig",
    "SchedulerConfig",
    "ServerConfig",
    "ShutdownConfig",
    "load_config",
    "owner_queue_share",
    "parse_config",
    "toml_config",
    "with_endpoint",
    "with_http",
    "with_journal",
]

EX_CONFIG = 78
"""Exit status for a bad config (sysexits.h ``EX_CONFIG``); systemd must not restart on it."""

BUILTIN_MODELS = ("tiny", "small", "smollm2")
"""The models the repo makes itself (``smollm2`` imported from its GGUF file, fetched
from PyPI); ``model.name`` picks one when ``model.path`` is empty."""

_ENDPOINT_SCHEMES = ("ipc://", "tcp://", "inproc://")

NonNegInt = Annotated[int, msgspec.Meta(ge=0)]
PositiveInt = Annotated[int, msgspec.Meta(ge=1)]
PositiveFloat = Annotated[float, msgspec.Meta(gt=0)]
NonNegFloat = Annotated[float, msgspec.Meta(ge=0)]


class ConfigError(Exception):
    """A config file that cannot be read, parsed or validated."""

    def __init__(self, message: str, *, path: str | None = None, key: str | None = None) -> None:
        self.path = path
        self.key = key
        self.message = message
        super().__init__(str(self))

    def __str__(self) -> str:
        parts = [p for p in (self.path, self.key) if p]
        return ": ".join([*parts, self.message])


class ModelConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """``[model]``: which model to serve and where it runs."""

    name: str = "tiny"
    # For a built-in name: "auto" (as it comes: tiny/small float, smollm2 its GGUF's own
    # quantized blocks), "float", or "int4" (see model.cache.MODEL_PRECISIONS).
    precision: Literal["auto", "float", "int4"] = "auto"
    path: str = ""
    # A Jinja chat template file for chat requests, overriding the model's own
    # (chat_template.jinja or tokenizer_config.json); read like ``path``.
    chat_template: str = ""
    cache_dir: str = ""
    provider: Literal["cpu", "cuda"] = "cpu"
    device_id: NonNegInt = 0
    intra_op_threads: NonNegInt = 0
    # CUDA graphs for decode steps (provider "cuda" only; the CPU provider has none).
    cuda_graph: bool = True


class ServerConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """``[server]``: the ZeroMQ endpoint and client liveness."""

    endpoint: str = ""
    max_message_bytes: Annotated[int, msgspec.Meta(ge=1024)] = 16 * 1024 * 1024
    heartbeat_interval: PositiveFloat = 2.0
    client_timeout: PositiveFloat = 10.0
    curve_secret_key: str = ""
    curve_authorized_keys: str = ""
    # z85 public keys (as in the clients' *.key files) that may see every job.
    operator_keys: list[str] = msgspec.field(default_factory=list)
    # A sender's malformed frames: this many get a typed reply at once, then
    # bad_frames_per_second more; past that they are dropped, and a sender
    # that sends bad_frame_burst more while dropped is disconnected.
    bad_frame_burst: PositiveInt = 100
    bad_frames_per_second: PositiveFloat = 10.0
    # Bytes of replies the daemon holds for one client that is not reading
    # (beyond libzmq's pipe of _SEND_HWM messages); past it, that client's
    # messages are dropped (results stay fetchable).
    max_client_buffer_bytes: Annotated[int, msgspec.Meta(ge=65536)] = 8 * 1024 * 1024
    # The daemon stops accepting connections while its open file descriptors
    # reach this (or half its descriptor limit, whichever is lower), and
    # accepts again below 3/4 of it: running out would make libzmq abort.
    max_connections: PositiveInt = 4096
    # A connection that has not finished the ZeroMQ handshake by then is closed.
    handshake_timeout: PositiveFloat = 5.0


class BudgetConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """``[budget]``: what valid requests may cost the daemon's event loop, per
    connection and per owner, in seconds of loop time a second (0 = unlimited);
    past it a request is answered ``overloaded`` with a ``retry_after``."""

    connection_rate: NonNegFloat = 0.05
    connection_burst: PositiveFloat = 0.05
    owner_rate: NonNegFloat = 0.1
    owner_burst: PositiveFloat = 0.1


class HttpConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """``[http]``: OpenAI's HTTP API (completions, files, batches) beside the socket."""

    # host:port ("" = off: a config without [http] serves no HTTP; the shipped
    # configs listen on 127.0.0.1:8000). Beyond loopback only with api_keys.
    listen: str = ""
    # A TOML file of API keys (their SHA-256) and the owners they stand for;
    # "" = no keys: everyone is `anonymous` (loopback only). Re-read on SIGHUP.
    api_keys: str = ""
    # The names `model` may take; [] = the served model's name.
    served_model_names: list[str] = msgspec.field(default_factory=list)
    # TLS straight from kvmuxd (else a reverse proxy): both or neither.
    tls_certfile: str = ""
    tls_keyfile: str = ""
    # Bodies: a JSON request, an uploaded file (multipart), lines in a batch file.
    max_body_bytes: Annotated[int, msgspec.Meta(ge=1024)] = 16 * 1024 * 1024
    max_file_bytes: Annotated[int, msgspec.Meta(ge=1024)] = 200 * 1024 * 1024
    max_batch_lines: PositiveInt = 50_000
    # Files: kept this long unless the upload says (expires_after), and at most
    # this much (bytes) and this many per owner. "" = beside the job journal.
    files_dir: str = ""
    file_retention: Annotated[float, msgspec.Meta(ge=3600)] = 30 * 24 * 3600.0
    max_owner_file_bytes: PositiveInt = 10 * 1024**3
    max_owner_files: PositiveInt = 1000
    # Connections: open at once (past it, requests get 503), seconds to send a
    # request's headers, its body, to take each piece of a response, and idle
    # between requests.
    max_connections: PositiveInt = 2048
    header_timeout: PositiveFloat = 10.0
    body_timeout: PositiveFloat = 60.0
    send_timeout: PositiveFloat = 60.0
    keep_alive_timeout: PositiveFloat = 5.0


class KvConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """``[kv]``: the KV-cache bucket floor, explicit cap, memory budget and prefix cache."""

    min_bucket: PositiveInt = 256
    max_len: NonNegInt = 0
    memory_budget: NonNegInt = 0
    # Prompt KV reused by items whose prompts begin with the same whole blocks
    # of prefix_block tokens; what it keeps is charged to memory_budget, at most
    # prefix_cache_bytes, and given back before any session is refused memory.
    prefix_cache: bool = True
    prefix_block: PositiveInt = 16
    prefix_cache_bytes: NonNegInt = 1 << 30
    # "owner": an entry serves only the owner whose prompt made it (a hit is
    # faster than a miss, so a shared cache tells tenants about each other's
    # prompts); "shared": everyone, for a daemon with one tenant.
    prefix_cache_scope: Literal["owner", "shared"] = "owner"


class SchedulerConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """``[scheduler]``: admission limits and what a failed growth does."""

    # 0: by provider, 16 on the CPU and 256 with CUDA (see AUTO_ACTIVE_SESSIONS).
    max_active_sessions: NonNegInt = 0
    max_queued_items: PositiveInt = 8192
    # One owner's share of the queue (0: half of max_queued_items), so one
    # user's big submit leaves room for everyone else's.
    max_queued_per_owner: NonNegInt = 0
    # The wire protocol carries at most 65536 items per submit.
    max_job_items: Annotated[int, msgspec.Meta(ge=1, le=65536)] = 4096
    # Items (and rejected lines) one open job may gather over all its messages.
    max_job_total: PositiveInt = 1_000_000
    prefill_chunk: PositiveInt = 256
    on_growth_failure: Literal["wait", "fail"] = "wait"
    growth_retries: NonNegInt = 8
    max_prompt_tokens: NonNegInt = 0
    max_new_tokens: PositiveInt = 4096


#: ``scheduler.max_active_sessions = 0`` by provider. A CPU run costs about the same per
#: row at 16 rows as at 256 (tiny: 19 and 16 us a row-step), so more sessions only
#: lengthen each one's steps; a GPU step costs about the same for 1 row as for 256, so
#: the device needs many rows to be busy (vLLM's max_num_seqs is 256 by default).
AUTO_ACTIVE_SESSIONS = {"cpu": 16, "cuda": 256}


def active_sessions(scheduler: SchedulerConfig, provider: str) -> SchedulerConfig:
    """``scheduler`` with ``max_active_sessions`` resolved for the provider that runs."""
    if scheduler.max_active_sessions:
        return scheduler
    return msgspec.structs.replace(
        scheduler, max_active_sessions=AUTO_ACTIVE_SESSIONS.get(provider, 16)
    )


class JobsConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """``[jobs]``: how long finished jobs stay available for re-attach."""

    retention: PositiveFloat = 3600.0
    max_retained: PositiveInt = 1000
    max_retained_tokens: PositiveInt = 2_000_000
    # The SQLite job journal: absent = a per-user file under $XDG_STATE_HOME,
    # "" = memory only (jobs die with the daemon).
    journal: str | None = None
    journal_sync: Literal["normal", "full"] = "normal"
    max_journal_bytes: Annotated[int, msgspec.Meta(ge=1 << 20)] = 1 << 30
    # An open job (still taking items) that nobody is attached to and that got
    # nothing for this long is closed: it then finishes with what it has.
    open_timeout: PositiveFloat = 600.0
    # Open jobs one owner may hold at once: an open job needs no item, so the
    # queue share alone would not bound how many a client can create.
    max_open_per_owner: PositiveInt = 16


class LogConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """``[log]``: level, rendering and an optional JSON-lines file."""

    level: Literal["debug", "info", "warning", "error"] = "info"
    format: Literal["auto", "json", "console"] = "auto"
    file: str = ""


class ShutdownConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """``[shutdown]``: the grace period active items get on SIGTERM."""

    grace: NonNegFloat = 30.0


class MetricsConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """``[metrics]``: the loopback address of the Prometheus endpoint, or off."""

    listen: str = ""


class Config(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """The whole daemon config; every table defaults to its defaults."""

    model: ModelConfig = msgspec.field(default_factory=ModelConfig)
    server: ServerConfig = msgspec.field(default_factory=ServerConfig)
    budget: BudgetConfig = msgspec.field(default_factory=BudgetConfig)
    http: HttpConfig = msgspec.field(default_factory=HttpConfig)
    kv: KvConfig = msgspec.field(default_factory=KvConfig)
    scheduler: SchedulerConfig = msgspec.field(default_factory=SchedulerConfig)
    jobs: JobsConfig = msgspec.field(default_factory=JobsConfig)
    log: LogConfig = msgspec.field(default_factory=LogConfig)
    shutdown: ShutdownConfig = msgspec.field(default_factory=ShutdownConfig)
    metrics: MetricsConfig = msgspec.field(default_factory=MetricsConfig)


def owner_queue_share(sched: SchedulerConfig) -> int:
    """How many queued items one owner may hold."""
    return sched.max_queued_per_owner or max(1, sched.max_queued_items // 2)


def load_config(path: Path | str) -> Config:
    """Read and validate the TOML config at ``path``; any failure is a :class:`ConfigError`."""
    source = str(path)
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        reason = exc.strerror or str(exc)
        raise ConfigError(f"cannot read config file: {reason}", path=source) from exc
    return parse_config(data, source=source)


def parse_config(text: str | bytes, *, source: str = "<string>") -> Config:
    """Decode and validate TOML ``text``; ``source`` names it in errors."""
    try:
        cfg = msgspec.toml.decode(text, type=Config)
    except msgspec.ValidationError as exc:
        key, message = _split_validation_error(str(exc))
        raise ConfigError(message, path=source, key=key) from exc
    except msgspec.DecodeError as exc:
        raise ConfigError(f"invalid TOML: {exc}", path=source) from exc
    except RecursionError:
        # tomllib recurses into inline arrays and tables; no config nests past a few.
        raise ConfigError("invalid TOML: arrays or tables nested too deep", path=source) from None
    _check(cfg, source)
    return cfg


def _with(cfg: Config, table: str, key: str, value: object, source: str) -> Config:
    """``cfg`` with one key of one table replaced (a kvmuxd flag), checked like the file."""
    replaced = msgspec.structs.replace(
        cfg, **{table: msgspec.structs.replace(getattr(cfg, table), **{key: value})}
    )
    _check(replaced, source)
    return replaced


def with_endpoint(cfg: Config, endpoint: str, *, source: str = "--endpoint") -> Config:
    """``cfg`` listening on ``endpoint`` instead (kvmuxd --endpoint)."""
    return _with(cfg, "server", "endpoint", endpoint, source)


def with_http(cfg: Config, listen: str, *, source: str = "--http") -> Config:
    """``cfg`` serving HTTP on ``listen`` instead ("" = off: kvmuxd --http)."""
    return _with(cfg, "http", "listen", listen, source)


def with_journal(cfg: Config, journal: str, *, source: str = "--journal") -> Config:
    """``cfg`` keeping its job journal at ``journal`` instead ("" = memory only: kvmuxd
    --journal): one config file for every ``kvmuxd@N``, each its own journal."""
    return _with(cfg, "jobs", "journal", journal, source)


def toml_config(tables: Mapping[str, Mapping[str, object]]) -> str:
    """A config file's text from ``{table: {key: value}}``: every kvmuxd table is flat,
    so this is all a program that writes configs for kvmuxd needs (no TOML writer in
    the standard library)."""
    lines: list[str] = []
    for table, values in tables.items():
        lines.append(f"[{table}]")
        lines.extend(f"{key} = {_toml_value(v)}" for key, v in values.items())
    return "\n".join(lines) + "\n"


def _toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a TOML basic string for what configs hold
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"cannot write {value!r} as a TOML config value")


_AT_PATH = re.compile(r"^(?P<message>.*) - at `\$(?P<path>[^`]*)`$", re.DOTALL)
_UNKNOWN_FIELD = re.compile(r"^Object contains unknown field `(?P<field>[^`]*)`$")


def _split_validation_error(text: str) -> tuple[str | None, str]:
    """Split msgspec's ``"<message> - at `$.a.b`"`` into (``"a.b"``, message)."""
    message, location = text, ""
    match = _AT_PATH.match(text)
    if match is not None:
        message, location = match["message"], match["path"]
    parts = [p for p in location.split(".") if p]
    unknown = _UNKNOWN_FIELD.match(message)
    if unknown is not None:
        table = ".".join(parts)
        where = f" in [{table}]" if table else " at the top level"
        parts.append(unknown["field"])
        message = f"unknown key{where}"
    return (".".join(parts) or None), message


def _check(cfg: Config, source: str) -> None:
    """Cross-field rules msgspec's per-field constraints cannot express."""

    def fail(key: str, message: str) -> ConfigError:
        return ConfigError(message, path=source, key=key)

    for table_name in cfg.__struct_fields__:
        table = getattr(cfg, table_name)
        for field_name in table.__struct_fields__:
            value = getattr(table, field_name)
            if isinstance(value, float) and not math.isfinite(value):
                raise fail(f"{table_name}.{field_name}", f"must be a finite number, got {value}")

    model = cfg.model
    default_name = ModelConfig().name
    if model.path:
        if model.name not in ("", default_name):
            raise fail(
                "model.name",
                f"is exclusive with model.path ({model.path!r}); "
                "leave model.name unset to serve the model folder",
            )
        if model.precision != "auto":
            raise fail(
                "model.precision",
                f"is for the built-in models; the folder {model.path!r} is served as it was "
                "built or imported (kvmux-model import-gguf --dequantize writes a float one)",
            )
    elif model.name not in BUILTIN_MODELS:
        raise fail(
            "model.name",
            f"unknown built-in model {model.name!r}; expected one of "
            f"{', '.join(BUILTIN_MODELS)} (or set model.path to a model folder)",
        )

    server = cfg.server
    if server.endpoint and not server.endpoint.startswith(_ENDPOINT_SCHEMES):
        raise fail(
            "server.endpoint",
            f"{server.endpoint!r} must start with one of {', '.join(_ENDPOINT_SCHEMES)} "
            "(or be empty for the default ipc socket)",
        )
    curve = bool(server.curve_secret_key)
    if curve != bool(server.curve_authorized_keys):
        raise fail(
            "server.curve_authorized_keys" if curve else "server.curve_secret_key",
            "CURVE needs both server.curve_secret_key (the server's certificate) and "
            "server.curve_authorized_keys (a folder of allowed clients' public certificates)",
        )
    if server.endpoint.startswith("tcp://") and not curve:
        problem = _loopback_tcp_problem(server.endpoint)
        if problem is not None:
            raise fail("server.endpoint", problem)
    if server.client_timeout <= server.heartbeat_interval:
        raise fail(
            "server.client_timeout",
            f"must be greater than server.heartbeat_interval ({server.heartbeat_interval}), "
            f"got {server.client_timeout}",
        )

    for key in server.operator_keys:
        if len(key) != 40:
            raise fail(
                "server.operator_keys",
                f"{key!r} is not a z85 CURVE public key (40 characters, as in a *.key file)",
            )

    sched = cfg.scheduler
    if sched.max_queued_per_owner > sched.max_queued_items:
        raise fail(
            "scheduler.max_queued_per_owner",
            f"must be <= scheduler.max_queued_items ({sched.max_queued_items}), "
            f"got {sched.max_queued_per_owner}",
        )
    share = owner_queue_share(sched)
    if sched.max_job_items > share:
        raise fail(
            "scheduler.max_job_items",
            f"must be <= one owner's share of the queue ({share}: "
            "scheduler.max_queued_per_owner, by default half of scheduler.max_queued_items), "
            f"got {sched.max_job_items}: a bigger job could never be admitted",
        )

    if cfg.metrics.listen:
        problem = _loopback_listen_problem(cfg.metrics.listen)
        if problem is not None:
            raise fail("metrics.listen", problem)

    http = cfg.http
    if http.listen:
        try:
            host, _ = split_listen(http.listen)
        except ValueError as exc:
            raise fail("http.listen", str(exc)) from None
        if not http.api_keys and not _is_loopback(host):
            raise fail(
                "http.listen",
                f"{http.listen!r} listens beyond loopback without API keys; set "
                "http.api_keys (a file of keys and their owners) or listen on 127.0.0.1",
            )
    if bool(http.tls_certfile) != bool(http.tls_keyfile):
        raise fail(
            "http.tls_keyfile" if http.tls_certfile else "http.tls_certfile",
            "TLS needs both http.tls_certfile and http.tls_keyfile (or neither: a reverse "
            "proxy terminates TLS)",
        )
    for name in http.served_model_names:
        if not name or len(name) > 256:
            raise fail("http.served_model_names", f"{name!r} is not a model name (1-256 chars)")


def _loopback_tcp_problem(endpoint: str) -> str | None:
    """Why a tcp endpoint without CURVE is refused: anything but loopback is open to all."""
    if _is_loopback(endpoint[len("tcp://") :].rpartition(":")[0].strip("[]")):
        return None
    return (
        f"{endpoint!r} listens beyond loopback without authentication; configure CURVE "
        "(server.curve_secret_key and server.curve_authorized_keys) or use an ipc:// socket "
        "or a 127.0.0.1 tcp endpoint"
    )


def split_listen(listen: str) -> tuple[str, int]:
    """``host:port`` (``[v6]:port``) as (host, port); ValueError if it is not one."""
    host, sep, port = listen.rpartition(":")
    if not sep or not host:
        raise ValueError(f"{listen!r} must be host:port, e.g. 127.0.0.1:9464")
    if not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"{listen!r} has an invalid port {port!r}; expected 0-65535")
    return host.removeprefix("[").removesuffix("]"), int(port)


def _is_loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _loopback_listen_problem(listen: str) -> str | None:
    """Why ``listen`` is not a loopback ``host:port``, or None when it is."""
    try:
        host, port = split_listen(listen)
    except ValueError as exc:
        return str(exc)
    if port == 0:
        return f"{listen!r} has an invalid port 0; expected 1-65535"
    if host.lower() == "localhost":
        return None
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return f"{listen!r}: host {host!r} must be localhost or a loopback IP address"
    if not address.is_loopback:
        return (
            f"{listen!r}: host {host!r} is not a loopback address; the metrics endpoint "
            "has no authentication, so it only listens on 127.0.0.0/8, ::1 or localhost"
        )
    return None
