"""Benchmark: the same GRPO stage through plain TRL and through trl-ext with no plugins, in one process.

Reports the step-time ratio and the peak-memory ratio (target <= 1.02). Runs alternate (TRL, trl-ext, TRL, ...) so
machine noise hits both sides alike; step time is the median over steps after warm-up; peak memory is the highest
resident set size sampled during each run, minus the RSS before it.

    python benchmarks/core_overhead.py [--steps 20] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import trl
from transformers import AutoTokenizer, TrainerCallback

from trl_ext.embedded.arithmetic import arithmetic_dataset, exact_match_reward
from trl_ext.embedded.models import materialize_model
from trl_ext.host import PluginHost
from trl_ext.trainers.grpo import ExtGRPOTrainer
from measure import PeakRSS  # benchmarks/measure.py; `python benchmarks/X.py` puts benchmarks/ on sys.path



class StepTimer(TrainerCallback):
    def __init__(self):
        self.times, self._start = [], None

    def on_step_begin(self, args, state, control, **kwargs):
        self._start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.times.append(time.perf_counter() - self._start)


def run_once(cls, model_dir, steps, extra):
    timer = StepTimer()
    with tempfile.TemporaryDirectory() as out:
        config = trl.GRPOConfig(output_dir=out, bf16=False, report_to="none", max_steps=steps, logging_steps=steps,
                                save_strategy="no", seed=0, per_device_train_batch_size=32, num_generations=8,
                                max_completion_length=8, gradient_checkpointing=False, disable_tqdm=True)
        trainer = cls(model=model_dir, reward_funcs=[exact_match_reward], args=config,
                      train_dataset=arithmetic_dataset("train", format="prompt", size=512),
                      processing_class=AutoTokenizer.from_pretrained(model_dir), callbacks=[timer], **extra)
        with PeakRSS() as memory:
            trainer.train()
    return statistics.median(timer.times[2:]), memory.delta


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    ns = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(materialize_model("tiny-qwen2", f"{tmp}/m"))
        results = {"trl": [], "trl-ext": []}
        for _ in range(ns.repeats):
            results["trl"].append(run_once(trl.GRPOTrainer, model_dir, ns.steps, {}))
            results["trl-ext"].append(run_once(ExtGRPOTrainer, model_dir, ns.steps, {"plugin_host": PluginHost([])}))
    step = {k: statistics.median(t for t, _ in v) for k, v in results.items()}
    peak = {k: statistics.median(m for _, m in v) for k, v in results.items()}
    print(f"GRPO step time  TRL {step['trl'] * 1000:.1f} ms   trl-ext {step['trl-ext'] * 1000:.1f} ms   "
          f"ratio {step['trl-ext'] / step['trl']:.3f}")
    print(f"peak RSS growth TRL {peak['trl'] / 2**20:.1f} MiB trl-ext {peak['trl-ext'] / 2**20:.1f} MiB "
          f"ratio {peak['trl-ext'] / peak['trl']:.3f}")


if __name__ == "__main__":
    main()
