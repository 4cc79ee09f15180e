"""kvmux.client: the wire protocol, the async client and the ``kvmux`` CLI.

Installs without onnxruntime: nothing here imports the daemon or the engine.
"""

from importlib.metadata import PackageNotFoundError, version

from ._client import Client, Job
from .endpoint import ENDPOINT_ENV, client_default_endpoint, daemon_default_endpoint
from .errors import (
    BadRequest,
    Cancelled,
    CapacityExceeded,
    DaemonUnreachable,
    GrowthFailed,
    Internal,
    KvmuxError,
    NotFound,
    NotReady,
    Overloaded,
    RunFailed,
    ShuttingDown,
    StorageFull,
    Unauthorized,
    VersionMismatch,
    error_from_info,
)
from .follow import results_through_restarts
from .protocol import (
    PROTOCOL_VERSION,
    DaemonStatus,
    Event,
    Item,
    ItemResult,
    StructuredOutputs,
)

try:
    __version__ = version("kvmux")
except PackageNotFoundError:  # run from a source tree that was never installed
    __version__ = "0+unknown"

__all__ = [
    "ENDPOINT_ENV",
    "PROTOCOL_VERSION",
    "BadRequest",
    "Cancelled",
    "CapacityExceeded",
    "Client",
    "DaemonStatus",
    "DaemonUnreachable",
    "Event",
    "GrowthFailed",
    "Internal",
    "Item",
    "ItemResult",
    "Job",
    "KvmuxError",
    "NotFound",
    "NotReady",
    "Overloaded",
    "RunFailed",
    "ShuttingDown",
    "StorageFull",
    "StructuredOutputs",
    "Unauthorized",
    "VersionMismatch",
    "client_default_endpoint",
    "daemon_default_endpoint",
    "error_from_info",
    "results_through_restarts",
]
