"""Reward throughput: math_verify scores/s, unit_tests scores/s with parallel sandboxes, sandbox per-sample overhead,
reward_model batched scoring (tiny embedded model with a sequence-classification head) per second.

Run: python benchmarks/rewards.py [--n 200] [--workers 1 2 4] [--rm-batch 1 32 128]
CPU-only; prints one line per figure. Figures depend on the machine's load (shared cores give noisy numbers).
"""

from __future__ import annotations

import argparse
import time

from trl_ext_plugins.rewards.sandbox import SandboxLimits, available_backend, run_python
from trl_ext_plugins.rewards.unit_tests import UnitTestsParams, build_program, score_programs
from trl_ext_plugins.rewards.verify_math import math_verify_scores


def bench_math_verify(n: int) -> float:
    pairs = [(r"so the answer is \boxed{\frac{1}{2}}", "0.5"), ("The answer is 42", "42"),
             (r"\boxed{x^2+2x+1}", "$(x+1)^2$"), (r"\boxed{3}", "4")]
    completions = [pairs[i % 4][0] for i in range(n)]
    answers = [pairs[i % 4][1] for i in range(n)]
    start = time.perf_counter()
    math_verify_scores(completions, answers)
    return n / (time.perf_counter() - start)


def bench_unit_tests(n: int, workers: int) -> float:
    program = build_program("def add(a, b):\n    return a + b\n", ["assert add(1, 2) == 3", "assert add(-1, 1) == 0"])
    params = UnitTestsParams(max_workers=workers, wall_seconds=10)
    start = time.perf_counter()
    scores = score_programs([program] * n, params)
    assert all(s == 1.0 for s in scores), scores
    return n / (time.perf_counter() - start)


def bench_overhead(n: int, backend: str) -> tuple[float, float]:
    """Seconds per trivial program: sandboxed (backend) and bare interpreter (plain, no isolation)."""
    out = []
    for name in (backend, "plain"):
        start = time.perf_counter()
        for _ in range(n):
            assert run_python("pass", SandboxLimits(), backend=name).passed
        out.append((time.perf_counter() - start) / n)
    return out[0], out[1]


def bench_reward_model(n: int, batch_size: int) -> float:
    """Texts scored per second by the reward_model scorer (prompt + completion + eos, right-padded batches)."""
    import tempfile

    from trl_ext.embedded.models import materialize_model
    from trl_ext_plugins.rewards.scoring import load_sequence_classifier, score_texts

    with tempfile.TemporaryDirectory() as tmp:
        model, tok = load_sequence_classifier(str(materialize_model("tiny-qwen2", tmp + "/m", seed=0)))
    texts = [f"{i % 50}+{i % 7}={i % 50 + i % 7}" for i in range(n)]
    score_texts(model, tok, texts[:batch_size], batch_size)  # warm-up
    start = time.perf_counter()
    score_texts(model, tok, texts, batch_size)
    return n / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=200, help="math_verify samples")
    parser.add_argument("--programs", type=int, default=32, help="unit_tests programs per worker setting")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--rm-batch", type=int, nargs="+", default=[1, 32, 128], help="reward_model batch sizes")
    parser.add_argument("--rm-n", type=int, default=512, help="reward_model texts per batch-size setting")
    args = parser.parse_args()
    for batch in args.rm_batch:
        print(f"reward_model: {bench_reward_model(args.rm_n, batch):.1f} scores/s at batch {batch} "
              f"(tiny-qwen2, n={args.rm_n}, CPU)")
    backend = available_backend()
    print(f"math_verify: {bench_math_verify(args.n):.1f} scores/s (n={args.n}, one thread)")
    for workers in args.workers:
        rate = bench_unit_tests(args.programs, workers)
        print(f"unit_tests[{backend}]: {rate:.1f} scores/s with {workers} parallel sandboxes (n={args.programs})")
    sandboxed, bare = bench_overhead(10, backend)
    print(f"sandbox overhead: {sandboxed * 1e3:.0f} ms/sample with {backend} vs {bare * 1e3:.0f} ms bare interpreter "
          f"(+{(sandboxed - bare) * 1e3:.0f} ms)")


if __name__ == "__main__":
    main()
