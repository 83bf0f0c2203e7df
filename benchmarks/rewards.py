"""Reward throughput: math_verify scores/s, reward_model batched scoring (tiny embedded model with a
sequence-classification head) per second. The unit_tests sandbox has its own benchmark: benchmarks/sandbox.py.

Run: python benchmarks/rewards.py [--n 200] [--rm-batch 1 32 128]
CPU-only; prints one line per figure. Figures depend on the machine's load (shared cores give noisy numbers).
"""

from __future__ import annotations

import argparse
import time

from trl_ext_plugins.rewards.verify_math import math_verify_scores


def bench_math_verify(n: int) -> float:
    pairs = [(r"so the answer is \boxed{\frac{1}{2}}", "0.5"), ("The answer is 42", "42"),
             (r"\boxed{x^2+2x+1}", "$(x+1)^2$"), (r"\boxed{3}", "4")]
    completions = [pairs[i % 4][0] for i in range(n)]
    answers = [pairs[i % 4][1] for i in range(n)]
    start = time.perf_counter()
    math_verify_scores(completions, answers)
    return n / (time.perf_counter() - start)


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
    parser.add_argument("--rm-batch", type=int, nargs="+", default=[1, 32, 128], help="reward_model batch sizes")
    parser.add_argument("--rm-n", type=int, default=512, help="reward_model texts per batch-size setting")
    args = parser.parse_args()
    for batch in args.rm_batch:
        print(f"reward_model: {bench_reward_model(args.rm_n, batch):.1f} scores/s at batch {batch} "
              f"(tiny-qwen2, n={args.rm_n}, CPU)")
    print(f"math_verify: {bench_math_verify(args.n):.1f} scores/s (n={args.n}, one thread)")


if __name__ == "__main__":
    main()
