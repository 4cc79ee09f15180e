"""Importing onnxruntime and creating a session on the provider that was asked for."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import RuntimeUnavailable

MIN_ORT = (1, 26)
INSTALL_HINT = (
    "install one runtime extra: pip install 'kvmux[cpu]' (CPU), 'kvmux[cuda12]' "
    "(NVIDIA, CUDA 12) or 'kvmux[cuda13]' (NVIDIA, CUDA 13) — never two of them"
)


def import_onnxruntime() -> Any:
    """onnxruntime, or :class:`RuntimeUnavailable` saying which extra to install."""
    try:
        ort = importlib.import_module("onnxruntime")
    except ImportError as exc:
        raise RuntimeUnavailable(f"onnxruntime is not installed ({exc}); {INSTALL_HINT}") from exc
    version = getattr(ort, "__version__", None)
    if version is None or not hasattr(ort, "InferenceSession"):
        # Uninstalling one of onnxruntime / onnxruntime-gpu guts the shared module.
        raise RuntimeUnavailable(f"the onnxruntime module is broken or partial; {INSTALL_HINT}")
    parts = tuple(int(p) for p in version.split(".")[:2] if p.isdigit())
    if parts < MIN_ORT:
        # 1.20 hangs at 100% CPU when a step writes past a shared KV buffer.
        raise RuntimeUnavailable(
            f"onnxruntime {version} is too old: kvmux needs >= {MIN_ORT[0]}.{MIN_ORT[1]}; "
            f"{INSTALL_HINT}"
        )
    return ort


@dataclass(frozen=True, slots=True)
class OrtSession:
    """An InferenceSession and the providers it actually runs on."""

    session: Any
    providers: tuple[str, ...]
    requested: str
    fell_back: bool
    ort: Any


def create_session(
    model_path: Path,
    *,
    provider: str = "cpu",
    device_id: int = 0,
    intra_op_threads: int = 0,
    cuda_graph: bool = False,
) -> OrtSession:
    """Create the session; report plainly when CUDA was asked for but CPU is running it.

    onnxruntime-gpu on a machine without a GPU still lists CUDA as available and
    silently falls back; only ``session.get_providers()`` after creation tells.
    """
    if provider not in ("cpu", "cuda"):
        raise ValueError(f"provider must be 'cpu' or 'cuda', got {provider!r}")
    ort = import_onnxruntime()
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = intra_op_threads
    opts.log_severity_level = 3
    providers: list[Any]
    if provider == "cuda":
        cuda_opts = {"device_id": str(device_id)}
        if cuda_graph:
            cuda_opts["enable_cuda_graph"] = "1"
        providers = [("CUDAExecutionProvider", cuda_opts), "CPUExecutionProvider"]
    else:
        providers = ["CPUExecutionProvider"]
    session = ort.InferenceSession(str(model_path), sess_options=opts, providers=providers)
    actual = tuple(session.get_providers())
    fell_back = provider == "cuda" and "CUDAExecutionProvider" not in actual
    return OrtSession(session, actual, provider, fell_back, ort)
