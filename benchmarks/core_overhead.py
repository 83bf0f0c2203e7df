"""Benchmark: the same GRPO stage through plain TRL and through trl-ext with no plugins, each run in a fresh process.

Reports the step-time ratio and the peak-memory ratio (target <= 1.02). Every run (TRL or trl-ext) is its own Python
process (``measure.run_variants``), so neither side inherits the other's allocator growth or warmed caches; the
``--repeats`` runs per side interleave (TRL, trl-ext, trl-ext, TRL, ...) so machine noise hits both alike. In each run,
step time is the median over the steps after two warm-up steps, and peak memory is the process's resident high-water
mark (``ru_maxrss``) after ``train()`` minus the RSS just before it; the figures reported are the medians over the
runs.

    python benchmarks/core_overhead.py [--steps 20] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import tempfile

import psutil

from measure import run_variants, step_timer  # benchmarks/measure.py: `python benchmarks/X.py` puts it on sys.path

VARIANTS = ("trl", "trl-ext")


def run_once(variant, model_dir, steps):
    """Runs inside the fresh process: one training run of ``steps`` steps, (median step seconds, peak RSS growth)."""
    import trl
    from transformers import AutoTokenizer

    from trl_ext.embedded.arithmetic import arithmetic_dataset, exact_match_reward
    from trl_ext.host import PluginHost
    from trl_ext.trainers.grpo import ExtGRPOTrainer

    cls, extra = (trl.GRPOTrainer, {}) if variant == "trl" else (ExtGRPOTrainer, {"plugin_host": PluginHost([])})
    timer = step_timer()
    with tempfile.TemporaryDirectory() as out:
        config = trl.GRPOConfig(output_dir=out, bf16=False, report_to="none", max_steps=steps, logging_steps=steps,
                                save_strategy="no", seed=0, per_device_train_batch_size=32, num_generations=8,
                                max_completion_length=8, gradient_checkpointing=False, disable_tqdm=True)
        trainer = cls(model=model_dir, reward_funcs=[exact_match_reward], args=config,
                      train_dataset=arithmetic_dataset("train", format="prompt", size=512),
                      processing_class=AutoTokenizer.from_pretrained(model_dir), callbacks=[timer], **extra)
        # Peak memory from the kernel's high-water mark, not a sampling thread: a thread polling RSS every few ms
        # takes the GIL from the trainer's Python code and slowed the side with more of it (measured 1.26x on trl-ext
        # with the sampler, 0.9-1.0x without). This process is fresh, so its high-water mark during train() is the
        # run's own.
        before = psutil.Process().memory_info().rss
        trainer.train()
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    return {"step": statistics.median(timer.times[2:]), "peak": max(peak, 1)}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)  # child process: one run
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    ns = parser.parse_args()
    if ns.steps < 3:
        parser.error("--steps must be at least 3 (two warm-up steps are not timed)")
    if ns.variant:
        print(json.dumps(run_once(ns.variant, ns.model_dir, ns.steps)))
        return
    from trl_ext.embedded.models import materialize_model

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(materialize_model("tiny-qwen2", f"{tmp}/m"))
        results = run_variants(__file__, VARIANTS, ["--model-dir", model_dir, "--steps", ns.steps], ns.repeats)
    step = {k: statistics.median(r["step"] for r in v) for k, v in results.items()}
    peak = {k: statistics.median(r["peak"] for r in v) for k, v in results.items()}
    print(f"GRPO step time  TRL {step['trl'] * 1000:.1f} ms   trl-ext {step['trl-ext'] * 1000:.1f} ms   "
          f"ratio {step['trl-ext'] / step['trl']:.3f}")
    print(f"peak RSS growth TRL {peak['trl'] / 2**20:.1f} MiB trl-ext {peak['trl-ext'] / 2**20:.1f} MiB "
          f"ratio {peak['trl-ext'] / peak['trl']:.3f}")


if __name__ == "__main__":
    main()
