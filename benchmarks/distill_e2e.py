"""Does a bigger teacher trained in an earlier stage lift a smaller student more than SFT with the same steps?

Run: python benchmarks/distill_e2e.py [--output-dir DIR]

One recipe, run through the trl-ext runner on the embedded arithmetic task: ``teacher`` (tiny-qwen2, SFT),
``student`` (tiny-qwen2-small, short SFT warm-up), then three students from that warm-up with the same optimizer steps
and batch size: ``sft_more`` (SFT on the gold completions), ``gkd`` (the gkd plugin from ``stage:teacher``, forward KL,
lmbda 0.5) and ``opd`` (opd_reward on the GRPO trainer, half the steps with 2 samples per prompt). Prints held-out
greedy exact-match accuracy after every stage. A comparison, not a test: with these small budgets the outcome depends
on how good the teacher gets (see the figures in the distillation issue note).
"""

from __future__ import annotations

import argparse
import json
import tempfile

from trl_ext.catalog import Catalog
from trl_ext.recipe import parse_recipe
from trl_ext.runner import run_recipe

TRAIN = {"source": "embedded:arithmetic", "split": "train", "params": {"format": "prompt_completion"}}
PROMPTS = {"source": "embedded:arithmetic", "split": "train", "params": {"format": "prompt"}}
EVAL = {"dataset": {"source": "embedded:arithmetic", "split": "test", "params": {"format": "prompt"}},
        "reward": "exact_match"}
STEPS, BATCH = 200, 32  # the same optimizer steps and prompts per step for every student variant


def recipe():
    sft_args = {"per_device_train_batch_size": 64, "logging_steps": 25, "save_strategy": "no", "max_length": 32}
    comparison = {"max_steps": STEPS, "per_device_train_batch_size": BATCH, "learning_rate": 3e-3,
                  "logging_steps": 25, "save_strategy": "no"}
    generation = {"max_completion_length": 5, "gradient_checkpointing": False}
    return {"seed": 0, "stages": [
        {"name": "teacher", "trainer": "sft", "model": "embedded:tiny-qwen2", "dataset": TRAIN, "plugins": ["sft"],
         "evaluation": EVAL, "args": {**sft_args, "max_steps": 200, "learning_rate": 3e-3}},
        {"name": "student", "trainer": "sft", "model": "embedded:tiny-qwen2-small", "dataset": TRAIN,
         "plugins": ["sft"], "evaluation": EVAL, "args": {**sft_args, "max_steps": 100, "learning_rate": 3e-3}},
        {"name": "sft_more", "trainer": "sft", "model": "stage:student", "dataset": TRAIN, "plugins": ["sft"],
         "evaluation": EVAL, "args": {**comparison, "max_length": 32}},
        {"name": "gkd", "trainer": "distillation", "model": "stage:student", "teacher": "stage:teacher",
         "dataset": TRAIN, "plugins": [{"gkd": {"divergence": "forward_kl", "lmbda": 0.5}}], "evaluation": EVAL,
         "args": {**comparison, **generation}},
        {"name": "opd", "trainer": "grpo", "model": "stage:student", "teacher": "stage:teacher", "dataset": PROMPTS,
         "plugins": ["grpo", "opd_reward", "exact_match"], "evaluation": EVAL,
         "args": {**comparison, **generation, "num_generations": 2, "max_steps": STEPS // 2}},
    ]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--output-dir", default=None)
    args = parser.parse_args()
    out = args.output_dir or tempfile.mkdtemp(prefix="distill-e2e-")
    info = run_recipe(parse_recipe(recipe()), out, Catalog.discover(), echo=lambda _m: None)
    acc = {name: s["eval"]["after"]["accuracy"] for name, s in info["stages"].items()}
    start = info["stages"]["gkd"]["eval"]["before"]["accuracy"]
    print(json.dumps({"student_before_comparison": start, "accuracy_after": acc}, indent=1))


if __name__ == "__main__":
    main()
