"""kvmux.ray: kvmux on a Ray cluster, one kvmuxd per GPU (or per share of CPUs).

A Ray Data stage (:class:`KvmuxReplica`) owns one kvmuxd per actor and runs
batches of batch-file lines on it; :func:`build_processor` puts it in a
pipeline, :func:`read_batch` reads a file into its rows, and ``kvmux-ray
submit`` does it all for a file. Needs the ``ray`` extra (``pip install
'kvmux[ray]'``); nothing else in kvmux imports Ray.
"""

try:
    import ray.data  # noqa: F401 - checked here, once, for a clear message
except ImportError as exc:  # pragma: no cover - depends on the install
    raise ImportError(
        "kvmux.ray needs Ray Data: install the ray extra (pip install 'kvmux[ray]')"
    ) from exc

from ._daemon import TMPDIR_ENV, DaemonFailed
from ._processor import ProcessorConfig, build_processor
from ._read import BatchFile, read_batch
from ._replica import KvmuxReplica
from ._rows import OUTPUT_COLUMNS

__all__ = [
    "OUTPUT_COLUMNS",
    "TMPDIR_ENV",
    "BatchFile",
    "DaemonFailed",
    "KvmuxReplica",
    "ProcessorConfig",
    "build_processor",
    "read_batch",
]
