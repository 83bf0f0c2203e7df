"""ReMax's extra greedy pass as a fraction of rollout time, and PPO's critic cost against GRPO (tiny model, CPU).

Run: python benchmarks/advantages.py [--only remax|ppo] [--rollouts 5] [--steps 8] [--repeats 2] [--batch 32] [--generations 4]
     [--max-completion-length 8]

Times the GRPO trainer's whole rollout (``_generate_and_score_completions``: sampling, rewards, advantages) with the
``remax`` plugin, and inside it the greedy baseline pass (one greedy generation per prompt plus its scoring), in the
same process and run. Also reports the rollout time of the same trainer with ``rloo`` for comparison.

PPO vs GRPO: full training steps (``trainer.train``) of the GRPO trainer with TRL's own advantages and with the ``ppo``
plugin (critic = value head on a copy of the policy trunk, one critic step per rollout), same model, batch and seed.
Each method runs in its own subprocess, so its peak resident memory (``ru_maxrss``) is its own; the step time is the
median over the steps after the first, with the min-max spread as the noise figure.
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
                       host=PluginHost([plugin] if plugin is not None else []), reward_funcs=[exact_match_reward], reward_weights=[])
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


def train_steps(method: str, steps: int, batch: int, generations: int, length: int, queue) -> None:
    """Subprocess body: build a GRPO trainer (``ppo`` plugin or none), train ``steps`` steps, report timings/memory."""
    import resource

    from transformers import TrainerCallback

    from trl_ext.embedded.models import materialize_model
    from trl_ext_plugins.advantages.ppo import PPO, PPOParams

    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = materialize_model("tiny-qwen2", Path(tmp) / "model")
        plugins = [PPO(PPOParams(kl_coef=0.0))] if method == "ppo" else []
        trainer = build(plugins[0] if plugins else None, model_dir, Path(tmp) / method, batch, generations, length)
        trainer.args.max_steps = steps
        for plugin in plugins:
            plugin.trl_ext_trainer_created(trainer)
        times, start = [], [0.0]

        class Timer(TrainerCallback):
            def on_step_begin(self, *a, **k):
                start[0] = (time.perf_counter(), time.process_time())

            def on_step_end(self, *a, **k):
                times.append((time.perf_counter() - start[0][0], time.process_time() - start[0][1]))

        trainer.add_callback(Timer())
        rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        trainer.train()
        rss_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        critic_params = sum(p.numel() for p in plugins[0].critic.parameters()) if plugins else 0
        policy_params = sum(p.numel() for p in trainer.model.parameters())
    queue.put({"times": times, "rss_before_mb": rss_before / 1024, "rss_peak_mb": rss_peak / 1024,
               "critic_params": critic_params, "policy_params": policy_params})


def ppo_vs_grpo(steps: int, batch: int, generations: int, length: int, repeats: int) -> None:
    import multiprocessing as mp
    import statistics

    context = mp.get_context("spawn")
    runs = {"grpo": [], "ppo": []}
    for _ in range(repeats):  # alternate the methods so load changes on a shared machine hit both
        for method in runs:
            queue = context.Queue()
            proc = context.Process(target=train_steps, args=(method, steps, batch, generations, length, queue))
            proc.start()
            runs[method].append(queue.get())
            proc.join()
    print(f"PPO vs GRPO: {repeats} x {steps} training steps of {batch} samples ({batch // generations} prompts x "
          f"{generations}), max_completion_length {length}; first step of each run dropped; wall = elapsed, "
          f"cpu = process CPU time (less sensitive to other load)")
    medians = {}
    for method, rs in runs.items():
        wall = [w for r in rs for w, _ in r["times"][1:]]
        cpu = [c for r in rs for _, c in r["times"][1:]]
        medians[method] = (statistics.median(wall), statistics.median(cpu))
        peak = max(r["rss_peak_mb"] for r in rs)
        grow = max(r["rss_peak_mb"] - r["rss_before_mb"] for r in rs)
        print(f"{method:5s} step: wall median {medians[method][0] * 1000:.0f} ms (min {min(wall) * 1000:.0f}, max "
              f"{max(wall) * 1000:.0f}); cpu median {medians[method][1] * 1000:.0f} ms (min {min(cpu) * 1000:.0f}, "
              f"max {max(cpu) * 1000:.0f}); peak RSS {peak:.0f} MB (+{grow:.0f} MB during training)")
    ratio = medians["ppo"][0] / medians["grpo"][0]
    cpu_ratio = medians["ppo"][1] / medians["grpo"][1]
    r = runs["ppo"][0]
    print(f"ppo/grpo step time: wall {ratio:.2f}x, cpu {cpu_ratio:.2f}x; critic {r['critic_params'] / 1e6:.2f}M parameters vs policy "
          f"{r['policy_params'] / 1e6:.2f}M (critic weights + AdamW moments: "
          f"{r['critic_params'] * 12 / 2**20:.1f} MB in float32)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", choices=["remax", "ppo"], default=None)
    parser.add_argument("--steps", type=int, default=8, help="PPO vs GRPO: training steps per method")
    parser.add_argument("--repeats", type=int, default=2, help="PPO vs GRPO: alternating runs per method")
    parser.add_argument("--rollouts", type=int, default=5)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--generations", type=int, default=4)
    parser.add_argument("--max-completion-length", type=int, default=8)
    a = parser.parse_args()
    torch.manual_seed(0)
    if a.only != "remax":
        ppo_vs_grpo(a.steps, a.batch, a.generations, a.max_completion_length, a.repeats)
    if a.only == "ppo":
        return

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
