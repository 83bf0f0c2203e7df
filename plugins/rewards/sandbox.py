"""Run untrusted (model-written) Python in a separate, resource-limited, network-less process.

Mechanisms, all existing ones (nothing here is a home-made jail):

* **bubblewrap** (Debian package ``bubblewrap``, ``apt-get install -y bubblewrap``) when ``bwrap`` is on PATH and
  works: new user, PID, network, IPC, UTS and cgroup namespaces (``--unshare-all``), only ``/usr`` (+ the ``/bin``,
  ``/lib*`` links) mounted read-only, a private ``/tmp`` tmpfs, the fresh work directory bound read-write at
  ``/tmp/work``, empty environment (``--clearenv``), ``--die-with-parent``, ``--new-session``.
* **unshare + setpriv** (util-linux) when running as root without bubblewrap: new network and PID namespaces; the
  file system is the host's, protected only by the unprivileged uid (see below).
* **plain** otherwise: only the resource limits, the uid of the caller, the scrubbed environment and the temp dir.

Always, in the child before ``exec`` (``preexec_fn``): ``setrlimit`` for CPU seconds, address space, file size (which
also caps the captured stdout/stderr: they are files, so writing past the cap kills the child with SIGXFSZ), process
count and core dumps; a new session (so a timeout kills the whole process group); and, when the parent is root, a
switch to an unprivileged uid/gid drawn per sandbox from ``UID_RANGE`` (so RLIMIT_NPROC, which root ignores, is
enforced and counted per sandbox, and the code cannot signal the trainer or write files owned by root). The parent
enforces a wall-clock timeout and kills the process group (and, with bubblewrap, the PID namespace) on expiry.

What it protects: the trainer process and its files (other uid, PID namespace), the network (network namespace;
not in *plain* mode), the environment's secrets, the host's CPU/memory/disk from runaway code, the trainer's memory
from gigantic outputs. What it does NOT protect: kernel exploits (no seccomp filter, shared kernel); reading files
that are world-readable under ``/usr`` (bubblewrap) or anywhere on the host (other modes); writing world-writable
places such as ``/tmp`` and ``/dev/shm`` outside bubblewrap; side channels and CPU contention between parallel
sandboxes (no cgroup CPU quota); without root and bubblewrap, RLIMIT_NPROC counts all processes of the caller's uid.
"""

from __future__ import annotations

import os
import random
import resource
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

UID_RANGE = (200_000, 260_000)  # unprivileged uids used for sandboxes when the parent is root
SAFE_PATH = "/usr/local/bin:/usr/bin:/bin"


@dataclass(frozen=True)
class SandboxLimits:
    wall_seconds: float = 10.0
    cpu_seconds: int = 10
    memory_bytes: int = 1 << 30  # RLIMIT_AS
    file_bytes: int = 16 << 20  # RLIMIT_FSIZE: any file written, stdout/stderr included
    max_processes: int = 32  # RLIMIT_NPROC (per sandbox uid when the parent is root)
    output_bytes: int = 64 << 10  # how much stdout/stderr the parent reads back


@dataclass
class SandboxResult:
    returncode: int | None  # None: killed by the wall-clock timeout
    stdout: str
    stderr: str
    timed_out: bool
    seconds: float
    backend: str

    @property
    def passed(self) -> bool:
        return self.returncode == 0 and not self.timed_out


def default_python() -> str:
    """A system interpreter every uid can execute (the venv's may live under a private home directory)."""
    return "/usr/bin/python3" if os.access("/usr/bin/python3", os.X_OK) else shutil.which("python3") or "python3"


@lru_cache(maxsize=None)
def available_backend() -> str:
    """``bwrap`` if bubblewrap works here, else ``unshare`` if root and util-linux can isolate, else ``plain``."""
    if shutil.which("bwrap"):
        probe = subprocess.run([*_bwrap_prefix("/tmp"), "true"], capture_output=True, timeout=30,
                               preexec_fn=_preexec(SandboxLimits(), _pick_uid()))
        if probe.returncode == 0:
            return "bwrap"
    if os.geteuid() == 0 and shutil.which("unshare") and shutil.which("setpriv"):
        probe = subprocess.run(["unshare", "--net", "--pid", "--fork", "--kill-child", "true"], capture_output=True,
                               timeout=30)
        if probe.returncode == 0:
            return "unshare"
    return "plain"


def _pick_uid() -> int | None:
    return random.randrange(*UID_RANGE) if os.geteuid() == 0 else None


def _bwrap_prefix(workdir: str) -> list[str]:
    args = ["bwrap", "--ro-bind", "/usr", "/usr"]
    for link in ("/bin", "/sbin", "/lib", "/lib64", "/lib32"):
        if os.path.islink(link):
            args += ["--symlink", os.readlink(link), link]
        elif os.path.isdir(link):
            args += ["--ro-bind", link, link]
    return args + ["--dev", "/dev", "--proc", "/proc", "--tmpfs", "/tmp", "--bind", workdir, "/tmp/work",
                   "--chdir", "/tmp/work", "--unshare-all", "--die-with-parent", "--new-session", "--clearenv",
                   "--setenv", "PATH", SAFE_PATH, "--setenv", "HOME", "/tmp/work", "--setenv", "LANG", "C.UTF-8"]


def _preexec(limits: SandboxLimits, uid: int | None, drop_in_child: bool = True):
    def apply() -> None:
        os.setsid()
        for which, value in ((resource.RLIMIT_CPU, limits.cpu_seconds), (resource.RLIMIT_AS, limits.memory_bytes),
                             (resource.RLIMIT_FSIZE, limits.file_bytes), (resource.RLIMIT_NPROC, limits.max_processes),
                             (resource.RLIMIT_CORE, 0)):
            resource.setrlimit(which, (value, value))
        if uid is not None and drop_in_child:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)

    return apply


def run_python(source: str, limits: SandboxLimits = SandboxLimits(), backend: str | None = None,
               python: str | None = None) -> SandboxResult:
    """Run ``source`` as ``main.py`` in a fresh temp dir under the sandbox; never raises for the code's misbehaviour."""
    backend = backend or available_backend()
    python = python or default_python()
    uid = _pick_uid()
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="trl-ext-sandbox-") as root:
        os.chmod(root, 0o711)  # the sandbox uid may traverse, not list, the parent folder
        work = Path(root, "work")
        work.mkdir()
        (work / "main.py").write_text(source)
        if uid is not None:
            os.chown(work, uid, uid)
            os.chown(work / "main.py", uid, uid)
        env = {"PATH": SAFE_PATH, "HOME": str(work), "LANG": "C.UTF-8"}
        if backend == "bwrap":
            argv, cwd, unshare_as_root = [*_bwrap_prefix(str(work)), python, "-I", "main.py"], str(work), False
        elif backend == "unshare":  # namespaces need root, so the uid is dropped by setpriv after unshare
            argv = ["unshare", "--net", "--pid", "--fork", "--kill-child", "--mount-proc",
                    "setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", python, "-I", "main.py"]
            cwd, unshare_as_root = str(work), True
        else:
            argv, cwd, unshare_as_root = [python, "-I", "main.py"], str(work), False
        out_path, err_path = Path(root, "stdout"), Path(root, "stderr")
        with open(out_path, "wb") as out, open(err_path, "wb") as err:
            proc = subprocess.Popen(argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                    preexec_fn=_preexec(limits, uid, drop_in_child=not unshare_as_root),
                                    close_fds=True)
            timed_out = False
            try:
                proc.wait(timeout=limits.wall_seconds)
            except subprocess.TimeoutExpired:
                timed_out = True
            finally:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)  # whole session: stragglers and forks too
                except (ProcessLookupError, PermissionError):
                    pass
                proc.wait()
        result = SandboxResult(
            returncode=None if timed_out else proc.returncode,
            stdout=_read_capped(out_path, limits.output_bytes),
            stderr=_read_capped(err_path, limits.output_bytes),
            timed_out=timed_out, seconds=time.monotonic() - start, backend=backend)
    return result


def _read_capped(path: Path, cap: int) -> str:
    with open(path, "rb") as handle:
        return handle.read(cap).decode("utf-8", errors="replace")
