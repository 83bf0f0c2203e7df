"""Run one candidate program's tests in a throw-away sandbox and return its raw outputs (never a verdict).

The trainer talks to :mod:`trl_ext_plugins.rewards.code_harness` (run by the sandbox's interpreter) over two pipes:
one setup line (source and per-test limits), then one request per test, each answered by one JSON line holding the
candidate's output bytes and exit status. Verdicts are computed by the caller (:mod:`code_tests`), outside the
sandbox, against expected values that never enter it.

Backends
--------
``bwrap`` (default and required; Debian/Ubuntu package ``bubblewrap``):

* namespaces: new user, PID, network, IPC, UTS, cgroup and mount namespaces (``--unshare-all --unshare-user``); the
  harness is the PID namespace's init (``--as-pid-1``), so when it ends, or when the trainer kills the sandbox
  (``--die-with-parent``), the kernel kills every process in the namespace, including ones that called ``setsid`` or
  daemonized; no nested user namespace can be created (``--disable-userns``, bubblewrap >= 0.8), so the candidate
  never gains the capabilities to mount a file system of its own (an uncapped tmpfs, say);
* file system: only the interpreter, its standard library (``site-packages``/``dist-packages`` hidden) and the shared
  libraries they load (found with ``ldd``), read-only; a fresh ``/proc`` and minimal ``/dev``; a private size-capped
  tmpfs at ``/tmp`` (also at ``/dev/shm``). Once these are mounted, ``/`` and ``/dev`` (bubblewrap's own tmpfs
  instances, with no size cap) are remounted read-only, so ``/tmp`` and ``/dev/shm`` are the only writable places.
  Nothing of the host (the project, ``/work``, ``/run``, ``/var``, ``/etc``, the trainer's ``/tmp``) is visible; no
  host unix socket or network is reachable (network namespace with only an unconfigured loopback). The harness
  empties ``/tmp`` and ``/dev/shm`` after every test, so no file carries over from one test to the next;
* empty environment (``--clearenv``), a new terminal session (``--new-session``), no capabilities (``--cap-drop
  ALL``, which also holds when bubblewrap itself is started as root).

Whole-sandbox limits, when the trainer runs as root on cgroup v1 (this project's machines): a cgroup per sample for
``memory`` (``memory.limit_in_bytes`` and the swap-inclusive ``memsw`` limit; tmpfs pages count), ``pids``
(``pids.max``: all processes and threads of the sample together) and ``cpu`` (CFS quota, ``cpu_cores``); the private
``/tmp`` is a tmpfs mounted by the trainer in a mount namespace of the sample's own, with ``size=`` and
``nr_inodes=`` (the file-count cap); each concurrent sample runs under its own unprivileged uid. cgroup v2 is not
implemented yet: there, and when not root, the documented fallback applies: ``RLIMIT_NPROC`` (per uid; as root a
uid of the sample's own, so the count is the sample's total), ``RLIMIT_AS`` per process (so total memory is bounded by
``max_processes x memory_bytes``, not ``memory_bytes``), bubblewrap's ``--size`` on the ``/tmp`` tmpfs (no file-count
cap beyond what fits in memory), no CPU quota. :func:`isolation_report` says which applies.
Always: per-test CPU seconds (measured by the harness for every process of the test, see :mod:`code_harness`: a test
over its limit is a timeout whatever it printed; ``RLIMIT_CPU`` a second later ends a runaway) and wall seconds (the
harness kills the test and every other process in the namespace), deadlines in the trainer for each reply (it kills
the sandbox), ``RLIMIT_FSIZE``, ``RLIMIT_NOFILE``, no core dumps, an output cap per test.

With bubblewrap older than 0.8 (no ``--disable-userns``) nested user namespaces stay possible: a tmpfs the candidate
mounts there is charged to the memory cgroup, but in the fallback it is bounded by nothing; :func:`isolation_report`
says which applies. In the fallback without root, ``/tmp`` has no file-count cap (bubblewrap cannot set
``nr_inodes``): the number of empty files a test can create there is bounded by its time only (and they are
removed after it).

``unsafe_subprocess`` (explicit opt-in only): the same harness as a plain subprocess with rlimits and a temp work dir.
It gives up the file-system isolation (the candidate can read the project, the tests on disk and other samples' files,
and write wherever the trainer's uid may), the network isolation, the PID namespace (processes that call ``setsid``
outlive the sample and can signal the trainer), the private ``/tmp`` and the whole-sandbox limits.

Not protected by either: kernel exploits (no seccomp filter), CPU-cache side channels between parallel samples.
"""

from __future__ import annotations

import itertools
import json
import os
import random
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

HARNESS_SOURCE = (Path(__file__).with_name("code_harness.py")).read_text()
BACKENDS = ("bwrap", "unsafe_subprocess")
UNSAFE_WARNING = ("unit_tests: backend 'unsafe_subprocess' runs model-written code WITHOUT isolation: it can read the "
                  "project's source and any test data on disk, other samples' files, reach the network and host "
                  "sockets, leave processes behind that outlive the sample and signal the trainer, and no "
                  "whole-sandbox memory/process/disk limit applies (per-process rlimits only)")
_UID_BASE = 200_000
_UID_SPAN = 60_000


@dataclass(frozen=True)
class SandboxLimits:
    """Limits of one sample's sandbox (whole-sandbox where :func:`isolation_report` says ``cgroup``)."""

    test_wall_seconds: float = 4.0  # per test, enforced by the harness (kills the test's processes)
    test_cpu_seconds: int = 2  # per test, all its processes together (measured by the harness; RLIMIT_CPU + 1 s)
    memory_bytes: int = 512 << 20  # whole sandbox (cgroup memory incl. tmpfs); fallback: RLIMIT_AS per process
    max_processes: int = 64  # whole sandbox (cgroup pids.max); fallback: RLIMIT_NPROC of the sample's uid
    cpu_cores: float = 1.0  # whole sandbox CFS quota (cgroup cpu); fallback: none
    tmp_bytes: int = 16 << 20  # private /tmp (and /dev/shm) tmpfs size
    max_files: int = 1024  # inodes of that tmpfs (file-count cap; root only)
    file_bytes: int = 8 << 20  # RLIMIT_FSIZE: largest file any process may write
    open_files: int = 256  # RLIMIT_NOFILE
    output_bytes: int = 64 << 10  # per test: output read back; more is the verdict "over_cap"
    startup_seconds: float = 30.0  # sandbox start to harness ready (generous: parallel starts on a busy machine)


@dataclass
class SampleRun:
    """Raw harness replies, one per test (``None``: no reply: the harness or the sandbox died, or its time ran out)."""

    replies: list[dict | None]
    backend: str
    compiled: bool | None = None
    seconds: float = 0.0
    peak_memory_bytes: int | None = None  # cgroup memory high-water mark (cgroup confinement only)
    diagnostics: str = ""  # bubblewrap's own error output, if any


# ---------------------------------------------------------------------------------------------------------------------
# What the machine allows
# ---------------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Confinement:
    root: bool  # per-sample uids, mount-namespace tmpfs with nr_inodes
    cgroup_bases: dict  # controller -> directory under which per-sample cgroups are created (empty: fallback)


@lru_cache(maxsize=None)
def confinement() -> Confinement:
    root = os.geteuid() == 0
    return Confinement(root=root, cgroup_bases=_cgroup_v1_bases() if root else {})


def _cgroup_v1_bases() -> dict[str, str]:
    """Writable cgroup v1 directories for memory, pids and cpu, nested under this process's own cgroups."""
    own = {}
    try:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            for controller in controllers.split(","):
                own[controller] = path
    except OSError:
        return {}
    bases = {}
    for controller in ("memory", "pids", "cpu"):
        mount = Path("/sys/fs/cgroup", controller)
        if controller not in own or not (mount / "cgroup.procs").exists():
            return {}
        base = mount / own[controller].lstrip("/")
        probe = base / f"trl-ext-probe-{os.getpid()}"
        try:
            probe.mkdir()
            probe.rmdir()
        except OSError:
            return {}
        bases[controller] = str(base)
    return bases


def isolation_report() -> dict[str, str]:
    """Which mechanism enforces each limit on this machine (for logs, docs and the tests)."""
    c = confinement()
    cg = bool(c.cgroup_bases)
    return {
        "backend": "bwrap" if bwrap_problem() is None else f"unavailable ({bwrap_problem()})",
        "memory": "cgroup v1 memory (whole sandbox)" if cg else "RLIMIT_AS (per process)",
        "processes": "cgroup v1 pids (whole sandbox)" if cg else
        ("RLIMIT_NPROC (sample's own uid)" if c.root else "RLIMIT_NPROC (trainer's uid, shared)"),
        "cpu": ("cgroup v1 cpu quota + " if cg else "") + "CPU time per test, measured by the harness "
        "(RLIMIT_CPU backstop)",
        "tmp": "tmpfs size+nr_inodes (mount namespace)" if c.root else "bwrap --size tmpfs (no file-count cap)",
        "root_fs": "read-only (/ and /dev; /tmp and /dev/shm are the only writable places)",
        "user_namespaces": "nested ones blocked (bwrap --disable-userns)" if bwrap_blocks_userns() else
        "nested ones allowed (bubblewrap < 0.8): a tmpfs mounted there is bounded " +
        ("by the memory cgroup only" if cg else "by nothing"),
    }


# ---------------------------------------------------------------------------------------------------------------------
# The sandbox's file system: the interpreter, its stdlib and its shared libraries, nothing else
# ---------------------------------------------------------------------------------------------------------------------


def default_python() -> str:
    """The system interpreter (readable by any uid; the trainer's own may live under a private home directory)."""
    for candidate in ("/usr/bin/python3", shutil.which("python3") or ""):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    return sys.executable


@lru_cache(maxsize=None)
def python_layout(python: str) -> dict:
    """The interpreter's real path, its stdlib directories and package directories to hide (asked of itself)."""
    probe = ("import json, sys, sysconfig; p = sysconfig.get_paths(); print(json.dumps({'exe': sys.executable, "
             "'stdlib': p['stdlib'], 'platstdlib': p['platstdlib'], 'purelib': p['purelib'], 'platlib': p['platlib'], "
             "'dynload': [q for q in sys.path if q.endswith('lib-dynload')]}))")
    out = subprocess.run([python, "-I", "-S", "-c", probe], capture_output=True, text=True, timeout=60, check=True)
    layout = json.loads(out.stdout)
    layout["exe"] = os.path.realpath(layout["exe"] or python)
    return layout


@lru_cache(maxsize=None)
def bind_args(python: str) -> tuple[str, ...]:
    """bwrap arguments mounting read-only exactly what ``python -I -S`` with its stdlib needs."""
    layout = python_layout(python)
    args: list[str] = []
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(top):  # merged-/usr systems: keep the links so the loader's paths resolve
            args += ["--symlink", os.readlink(top), top]
    stdlib_dirs = sorted({os.path.realpath(layout[k]) for k in ("stdlib", "platstdlib")}
                         | {os.path.realpath(d) for d in layout["dynload"]})
    stdlib_dirs = [d for d in stdlib_dirs if os.path.isdir(d) and not any(d.startswith(o + "/") for o in stdlib_dirs)]
    args += ["--ro-bind", layout["exe"], layout["exe"]]
    for directory in stdlib_dirs:
        args += ["--ro-bind", directory, directory]
    for key in ("purelib", "platlib"):  # third-party packages (maybe the project itself) stay invisible
        hidden = os.path.realpath(layout[key])
        if any(hidden.startswith(d + "/") for d in stdlib_dirs) and os.path.isdir(hidden):
            args += ["--tmpfs", hidden, "--remount-ro", hidden]
    for library in shared_libraries([layout["exe"], *_extension_modules(stdlib_dirs)]):
        target = os.path.join(os.path.realpath(os.path.dirname(library)), os.path.basename(library))
        args += ["--ro-bind", os.path.realpath(library), target]
    return tuple(args)


def _extension_modules(directories: list[str]) -> list[str]:
    found = []
    for directory in directories:
        for root, _dirs, files in os.walk(directory):
            found += [os.path.join(root, f) for f in files if f.endswith(".so")]
    return found


def shared_libraries(binaries: list[str]) -> list[str]:
    """Every shared library (and the dynamic loader) the binaries link, by ``ldd``."""
    libraries: set[str] = set()
    for start in range(0, len(binaries), 64):
        out = subprocess.run(["ldd", *binaries[start:start + 64]], capture_output=True, text=True, timeout=60).stdout
        for line in out.splitlines():
            parts = line.split()
            if "=>" in parts and len(parts) > parts.index("=>") + 1:
                path = parts[parts.index("=>") + 1]
            elif parts and parts[0].startswith("/") and not parts[0].endswith(":"):
                path = parts[0]
            else:
                continue
            if path.startswith("/") and os.path.exists(path):
                libraries.add(path)
    return sorted(libraries)


@lru_cache(maxsize=None)
def bwrap_blocks_userns() -> bool:
    """Whether this bubblewrap can forbid nested user namespaces (``--disable-userns``, bubblewrap >= 0.8)."""
    try:
        usage = subprocess.run(["bwrap", "--help"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return False
    return "--disable-userns" in usage


def bwrap_command(python: str, root_tmp: bool, limits: SandboxLimits) -> list[str]:
    tmp = (["--bind", "/tmp", "/tmp", "--bind", "/tmp", "/dev/shm"] if root_tmp else
           ["--size", str(limits.tmp_bytes), "--tmpfs", "/tmp", "--size", str(limits.tmp_bytes), "--tmpfs", "/dev/shm"])
    # A nested user namespace would give the candidate CAP_SYS_ADMIN over mounts of its own (an uncapped tmpfs).
    userns = ["--unshare-user", "--disable-userns"] if bwrap_blocks_userns() else []
    layout = python_layout(python)
    return ["bwrap", "--unshare-all", *userns, "--cap-drop", "ALL", "--die-with-parent", "--new-session",
            "--as-pid-1", "--clearenv", "--setenv", "PATH", "/usr/bin:/bin", "--setenv", "HOME", "/tmp",
            "--setenv", "LANG", "C.UTF-8",
            *bind_args(python), "--proc", "/proc", "--dev", "/dev", *tmp,
            # last: bwrap's / and /dev are tmpfs without any cap; the mounts above stay as they are (not recursive)
            "--remount-ro", "/dev", "--remount-ro", "/", "--chdir", "/tmp",
            layout["exe"], "-I", "-S", "-B", "-c", HARNESS_SOURCE]


@lru_cache(maxsize=None)
def bwrap_problem(python: str | None = None) -> str | None:
    """None when bubblewrap runs the harness here, else why not (one line)."""
    if shutil.which("bwrap") is None:
        return "bubblewrap is not installed (apt-get install -y bubblewrap)"
    python = python or default_python()
    try:
        run = run_sample("def f(x):\n    return int(x)\n", [{"kind": "call", "fn": "f", "args_literal": "('7',)",
                                                "kwargs_literal": "{}"}],
                         SandboxLimits(startup_seconds=60), backend="bwrap", python=python, _probe=True)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"bubblewrap failed to start: {exc}"
    if run.replies != [{"status": "exited", "exit": 0, "signal": None, "output": "7"}]:
        return f"bubblewrap did not run the harness: {run.diagnostics.strip()[:300] or run.replies}"
    return None


# ---------------------------------------------------------------------------------------------------------------------
# Per-sample resources: uid, cgroups, the private tmpfs
# ---------------------------------------------------------------------------------------------------------------------


class _UidPool:
    """Distinct unprivileged uids for concurrent samples (RLIMIT_NPROC and signals are per uid)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._in_use: set[int] = set()
        self.handed_out: set[int] = set()  # every uid this process used (lets tests look for leftovers of their own)
        self._next = itertools.count(random.randrange(_UID_SPAN))  # other trainer processes start elsewhere

    def take(self) -> int:
        with self._lock:
            while True:
                uid = _UID_BASE + next(self._next) % _UID_SPAN
                if uid not in self._in_use:
                    self._in_use.add(uid)
                    self.handed_out.add(uid)
                    return uid

    def give_back(self, uid: int) -> None:
        with self._lock:
            self._in_use.discard(uid)


_UIDS = _UidPool()
_SERIAL = itertools.count()


class SampleCgroups:
    """One cgroup per controller for one sample; ``close`` kills anything left in them and removes them."""

    def __init__(self, bases: dict[str, str], limits: SandboxLimits):
        name = f"trl-ext-{os.getpid()}-{next(_SERIAL)}"
        self.dirs = {c: Path(base, name) for c, base in bases.items()}
        for directory in self.dirs.values():
            directory.mkdir()
        memory = self.dirs["memory"]
        _write(memory / "memory.limit_in_bytes", limits.memory_bytes)
        if (memory / "memory.memsw.limit_in_bytes").exists():  # no swapping around the limit
            _write(memory / "memory.memsw.limit_in_bytes", limits.memory_bytes)
        _write(self.dirs["pids"] / "pids.max", limits.max_processes)
        period = 100_000
        _write(self.dirs["cpu"] / "cpu.cfs_period_us", period)
        _write(self.dirs["cpu"] / "cpu.cfs_quota_us", max(1000, int(period * limits.cpu_cores)))
        self.procs_files = [str(d / "cgroup.procs") for d in self.dirs.values()]

    def peak_memory(self) -> int | None:
        try:
            return int((self.dirs["memory"] / "memory.max_usage_in_bytes").read_text())
        except (OSError, ValueError):
            return None

    def close(self) -> None:
        deadline = time.monotonic() + 10
        for directory in self.dirs.values():
            while True:
                try:
                    pids = [int(p) for p in (directory / "cgroup.procs").read_text().split()]
                except OSError:
                    pids = []
                for pid in pids:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                try:
                    directory.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        warnings.warn(f"unit_tests sandbox: could not remove cgroup {directory}")
                        break
                    time.sleep(0.01)


def _processes_of(uid: int) -> int:
    count = 0
    for entry in os.scandir("/proc"):
        try:
            count += entry.name.isdigit() and entry.stat().st_uid == uid
        except OSError:
            pass
    return count


def _write(path: Path, value) -> None:
    path.write_text(str(value))


# The sandbox is entered through a small launcher run by the system interpreter, not a ``preexec_fn``: a preexec
# function forces ``fork`` of the whole trainer (torch and a model: about 0.3 s per sample measured here), while a
# plain ``Popen`` uses ``vfork``. The launcher joins the cgroups, mounts the private /tmp in a mount namespace of its
# own, sets the rlimits, drops root, then execs bubblewrap (or the harness, for the unsafe backend).
LAUNCHER_SOURCE = """
import ctypes, json, os, resource, sys
config = json.loads(sys.argv[1])
pid = str(os.getpid())
for path in config["cgroup_procs"]:
    with open(path, "w") as handle:
        handle.write(pid)
if config["tmpfs"]:
    libc = ctypes.CDLL(None, use_errno=True)
    for ok, what in ((libc.unshare(0x00020000) == 0, "unshare(CLONE_NEWNS)"),
                     (libc.mount(None, b"/", None, 0x4000 | 0x40000, None) == 0, "make / private"),
                     (libc.mount(b"trl-ext-sandbox", b"/tmp", b"tmpfs", 0x2 | 0x4, config["tmpfs"].encode()) == 0,
                      "mount tmpfs")):
        if not ok:
            raise OSError(ctypes.get_errno(), what)
for name, value in config["rlimits"]:
    resource.setrlimit(getattr(resource, name), (value, value))
if config["uid"] is not None:
    os.setgroups([])
    os.setgid(config["uid"])
    os.setuid(config["uid"])
os.execv(config["argv"][0], config["argv"])
"""


def launcher_command(python: str, argv: list[str], limits: SandboxLimits, uid: int | None, cgroup_procs: list[str],
                     tmpfs_options: str | None, whole_sandbox: bool) -> list[str]:
    """``python -c LAUNCHER config``: confine, drop root, exec ``argv``."""
    # RLIMIT_NPROC counts every process of the uid: exact for a sample's own uid (root), an allowance on top of what the
    # trainer's uid already runs otherwise; with a pids cgroup it is only a backstop.
    nproc = limits.max_processes + (0 if uid is not None else _processes_of(os.getuid()))
    if whole_sandbox:
        nproc = max(nproc * 4, 256)
    rlimits = [("RLIMIT_FSIZE", limits.file_bytes), ("RLIMIT_NOFILE", limits.open_files), ("RLIMIT_CORE", 0)]
    if uid is not None or not whole_sandbox:
        rlimits.append(("RLIMIT_NPROC", nproc))
    if not whole_sandbox:
        rlimits.append(("RLIMIT_AS", limits.memory_bytes))
    config = {"cgroup_procs": cgroup_procs, "tmpfs": tmpfs_options, "rlimits": rlimits, "uid": uid,
              "argv": [shutil.which(argv[0]) or argv[0], *argv[1:]]}
    return [python_layout(python)["exe"], "-I", "-S", "-B", "-c", LAUNCHER_SOURCE, json.dumps(config)]


# ---------------------------------------------------------------------------------------------------------------------
# Running one sample
# ---------------------------------------------------------------------------------------------------------------------


def run_sample(source: str, requests: list[dict], limits: SandboxLimits = SandboxLimits(), backend: str = "bwrap",
               python: str | None = None, _probe: bool = False) -> SampleRun:
    """Run ``source``'s tests (harness requests, see :mod:`code_harness`) in a fresh sandbox; never raises for the
    candidate's misbehaviour. ``backend='bwrap'`` refuses to run when bubblewrap does not work here."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown sandbox backend {backend!r}; known: {BACKENDS}")
    python = python or default_python()
    if backend == "bwrap" and not _probe:
        problem = bwrap_problem(python)
        if problem is not None:
            raise RuntimeError(f"unit_tests: refusing to run model-written code without isolation: {problem}")
    start = time.monotonic()
    conf = confinement()
    uid = _UIDS.take() if conf.root else None
    cgroups = SampleCgroups(conf.cgroup_bases, limits) if (backend == "bwrap" and conf.cgroup_bases) else None
    workdir = None
    try:
        if backend == "bwrap":
            root_tmp = conf.root
            tmpfs = (f"size={limits.tmp_bytes},nr_inodes={limits.max_files},mode=0700,uid={uid},gid={uid}"
                     if root_tmp else None)
            argv = launcher_command(python, bwrap_command(python, root_tmp, limits), limits, uid,
                                    cgroups.procs_files if cgroups else [], tmpfs, cgroups is not None)
            cwd = "/"
        else:
            warnings.warn(UNSAFE_WARNING, stacklevel=2)
            workdir = tempfile.mkdtemp(prefix="trl-ext-unsafe-")
            if uid is not None:
                os.chown(workdir, uid, uid)
            harness = [python_layout(python)["exe"], "-I", "-S", "-B", "-c", HARNESS_SOURCE]
            argv, cwd = launcher_command(python, harness, limits, uid, [], None, False), workdir
        with tempfile.TemporaryFile() as errors:
            proc = subprocess.Popen(argv, cwd=cwd, env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": cwd},
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=errors, close_fds=True,
                                    start_new_session=True)
            try:
                run = _converse(proc, source, requests, limits, backend)
            finally:
                _end(proc)
            errors.seek(0)
            run.diagnostics = errors.read(4096).decode("utf-8", errors="replace")
        if cgroups is not None:
            run.peak_memory_bytes = cgroups.peak_memory()
        run.seconds = time.monotonic() - start
        return run
    finally:
        if cgroups is not None:
            cgroups.close()
        if workdir is not None:
            shutil.rmtree(workdir, ignore_errors=True)
        if uid is not None:
            _UIDS.give_back(uid)


def _end(proc: subprocess.Popen) -> None:
    """End the sandbox: the harness exits on end of input (and, as init, takes the namespace with it); a harness
    that does not is killed first, so bwrap reaps it (killing bwrap first would leave a zombie of the host's init)."""
    for stream in (proc.stdin, proc.stdout):
        try:
            stream.close()
        except OSError:
            pass
    try:
        proc.wait(timeout=2.0)
        return
    except subprocess.TimeoutExpired:
        pass
    try:
        children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
    except OSError:
        children = []
    for child in children:
        try:
            os.kill(int(child), signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    try:
        proc.wait(timeout=2.0)
    except subprocess.TimeoutExpired:
        proc.kill()  # the harness dies with bwrap (--die-with-parent), and the namespace with it
        proc.wait()


def _converse(proc: subprocess.Popen, source: str, requests: list[dict], limits: SandboxLimits,
              backend: str) -> SampleRun:
    run = SampleRun(replies=[None] * len(requests), backend=backend)
    setup = {"source": source, "wall_seconds": limits.test_wall_seconds, "cpu_seconds": limits.test_cpu_seconds,
             "output_bytes": limits.output_bytes, "pid_namespace": backend == "bwrap",
             "scratch_dirs": ["/tmp", "/dev/shm"] if backend == "bwrap" else []}  # emptied after each test
    reader = _LineReader(proc.stdout.fileno(), max_line=limits.output_bytes * 6 + 4096)
    if not _send(proc, setup):
        return run
    ready = reader.line(time.monotonic() + limits.startup_seconds)
    if not isinstance(ready, dict) or ready.get("ready") is not True:
        return run
    run.compiled = bool(ready.get("compiled"))
    for i, request in enumerate(requests):
        if not _send(proc, request):
            break
        # The harness enforces the test's wall time; the margin covers its fork and clean-up on a loaded machine.
        reply = reader.line(time.monotonic() + limits.test_wall_seconds + 10.0)
        if not _valid_reply(reply):
            break  # the harness is gone or hung: this and every later test have no result
        run.replies[i] = reply
    return run


def _send(proc: subprocess.Popen, message: dict) -> bool:
    try:
        proc.stdin.write((json.dumps(message) + "\n").encode())
        proc.stdin.flush()
        return True
    except (BrokenPipeError, OSError, ValueError):
        return False


_STATUSES = {"exited", "timeout", "over_cap", "error"}


def _valid_reply(reply) -> bool:
    return (isinstance(reply, dict) and reply.get("status") in _STATUSES and isinstance(reply.get("output"), str)
            and all(reply.get(k) is None or type(reply.get(k)) is int for k in ("exit", "signal")))


class _LineReader:
    """Read newline-terminated JSON replies from a pipe with a deadline and a length cap."""

    def __init__(self, fd: int, max_line: int):
        self.fd, self.max_line, self.buffer = fd, max_line, b""

    def line(self, deadline: float):
        while b"\n" not in self.buffer:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or len(self.buffer) > self.max_line:
                return None
            ready, _, _ = select.select([self.fd], [], [], remaining)
            if not ready:
                return None
            chunk = os.read(self.fd, 1 << 16)
            if not chunk:
                return None
            self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        try:
            return json.loads(line)
        except ValueError:
            return None
