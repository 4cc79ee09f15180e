"""``build_processor``: the kvmux stage with its replicas, in the shape of ``ray.data.llm``'s."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray.data

from kvmux.daemon.config import parse_config

from ._formats import Format
from ._replica import KvmuxReplica

# Batches (each a Ray task, each a job) one replica works on at once: with a few
# jobs queued in it, its daemon never waits for the next batch to arrive.
BATCHES_IN_FLIGHT = 4


@dataclass(frozen=True)
class ProcessorConfig:
    """How to run a dataset of batch lines on kvmux replicas.

    ``config`` is a kvmuxd config's TOML text (the same file on every
    replica; its socket and journal are replaced per replica), ``replicas``
    the size of the actor pool, each holding ``gpus_per_replica`` GPUs or
    ``cpus_per_replica`` CPUs (its daemon's onnxruntime threads unless the
    config names them). ``batch_size`` lines make one job; ``format`` is the
    result lines' shape, kvmux's or OpenAI's batch output.
    """

    config: str = ""
    replicas: int = 1
    cpus_per_replica: float = 1.0
    gpus_per_replica: float = 0.0
    batch_size: int = 64
    format: Format = "kvmux"
    max_restarts: int = 3
    startup_timeout: float = 300.0

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ValueError(f"replicas must be at least 1, got {self.replicas}")
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {self.batch_size}")
        if self.cpus_per_replica <= 0:
            raise ValueError(f"cpus_per_replica must be > 0, got {self.cpus_per_replica}")
        if self.gpus_per_replica < 0:
            raise ValueError(f"gpus_per_replica must be >= 0, got {self.gpus_per_replica}")
        # Found here, on the driver, rather than as N replicas failing to start.
        parse_config(self.config, source="the kvmuxd config")

    @classmethod
    def from_file(cls, path: str | Path | None, **kwargs: Any) -> ProcessorConfig:
        """The config file's text (none: kvmuxd's defaults) with the other fields given."""
        text = "" if path is None else Path(path).read_text(encoding="utf-8")
        return cls(config=text, **kwargs)


Processor = Callable[[ray.data.Dataset], ray.data.Dataset]


def build_processor(
    config: ProcessorConfig,
    preprocess: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
    postprocess: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
) -> Processor:
    """A function from a dataset of batch lines to a dataset of result lines.

    Like ``ray.data.llm.build_processor``: ``preprocess`` maps each input row
    to a row the stage takes (see :mod:`kvmux.ray._rows`), ``postprocess`` each
    output row to what the caller wants; both run as Ray Data ``map`` tasks.
    """
    gpu = config.gpus_per_replica > 0
    resources: dict[str, Any] = (
        {"num_gpus": config.gpus_per_replica, "num_cpus": 1}
        if gpu
        else {"num_cpus": config.cpus_per_replica}
    )
    stage_kwargs = {
        "config": config.config,
        "format": config.format,
        "threads": 0 if gpu else max(1, math.floor(config.cpus_per_replica)),
        "gpu": gpu,
        "max_restarts": config.max_restarts,
        "startup_timeout": config.startup_timeout,
    }

    def process(ds: ray.data.Dataset) -> ray.data.Dataset:
        if preprocess is not None:
            ds = ds.map(preprocess)
        ds = ds.map_batches(
            KvmuxReplica,
            fn_constructor_kwargs=stage_kwargs,
            # No batch waits in a replica's queue beyond those it runs: a batch
            # goes to whichever replica has room, so a replica that started first
            # (or runs faster) does not hoard the file.
            compute=ray.data.ActorPoolStrategy(
                size=config.replicas,
                max_concurrent_calls_per_actor=BATCHES_IN_FLIGHT,
                max_tasks_in_flight_per_actor=BATCHES_IN_FLIGHT,
            ),
            batch_size=config.batch_size,
            batch_format="pyarrow",
            **resources,
        )
        if postprocess is not None:
            ds = ds.map(postprocess)
        # Batches go out once every replica is up, not to the first one that is: a
        # replica a second ahead would take the first several batches of the file.
        # A cluster that cannot place the pool says so after this long, not never.
        ds.context.wait_for_min_actors_s = math.ceil(config.startup_timeout) + 60
        return ds

    return process
