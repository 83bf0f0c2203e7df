"""Step time of trl-ext against the same TRL trainer under each multi-process backend (2 CPU processes, gloo).

Run: python benchmarks/distributed_overhead.py [--backends ddp fsdp2 zero2 zero3] [--trainers sft dpo grpo]
     [--steps 12] [--repeats 1] [--json FILE]

For every backend x trainer, two variants train the embedded tiny Qwen2 on the embedded arithmetic task with the
*same* resolved TRL arguments (``trl_ext.stage.resolve_stage`` on one stage, so the backend's arguments
``trl_ext.launch.backend_args`` and every plugin's ``trl_ext_configure_args`` are in both):

* ``trl``: TRL's own trainer class (``SFTTrainer``, ``DPOTrainer``, ``GRPOTrainer``) built from those arguments;
* ``trl-ext``: trl-ext's trainer for the stage with its plugins (``sft``; ``dpo``; ``grpo`` + ``exact_match``, the
  reward both variants use), as the runner builds it.

Each variant is its own ``torch.distributed.run`` job of 2 processes (repeats interleave the variants, reversing the
order every other round), so no run inherits another's warmed caches. Rank 0 reports the median step time over the
steps after two warm-up steps; the figure per cell is the median over repeats, and the ratio is trl-ext / TRL.
ZeRO-2/3 need the ``deepspeed`` extra; without it those backends are reported as skipped. The processes run on the
CPU, where accelerate does not enable FSDP (the ranks would run DDP), so ``fsdp2`` is reported as skipped too.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from measure import step_timer  # benchmarks/measure.py, on sys.path when run as a script

BACKENDS = ("ddp", "fsdp2", "zero2", "zero3")
TRAINERS = ("sft", "dpo", "grpo")
VARIANTS = ("trl", "trl-ext")
STAGES = {  # per trainer: dataset format, plugins, TRL arguments (per process: 4 rows; 2 processes)
    "sft": ("prompt_completion", ["sft"], {"max_length": 32}),
    "dpo": ("preference", ["dpo"], {"max_length": 32, "beta": 0.1}),
    "grpo": ("prompt", ["grpo", "exact_match"], {"num_generations": 4, "max_completion_length": 8}),
}


def worker(variant: str, trainer_name: str, backend: str, model_dir: str, steps: int, out: str) -> None:
    """One rank of one job: build the trainer, train ``steps`` steps, rank 0 writes its timings to ``out``."""
    import trl
    from transformers import AutoTokenizer

    from trl_ext.catalog import Catalog
    from trl_ext.embedded.arithmetic import arithmetic_dataset, exact_match_reward
    from trl_ext.launch import backend_args, init_cpu_deepspeed
    from trl_ext.recipe import StageSpec
    from trl_ext.stage import resolve_stage
    from trl_ext.trainers import BuildContext

    data_format, plugins, extra = STAGES[trainer_name]
    args = {**backend_args(backend, cuda=False), **extra, "max_steps": steps, "per_device_train_batch_size": 4,
            "learning_rate": 1e-4, "logging_steps": steps, "save_strategy": "no", "disable_tqdm": True}
    stage = StageSpec(trainer=trainer_name, model=model_dir, dataset="embedded:arithmetic", plugins=plugins, args=args)
    resolved = resolve_stage(stage, 0, Catalog.discover(), seed=0)
    init_cpu_deepspeed([resolved.args])
    timer = step_timer()
    with tempfile.TemporaryDirectory() as tmp:
        config = resolved.build_config(tmp)
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        dataset = arithmetic_dataset("train", format=data_format, size=8 * steps * 4)
        rewards = [exact_match_reward] if trainer_name == "grpo" else []
        if variant == "trl":
            cls = {"sft": trl.SFTTrainer, "dpo": trl.DPOTrainer, "grpo": trl.GRPOTrainer}[trainer_name]
            kwargs = {"reward_funcs": rewards} if rewards else {}
            trainer = cls(model=model_dir, args=config, train_dataset=dataset, processing_class=tokenizer,
                          callbacks=[timer], **kwargs)
        else:
            build = BuildContext(model=model_dir, ref_model=None, teacher=None, config=config, train_dataset=dataset,
                                 eval_dataset=None, tokenizer=tokenizer, peft_config=None, callbacks=[timer],
                                 host=resolved.host, reward_funcs=rewards, reward_weights=[1.0] * len(rewards))
            trainer = resolved.kind.build(build)
            resolved.host.hook.trl_ext_trainer_created(trainer=trainer)
        trainer.train()
    if trainer.accelerator.is_main_process:
        Path(out).write_text(json.dumps({"step": statistics.median(timer.times[2:]), "steps": len(timer.times)}))
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def run_job(variant, trainer_name, backend, model_dir, steps) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                   str(_free_port()), __file__, "--worker", variant, trainer_name, backend, model_dir, str(steps),
                   str(out)]
        proc = subprocess.run(command, capture_output=True, text=True, env=_env())
        if proc.returncode != 0 or not out.is_file():
            raise SystemExit(f"{variant} {trainer_name} {backend} failed (exit {proc.returncode}):\n"
                             f"{proc.stderr[-3000:]}")
        return json.loads(out.read_text())


def _env():
    import os

    return {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        variant, trainer_name, backend, model_dir, steps, out = sys.argv[2:8]
        worker(variant, trainer_name, backend, model_dir, int(steps), out)
        return
    parser = argparse.ArgumentParser()
    parser.add_argument("--backends", nargs="+", choices=BACKENDS, default=list(BACKENDS))
    parser.add_argument("--trainers", nargs="+", choices=TRAINERS, default=list(TRAINERS))
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--json", help="also write the table as JSON to this file")
    ns = parser.parse_args()
    if ns.steps < 3:
        parser.error("--steps must be at least 3 (two warm-up steps are not timed)")
    from trl_ext.embedded.models import materialize_model

    has_deepspeed = importlib.util.find_spec("deepspeed") is not None
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(materialize_model("tiny-qwen2", f"{tmp}/model"))
        for backend in ns.backends:
            if backend.startswith("zero") and not has_deepspeed:
                print(f"{backend}: skipped (pip install 'trl-ext[deepspeed]')")
                continue
            if backend == "fsdp2":  # CPU process groups: accelerate would wrap DDP, timing ddp under fsdp2's name
                print(f"{backend}: skipped (accelerate enables FSDP only on GPUs; these processes run on the CPU)")
                continue
            for trainer_name in ns.trainers:
                times = {v: [] for v in VARIANTS}
                for round_ in range(ns.repeats):
                    for variant in VARIANTS if round_ % 2 == 0 else VARIANTS[::-1]:
                        times[variant].append(run_job(variant, trainer_name, backend, model_dir, ns.steps)["step"])
                step = {v: statistics.median(t) for v, t in times.items()}
                row = {"backend": backend, "trainer": trainer_name, "trl_ms": 1000 * step["trl"],
                       "trl_ext_ms": 1000 * step["trl-ext"], "ratio": step["trl-ext"] / step["trl"]}
                rows.append(row)
                print(f"{backend:6s} {trainer_name:5s} TRL {row['trl_ms']:8.1f} ms  trl-ext {row['trl_ext_ms']:8.1f} ms"
                      f"  ratio {row['ratio']:.3f}", flush=True)
    if ns.json:
        Path(ns.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
