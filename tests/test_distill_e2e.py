"""End to end (slow): a bigger teacher trained in an earlier stage lifts a smaller student's held-out accuracy more
than SFT on the gold data with the same steps and batch size (GKD on TRL's DistillationTrainer, and opd_reward on
the GRPO trainer). Prints the figures; run with ``python -m pytest -q -m slow tests/test_distill_e2e.py -s``."""

import json

import pytest

from trl_ext.catalog import Catalog
from trl_ext.recipe import parse_recipe
from trl_ext.runner import run_recipe

TRAIN = {"source": "embedded:arithmetic", "split": "train", "params": {"format": "prompt_completion"}}
PROMPTS = {"source": "embedded:arithmetic", "split": "train", "params": {"format": "prompt"}}
EVAL = {"dataset": {"source": "embedded:arithmetic", "split": "test", "params": {"format": "prompt"}},
        "reward": "exact_match"}
STEPS, BATCH = 100, 32  # the same optimizer steps and prompts per step for every student variant


def recipe():
    sft_args = {"per_device_train_batch_size": 64, "logging_steps": 25, "save_strategy": "no", "max_length": 32}
    comparison = {"max_steps": STEPS, "per_device_train_batch_size": BATCH, "learning_rate": 1e-3,
                  "logging_steps": 25, "save_strategy": "no"}
    generation = {"max_completion_length": 5, "gradient_checkpointing": False}
    return {"seed": 0, "stages": [
        {"name": "teacher", "trainer": "sft", "model": "embedded:tiny-qwen2", "dataset": TRAIN, "plugins": ["sft"],
         "evaluation": EVAL, "args": {**sft_args, "max_steps": 300, "learning_rate": 3e-3}},
        {"name": "student", "trainer": "sft", "model": "embedded:tiny-qwen2-small", "dataset": TRAIN,
         "plugins": ["sft"], "evaluation": EVAL, "args": {**sft_args, "max_steps": 60, "learning_rate": 3e-3}},
        {"name": "sft_more", "trainer": "sft", "model": "stage:student", "dataset": TRAIN, "plugins": ["sft"],
         "evaluation": EVAL, "args": {**comparison, "max_length": 32}},
        {"name": "gkd", "trainer": "distillation", "model": "stage:student", "teacher": "stage:teacher",
         "dataset": TRAIN, "plugins": [{"gkd": {"divergence": "reverse_kl"}}], "evaluation": EVAL,
         "args": {**comparison, **generation}},
        {"name": "opd", "trainer": "grpo", "model": "stage:student", "teacher": "stage:teacher", "dataset": PROMPTS,
         "plugins": ["grpo", "opd_reward", "exact_match"], "evaluation": EVAL,
         "args": {**comparison, **generation, "num_generations": 2}},
    ]}


@pytest.mark.slow
def test_stage_teacher_lifts_the_student_more_than_sft(tmp_path):
    info = run_recipe(parse_recipe(recipe()), tmp_path, Catalog.discover(), echo=lambda _m: None)
    acc = {name: s["eval"]["after"]["accuracy"] for name, s in info["stages"].items()}
    start = info["stages"]["gkd"]["eval"]["before"]["accuracy"]
    print(json.dumps({"accuracy_after": acc, "student_before_comparison": start}, indent=1))
    assert acc["teacher"] > acc["student"] + 0.2  # the earlier stage really is the stronger model
    assert acc["gkd"] - start > acc["sft_more"] - start
    assert acc["opd"] - start > acc["sft_more"] - start
