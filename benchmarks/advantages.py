"""ReMax's extra greedy pass as a fraction of rollout time (tiny embedded model, CPU).

Run: python benchmarks/advantages.py [--rollouts 5] [--batch 32] [--generations 4] [--max-completion-length 8]

Times the GRPO trainer's whole rollout (``_generate_and_score_completions``: sampling, rewards, advantages) with the
``remax`` plugin, and inside it the greedy baseline pass (one greedy generation per prompt plus its scoring), in the
same process and run. Also reports the rollout time of the same trainer with ``rloo`` for comparison.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch


def build(plugin, model_dir: Path, out: Path, batch: int, generations: int, length: int):
    from transformers import AutoTokenizer

    from trl_ext.embedded.arithmetic import arithmetic_dataset, exact_match_reward
    from trl_ext.host import PluginHost
    from trl_ext.stage import default_args
    from trl_ext.trainers import TRAINER_KINDS, BuildContext

    kind = TRAINER_KINDS["grpo"]
    args = {**default_args(kind), "max_steps": 1, "save_strategy": "no", "seed": 0, "per_device_train_batch_size": batch,
            "num_generations": generations, "max_completion_length": length, "gradient_checkpointing": False}
    ctx = BuildContext(model=str(model_dir), ref_model=None, teacher=None, config=kind.config_cls(output_dir=str(out), **args),
                       train_dataset=arithmetic_dataset("train", format="prompt", size=256), eval_dataset=None,
                       tokenizer=AutoTokenizer.from_pretrained(model_dir), peft_config=None, callbacks=[],
                       host=PluginHost([plugin]), reward_funcs=[exact_match_reward], reward_weights=[])
    trainer = kind.build(ctx)
    trainer.model.train()
    return trainer


def time_rollouts(trainer, rollouts: int, batch: int, generations: int) -> float:
    total = 0.0
    for r in range(rollouts):
        inputs = [trainer.train_dataset[(r * batch + i) // generations] for i in range(batch)]
        start = time.perf_counter()
        trainer._generate_and_score_completions(inputs)
        total += time.perf_counter() - start
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rollouts", type=int, default=5)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--generations", type=int, default=4)
    parser.add_argument("--max-completion-length", type=int, default=8)
    a = parser.parse_args()
    torch.manual_seed(0)

    import trl_ext_plugins.advantages.remax as remax_module
    from trl_ext.embedded.models import materialize_model
    from trl_ext_plugins.advantages.remax import ReMax
    from trl_ext_plugins.advantages.rloo import RLOO

    greedy_time = [0.0]
    original = remax_module.greedy_rewards

    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            greedy_time[0] += time.perf_counter() - start

    remax_module.greedy_rewards = timed
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = materialize_model("tiny-qwen2", Path(tmp) / "model")
        shape = (a.batch, a.generations, a.max_completion_length)
        rloo = build(RLOO(), model_dir, Path(tmp) / "rloo", *shape)
        time_rollouts(rloo, 1, a.batch, a.generations)  # warm-up
        rloo_time = time_rollouts(rloo, a.rollouts, a.batch, a.generations)
        remax = build(ReMax(), model_dir, Path(tmp) / "remax", *shape)
        time_rollouts(remax, 1, a.batch, a.generations)
        greedy_time[0] = 0.0
        remax_time = time_rollouts(remax, a.rollouts, a.batch, a.generations)
    prompts = a.batch // a.generations
    print(f"{a.rollouts} rollouts of {a.batch} samples ({prompts} prompts x {a.generations}), "
          f"max_completion_length {a.max_completion_length}")
    print(f"rloo  rollout: {rloo_time / a.rollouts * 1000:.1f} ms")
    print(f"remax rollout: {remax_time / a.rollouts * 1000:.1f} ms, of which greedy pass "
          f"{greedy_time[0] / a.rollouts * 1000:.1f} ms = {greedy_time[0] / remax_time:.1%} of the rollout "
          f"({prompts} greedy generations per {a.batch} sampled); remax/rloo rollout time {remax_time / rloo_time:.2f}x")


if __name__ == "__main__":
    main()
