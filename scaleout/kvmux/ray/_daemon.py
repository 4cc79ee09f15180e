"""A replica's kvmuxd: a child process in a folder of its own that never outlives its parent.

Each daemon gets its own socket and job journal in a fresh folder, so any
number of replicas share a node (and the user's config, whatever socket or
journal it names). The child is started through a small launcher that sets
``PR_SET_PDEATHSIG`` and then execs kvmuxd: when the process that started it
dies by any means (SIGKILL of a Ray actor, an OOM kill, Ray shutting a
worker down) the kernel kills the daemon too. Folders left by parents that
died that way are removed by the next replica that starts on the node.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import tomllib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from kvmux.client import Client, DaemonUnreachable
from kvmux.daemon.config import toml_config

TMPDIR_ENV = "KVMUX_RAY_TMPDIR"
"""Where replicas put their daemons' folders (default: the system's temp folder)."""

_PREFIX = "kvmux-ray-"
_FOLDER = re.compile(rf"^{_PREFIX}(\d+)-")
# Unix socket paths are cut at 108 bytes; past this the folder goes to /tmp instead.
_MAX_SOCKET_PATH = 100

# Runs in the child before kvmuxd: the death signal survives exec, and a parent
# that died between fork and prctl is caught by comparing the parent's pid.
_LAUNCHER = """\
import ctypes, os, signal, sys
PR_SET_PDEATHSIG = 1
if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL) != 0:
    sys.exit("kvmux.ray: prctl(PR_SET_PDEATHSIG) failed: " + os.strerror(ctypes.get_errno()))
if os.getppid() != int(sys.argv[1]):
    sys.exit("kvmux.ray: the replica that started this kvmuxd is gone")
os.execv(sys.executable, [sys.executable, "-m", "kvmux.daemon", *sys.argv[2:]])
"""


class DaemonFailed(RuntimeError):
    """kvmuxd could not be started (its config, its model, its machine): the replica cannot run."""


def replica_config(
    user_config: str, folder: Path, *, threads: int = 0, gpu: bool = False
) -> dict[str, dict[str, Any]]:
    """The user's config tables with what a replica's daemon must have of its own.

    The socket and the journal go in the replica's folder (two daemons cannot
    share either); metrics are off, since every replica on a node would want
    the same port. ``threads`` fills ``model.intra_op_threads`` where the user
    left it to onnxruntime (0): a replica gets the CPUs Ray gave it, not the
    node's. With ``gpu``, Ray has set ``CUDA_VISIBLE_DEVICES`` to this
    replica's device(s), so the daemon's device is the first one it sees.
    """
    tables: dict[str, dict[str, Any]] = {k: dict(v) for k, v in tomllib.loads(user_config).items()}
    model = tables.setdefault("model", {})
    if threads and not model.get("intra_op_threads"):
        model["intra_op_threads"] = threads
    if gpu:
        model["device_id"] = 0
    tables.setdefault("server", {})["endpoint"] = f"ipc://{folder}/kvmuxd.sock"
    tables.setdefault("jobs", {})["journal"] = str(folder / "jobs.sqlite3")
    tables.setdefault("metrics", {})["listen"] = ""
    return tables


class Daemon:
    """One kvmuxd child: started, watched, stopped; ``generation`` counts its starts.

    Every start happens on one thread of this object's own that lives as
    long as it does: the kernel sends the death signal when the *thread* that
    forked the child ends, and Ray runs a replica's code on threads of its own
    choosing.
    """

    def __init__(
        self,
        user_config: str,
        *,
        threads: int = 0,
        gpu: bool = False,
        root: str | None = None,
        startup_timeout: float = 300.0,
    ) -> None:
        self.user_config = user_config
        self.threads = threads
        self.gpu = gpu
        self.root = Path(root or os.environ.get(TMPDIR_ENV) or tempfile.gettempdir())
        self.startup_timeout = startup_timeout
        self.generation = 0
        self.folder: Path | None = None
        self.proc: subprocess.Popen[bytes] | None = None
        self._spawner = ThreadPoolExecutor(1, thread_name_prefix="kvmuxd-spawner")

    @property
    def endpoint(self) -> str:
        assert self.folder is not None
        return f"ipc://{self.folder}/kvmuxd.sock"

    @property
    def log_path(self) -> Path:
        assert self.folder is not None
        return self.folder / "kvmuxd.log"

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def describe_exit(self) -> str:
        rc = None if self.proc is None else self.proc.poll()
        if rc is None:
            return "still running" if self.proc is not None else "never started"
        if rc < 0:
            return f"killed by {signal.Signals(-rc).name}"
        return f"exited with status {rc}"

    async def start(self) -> None:
        """Start a new kvmuxd (stopping one that runs) and return once it takes jobs."""
        await asyncio.get_running_loop().run_in_executor(self._spawner, self._spawn)
        await self._wait_ready()

    def _spawn(self) -> None:
        self.kill()
        remove_orphaned_folders(self.root)
        root = self.root
        if len(str(root)) > _MAX_SOCKET_PATH - 40:
            root = Path("/tmp")  # the socket path must fit in 108 bytes
        self.folder = Path(tempfile.mkdtemp(prefix=f"{_PREFIX}{os.getpid()}-", dir=root))
        config = self.folder / "kvmuxd.toml"
        tables = replica_config(self.user_config, self.folder, threads=self.threads, gpu=self.gpu)
        config.write_text(toml_config(tables))
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", _LAUNCHER, str(os.getpid()), "--config", str(config)],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                # Its own session: a Ctrl-C at the terminal that started Ray is the
                # replica's to handle, not a signal for the daemon to drain on.
                start_new_session=True,
            )
        self.generation += 1

    async def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.startup_timeout
        while True:
            proc = self.proc
            assert proc is not None
            if proc.poll() is not None:
                failure = f"kvmuxd exited with status {proc.returncode} at start:\n"
                failure += self.log_tail()
                self.kill()
                raise DaemonFailed(failure)
            with contextlib.suppress(DaemonUnreachable, TimeoutError):
                async with Client(self.endpoint, timeout=1.0, name="kvmux-ray-probe") as probe:
                    # The socket answers while the model loads; jobs wait for ready.
                    if (await probe.status()).state == "ready":
                        return
            if time.monotonic() > deadline:
                failure = f"kvmuxd did not become ready within {self.startup_timeout:g} s:\n"
                failure += self.log_tail()
                self.kill()
                raise DaemonFailed(failure)
            await asyncio.sleep(0.05)

    def log_tail(self, n: int = 4000) -> str:
        if self.folder is None or not self.log_path.exists():
            return ""
        return self.log_path.read_text(errors="replace")[-n:]

    def kill(self) -> None:
        """SIGKILL the daemon and drop its folder (its journal holds nothing to keep:
        the replica has every result it received, and reruns the rest)."""
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.kill()
            self.proc.wait()
            self.proc = None
        self._remove_folder()

    def stop(self, grace: float = 10.0) -> None:
        """SIGTERM (kvmuxd drains: nothing is running by now), SIGKILL after ``grace``."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=grace)
        self.kill()
        self._spawner.shutdown(wait=False)

    def _remove_folder(self) -> None:
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)
            self.folder = None


async def exited(proc: subprocess.Popen[bytes]) -> int:
    """Wait until ``proc`` ends; its exit status."""
    if proc.poll() is not None:
        return proc.returncode
    # A pidfd becomes readable when the process ends: no thread, no polling.
    try:
        fd = os.pidfd_open(proc.pid)
    except ProcessLookupError:  # it ended, and was reaped, since the poll above
        return proc.wait()
    loop = asyncio.get_running_loop()
    ended: asyncio.Future[None] = loop.create_future()

    def wake() -> None:
        if not ended.done():
            ended.set_result(None)

    loop.add_reader(fd, wake)
    try:
        await ended
    finally:
        loop.remove_reader(fd)
        os.close(fd)
    return proc.wait()


def remove_orphaned_folders(root: Path) -> None:
    """Remove this user's replica folders whose replica process is gone (killed, so it
    could not clean up)."""
    try:
        entries = list(os.scandir(root))
    except OSError:
        return
    for entry in entries:
        match = _FOLDER.match(entry.name)
        if match is None or not entry.is_dir(follow_symlinks=False):
            continue
        with contextlib.suppress(OSError):
            if entry.stat(follow_symlinks=False).st_uid != os.getuid():
                continue
            if _pid_alive(int(match[1])):
                continue
            shutil.rmtree(entry.path, ignore_errors=True)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process: not ours to judge
    return True
