"""unit_tests reward and its sandbox: correct programs pass; hostile programs are contained and score 0."""

import os
import time
from pathlib import Path

import pytest

from trl_ext.testing import check_plugin_conformance
from trl_ext_plugins.rewards.sandbox import SandboxLimits, available_backend, run_python
from trl_ext_plugins.rewards.unit_tests import UnitTests, UnitTestsParams, build_program, extract_code

BACKENDS = [b for b in ("bwrap", "unshare") if b == available_backend() or (b == "unshare" and os.geteuid() == 0)]
if not BACKENDS:
    pytest.skip("no isolating sandbox backend here (needs bubblewrap or root)", allow_module_level=True)

LIMITS = SandboxLimits(wall_seconds=1.5, cpu_seconds=2, memory_bytes=512 << 20, file_bytes=1 << 20,
                       max_processes=16, output_bytes=4096)


@pytest.fixture(params=BACKENDS)
def backend(request):
    return request.param


def _run(source, backend):
    start = time.monotonic()
    result = run_python(source, LIMITS, backend=backend)
    assert time.monotonic() - start < LIMITS.wall_seconds + 3  # never hangs the trainer
    return result


def test_good_program_passes_and_bad_fails(backend):
    assert _run("def add(a, b):\n    return a + b\nassert add(2, 3) == 5\n", backend).passed
    assert not _run("def add(a, b):\n    return a - b\nassert add(2, 3) == 5\n", backend).passed
    assert not _run("raise SystemExit(3)", backend).passed


def test_infinite_loop_times_out(backend):
    result = _run("while True:\n    pass\n", backend)
    assert not result.passed and (result.timed_out or result.returncode != 0)


def test_fork_bomb_is_contained(backend):
    source = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    result = _run(source, backend)
    assert not result.passed
    # afterwards this machine can still start processes, and no sandbox process survived
    assert run_python("print('alive')", LIMITS, backend=backend).stdout == "alive\n"


def test_huge_allocation_fails(backend):
    result = _run("x = bytearray(64 * 2**30)\n", backend)
    assert not result.passed and "MemoryError" in result.stderr
    result = _run("chunks = []\nwhile True:\n    chunks.append(bytearray(64 << 20))\n", backend)
    assert not result.passed


def test_writing_outside_workdir_is_refused(backend, tmp_path):
    target = tmp_path / "pwned.txt"
    source = (f"import pathlib\nok = 0\nfor p in [{str(target)!r}, '/usr/pwned.txt', '/etc/pwned.txt']:\n"
              "    try:\n        pathlib.Path(p).write_text('x'); ok += 1\n    except OSError:\n        pass\n"
              "pathlib.Path('inside.txt').write_text('fine')\nassert ok == 0, ok\n")
    assert _run(source, backend).passed  # every outside write raised, the inside write worked
    assert not target.exists() and not Path("/usr/pwned.txt").exists() and not Path("/etc/pwned.txt").exists()


def test_environment_secrets_are_not_visible(backend, monkeypatch):
    monkeypatch.setenv("TRL_EXT_FAKE_SECRET", "hunter2-token")
    source = ("import os, glob\nprint(dict(os.environ))\n"
              "for p in glob.glob('/proc/*/environ'):\n    try:\n        print(open(p, 'rb').read())\n"
              "    except OSError:\n        pass\n")
    result = _run(source, backend)
    assert result.passed and "hunter2-token" not in result.stdout and "TRL_EXT_FAKE_SECRET" not in result.stdout


def test_network_is_unreachable(backend):
    source = ("import socket\ns = socket.socket()\ns.settimeout(1)\ntry:\n    s.connect(('1.1.1.1', 80))\n"
              "    print('CONNECTED')\nexcept OSError as e:\n    print('blocked', e.errno)\n"
              "print([n for _, n in socket.if_nameindex()])\n")
    result = _run(source, backend)
    assert "CONNECTED" not in result.stdout and "blocked" in result.stdout
    assert "['lo']" in result.stdout  # only a loopback interface exists


def test_printing_gigabytes_is_capped(backend):
    result = _run("import sys\nwhile True:\n    sys.stdout.write('x' * (1 << 20))\n", backend)
    assert not result.passed and len(result.stdout) <= LIMITS.output_bytes


def test_killing_the_parent_fails(backend):
    me = os.getpid()
    source = (f"import os, signal\nfor how in (lambda: os.kill({me}, 9), lambda: os.killpg(os.getpgid({me}), 9),\n"
              "            lambda: os.kill(os.getppid(), 9), lambda: os.kill(-1, 9)):\n"
              "    try:\n        how()\n    except OSError as e:\n        print('denied', e.errno)\n")
    _run(source, backend)
    assert os.getpid() == me  # still here; the next sandbox still works
    assert run_python("print(1)", LIMITS, backend=backend).passed


def test_extract_code_and_reward_plugin():
    assert extract_code("text\n```python\nx = 1\n```\nmore\n```python\ny = 2\n```") == "y = 2\n"
    assert extract_code("z = 3") == "z = 3"
    (fn,) = UnitTests(UnitTestsParams(wall_seconds=1.5, max_workers=4)).trl_ext_reward_functions(stage=None)
    good = "```python\ndef sq(x):\n    return x * x\n```"
    completions = [good, "def sq(x):\n    return x + x", "while True: pass", good]
    tests = [["assert sq(3) == 9", "assert sq(0) == 0"]] * 3 + [None]
    assert fn.fn(completions=completions, tests=tests) == [1.0, 0.0, 0.0, None]
    assert build_program("a", ["b", "c"]).endswith("b\nc\n")


def test_plain_backend_needs_opt_in():
    (fn,) = UnitTests(UnitTestsParams(backend="plain")).trl_ext_reward_functions(stage=None)
    with pytest.raises(RuntimeError, match="isolation"):
        fn.fn(completions=["x"], tests=["assert True"])
    check_plugin_conformance(UnitTests)
