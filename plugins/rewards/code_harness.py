"""The harness that runs inside the code sandbox: it calls the candidate and reports raw outputs, never verdicts.

This file is executed by the sandbox's interpreter (``python3 -I -S -c <this source>``); it imports only the standard
library and nothing of trl-ext, and must keep working on any Python 3.8+.

Trust boundary. The harness is trusted; the candidate's code never runs in the harness process. The harness reads
one setup line (the candidate's source and the per-test limits) and then one test request at a time from the trainer
on fd 0, and answers each request with one JSON line on fd 1. For every test it ``fork``s a fresh child, and only the
child executes the candidate (module code, then the call or the program). The child reports the candidate's output
on a pipe of its own (function-call tests: ``json.dumps`` of the return value; stdin/stdout tests: the program's
stdout). The harness forwards those bytes verbatim as a string with the child's exit status; the trainer parses them
as JSON (plain data only, no custom object can cross) and compares them with the expected values, which never enter
the sandbox. So whatever the candidate does in its child (exit early in any way, register exit handlers, start
threads, exec another program, install signal handlers, monkeypatch ``json``, write fake protocol lines to every fd it
finds) only changes *its own output* for *that test*, which is exactly what it is graded on.

Why the candidate cannot reach the harness's channel or state:

* the child closes every descriptor except its stdin, stdout (``/dev/null`` for function calls), stderr
  (``/dev/null``) and its own result pipe before running candidate code; the trainer's pipes live at other
  descriptors in the harness only;
* the harness makes itself non-dumpable (``prctl(PR_SET_DUMPABLE, 0)``), so the candidate, though the same uid,
  cannot open ``/proc/1/fd/*`` or ``/proc/1/mem`` or ptrace it (it holds no capability in the sandbox's namespace);
* being the same uid, the candidate *can* lower the harness's own rlimits (``prlimit``) or priority (``setpriority``);
  no hard limit can be raised again without a capability, so this only slows or breaks the harness for the rest of
  this sample. The harness compares its limits and priority after every test with those it started with, and
  answers ``error`` for that test and every later one once they changed (a sample that tampers earns nothing more);
* under bubblewrap the harness is the PID namespace's init (``--as-pid-1``): the kernel delivers to it no signal
  from inside the namespace that it has no handler for, and it keeps none (Python's SIGINT handler is reset), so
  ``os.kill(1, 9)``, ``os.kill(os.getppid(), signal.SIGINT)`` or ``os.kill(-1, 9)`` cannot end it; the trainer is
  outside the namespace and invisible;
* tests arrive one at a time: when test *i* runs, the harness has seen only requests ``0..i`` (inputs, never
  expected values), so a child cannot read future tests from memory inherited through ``fork``;
* after each test, the harness kills every other process in the namespace (``kill(-1, SIGKILL)`` from init), including
  ones that called ``setsid`` or double-forked, and reaps them, so nothing the candidate started outlives its test;
  it then empties the sandbox's scratch directories (``/tmp``, ``/dev/shm``), so no file carries over to the next
  test (best effort: what it cannot remove, such as a tree nested deeper than ``PATH_MAX``, stays; it is only ever
  the candidate's own files, which never hold expected values).

CPU time. A test's CPU time is measured by the harness, not reported by the candidate: the ``wait4`` usage of the
test's process (which includes every descendant it reaped) plus that of every other process of the namespace that
the harness reaps after the test (orphans and processes still running, which it kills first). A test that used more
than ``cpu_seconds`` in total is a ``timeout`` whatever its exit status or output; one within it is judged on its
output. The kernel's ``RLIMIT_CPU`` only stops a runaway process: soft = hard = ``cpu_seconds + 1`` (``SIGKILL``, so
no ``SIGXCPU`` to ignore or handle; the candidate cannot raise a hard limit). It is set a second past the limit
because the kernel counts CPU time in scheduler ticks, which on a busy or virtual machine run a few percent ahead
of the exact time ``wait4`` reports: at exactly ``cpu_seconds`` the kernel would end some tests that are within
the limit by the harness's measure. Outside a PID namespace only the test's process and the descendants it reaped
are counted.

Outside a PID namespace (the explicitly unsafe backend) the harness is not init: it puts each child in its own
session and kills that process group, which a candidate can leave with ``setsid``; that backend says so when chosen.
"""

import ast
import json
import os
import select
import signal
import sys
import time

try:  # resource and ctypes exist on Linux; the harness degrades (no per-test CPU limit, dumpable) without them
    import resource
except ImportError:  # pragma: no cover
    resource = None

READ_CHUNK = 65536


def make_non_dumpable():
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE = 4
    except Exception:  # pragma: no cover - no libc: the sandbox's other walls still hold
        pass


def write_all(fd, data):
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]


def child_main(code, request, setup, stdin_fd, out_fd):
    """Run the candidate for one test in this forked child; never returns (``os._exit``)."""
    try:
        devnull = os.open(os.devnull, os.O_RDWR)
        os.dup2(stdin_fd if stdin_fd is not None else devnull, 0)
        os.dup2(out_fd if request["kind"] == "stdio" else devnull, 1)
        os.dup2(devnull, 2)
        if request["kind"] == "call":
            os.dup2(out_fd, 3)
        os.closerange(4 if request["kind"] == "call" else 3, setup["max_fd"])
        if resource is not None:  # a backstop only (module docstring): ran_out_of_cpu decides, by measurement
            backstop = int(setup["cpu_seconds"]) + 1
            resource.setrlimit(resource.RLIMIT_CPU, (backstop, backstop))
        signal.signal(signal.SIGINT, signal.default_int_handler)
        if not setup.get("pid_namespace"):
            os.setsid()  # the unsafe backend kills this process group after the test
        sys.stdin = open(0, "r", closefd=False)
        sys.stdout = open(1, "w", closefd=False)
        sys.stderr = open(2, "w", closefd=False)
        sys.argv = ["solution.py"]
    except BaseException:
        os._exit(70)
    if request["kind"] == "stdio":
        os._exit(run_program(code))
    os._exit(run_call(code, request))


def run_program(code):
    """Exit status of the candidate run as ``__main__`` (as ``python solution.py < input`` would give)."""
    status = 0
    try:
        exec(code, {"__name__": "__main__", "__builtins__": __builtins__})
    except SystemExit as exc:
        status = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:
        status = 1
    try:
        sys.stdout.flush()
    except BaseException:
        status = status or 1
    return status


def run_call(code, request):
    """Import the candidate as a module, call the function, write ``json.dumps`` of its value on fd 3."""
    try:
        args = ast.literal_eval(request["args_literal"])  # tuples, sets, bytes arrive as such
        kwargs = ast.literal_eval(request["kwargs_literal"])
        namespace = {"__name__": "solution", "__builtins__": __builtins__}
        exec(code, namespace)
        name = request["fn"]
        function = namespace.get(name)
        if function is None and isinstance(namespace.get("Solution"), type):  # LeetCode / APPS class style
            function = getattr(namespace["Solution"](), name)
        value = function(*args, **kwargs)
        text = json.dumps(value)
    except BaseException:
        return 1  # no result: the test fails whatever the reason (exception, SystemExit, missing function)
    try:
        write_all(3, text.encode("utf-8"))
    except BaseException:
        return 1
    return 0


def run_test(code, request, setup):
    """Fork a child for one test, collect its output under the limits; a reply dict for the trainer."""
    if code is None:
        return {"status": "error", "exit": None, "signal": None, "output": "", "detail": "does not compile"}
    cap = int(setup["output_bytes"])
    out_r, out_w = os.pipe()
    stdin_r = stdin_w = None
    if request["kind"] == "stdio":
        stdin_r, stdin_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        try:
            os.close(out_r)
            if stdin_w is not None:
                os.close(stdin_w)
        finally:
            child_main(code, request, setup, stdin_r, out_w)
    os.close(out_w)
    if stdin_r is not None:
        os.close(stdin_r)
    pending = request.get("stdin", "").encode("utf-8")
    if stdin_w is not None:
        os.set_blocking(stdin_w, False)
        if not pending:
            os.close(stdin_w)
            stdin_w = None
    os.set_blocking(out_r, False)
    pidfd = os.pidfd_open(pid) if hasattr(os, "pidfd_open") else None
    deadline = time.monotonic() + float(setup["wall_seconds"])
    chunks, size, status, exit_status, cpu_used = [], 0, None, None, 0.0
    while status is None:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            status = "timeout"
            break
        readers = [out_r] + ([pidfd] if pidfd is not None else [])
        writers = [stdin_w] if stdin_w is not None else []
        ready_r, ready_w, _ = select.select(readers, writers, [], min(remaining, 0.05 if pidfd is None else remaining))
        if stdin_w is not None and stdin_w in ready_w:
            try:
                written = os.write(stdin_w, pending[:READ_CHUNK])
                pending = pending[written:]
            except OSError:  # the program closed its stdin: it does not want the rest
                pending = b""
            if not pending:
                os.close(stdin_w)
                stdin_w = None
        if out_r in ready_r:
            data = read_some(out_r)
            if data:
                chunks.append(data)
                size += len(data)
                if size > cap:
                    status = "over_cap"
                    break
        exited, exit_status, cpu_used = reap_child(pid)
        if exited:  # drain what the child wrote before it ended, then stop
            while True:
                data = read_some(out_r)
                if not data:
                    break
                chunks.append(data)
                size += len(data)
                if size > cap:
                    break
            status = "over_cap" if size > cap else "exited"
    if stdin_w is not None:
        os.close(stdin_w)
    os.close(out_r)
    if pidfd is not None:
        os.close(pidfd)
    reaped, reaped_cpu = kill_everything_else(pid, setup)
    if exit_status is None:
        exit_status, child_cpu = (reaped[pid], 0.0) if pid in reaped else wait_child(pid)  # reaped_cpu has its part
        cpu_used += child_cpu
    cpu_used += reaped_cpu
    empty_scratch_dirs(setup)
    if status == "exited" and ran_out_of_cpu(cpu_used, setup):
        status = "timeout"
    output = b"".join(chunks)[:cap].decode("utf-8", errors="replace")
    code_, sig = (os.WEXITSTATUS(exit_status), None) if os.WIFEXITED(exit_status) else (None, os.WTERMSIG(exit_status))
    return {"status": status, "exit": code_ if status == "exited" else None,
            "signal": sig if status == "exited" else None, "output": output}


def read_some(fd):
    try:
        return os.read(fd, READ_CHUNK)
    except BlockingIOError:
        return b""


def reap_child(pid):
    """(exited, wait status, CPU seconds the child used) without blocking."""
    try:
        done, status, usage = os.wait4(pid, os.WNOHANG)
    except ChildProcessError:
        return True, 0, 0.0
    if done != pid:
        return False, None, 0.0
    return True, status, usage.ru_utime + usage.ru_stime


def wait_child(pid):
    try:
        _, status, usage = os.wait4(pid, 0)
    except ChildProcessError:
        return 0, 0.0
    return status, usage.ru_utime + usage.ru_stime


def ran_out_of_cpu(cpu_used, setup):
    """A test that used more CPU time than allowed, by the harness's measure, is a timeout like one the wall clock
    ended (which comes first depends only on how loaded the machine is), whatever its exit status or output: a
    correct answer computed too slowly is too slow, and so is a process the kernel's backstop killed."""
    return cpu_used > float(setup["cpu_seconds"])


def kill_everything_else(pid, setup):
    """After a test: no process the candidate started survives (init kills the whole namespace but itself). Returns
    the wait statuses of the processes reaped here ({pid: status}) and the CPU seconds they used (with what each of
    them reaped): work handed to a process the test did not wait for still counts against the test."""
    statuses, cpu = {}, 0.0
    if setup.get("pid_namespace") and os.getpid() == 1:
        try:
            os.kill(-1, signal.SIGKILL)  # every process of the namespace except init, atomically w.r.t. fork
        except ProcessLookupError:
            pass
        while True:  # reap everything, the test's child and orphans re-parented to init
            try:
                done, status, usage = os.wait4(-1, 0)
            except ChildProcessError:
                break
            statuses[done] = status
            cpu += usage.ru_utime + usage.ru_stime
    else:
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    return statuses, cpu


def empty_scratch_dirs(setup):
    """Remove the files the test left in the sandbox's scratch directories, so the next test starts clean. Every
    file there is the candidate's, owned by this uid, so changing modes suffices; whatever still fails stays."""
    for top in setup.get("scratch_dirs", ()):
        try:
            empty_directory(top)
        except BaseException:  # e.g. RecursionError on absurd nesting: leftovers only ever hurt this sample
            pass


def empty_directory(top):
    try:  # its owner may always list and empty it, whatever mode the candidate gave it
        os.chmod(top, os.lstat(top).st_mode & 0o7777 | 0o700)
    except OSError:
        pass
    try:
        with os.scandir(top) as found:
            entries = list(found)
    except OSError:
        return
    for entry in entries:
        try:
            if entry.is_dir(follow_symlinks=False):
                empty_directory(entry.path)
                os.rmdir(entry.path)
            else:
                os.unlink(entry.path)
        except OSError:
            pass


def own_limits():
    """The harness's own rlimits and priority, which the candidate (same uid) can lower but never raise back."""
    if resource is None:  # pragma: no cover
        return None
    names = sorted(n for n in dir(resource) if n.startswith("RLIMIT_"))
    return [resource.getrlimit(getattr(resource, n)) for n in names], os.getpriority(os.PRIO_PROCESS, 0)


def main():
    make_non_dumpable()
    # Python's own SIGINT handler is the one disposition a process of the namespace could reach init through: it
    # would raise KeyboardInterrupt here and end the sample (os.kill(1, SIGINT) from a test). With the default
    # disposition the kernel drops every signal sent to init from inside its namespace. Children get Python's
    # handler back (child_main), as `python solution.py` has it.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    requests = os.fdopen(os.dup(0), "rb")
    replies = os.dup(1)
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    setup = json.loads(requests.readline())
    setup["max_fd"] = resource.getrlimit(resource.RLIMIT_NOFILE)[0] if resource is not None else 4096
    try:
        code = compile(setup["source"], "solution.py", "exec")
    except BaseException:
        code = None
    write_all(replies, (json.dumps({"ready": True, "compiled": code is not None}) + "\n").encode())
    limits = own_limits()
    for line in requests:
        request = json.loads(line)
        reply = run_test(code, request, setup)
        if own_limits() != limits:  # a test lowered them (prlimit/setpriority on pid 1): this sample is over
            reply = {"status": "error", "exit": None, "signal": None, "output": "",
                     "detail": "a test changed the harness's own limits or priority"}
        write_all(replies, (json.dumps(reply) + "\n").encode())


if __name__ == "__main__":
    main()
