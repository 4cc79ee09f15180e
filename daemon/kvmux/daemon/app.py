"""kvmuxd composed: config → engine (on its worker thread) → scheduler → server.

``Daemon.serve`` binds the socket (answering ``loading`` meanwhile), loads
the model, starts the metrics endpoint if configured, reports ready through
``task_status`` (tests) and systemd's notify socket (``READY=1``), then runs
until :meth:`Daemon.stop`, sending ``WATCHDOG=1`` and ``STATUS=`` from the
event loop itself so a stuck loop is caught. Stopping drains: ``STOPPING=1``,
no new jobs, active items get ``shutdown.grace`` seconds, the rest end with a
``shutdown`` error that reaches their clients.
"""

from __future__ import annotations

import gc
import os
import secrets
import tempfile
import time
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Literal

import anyio
import anyio.abc
import msgspec
import structlog

from kvmux.client import protocol as p
from kvmux.client.endpoint import daemon_default_endpoint
from kvmux.client.errors import ShuttingDown
from kvmux.kv import KvConfigError, MemoryBudget, failpoints, format_bytes, resolve_min_bucket

from .access import OPERATOR, Caller
from .batches import Batches, FileStore
from .budget import RequestBudget
from .config import Config, ConfigError, ModelConfig, active_sessions
from .coordinator import GrowthCoordinator
from .engine import Engine, EngineOptions
from .http import HttpFront
from .http.keys import ApiKeys
from .journal import Journal, default_journal_path
from .metrics import Metrics
from .model import resolve_model
from .model.smollm2 import SMOLLM2_HF_ID
from .notify import Notifier
from .scheduler import Scheduler, prefix_stats
from .server import Server, client_bound_bytes
from .service import Service
from .worker import EngineWorker

log = structlog.get_logger("kvmux.daemon")
failpoints.register("daemon.load")

try:
    DAEMON_VERSION = version("kvmux")
except PackageNotFoundError:  # a source tree without an install
    DAEMON_VERSION = "0+unknown"


# Sessions a status reply lists at most, so it stays within one message.
STATUS_SESSIONS = 1024

# [model] keys that name a file or folder (by name, so a key added later is checked too).
_PATH_SUFFIXES = ("path", "_file", "_template", "_dir")


def startup_problems(config: Config) -> list[ConfigError]:
    """What the daemon would refuse at start that the config's own validation cannot
    see: model paths that do not exist, a model folder without its ``genai_config.json``,
    an invalid ``KVMUX_KV_MIN_BUCKET``, CURVE key files that are not there
    (``kvmuxd --check-config``)."""
    problems: list[ConfigError] = []
    model = config.model
    for key in (f.name for f in msgspec.structs.fields(ModelConfig)):
        value = getattr(model, key)
        if key == "cache_dir" or not isinstance(value, str) or not value:
            continue  # the cache folder is created on first use
        if key == "path" or key.endswith(_PATH_SUFFIXES):
            where = Path(value)
            if not where.exists():
                problems.append(ConfigError(f"{where} does not exist", key=f"model.{key}"))
            elif key == "path" and not (where / "genai_config.json").is_file():
                problems.append(
                    ConfigError(
                        f"{where} holds no genai_config.json: not a model folder as "
                        "onnxruntime-genai's builder writes it",
                        key="model.path",
                    )
                )
    try:
        resolve_min_bucket(config.kv.min_bucket)
    except KvConfigError as exc:
        problems.append(ConfigError(str(exc), key="kv.min_bucket"))
    server = config.server
    if server.curve_secret_key and not Path(server.curve_secret_key).is_file():
        problems.append(
            ConfigError(f"{server.curve_secret_key} is not a file", key="server.curve_secret_key")
        )
    if config.http.api_keys:
        try:
            ApiKeys(config.http.api_keys).load()
        except ConfigError as exc:
            problems.append(exc)
    for key in ("tls_certfile", "tls_keyfile"):
        value = getattr(config.http, key)
        if value and not Path(value).is_file():
            problems.append(ConfigError(f"{value} is not a file", key=f"http.{key}"))
    if server.curve_authorized_keys and not Path(server.curve_authorized_keys).is_dir():
        problems.append(
            ConfigError(
                f"{server.curve_authorized_keys} is not a folder",
                key="server.curve_authorized_keys",
            )
        )
    return problems


def served_names(model: ModelConfig) -> list[str]:
    """The names HTTP requests may give the model when http.served_model_names is
    empty: its own, and for the built-in SmolLM2 its Hugging Face id too."""
    if model.path:
        return [model.path]
    return [model.name, *([SMOLLM2_HF_ID] if model.name == "smollm2" else [])]


class Daemon:
    """One model, one worker thread, one scheduler, one ROUTER socket."""

    def __init__(
        self,
        config: Config,
        *,
        serialize_growth: bool = True,
        growth_threads: int = 4,
        notifier: Notifier | None = None,
    ) -> None:
        self.config = config
        self.endpoint = config.server.endpoint or daemon_default_endpoint()
        self.state: Literal["loading", "ready", "draining"] = "loading"
        self.started = time.monotonic()
        self.notifier = notifier or Notifier()
        self._stop = anyio.Event()
        self.worker = EngineWorker()
        self.metrics = Metrics()
        self.coordinator = GrowthCoordinator(
            serialize=serialize_growth,
            threads=growth_threads,
            on_wait=self.metrics.lock_wait.observe,
        )
        self.engine: Engine | None = None
        self.scheduler: Scheduler | None = None
        self.server: Server | None = None
        self.model_name = config.model.path or config.model.name
        self.journal: Journal | None = None
        self.http: HttpFront | None = None
        self._files_tmp: tempfile.TemporaryDirectory[str] | None = None
        self.instance = secrets.token_hex(8)
        # Shared by every front: an owner's requests cost the same budget on each.
        self.budget = RequestBudget(config.budget)
        self.service = Service(budget=self.budget, hello=self.hello, status=self.status)

    # -- lifecycle ---------------------------------------------------------------
    def _load_engine(self) -> Engine:
        cfg = self.config
        resolve_min_bucket(cfg.kv.min_bucket)  # a bad KVMUX_KV_MIN_BUCKET fails here, at start
        # Every failpoint is registered by now (the engine's and the scheduler's too).
        failpoints.arm_from_env()
        failpoints.slow_from_env()
        failpoints.hit("daemon.load")  # tests slow it: what clients see while a model loads
        if cfg.model.path:
            folder = Path(cfg.model.path)
        else:
            cache = Path(cfg.model.cache_dir) if cfg.model.cache_dir else None
            folder = resolve_model(cfg.model.name, cache, cfg.model.precision)
        options = EngineOptions(
            provider=cfg.model.provider,
            device_id=cfg.model.device_id,
            intra_op_threads=cfg.model.intra_op_threads,
            prefill_chunk=cfg.scheduler.prefill_chunk,
            min_bucket=cfg.kv.min_bucket,
            max_len=cfg.kv.max_len or None,
            cuda_graph=cfg.model.cuda_graph,
            chat_template=Path(cfg.model.chat_template) if cfg.model.chat_template else None,
            prefix_cache=cfg.kv.prefix_cache,
            prefix_block=cfg.kv.prefix_block,
            prefix_cache_bytes=cfg.kv.prefix_cache_bytes,
            prefix_scope=cfg.kv.prefix_cache_scope,
        )
        return Engine(folder, options, budget=MemoryBudget(cfg.kv.memory_budget or None))

    async def serve(
        self, *, task_status: anyio.abc.TaskStatus[Daemon] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        try:
            server = Server(self.endpoint, self.config.server, self.service)
            self.server = server
            # Bound before the model loads: a second daemon on this socket fails
            # at once, and clients see "loading" rather than "unreachable" while
            # a large model loads (jobs are answered not_ready until then).
            server.bind()
            self.journal = self._open_journal()
            self.http = self._http_front()
            # Unfinished batches' jobs: restore must not prune them before they are done.
            pinned = self.http.batches.load() if self.http is not None else set()
            self.metrics.attach(self)
            async with anyio.create_task_group() as tg:
                await tg.start(server.serve)
                if self.http is not None:
                    await tg.start(self.http.serve)
                # The loop is alive while the model loads: keep systemd's watchdog fed.
                tg.start_soon(self._keepalive)
                log.info("daemon_loading", endpoint=self.endpoint, model=self.model_name)
                self.engine = await self.worker.run(self._load_engine)
                scheduler = Scheduler(
                    self.engine,
                    self.worker,
                    self.coordinator,
                    active_sessions(
                        self.config.scheduler, "cuda" if self.engine.on_cuda else "cpu"
                    ),
                    self.config.jobs,
                )
                scheduler.metrics = self.metrics
                scheduler.jobs.pinned.update(pinned)
                if self.journal is not None:
                    scheduler.journal = self.journal
                    started = time.perf_counter()
                    replayed = await scheduler.restore(
                        await anyio.to_thread.run_sync(self.journal.load)
                    )
                    self.metrics.replayed_items.inc(replayed)
                    log.info(
                        "journal_restored",
                        items_queued_again=replayed,
                        seconds=round(time.perf_counter() - started, 3),
                    )
                await tg.start(scheduler.run)
                self.scheduler = scheduler
                self.service.ready(scheduler)
                tg.start_soon(self._housekeeping)
                if self.http is not None:
                    self.http.loaded(self.engine.spec, self.config.scheduler.max_new_tokens)
                    await tg.start(self.http.batches.run)
                if self.config.metrics.listen:
                    host, port = self.metrics.serve(self.config.metrics.listen)
                    log.info("metrics_listening", url=f"http://{host}:{port}/metrics")
                # What was loaded so far (model, tokenizer, modules, restored jobs)
                # lives as long as the daemon. Frozen, a full collection skips it: one
                # holds the GIL, and with it the model thread, for as long as it scans
                # (10-20 ms without this, at 256 sessions). vLLM's freeze_gc_heap.
                gc.collect()
                gc.freeze()
                self.state = "ready"
                log.info(
                    "daemon_ready",
                    endpoint=self.endpoint,
                    model=self.model_name,
                    # Where a built-in resolved to, and what its weights are.
                    folder=str(self.engine.spec.folder),
                    precision=self.engine.spec.features.precision,
                    providers=list(self.engine.ort.providers),
                    pid=os.getpid(),
                    min_bucket=resolve_min_bucket(self.config.kv.min_bucket),
                    kv_budget_bytes=self.engine.budget.total,
                )
                self.notifier.ready(self.status_line())
                task_status.started(self)
                await self._stop.wait()
                await self._drain()
                tg.cancel_scope.cancel()
        finally:
            if self.journal is not None:
                self.journal.close()  # commits what is queued: finished results are kept
            if self._files_tmp is not None:
                self._files_tmp.cleanup()
            self.metrics.close()
            self.worker.close()
            self.notifier.close()
            log.info("daemon_stopped", endpoint=self.endpoint)

    async def _keepalive(self) -> None:
        """``WATCHDOG=1`` at half systemd's interval and a fresh ``STATUS=``, from the loop."""
        watchdog = self.notifier.watchdog_interval
        period = min(watchdog / 2, 5.0) if watchdog else 5.0
        while True:
            await anyio.sleep(period)
            if watchdog:
                self.notifier.watchdog()
            self.notifier.status(self.status_line())

    async def _housekeeping(self) -> None:
        while True:
            await anyio.sleep(1.0)
            self.service.housekeeping()
            if self.http is not None:
                self.http.housekeeping()

    def _http_front(self) -> HttpFront | None:
        """OpenAI's HTTP API (``http.listen``), bound now: a port in use stops the start,
        and /health answers ``loading`` while the model loads."""
        cfg = self.config.http
        if not cfg.listen:
            return None
        if cfg.files_dir:
            folder = Path(cfg.files_dir)
        elif self.journal is not None:
            folder = self.journal.path.with_name(self.journal.path.stem + ".files")
        else:
            # No journal: files last as long as the daemon, like its jobs.
            self._files_tmp = tempfile.TemporaryDirectory(prefix="kvmuxd-files-")
            folder = Path(self._files_tmp.name)
        files = FileStore(folder, self.journal, cfg)
        files.restore()
        names = list(cfg.served_model_names) or served_names(self.config.model)
        batches = Batches(self.service, files, self.journal, cfg, self.config.scheduler, names[0])
        front = HttpFront(
            cfg,
            self.service,
            files,
            batches,
            names=names,
            state=lambda: self.state,
            grace=self.config.shutdown.grace,
            metrics=self.metrics,
        )
        front.bind()
        return front

    def status_line(self) -> str:
        """One line for ``systemctl status``: state, sessions, KV in use."""
        if self.scheduler is None or self.engine is None:
            return self.state
        c = self.scheduler.counts()
        return (
            f"{self.state}: {c['sessions_active']} active, {c['sessions_queued']} queued, "
            f"{c['sessions_parked']} parked; KV {format_bytes(self.engine.budget.used)} in use"
        )

    def _open_journal(self) -> Journal | None:
        path = self.config.jobs.journal
        if path == "":
            log.warning(
                "journal_off",
                why='jobs.journal = "": jobs live in memory only and are lost when kvmuxd stops',
            )
            return None
        file = Path(path) if path else default_journal_path(self.endpoint)
        journal = Journal(file, sync=self.config.jobs.journal_sync)
        journal.on_commit = self.metrics.journal_write.observe
        log.info(
            "journal_opened",
            path=str(file),
            sync=self.config.jobs.journal_sync,
            bytes=journal.size(),
        )
        return journal

    def reload(self) -> None:
        """SIGHUP: re-read what can change without a restart (CURVE authorized keys,
        HTTP API keys)."""
        if self.server is not None:
            self.server.reload_keys()
        if self.http is not None:
            self.http.reload_keys()

    def stop(self) -> None:
        """Begin a graceful stop (drain); safe to call more than once."""
        self._stop.set()

    async def _drain(self) -> None:
        scheduler, server = self.scheduler, self.server
        assert scheduler is not None and server is not None
        self.state = "draining"
        scheduler.draining = True
        self.notifier.stopping(self.status_line())
        grace = self.config.shutdown.grace
        # A warning: unfinished items may end (or wait for a restart) because of it.
        log.warning("daemon_draining", grace_seconds=grace, **scheduler.counts())
        # Items, not jobs: an open job waiting for more items has nothing to
        # finish (journaled, it comes back open; else it ends with the rest).
        with anyio.move_on_after(grace):
            while _has_items(scheduler):
                await anyio.sleep(0.05)
        stopped = ShuttingDown(
            f"kvmuxd shut down before this item finished (shutdown.grace {grace:g} s)",
            {"grace_seconds": grace},
        )
        if self.journal is not None:
            # Nothing journaled is failed: what did not finish stays in the journal
            # and runs when kvmuxd is back; clients wait for it and re-attach. An
            # HTTP request's job is not journaled: its client hears why it ends.
            scheduler.cancel_all(stopped, transient_only=True)
            if _has_items(scheduler):
                log.warning(
                    "daemon_stopping_with_work",
                    journal=str(self.journal.path),
                    **scheduler.counts(),
                )
        else:
            scheduler.cancel_all(stopped)
        with anyio.move_on_after(5.0):
            while _unfinished_transient(scheduler) if self.journal else not scheduler.idle:
                await anyio.sleep(0.01)
        await server.flush()

    # -- what clients ask ---------------------------------------------------------
    def hello(self) -> p.Welcome:
        cfg = self.config
        return p.Welcome(
            id=0,
            version=p.PROTOCOL_VERSION,
            daemon_version=DAEMON_VERSION,
            model=self.model_name,
            heartbeat_interval=cfg.server.heartbeat_interval,
            max_message_bytes=cfg.server.max_message_bytes,
            max_job_items=cfg.scheduler.max_job_items,
            instance=self.instance,
        )

    def status(self, caller: Caller = OPERATOR) -> p.DaemonStatus:
        """The daemon's state; ``sessions`` only of jobs ``caller`` may see."""
        engine, scheduler, cfg = self.engine, self.scheduler, self.config
        # While the model loads there is no engine or scheduler yet: zeros, and
        # what the config already says.
        mem = engine.memory() if engine is not None else None
        counts = (
            scheduler.counts()
            if scheduler is not None
            else dict.fromkeys(
                (
                    "jobs_active",
                    "jobs_retained",
                    "sessions_active",
                    "sessions_queued",
                    "sessions_parked",
                ),
                0,
            )
        )
        sessions = scheduler.sessions(caller) if scheduler is not None else []
        return p.DaemonStatus(
            state=self.state,
            version=DAEMON_VERSION,
            pid=os.getpid(),
            uptime_seconds=time.monotonic() - self.started,
            model=self.model_name,
            provider=("cuda" if engine.on_cuda else "cpu") if engine else cfg.model.provider,
            clients=self.server.clients if self.server else 0,
            **counts,
            kv_bytes_in_use=engine.session_kv_bytes() if engine else 0,
            kv_peak_bytes=engine.budget.peak if engine else 0,
            kv_budget_bytes=engine.budget.total if engine else (cfg.kv.memory_budget or None),
            kv_bytes_per_token=engine.kv_spec.bytes_per_token if engine else 0,
            min_bucket=resolve_min_bucket(cfg.kv.min_bucket),
            device_free_bytes=None if mem is None else mem.free,
            device_total_bytes=None if mem is None else mem.total,
            memory_source="unavailable" if mem is None else mem.source,
            growth=self.coordinator.stats(),
            sessions=sessions[:STATUS_SESSIONS],
            sessions_omitted=max(0, len(sessions) - STATUS_SESSIONS),
            caller=caller.owner,
            caller_is_operator=caller.operator,
            frames_rejected=self.server.rejected if self.server else 0,
            frames_dropped=self.server.dropped_frames if self.server else 0,
            clients_disconnected=self.server.disconnected if self.server else 0,
            replies_dropped=self.server.lost_replies if self.server else 0,
            requests_refused=self.budget.refused,
            client_bound_bytes=client_bound_bytes(cfg.server),
            http_url=self.http.url if self.http is not None else "",
            prefix_cache=prefix_stats(engine.prefix) if engine is not None else None,
            model_folder=str(engine.spec.folder) if engine is not None else "",
            model_precision=engine.spec.features.precision if engine is not None else "",
            chat_template=engine is not None and engine.chat_template is not None,
        )


def _unfinished_transient(scheduler: Scheduler) -> list[str]:
    return [j.job_id for j in scheduler.jobs.live.values() if j.transient]


def _has_items(scheduler: Scheduler) -> bool:
    """Whether items are queued, decoding or parked (what a drain waits for)."""
    c = scheduler.counts()
    return c["sessions_active"] + c["sessions_queued"] + c["sessions_parked"] > 0
