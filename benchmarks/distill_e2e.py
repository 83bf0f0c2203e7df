"""Does distillation lift a student more than SFT on the same tokens, and do two domain teachers beat one?

Run: python benchmarks/distill_e2e.py [--experiment single|multi|both] [--seeds 0 1 2] [--output-dir DIR]

Both experiments are recipes run through the trl-ext runner on the embedded arithmetic task; every figure is held-out
greedy exact-match accuracy (the runner's evaluation). A comparison, not a test: the outcome of a tiny model trained
from scratch varies with the seed, so ``single`` repeats its students over ``--seeds`` and prints each and the mean.

``single`` (the setting of Hinton et al. 2015, arXiv 1503.02531, and GKD, arXiv 2306.13649): a bigger teacher
(``tiny-qwen2``) is SFT-trained on the whole train split in an earlier stage. Then smaller students
(``tiny-qwen2-small``, from scratch) get the same budget on the same ``--size`` labelled rows, the same optimizer steps,
batch, learning rate and seed: ``sft`` trains on the gold completions; ``gkd<lambda>`` trains with the ``gkd`` plugin
from ``stage:teacher`` (forward KL, on/off-policy mix ``lambda``; off-policy batches are the same gold completions).

``multi`` (MOPD, MiMo-V2-Flash arXiv 2601.02780): two ``tiny-qwen2`` teachers, each SFT-trained on one operation only
(addition, subtraction), a ``tiny-qwen2-small`` student warmed up by SFT on both, then the same on-policy distillation
budget three ways from that warm-up: ``both`` (``multi_teacher_opd``, each prompt routed to its domain's teacher),
``add_only`` and ``sub_only`` (``opd_reward`` with one teacher for every prompt). Held-out is the mixed test set.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from trl_ext.catalog import Catalog
from trl_ext.recipe import parse_recipe
from trl_ext.runner import run_recipe


def _arithmetic(split: str, fmt: str, **params) -> dict:
    return {"source": "embedded:arithmetic", "split": split, "params": {"format": fmt, **params}}


def _held_out(source: str = "embedded:arithmetic", **params) -> dict:
    return {"dataset": {"source": source, "split": "test", "params": {"format": "prompt", **params}},
            "reward": "exact_match"}


def _sft_args(steps: int, **extra) -> dict:
    return {"max_steps": steps, "per_device_train_batch_size": 64, "learning_rate": 1e-3, "lr_scheduler_type": "linear",
            "logging_steps": 100, "save_strategy": "no", "max_length": 32, **extra}


def single_recipe(seeds: list[int], size: int, steps: int, lmbdas: list[float], learning_rate: float) -> dict:
    """Teacher on the full train split, then per seed: SFT and gkd students on the same ``size`` labelled rows."""
    held_out = _held_out()
    labelled = _arithmetic("train", "prompt_completion", size=size)
    stages = [{"name": "teacher", "trainer": "sft", "model": "embedded:tiny-qwen2", "plugins": ["sft"],
               "dataset": _arithmetic("train", "prompt_completion"), "evaluation": held_out,
               "args": _sft_args(800)}]
    for seed in seeds:
        budget = {"max_steps": steps, "per_device_train_batch_size": 32, "learning_rate": learning_rate,
                  "lr_scheduler_type": "linear", "logging_steps": 100, "save_strategy": "no", "seed": seed}
        stages.append({"name": f"sft_s{seed}", "trainer": "sft", "model": "embedded:tiny-qwen2-small",
                       "dataset": labelled, "plugins": ["sft"], "evaluation": held_out,
                       "args": {**budget, "max_length": 32}})
        for lmbda in lmbdas:
            stages.append({"name": f"gkd{round(lmbda * 100)}_s{seed}", "trainer": "distillation",
                           "model": "embedded:tiny-qwen2-small", "teacher": "stage:teacher", "dataset": labelled,
                           "plugins": [{"gkd": {"divergence": "forward_kl", "lmbda": lmbda}}],
                           "evaluation": held_out,
                           "args": {**budget, "max_completion_length": 5, "gradient_checkpointing": False}})
    return {"seed": 0, "stages": stages}


def multi_recipe(steps: int, learning_rate: float, seed: int = 0, max_operand: int = 20) -> dict:
    """Two single-operation teachers, a warmed-up student, then on-policy distillation from both, or from one."""
    held_out = _held_out("embedded:domain_arithmetic", max_operand=max_operand)
    mixed_prompts = {"source": "embedded:domain_arithmetic", "split": "train",
                     "params": {"format": "prompt", "max_operand": max_operand}}
    budget = {"max_steps": steps, "per_device_train_batch_size": 64, "num_generations": 4,
              "max_completion_length": 6, "learning_rate": learning_rate, "logging_steps": 50,
              "save_strategy": "no", "gradient_checkpointing": False}

    def teacher(name: str, operation: str) -> dict:
        return {"name": name, "trainer": "sft", "model": "embedded:tiny-qwen2", "plugins": ["sft"],
                "dataset": _arithmetic("train", "prompt_completion", operations=operation, max_operand=max_operand),
                "evaluation": held_out, "args": _sft_args(600)}

    def one_teacher(name: str, teacher_stage: str) -> dict:
        return {"name": name, "trainer": "grpo", "model": "stage:student", "teacher": f"stage:{teacher_stage}",
                "dataset": mixed_prompts, "plugins": ["grpo", "opd_reward", "exact_match"],
                "evaluation": held_out, "args": budget}

    return {"seed": seed, "stages": [
        teacher("add_teacher", "+"),
        teacher("sub_teacher", "-"),
        {"name": "student", "trainer": "sft", "model": "embedded:tiny-qwen2-small", "plugins": ["sft"],
         "dataset": _arithmetic("train", "prompt_completion", operations="+-", max_operand=max_operand),
         "evaluation": held_out, "args": _sft_args(600, learning_rate=3e-3)},
        {"name": "both", "trainer": "grpo", "model": "stage:student", "dataset": mixed_prompts,
         "plugins": ["grpo", {"multi_teacher_opd": {"teachers": {"add": "stage:add_teacher",
                                                                  "sub": "stage:sub_teacher"}}}, "exact_match"],
         "evaluation": held_out, "args": budget},
        one_teacher("add_only", "add_teacher"),
        one_teacher("sub_only", "sub_teacher"),
    ]}


def _accuracies(recipe: dict, output_dir: Path) -> dict[str, float]:
    info = run_recipe(parse_recipe(recipe), str(output_dir), Catalog.discover(), echo=lambda _m: None)
    return {name: stage["eval"]["after"]["accuracy"] for name, stage in info["stages"].items()}


def report_single(acc: dict[str, float], seeds: list[int], lmbdas: list[float]) -> None:
    variants = ["sft"] + [f"gkd{round(lmbda * 100)}" for lmbda in lmbdas]
    print(f"teacher (tiny-qwen2, full train split): {acc['teacher']:.3f}")
    print(f"{'student':<8}" + "".join(f"{f'seed {s}':>9}" for s in seeds) + f"{'mean':>9}")
    for variant in variants:
        values = [acc[f"{variant}_s{seed}"] for seed in seeds]
        print(f"{variant:<8}" + "".join(f"{v:>9.3f}" for v in values) + f"{statistics.mean(values):>9.3f}")


def report_multi(acc: dict[str, float]) -> None:
    for name in ("add_teacher", "sub_teacher", "student", "both", "add_only", "sub_only"):
        print(f"{name:<12}{acc[name]:>8.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--experiment", choices=["single", "multi", "both"], default="both")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--size", type=int, default=256, help="labelled rows every single-teacher student trains on")
    parser.add_argument("--steps", type=int, default=1500, help="optimizer steps of every single-teacher student")
    parser.add_argument("--lmbda", type=float, nargs="+", default=[0.5], help="gkd on-policy fractions to compare")
    parser.add_argument("--learning-rate", type=float, default=1e-3, help="single-teacher students' learning rate")
    parser.add_argument("--multi-steps", type=int, default=1000, help="on-policy distillation steps of each student")
    parser.add_argument("--multi-learning-rate", type=float, default=3e-4)
    parser.add_argument("--multi-seed", type=int, default=0, help="seed of the whole multi recipe (teachers included)")
    parser.add_argument("--output-dir", default=None)
    args = parser.parse_args()
    out = Path(args.output_dir or tempfile.mkdtemp(prefix="distill-e2e-"))
    results = {}
    if args.experiment in ("single", "both"):
        acc = _accuracies(single_recipe(args.seeds, args.size, args.steps, args.lmbda, args.learning_rate),
                          out / "single")
        report_single(acc, args.seeds, args.lmbda)
        results["single"] = acc
    if args.experiment in ("multi", "both"):
        acc = _accuracies(multi_recipe(args.multi_steps, args.multi_learning_rate, args.multi_seed), out / "multi")
        report_multi(acc)
        results["multi"] = acc
    (out / "distill_e2e.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
