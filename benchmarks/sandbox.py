"""unit_tests sandbox throughput: samples/s for N candidates x T tests, against a plain unsandboxed subprocess baseline.

Run: python benchmarks/sandbox.py [--candidates 64] [--tests 10] [--workers 0]

Measured in one run, same candidates, same worker count (0 = the machine's CPU count):

* ``bwrap``: the unit_tests reward as shipped (one bubblewrap sandbox per candidate, a fresh process per test, verdicts
  in the trainer; cgroups and the private tmpfs where the machine allows them);
* ``unsafe_subprocess``: the same harness without any isolation (what the isolation itself costs);
* ``plain subprocess``: the naive baseline, ``python -c "<candidate>\\n<assert lines>"`` per candidate, reward = exit 0
  (forgeable, shown only for cost).

Candidates are distinct (so the reward's in-batch de-duplication does not apply); half are correct, a quarter wrong,
a quarter partially correct. Figures depend on the machine's load.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import time
import warnings
from concurrent.futures import ThreadPoolExecutor

from trl_ext_plugins.rewards.code_tests import sample_reward
from trl_ext_plugins.rewards.sandbox import default_python, isolation_report
from trl_ext_plugins.rewards.unit_tests import UnitTestsParams, row_tests, score_candidates


def candidates(n: int) -> list[str]:
    bodies = ["return x * x + 1", "return x * x", "return x * x + 1 if x < 5 else 0", "return (x ** 2) + 1"]
    return [f"# candidate {i}\ndef f(x):\n    {bodies[i % 4]}\n" for i in range(n)]


def plain_subprocess(codes: list[str], asserts: list[str], workers: int) -> list[float]:
    python = default_python()

    def one(code: str) -> float:
        program = code + "\n" + "\n".join(asserts) + "\n"
        run = subprocess.run([python, "-I", "-S", "-c", program], capture_output=True, timeout=60)
        return 1.0 if run.returncode == 0 else 0.0

    with ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(one, codes))


def timed(fn):
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--candidates", type=int, default=64)
    parser.add_argument("--tests", type=int, default=10)
    parser.add_argument("--workers", type=int, default=0, help="parallel samples; 0 = CPU count")
    args = parser.parse_args()
    workers = args.workers or os.cpu_count() or 1
    asserts = [f"assert f({x}) == {x * x + 1}" for x in range(args.tests)]
    tests = row_tests(json.dumps(asserts))
    codes = candidates(args.candidates)
    print(f"isolation: {isolation_report()}")
    print(f"{args.candidates} candidates x {args.tests} tests, {workers} workers, {os.cpu_count()} CPUs")

    rates = {}
    for backend in ("bwrap", "unsafe_subprocess"):
        params = UnitTestsParams(backend=backend, max_workers=workers, scoring="fraction")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            verdicts, seconds = timed(lambda: score_candidates(codes, [tests] * len(codes), params))
        rewards = [sample_reward(v, "fraction") for v in verdicts]
        rates[backend] = args.candidates / seconds
        print(f"unit_tests[{backend}]: {rates[backend]:.1f} samples/s ({seconds:.2f} s), mean reward "
              f"{sum(rewards) / len(rewards):.3f}")
    rewards, seconds = timed(lambda: plain_subprocess(codes, asserts, workers))
    rates["plain"] = args.candidates / seconds
    print(f"plain subprocess (no isolation, exit-code reward): {rates['plain']:.1f} samples/s ({seconds:.2f} s), "
          f"mean reward {sum(rewards) / len(rewards):.3f}")
    print(f"ratio bwrap / plain subprocess: {rates['bwrap'] / rates['plain']:.2f}x; "
          f"bwrap / unsafe_subprocess harness: {rates['bwrap'] / rates['unsafe_subprocess']:.2f}x")


if __name__ == "__main__":
    main()
