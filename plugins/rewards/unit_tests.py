"""``unit_tests``: 1 when the model-written program passes every test of its dataset row, run in a sandbox."""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal

from pydantic import Field

from trl_ext import Plugin, PluginParams, hookimpl
from trl_ext.rewards import RewardFunction
from trl_ext_plugins.rewards.sandbox import SandboxLimits, available_backend, run_python
from trl_ext_plugins.rewards.verify_math import completion_text

FENCE = re.compile(r"```(?:python|py|Python)?[ \t]*\n(.*?)```", re.DOTALL)


def extract_code(text: str) -> str:
    """The last fenced code block (```python ... ```), or the whole text when there is no fence."""
    blocks = FENCE.findall(text)
    return blocks[-1] if blocks else text


def build_program(code: str, tests: Any) -> str:
    """Candidate code followed by the tests (a string, or a list of statements joined by newlines)."""
    if isinstance(tests, (list, tuple)):
        tests = "\n".join(str(t) for t in tests)
    return f"{code}\n\n# ---- tests ----\n{tests}\n"


class UnitTestsParams(PluginParams):
    weight: float = Field(1.0, description="weight of this reward in the weighted sum of reward functions")
    tests_column: str = Field("tests", description="dataset column with the hidden tests (Python source or list of "
                              "assert statements); rows whose value is empty/None get None (not applicable)")
    pass_reward: float = Field(1.0, description="reward when the program exits 0 (every test passed)")
    fail_reward: float = Field(0.0, description="reward on failure, crash, timeout or limit (never raises)")
    max_workers: int = Field(4, description="sandboxes run in parallel")
    wall_seconds: float = Field(10.0, description="wall-clock timeout per program")
    cpu_seconds: int = Field(10, description="RLIMIT_CPU per program")
    memory_mb: int = Field(1024, description="RLIMIT_AS per program, MiB")
    file_mb: int = Field(16, description="RLIMIT_FSIZE per program (caps stdout/stderr too), MiB")
    max_processes: int = Field(32, description="RLIMIT_NPROC per sandbox")
    backend: Literal["auto", "bwrap", "unshare", "plain"] = Field(
        "auto", description="isolation: auto picks bwrap, then unshare (root), then plain (limits only)")
    require_isolation: bool = Field(True, description="refuse to run when only the plain backend is available")

    def limits(self) -> SandboxLimits:
        return SandboxLimits(wall_seconds=self.wall_seconds, cpu_seconds=self.cpu_seconds,
                             memory_bytes=self.memory_mb << 20, file_bytes=self.file_mb << 20,
                             max_processes=self.max_processes)


def score_programs(programs: list[str | None], params: UnitTestsParams) -> list[float | None]:
    """Run each program in its own sandbox (``max_workers`` at a time); None programs give None."""
    backend = None if params.backend == "auto" else params.backend
    if (backend or available_backend()) == "plain" and params.require_isolation:
        raise RuntimeError("unit_tests: no network/file-system isolation is available (install bubblewrap: "
                           "apt-get install -y bubblewrap, or run as root for unshare); set require_isolation=false "
                           "to accept resource limits only")
    limits = params.limits()

    def one(program: str | None) -> float | None:
        if program is None:
            return None
        return params.pass_reward if run_python(program, limits, backend=backend).passed else params.fail_reward

    with ThreadPoolExecutor(max_workers=max(1, params.max_workers)) as pool:
        return list(pool.map(one, programs))


class UnitTests(Plugin):
    """Unit-test reward for code generation (RLVR: Tulu 3, arXiv 2411.15124; DeepSeek-R1, arXiv 2501.12948).

    The completion's last fenced Python block (or the whole completion) is followed by the row's tests and run as one
    program in a sandbox (:mod:`trl_ext_plugins.rewards.sandbox`: bubblewrap namespaces or unshare, per-sandbox
    unprivileged uid, setrlimit CPU/address space/file size/process count, wall-clock timeout, fresh temp work dir,
    empty environment, output capped by the file-size limit). Reward ``pass_reward`` (1.0) only if the program exits 0,
    i.e. every hidden test passed (all-or-nothing, as in ALGORITHMS.md item 12); any failure, crash, timeout or limit
    gives ``fail_reward`` (0.0) and never stops training. Rows without tests give None.

    Protects: the trainer (other uid, PID namespace), the network, secrets in the environment, the host's resources.
    Does not protect: kernel exploits (no seccomp), world-readable files under /usr (bubblewrap) or on the host
    (unshare), world-writable dirs like /tmp outside bubblewrap, CPU contention between sandboxes. With
    ``backend: plain`` (no bubblewrap, not root) there is no network or file isolation; it must be enabled explicitly
    (``require_isolation: false``). The sandboxed interpreter is the system ``/usr/bin/python3`` (stdlib only).
    """

    name = "unit_tests"
    family = "reward"
    trainers = frozenset({"grpo", "rloo"})
    Params = UnitTestsParams

    @hookimpl
    def trl_ext_reward_functions(self, stage):
        p = self.params

        def unit_tests(completions, **kwargs):
            tests = kwargs[p.tests_column]
            programs = [build_program(extract_code(completion_text(c)), t) if t else None
                        for c, t in zip(completions, tests, strict=True)]
            return score_programs(programs, p)

        return [RewardFunction(self.name, unit_tests, p.weight)]
