"""Attack suite for the unit_tests reward: every cheat earns exactly what it solved, and leaves nothing behind.

Each attack is a *wrong* solution of the hidden task f(x) = x*x + 1 that tries one way of faking success; it must
score 0 (or, where it also computes some answers honestly, exactly that fraction). After every test no process of a
sandbox uid, no per-sample cgroup and no sandbox file on the host remains (fixture ``nothing_left_behind``).
"""

import json
import os
import socket
import threading
import time
from pathlib import Path

import pytest

from trl_ext_plugins.rewards import sandbox
from trl_ext_plugins.rewards.code_tests import parse_tests
from trl_ext_plugins.rewards.sandbox import bwrap_problem, confinement, run_sample
from trl_ext_plugins.rewards.unit_tests import UnitTests, UnitTestsParams

if bwrap_problem() is not None:  # .ci/run installs bubblewrap; without it the reward refuses to run (tested below)
    pytest.skip(f"bubblewrap sandbox unavailable here: {bwrap_problem()}", allow_module_level=True)

CALL_TESTS = json.dumps(["assert f(2) == 5", "assert f(3) == 10", "assert f(-1) == 2"])
STDIO_TESTS = json.dumps([{"stdin": "2\n", "stdout": "5\n"}, {"stdin": "3\n", "stdout": "10\n"},
                          {"stdin": "-1\n", "stdout": "2\n"}])
ONE_TEST = json.dumps(["assert f(2) == 5"])  # for attacks that burn their whole time limit
FAST = dict(test_wall_seconds=1.5, test_cpu_seconds=1, memory_mb=256, max_processes=32, tmp_mb=4, max_files=200,
            output_kb=4, max_workers=2)
LIMITS = UnitTestsParams(**FAST).limits()


def reward(code, tests=CALL_TESTS, **params):
    """The plugin's reward and the per-test verdicts it logged, for one candidate."""
    logged = {}
    (fn,) = UnitTests(UnitTestsParams(**{**FAST, **params})).trl_ext_reward_functions(stage=None)
    rewards = fn.fn(completions=[code], tests=[tests], log_extra=lambda k, v: logged.setdefault(k, v),
                    log_metric=lambda k, v: logged.setdefault(k, v))
    return rewards[0], logged["unit_tests_verdicts"][0].split(",")


def outputs(code, tests=CALL_TESTS, limits=LIMITS):
    """Raw outputs the harness reported (what the candidate managed to say), one per test."""
    run = run_sample(code, [t.request() for t in parse_tests(tests)], limits)
    return [r and r["output"] for r in run.replies], run


def _sandbox_processes():
    found = []
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            uid = int(next(l for l in status.read_text().splitlines() if l.startswith("Uid:")).split()[1])
        except (OSError, StopIteration, ValueError):
            continue
        if uid in sandbox._UIDS.handed_out:  # uids this test process gave its sandboxes
            found.append(status.parent.name)
    return found


def _sandbox_cgroups():
    return [p for base in confinement().cgroup_bases.values() for p in Path(base).glob(f"trl-ext-{os.getpid()}-*")]


@pytest.fixture(autouse=True)
def nothing_left_behind():
    mounts = Path("/proc/self/mountinfo").read_text().count("\n")
    tmp_before = {p.name for p in Path("/tmp").iterdir()}
    yield
    deadline = time.monotonic() + 5
    while _sandbox_processes() and time.monotonic() < deadline:  # a killed namespace is reaped asynchronously
        time.sleep(0.05)
    assert _sandbox_processes() == []
    assert _sandbox_cgroups() == []
    assert Path("/proc/self/mountinfo").read_text().count("\n") == mounts
    assert not [n for n in {p.name for p in Path("/tmp").iterdir()} - tmp_before if "trl-ext" in n or "pwn" in n]


# ---- controls ---------------------------------------------------------------------------------------------------


def test_correct_wrong_and_partial_solutions_get_what_they_earned():
    assert reward("def f(x):\n    return x * x + 1\n") == (1.0, ["pass"] * 3)
    assert reward("def f(x):\n    return x * x\n") == (0.0, ["wrong"] * 3)
    partial = "def f(x):\n    return x * x + 1 if x > 0 else 0\n"
    assert reward(partial, scoring="fraction") == (pytest.approx(2 / 3), ["pass", "pass", "wrong"])
    assert reward(partial) == (0.0, ["pass", "pass", "wrong"])  # all_or_nothing is the default
    program = "x = int(input())\nprint(x * x + 1, '  ')\nprint()\n"  # trailing spaces and blank lines are ignored
    assert reward(program, STDIO_TESTS) == (1.0, ["pass"] * 3)
    assert reward("print(int(input()) ** 2)\n", STDIO_TESTS) == (0.0, ["wrong"] * 3)
    assert reward("def f(x) return 1\n") == (0.0, ["error"] * 3)  # does not compile


def test_fenced_block_is_the_candidate():
    text = "Here it is:\n```python\ndef f(x):\n    return x * x + 1\n```\nDone."
    assert reward(text) == (1.0, ["pass"] * 3)


# ---- 1. ending the process successfully before the tests run --------------------------------------------------------

EARLY_EXITS = {
    "sys.exit at import": "import sys\nsys.exit(0)\ndef f(x):\n    return 0\n",
    "os._exit at import": "import os\nos._exit(0)\n",
    "os._exit in the call": "def f(x):\n    import os\n    os._exit(0)\n",
    "SystemExit in the call": "def f(x):\n    raise SystemExit(0)\n",
    "atexit handler": "import atexit, os\natexit.register(lambda: os._exit(0))\ndef f(x):\n    raise SystemExit(0)\n",
    "thread exits the process": ("import os, threading, time\ndef f(x):\n"
                                 "    threading.Thread(target=lambda: os._exit(0)).start()\n    time.sleep(5)\n"),
    "exec another program": "import os, sys\ndef f(x):\n    os.execv(sys.executable, [sys.executable, '-c', 'pass'])\n",
    "signal handler on the CPU limit": ("import os, signal\nsignal.signal(signal.SIGXCPU, lambda *a: os._exit(0))\n"
                                        "def f(x):\n    while True:\n        pass\n"),
    "sys.excepthook and exit": ("import sys, os\nsys.excepthook = lambda *a: os._exit(0)\n"
                                "def f(x):\n    raise ValueError\n"),
}


@pytest.mark.parametrize("name", list(EARLY_EXITS))
def test_early_successful_exit_earns_nothing(name):
    score, verdicts = reward(EARLY_EXITS[name], ONE_TEST if "CPU" in name else CALL_TESTS)
    assert score == 0.0 and all(v in ("no_result", "error", "timeout") for v in verdicts), verdicts


def test_early_exit_in_a_program_earns_nothing():
    assert reward("import sys\nsys.exit(0)\nprint(int(input()) ** 2 + 1)\n", STDIO_TESTS) == (0.0, ["wrong"] * 3)


# ---- 2. objects that compare equal to anything ----------------------------------------------------------------------

ALWAYS_EQUAL = {
    "custom __eq__": "class A:\n    def __eq__(self, o):\n        return True\n    def __ne__(self, o):\n"
                     "        return False\ndef f(x):\n    return A()\n",
    "int subclass": "class I(int):\n    def __eq__(self, o):\n        return True\n    __hash__ = int.__hash__\n"
                    "def f(x):\n    return I(0)\n",
    "str subclass": "class S(str):\n    def __eq__(self, o):\n        return True\n    __hash__ = str.__hash__\n"
                    "def f(x):\n    return S('anything')\n",
    "json.dumps patched": "import json\njson.dumps = lambda v, *a, **k: 'True'\ndef f(x):\n    return 0\n",
}


@pytest.mark.parametrize("name", list(ALWAYS_EQUAL))
def test_always_equal_objects_earn_nothing(name):
    score, verdicts = reward(ALWAYS_EQUAL[name])
    assert score == 0.0 and all(v in ("wrong", "error", "invalid") for v in verdicts), verdicts


# ---- 3. reading the tests or the expected values --------------------------------------------------------------------

SECRET = "EXPECTED-7f3a9c"
SNOOP = r'''
import gc, os, stat, sys
NEEDLE = "c9a3f7-DETCEPXE"  # the expected value, reversed so that this source does not contain it
def hit(text):
    return NEEDLE[::-1] in text
def f(x):
    found = []
    for o in gc.get_objects():  # everything this process inherited from the harness by fork
        try:
            if hit(repr(o)):
                found.append("memory")
                break
        except Exception:
            pass
    frame = sys._getframe()
    while frame:  # the harness's frames and their locals
        if hit(repr(frame.f_locals)):
            found.append("frame")
        frame = frame.f_back
    if hit(repr(dict(os.environ))):
        found.append("environ")
    paths = []
    for pid in [p for p in os.listdir("/proc") if p.isdigit()]:
        paths += ["/proc/%s/%s" % (pid, n) for n in ("cmdline", "environ", "mem", "fd/0", "fd/1", "fd/3")]
    for root, dirs, files in os.walk("/"):
        if root in ("/proc", "/sys") or root.startswith(("/proc/", "/sys/")):
            dirs[:] = []
            continue
        paths += [os.path.join(root, n) for n in files]
    for path in paths:
        try:
            if not stat.S_ISREG(os.stat(path).st_mode) and not path.startswith("/proc/"):
                continue
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
            try:
                if hit(os.read(fd, 1 << 20).decode("latin-1")):
                    found.append(path)
            finally:
                os.close(fd)
        except Exception:
            pass
    return found
'''


def test_candidate_cannot_read_tests_or_expected_values(monkeypatch):
    monkeypatch.setenv("TRL_EXT_EXPECTED", SECRET)  # even the trainer's environment holds the expected value
    tests = json.dumps([{"fn": "f", "args": [1], "expected": SECRET}, {"fn": "f", "args": [2], "expected": SECRET}])
    slow = {"test_wall_seconds": 10, "test_cpu_seconds": 5}
    said, _ = outputs(SNOOP, tests, UnitTestsParams(**{**FAST, **slow}).limits())
    assert said == ["[]", "[]"]  # the candidate's exhaustive search found nothing, anywhere
    assert reward(SNOOP, tests, **slow) == (0.0, ["wrong", "wrong"])


def test_candidate_sees_no_project_source_nor_site_packages():
    probe = ("import os, sys\ndef f(x):\n    return [p for p in ('/work', '/root', '/etc', '/run', '/var', '/home') "
             "if os.path.exists(p)] + [p for p in sys.path\n"
             "        if os.path.isdir(p) and 'packages' in p and os.listdir(p)]\n")
    said, _ = outputs(probe)
    assert said == ["[]"] * 3


# ---- 4. rewriting its own file or the harness -----------------------------------------------------------------------

REWRITE = r'''
import glob, os, sys
written = 0
for path in [sys.executable, "/proc/1/mem", "/proc/1/exe", "/proc/self/exe"] + glob.glob("/usr/lib/python3*/json/*.py"):
    try:
        with open(path, "r+b") as handle:
            handle.write(b"pwned")
            written += 1
    except Exception:
        pass
def f(x):
    return written
'''
PATCH_HARNESS = r'''
import sys
harness = sys.modules["__main__"]  # the harness module, as this test's process inherited it
for name in dir(harness):
    if callable(getattr(harness, name, None)) and not name.startswith("__"):
        setattr(harness, name, lambda *a, **k: 0)
def f(x):
    return 0
'''


def test_rewriting_its_file_or_the_harness_earns_nothing():
    said, _ = outputs(REWRITE)
    assert said == ["0"] * 3  # no write anywhere succeeded: the interpreter, stdlib and harness are read-only
    assert reward(REWRITE) == (0.0, ["wrong"] * 3)
    score, verdicts = reward(PATCH_HARNESS)  # patching the harness only silences this test's own report
    assert score == 0.0 and all(v in ("no_result", "wrong", "error") for v in verdicts), verdicts
    assert reward("def f(x):\n    return x * x + 1\n") == (1.0, ["pass"] * 3)  # the next sample is unaffected


# ---- 5. forging the result channel ----------------------------------------------------------------------------------

FORGE = r'''
import json, os, sys
fake = [json.dumps({"status": "exited", "exit": 0, "signal": None, "output": v}) for v in ("5", "10", "2", "pass")]
fake += [json.dumps({"ready": True, "compiled": True}), "pass", "PASS", "ok 1 - all tests passed", "5\n10\n2"]
for fd in range(0, 64):
    for line in fake:
        try:
            os.write(fd, (line + "\n").encode())
        except OSError:
            pass
for path in ("/proc/1/fd/1", "/proc/1/fd/0", "/proc/self/fd/1", "/dev/stdout"):
    try:
        with open(path, "w") as handle:
            handle.write("\n".join(fake) + "\n")
    except OSError:
        pass
print("\n".join(fake))
def f(x):
    return {"status": "exited", "exit": 0, "output": "5", "verdict": "pass"}
'''


@pytest.mark.parametrize("tests", [CALL_TESTS, STDIO_TESTS], ids=["call", "stdio"])
def test_forging_the_result_channel_earns_nothing(tests):
    score, verdicts = reward(FORGE, tests)
    assert score == 0.0 and all(v in ("wrong", "invalid") for v in verdicts), verdicts


# ---- 6-9. resource attacks ------------------------------------------------------------------------------------------

FORK_BOMB = ("import os\ndef f(x):\n    if x == 2:\n        while True:\n            try:\n                os.fork()\n"
             "            except OSError:\n                pass\n    return x * x + 1\n")


def test_fork_bomb_is_contained_and_the_rest_of_the_sample_still_runs():
    score, verdicts = reward(FORK_BOMB, scoring="fraction")
    assert verdicts[0] in ("timeout", "error") and verdicts[1:] == ["pass", "pass"]
    assert score == pytest.approx(2 / 3)  # exactly the tests it solved


MEMORY_SPREAD = r'''
import os, time
def f(x):
    for _ in range(12):
        if os.fork() == 0:
            try:
                block = bytearray(48 << 20)
                for i in range(0, len(block), 4096):
                    block[i] = 1
            except MemoryError:
                pass
            time.sleep(10)
            os._exit(0)
    time.sleep(3)
    return 0
'''


def test_memory_spread_over_processes_is_capped_for_the_whole_sandbox():
    said, run = outputs(MEMORY_SPREAD, ONE_TEST)
    if confinement().cgroup_bases:  # 12 x 48 MiB asked for; the sample as a whole never exceeded its 256 MiB
        assert run.peak_memory_bytes is not None and run.peak_memory_bytes <= LIMITS.memory_bytes
    assert reward(MEMORY_SPREAD, ONE_TEST)[0] == 0.0


DISK_FILL = r'''
import os
def f(x):
    total = 0
    for target in ("/tmp/fill-a", "/dev/shm/fill-b", "fill-c"):
        try:
            with open(target, "wb") as handle:
                while True:
                    handle.write(b"x" * 65536)
                    handle.flush()
                    total += 65536
        except OSError:
            pass
    return total
'''


def test_disk_fill_stops_at_the_tmp_cap():
    said, _ = outputs(DISK_FILL)
    assert all(int(s) <= LIMITS.tmp_bytes for s in said)  # /tmp and /dev/shm share one capped tmpfs
    assert reward(DISK_FILL) == (0.0, ["wrong"] * 3)


FILE_FLOOD = r'''
import os
def f(x):
    made = 0
    try:
        while made < 100000:
            open("/tmp/f%d" % made, "w").close()
            made += 1
    except OSError:
        pass
    return made
'''


def test_file_count_flood_stops_at_the_file_cap():
    said, _ = outputs(FILE_FLOOD)
    if confinement().root:
        assert all(0 < int(s) <= LIMITS.max_files for s in said)
    assert reward(FILE_FLOOD) == (0.0, ["wrong"] * 3)


def test_output_flood_is_cut_at_the_cap():
    flood = "import sys\nwhile True:\n    sys.stdout.write('5\\n' * 65536)\n"
    assert reward(flood, STDIO_TESTS) == (0.0, ["over_cap"] * 3)


SPIN = "def f(x):\n    while True:\n        pass\n"
# Ignoring SIGXCPU changes nothing: the kernel's CPU backstop is SIGKILL, and the harness's measure decides.
SPIN_IGNORING_SIGXCPU = "import signal\nsignal.signal(signal.SIGXCPU, signal.SIG_IGN)\n" + SPIN


@pytest.mark.parametrize("limits", [
    {},  # as the other tests run: whichever limit the machine's load makes come first
    {"test_wall_seconds": 1.0, "test_cpu_seconds": 30},  # the wall clock ends it
    {"test_wall_seconds": 30, "test_cpu_seconds": 1},  # the CPU-time limit ends it (SIGXCPU)
], ids=["default", "wall-first", "cpu-first"])
def test_infinite_loop_times_out_whichever_limit_ends_it(limits):
    assert reward(SPIN, ONE_TEST, **limits) == (0.0, ["timeout"])


def test_loop_that_ignores_sigxcpu_times_out():
    assert reward(SPIN_IGNORING_SIGXCPU, ONE_TEST, test_wall_seconds=30, test_cpu_seconds=1) == (0.0, ["timeout"])


# A correct answer computed with more CPU time than allowed (1.4 CPU-s against 1) is a timeout, however the CPU limit
# is dodged: SIGXCPU ignored, or the work handed to processes the test never waits for (each under the limit).
SLOW_CORRECT = ("import time\ndef burn(seconds):\n    start = time.process_time()\n"
                "    while time.process_time() - start < seconds:\n        pass\n")
SLOW_BUT_IGNORES_SIGXCPU = ("import signal\nsignal.signal(signal.SIGXCPU, signal.SIG_IGN)\n" + SLOW_CORRECT
                            + "def f(x):\n    burn(1.4)\n    return x * x + 1\n")
SLOW_IN_UNREAPED_HELPERS = SLOW_CORRECT + r'''
import os
def f(x):
    done = []
    for _ in range(2):
        r, w = os.pipe()
        if os.fork() == 0:
            burn(0.7)
            os.write(w, b"1")
            os._exit(0)
        done.append(r)
    for r in done:
        os.read(r, 1)  # never waits for the helpers: their CPU time is not in this process's own usage
    return x * x + 1
'''
WITHIN_THE_LIMIT_IN_A_HELPER = SLOW_CORRECT + ("import os\ndef f(x):\n    pid = os.fork()\n    if pid == 0:\n"
                                               "        burn(0.3)\n        os._exit(0)\n    os.waitpid(pid, 0)\n"
                                               "    return x * x + 1\n")


@pytest.mark.parametrize("code", [SLOW_BUT_IGNORES_SIGXCPU, SLOW_IN_UNREAPED_HELPERS], ids=["sigxcpu", "helpers"])
def test_correct_answer_over_the_cpu_limit_is_a_timeout(code):
    assert reward(code, ONE_TEST, test_wall_seconds=8, test_cpu_seconds=1) == (0.0, ["timeout"])


def test_helper_processes_within_the_cpu_limit_pass():
    assert reward(WITHIN_THE_LIMIT_IN_A_HELPER, ONE_TEST, test_wall_seconds=8, test_cpu_seconds=1) == (1.0, ["pass"])


def test_crash_by_signal_is_an_error_not_a_timeout():
    crash = "import os, signal\ndef f(x):\n    os.kill(os.getpid(), signal.SIGKILL)\n"
    assert reward(crash, ONE_TEST) == (0.0, ["error"])


# ---- 10-11. persistence and neighbours ------------------------------------------------------------------------------

PERSIST = r'''
import os, time
def f(x):
    for path in ("/tmp/pwn-marker", "/dev/shm/pwn-marker", os.path.expanduser("~/pwn-marker")):
        try:
            open(path, "w").write("left")
        except OSError:
            pass
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            time.sleep(30)
        os._exit(0)
    return 0
'''
LOOK_FOR_TRACES = r'''
import os
def f(x):
    seen = [p for p in ("/tmp/pwn-marker", "/dev/shm/pwn-marker") if os.path.exists(p)]
    seen += [p for p in os.listdir("/proc") if p.isdigit() and p != str(os.getpid()) and p != "1"]
    return seen
'''


CARRY_OVER = r'''
import os
def f(x):
    seen = [p for p in ("/tmp/pwn-a", "/dev/shm/pwn-b", "/tmp/pwn-locked") if os.path.lexists(p)]
    open("/tmp/pwn-a", "w").write("left")
    open("/dev/shm/pwn-b", "w").write("left")
    os.makedirs("/tmp/pwn-locked/deep", exist_ok=True)
    open("/tmp/pwn-locked/deep/file", "w").close()
    os.chmod("/tmp/pwn-locked/deep", 0)
    os.chmod("/tmp/pwn-locked", 0)
    return seen
'''


def test_files_do_not_persist_to_the_next_test():
    said, _ = outputs(CARRY_OVER)
    assert said == ["[]"] * 3  # the harness emptied /tmp and /dev/shm after each test, unreadable directories too


def test_nothing_persists_to_the_next_sample():
    assert reward(PERSIST) == (0.0, ["wrong"] * 3)
    said, _ = outputs(LOOK_FOR_TRACES)
    assert said == ["[]"] * 3


NEIGHBOUR_WRITES = ("import time\ndef f(x):\n    open('/tmp/neighbour-secret', 'w').write('SECRET-SAMPLE-A')\n"
                    "    time.sleep(1.0)\n    return 0\n")
NEIGHBOUR_READS = r'''
import os, time
def f(x):
    time.sleep(0.3)
    found = []
    for top in ("/tmp", "/dev/shm", "/proc"):
        for root, dirs, files in os.walk(top):
            if root.count("/") > 3:
                dirs[:] = []
            for name in files:
                if "neighbour" in name:
                    found.append(os.path.join(root, name))
    return found
'''


def test_concurrent_samples_cannot_see_each_other():
    logged = {}
    (fn,) = UnitTests(UnitTestsParams(**FAST)).trl_ext_reward_functions(stage=None)
    tests = json.dumps([{"fn": "f", "args": [1], "expected": ["/tmp/neighbour-secret"]}])
    rewards = fn.fn(completions=[NEIGHBOUR_WRITES, NEIGHBOUR_READS], tests=[tests, tests],
                    log_extra=lambda k, v: logged.setdefault(k, v))
    assert rewards == [0.0, 0.0] and logged["unit_tests_verdicts"] == ["wrong", "wrong"]


# ---- 12. host sockets -----------------------------------------------------------------------------------------------


def test_host_sockets_are_unreachable(tmp_path):
    accepted = []
    tcp = socket.socket()
    tcp.bind(("127.0.0.1", 0))
    tcp.listen()
    unix_path = str(tmp_path / "trainer.sock")
    unix = socket.socket(socket.AF_UNIX)
    unix.bind(unix_path)
    unix.listen()
    abstract = socket.socket(socket.AF_UNIX)
    abstract.bind("\0trl-ext-test-trainer")
    abstract.listen()
    stop = threading.Event()

    def serve(server):
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                accepted.append(server.accept())
            except OSError:
                pass

    threads = [threading.Thread(target=serve, args=(s,)) for s in (tcp, unix, abstract)]
    for t in threads:
        t.start()
    port = tcp.getsockname()[1]
    attack = (f"import socket\ndef f(x):\n    ok = []\n"
              f"    for family, address in [(socket.AF_INET, ('127.0.0.1', {port})), (socket.AF_INET, ('1.1.1.1', 80)),"
              f" (socket.AF_UNIX, {unix_path!r}), (socket.AF_UNIX, '\\0trl-ext-test-trainer'),"
              f" (socket.AF_UNIX, '/run/dbus/system_bus_socket'), (socket.AF_UNIX, '/var/run/docker.sock')]:\n"
              f"        s = socket.socket(family)\n        s.settimeout(0.5)\n        try:\n"
              f"            s.connect(address)\n            ok.append(str(address))\n        except OSError:\n"
              f"            pass\n    return ok\n")
    try:
        said, _ = outputs(attack)
        assert reward(attack) == (0.0, ["wrong"] * 3)
    finally:
        stop.set()
        for t in threads:
            t.join()
        for s in (tcp, unix, abstract):
            s.close()
    assert said == ["[]"] * 3 and accepted == []


# ---- 13. escaping the time limit by detaching -----------------------------------------------------------------------

DETACH = r'''
import os, time
def f(x):
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            time.sleep(60)  # a daemon that would outlive the sample
            os._exit(0)
        os._exit(0)
    return 0
'''


def test_detached_processes_die_with_their_test():
    start = time.monotonic()
    assert reward(DETACH) == (0.0, ["wrong"] * 3)
    assert time.monotonic() - start < 30  # the 60 s daemons did not keep the sample alive
    # nothing_left_behind checks that no sandbox process survived on the host


# ---- 14. signalling the trainer -------------------------------------------------------------------------------------


def _signal_everyone(me, then):
    # SIGINT first: Python installs a handler for it, and a handler is what lets a signal reach a namespace's init
    return (f"import os, signal\ndef f(x):\n"
            f"    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGKILL):\n"
            f"        for target in (os.getppid(), 1, {me}, -1):\n            try:\n"
            f"                os.kill(target, sig)\n            except OSError:\n                pass\n"
            f"    return {then}\n")


def test_signalling_the_trainer_or_harness_changes_nothing():
    me = os.getpid()  # the trainer's pid, which the candidate tries to signal along with its parent, init and everyone
    assert reward(_signal_everyone(me, "x * x + 1")) == (1.0, ["pass"] * 3)  # the harness survived: full credit
    assert reward(_signal_everyone(me, "0")) == (0.0, ["wrong"] * 3)
    assert os.getpid() == me


TAMPER_WITH_THE_HARNESS = r'''
import os, resource
def f(x):
    if x == 2:
        soft, hard = resource.prlimit(1, resource.RLIMIT_NOFILE)
        resource.prlimit(1, resource.RLIMIT_NOFILE, (soft - 1, hard))  # allowed: same uid, lowering only
    return x * x + 1
'''


def test_lowering_the_harness_limits_ends_the_sample():
    # Only the tampering sample can suffer from it, but it earns nothing from that test on: no silent degradation.
    assert reward(TAMPER_WITH_THE_HARNESS) == (0.0, ["error"] * 3)
    assert reward("def f(x):\n    return x * x + 1\n") == (1.0, ["pass"] * 3)  # the next sample is unaffected


# ---- 15. writable places and nested namespaces ----------------------------------------------------------------------

WRITE_EVERYWHERE = r'''
import os
def f(x):
    wrote = []
    for directory in ("/", "/dev", "/usr", "/proc", "/fresh"):
        try:
            with open(os.path.join(directory, "pwn-fill"), "wb") as handle:
                handle.write(b"x" * (8 << 20))  # twice the tmp cap: uncapped if it lands
            wrote.append(directory)
        except OSError:
            pass
    try:
        os.mkdir("/pwn-dir")
        wrote.append("mkdir /")
    except OSError:
        pass
    return wrote
'''


def _fallback(monkeypatch):
    # As root, the fallback's bubblewrap runs as root (no uid to drop to): --cap-drop ALL keeps it as weak as a user's.
    monkeypatch.setattr(sandbox, "confinement", lambda: sandbox.Confinement(root=False, cgroup_bases={}))


@pytest.mark.parametrize("fallback", [False, True], ids=["this-machine", "fallback"])
def test_only_the_capped_tmpfs_is_writable(monkeypatch, fallback):
    if fallback:
        _fallback(monkeypatch)
    said, _ = outputs(WRITE_EVERYWHERE, ONE_TEST)
    assert said == ["[]"]  # / and /dev (bwrap's uncapped tmpfs) are read-only; /tmp is tested by test_disk_fill...
    assert sandbox.isolation_report()["root_fs"].startswith("read-only")


NESTED_NAMESPACES = r'''
import ctypes
def f(x):
    libc = ctypes.CDLL(None, use_errno=True)
    made = []
    for name, flags in (("user", 0x10000000), ("user+mount", 0x10000000 | 0x00020000), ("mount", 0x00020000)):
        if libc.unshare(flags) == 0:
            made.append(name)
    if libc.mount(b"none", b"/tmp", b"tmpfs", 0, None) == 0:
        made.append("tmpfs")
    return made
'''


@pytest.mark.skipif(not sandbox.bwrap_blocks_userns(), reason="bubblewrap < 0.8 cannot block nested user namespaces "
                                                               "(no --disable-userns); isolation_report says so")
@pytest.mark.parametrize("fallback", [False, True], ids=["this-machine", "fallback"])
def test_nested_user_namespaces_and_mounts_fail(monkeypatch, fallback):
    if fallback:
        _fallback(monkeypatch)
    said, _ = outputs(NESTED_NAMESPACES, ONE_TEST)
    assert said == ["[]"]
    assert sandbox.isolation_report()["user_namespaces"].startswith("nested ones blocked")


# ---- backends -------------------------------------------------------------------------------------------------------


def test_without_bubblewrap_the_reward_refuses_unless_the_unsafe_backend_is_chosen(monkeypatch):
    from trl_ext.recipe import StageSpec
    from trl_ext_plugins.rewards import unit_tests

    monkeypatch.setattr(sandbox, "bwrap_problem", lambda python=None: "bubblewrap is not installed")
    monkeypatch.setattr(unit_tests, "bwrap_problem", lambda python=None: "bubblewrap is not installed")
    with pytest.raises(RuntimeError, match="refusing to run model-written code without isolation"):
        run_sample("def f(x):\n    return 1\n", [], LIMITS)
    stage = StageSpec(trainer="grpo", model="m", dataset={"source": "nowhere"})
    plugin = UnitTests(UnitTestsParams())
    (error,) = plugin.trl_ext_validate_stage(stage=stage, plugins=[plugin])
    assert "bwrap is required" in error and "unsafe_subprocess" in error
    unsafe = UnitTests(UnitTestsParams(backend="unsafe_subprocess"))
    with pytest.warns(UserWarning, match="WITHOUT isolation.*project's source.*network"):
        assert unsafe.trl_ext_validate_stage(stage=stage, plugins=[unsafe]) == []
    with pytest.warns(UserWarning, match="WITHOUT isolation"):
        assert reward("def f(x):\n    return x * x + 1\n", backend="unsafe_subprocess") == (1.0, ["pass"] * 3)
