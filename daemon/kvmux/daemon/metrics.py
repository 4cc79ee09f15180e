"""Prometheus metrics: at /metrics of the HTTP API (``http.listen``), and on an optional
loopback port of their own (``metrics.listen``).

Counters and gauges are read from the daemon's own tallies when scraped, so
the decode loop pays nothing for them; only the latency histograms are
observed as events happen (once per growth, once per item).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
    start_http_server,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from .config import split_listen

if TYPE_CHECKING:
    from .app import Daemon

__all__ = ["CONTENT_TYPE_LATEST", "Metrics"]

_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class Metrics:
    """The daemon's registry: scrape-time tallies plus three histograms."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.lock_wait = Histogram(
            "kvmux_growth_lock_wait_seconds",
            "Time a KV growth waited for the growth lock",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.ttft = Histogram(
            "kvmux_time_to_first_token_seconds",
            "From job acceptance to an item's first token",
            buckets=_TTFT_BUCKETS,
            registry=self.registry,
        )
        self.tpot = Histogram(
            "kvmux_time_per_output_token_seconds",
            "Per item: decode time after the first token / (tokens - 1)",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.journal_write = Histogram(
            "kvmux_journal_commit_seconds",
            "Time one job-journal transaction took to commit (a turn's writes together)",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.replayed_items = Counter(
            "kvmux_journal_replayed_items",
            "Unfinished items queued again from the journal at start",
            registry=self.registry,
        )
        self._server: Any = None

    def attach(self, daemon: Daemon) -> None:
        self.registry.register(_DaemonCollector(daemon))

    def serve(self, listen: str) -> tuple[str, int]:
        """Start the HTTP endpoint on ``host:port`` (loopback, checked by the config)."""
        host, port = split_listen(listen)
        self._server, _ = start_http_server(port, addr=host, registry=self.registry)
        bound: tuple[str, int] = self._server.server_address[:2]
        return bound

    def exposition(self) -> bytes:
        """Every metric in Prometheus' text format (/metrics on the HTTP API's port)."""
        return generate_latest(self.registry)

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


class _DaemonCollector(Collector):
    def __init__(self, daemon: Daemon) -> None:
        self.daemon = daemon

    def collect(self) -> Iterator[Metric]:
        d = self.daemon
        sched, server, engine, coord = d.scheduler, d.server, d.engine, d.coordinator
        if sched is None or server is None or engine is None:
            return

        def counter(name: str, doc: str, value: float) -> Metric:
            family = CounterMetricFamily(name, doc)
            family.add_metric([], value)
            return family

        def gauge(name: str, doc: str, value: float | None) -> Metric:
            family = GaugeMetricFamily(name, doc)
            family.add_metric([], float("nan") if value is None else value)
            return family

        requests = CounterMetricFamily("kvmux_requests", "Requests received", labels=["outcome"])
        bad = server.rejected + server.dropped_frames
        requests.add_metric(["accepted"], server.requests - bad)
        requests.add_metric(["rejected"], server.rejected)
        requests.add_metric(["dropped"], server.dropped_frames)
        yield requests
        yield counter(
            "kvmux_clients_disconnected",
            "Connections shut for sending garbage past their budget",
            server.disconnected,
        )
        if d.journal is not None:
            yield gauge("kvmux_journal_bytes", "Job journal size on disk", d.journal.size())
        yield counter(
            "kvmux_replies_dropped",
            "Replies dropped for clients that do not read",
            server.lost_replies,
        )
        items = CounterMetricFamily("kvmux_items_finished", "Items finished", labels=["status"])
        for status, count in sorted(sched.finished_by_code.items()):
            items.add_metric([status], count)
        yield items
        yield counter("kvmux_tokens_generated", "Tokens generated", sched.tokens_generated)
        counts = sched.counts()
        yield gauge("kvmux_queue_depth", "Items waiting for a session", counts["sessions_queued"])
        yield gauge("kvmux_sessions_active", "Sessions decoding", counts["sessions_active"])
        yield gauge(
            "kvmux_sessions_parked", "Sessions waiting for memory", counts["sessions_parked"]
        )
        yield gauge("kvmux_jobs_active", "Jobs with unfinished items", counts["jobs_active"])
        yield gauge(
            "kvmux_kv_bytes_in_use", "KV cache bytes sessions hold", engine.session_kv_bytes()
        )
        # On CUDA the budget charges whole cohorts, rows in use or not: this is
        # the part sessions hold, to set against it.
        yield gauge(
            "kvmux_kv_bytes_rows",
            "KV bytes of the cohort rows sessions hold",
            engine.pool.used_bytes(),
        )
        yield gauge("kvmux_kv_budget_bytes", "kv.memory_budget (NaN: none)", engine.budget.total)
        yield counter("kvmux_kv_growths", "KV growths committed", coord.growths)
        yield counter("kvmux_kv_growth_bytes_copied", "Bytes copied by growths", coord.bytes_copied)
        failures = CounterMetricFamily(
            "kvmux_kv_growth_failures", "KV growths refused, by cause", labels=["cause"]
        )
        for cause in ("out_of_memory", "budget", "injected", "error"):
            failures.add_metric([cause], coord.failures.get(cause, 0))
        yield failures
        yield gauge("kvmux_clients", "Clients seen within client_timeout", server.clients)
        prefix = engine.prefix
        if prefix is not None:
            st = prefix.stats
            yield gauge(
                "kvmux_prefix_cache_bytes",
                "KV bytes of the prompt prefixes the cache keeps (charged to the budget)",
                prefix.bytes,
            )
            yield gauge("kvmux_prefix_cache_entries", "Prompt prefixes kept", st.entries)
            yield counter(
                "kvmux_prefix_cache_lookups", "Items whose prompt was looked up", st.lookups
            )
            yield counter(
                "kvmux_prefix_cache_prompt_tokens",
                "Prompt tokens of the items looked up",
                st.prompt_tokens,
            )
            yield counter(
                "kvmux_prefix_cache_hit_tokens",
                "Prompt tokens copied from a cached prefix instead of prefilled",
                st.hit_tokens,
            )
            yield counter(
                "kvmux_prefix_cache_hits", "Items that started on a cached prefix", st.hits
            )
            yield counter("kvmux_prefix_cache_evictions", "Kept prefixes evicted", st.evictions)
            yield counter(
                "kvmux_prefix_cache_waits",
                "Items that waited for another item's prefill of their prefix",
                st.waits,
            )
            yield counter(
                "kvmux_prefix_cache_fork_failures",
                "Prefix copies that failed (the item prefilled its whole prompt)",
                st.fork_failures,
            )
