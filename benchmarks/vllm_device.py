"""GPU device check: GRPO with vLLM rollouts, trl-ext against plain TRL on the same model and settings (issue 17).

Run on a machine with a CUDA GPU and the ``vllm`` extra (``pip install 'trl-ext[vllm]'``):

    python benchmarks/vllm_device.py --out vllm.json [--model embedded:smollm2-135m] [--modes colocate server]
        [--steps 8] [--batch 32] [--generations 8] [--completion 128] [--peak-tflops 989]

Without a CUDA GPU or without vLLM it writes ``{"skipped": "<reason>"}`` to ``--out`` and exits 0, so the same
command is safe everywhere; tests/test_vllm_device.py checks that and runs the real thing only where both exist.

For each vLLM mode (``colocate``: vLLM inside the training process; ``server``: ``trl vllm-serve`` started here on
the same GPU, the trainer talking to it) two variants train ``--steps`` GRPO steps, each in a fresh process:

* ``trl``: TRL's ``GRPOTrainer`` with ``use_vllm`` and the exact_match reward on the embedded arithmetic task (TRL's
  own vLLM importance-sampling correction on, its default);
* ``trl-ext``: trl-ext's GRPO trainer from one ``resolve_stage`` with plugins ``grpo``, ``tis`` and ``exact_match``:
  ``tis`` weights the loss by pi_old / pi_vLLM from the sampling log-probs vLLM returns (TRL's own vLLM correction
  is switched off by the plugin), so a run that finishes with ``tis/rho/mean`` logged shows those log-probs flowed.

Both variants get the same resolved TRL arguments (bf16, the mode, batch, generations, completion length). Reported
per mode and variant: median step seconds over the steps after the first two, completion tokens per second (TRL's
logged ``num_tokens`` growth over the timed steps divided by their time), MFU = 6 x parameters x tokens/s / peak
(training FLOPs only: generation is counted in the time, not in the FLOPs, so this is a floor), and for trl-ext the
last logged ``tis/rho/mean`` and ``tis/logp_diff/max``; then the trl-ext / TRL step-time ratio per mode. Never run
on this project's CPU machine (no GPU was lent to the task that wrote it).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from measure import step_timer  # benchmarks/measure.py, on sys.path when run as a script

VARIANTS = ("trl", "trl-ext")


def skip_reason() -> str | None:
    """Why this machine cannot run the check, or None."""
    import torch

    if not torch.cuda.is_available():
        return "no CUDA GPU on this machine"
    if importlib.util.find_spec("vllm") is None:
        return "vLLM is not installed: pip install 'trl-ext[vllm]'"
    return None


def run_variant(variant: str, mode: str, model_dir: str, steps: int, batch: int, generations: int, completion: int,
                server_port: int | None) -> dict:
    """Inside a fresh process: one GRPO run with vLLM; timings and the logged figures."""
    import trl
    from transformers import AutoTokenizer

    from trl_ext.catalog import Catalog
    from trl_ext.embedded.arithmetic import arithmetic_dataset, exact_match_reward
    from trl_ext.recipe import StageSpec
    from trl_ext.stage import resolve_stage
    from trl_ext.trainers import BuildContext

    args = {"use_vllm": True, "vllm_mode": mode, "bf16": True, "max_steps": steps, "logging_steps": 1,
            "per_device_train_batch_size": batch, "num_generations": generations, "max_completion_length": completion,
            "learning_rate": 1e-6, "save_strategy": "no", "report_to": "none", "gradient_checkpointing": True}
    if mode == "colocate":
        args["vllm_gpu_memory_utilization"] = 0.3
    else:
        args["vllm_server_port"] = server_port
    stage = StageSpec(trainer="grpo", model=model_dir, dataset="embedded:arithmetic",
                      plugins=["grpo", "tis", "exact_match"] if variant == "trl-ext" else ["grpo", "exact_match"],
                      args=args)
    resolved = resolve_stage(stage, 0, Catalog.discover(), seed=0)
    timer = step_timer()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    dataset = arithmetic_dataset("train", format="prompt", size=batch * steps * 2)
    with tempfile.TemporaryDirectory() as tmp:
        config = resolved.build_config(tmp)
        if variant == "trl":
            trainer = trl.GRPOTrainer(model=model_dir, reward_funcs=[exact_match_reward], args=config,
                                      train_dataset=dataset, processing_class=tokenizer, callbacks=[timer])
        else:
            build = BuildContext(model=model_dir, ref_model=None, teacher=None, config=config, train_dataset=dataset,
                                 eval_dataset=None, tokenizer=tokenizer, peft_config=None, callbacks=[timer],
                                 host=resolved.host, reward_funcs=[exact_match_reward], reward_weights=[1.0])
            trainer = resolved.kind.build(build)
            resolved.host.hook.trl_ext_trainer_created(trainer=trainer)
        trainer.train()
    logs = [h for h in trainer.state.log_history if "num_tokens" in h]
    timed = timer.times[2:]
    tokens = logs[-1]["num_tokens"] - logs[1]["num_tokens"] if len(logs) > 2 else float("nan")
    params = sum(p.numel() for p in trainer.model.parameters())
    row = {"variant": variant, "mode": mode, "step_s": statistics.median(timed), "steps": len(timer.times),
           "tokens_per_s": tokens / sum(timed), "parameters": params}
    last = trainer.state.log_history[-2] if len(trainer.state.log_history) > 1 else {}
    for key in ("tis/rho/mean", "tis/logp_diff/max", "tis/ess"):
        if key in last:
            row[key] = last[key]
    return row


def start_server(model_dir: str, port: int) -> subprocess.Popen:
    """``trl vllm-serve`` on this GPU (the trainer shares it), ready when /health/ answers."""
    server = subprocess.Popen([sys.executable, "-m", "trl.cli.main", "vllm-serve", "--model", model_dir, "--port",
                               str(port), "--gpu_memory_utilization", "0.3"])
    deadline = time.time() + 600
    while time.time() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health/", timeout=5):
                return server
        except OSError:
            if server.poll() is not None:
                raise SystemExit(f"trl vllm-serve exited with {server.returncode}")
            time.sleep(5)
    server.kill()
    raise SystemExit("trl vllm-serve did not become healthy within 10 minutes")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True, help="JSON file for the figures (or the skip reason)")
    parser.add_argument("--model", default="embedded:smollm2-135m")
    parser.add_argument("--modes", nargs="+", choices=("colocate", "server"), default=["colocate", "server"])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--completion", type=int, default=128)
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="the GPU's dense bf16 peak (H100/H200: 989)")
    parser.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)  # child process: one run
    parser.add_argument("--mode", help=argparse.SUPPRESS)
    parser.add_argument("--server-port", type=int, help=argparse.SUPPRESS)
    ns = parser.parse_args()
    out = Path(ns.out)
    if ns.variant:
        row = run_variant(ns.variant, ns.mode, ns.model, ns.steps, ns.batch, ns.generations, ns.completion,
                          ns.server_port)
        out.write_text(json.dumps(row))
        return
    reason = skip_reason()
    if reason is not None:
        out.write_text(json.dumps({"skipped": reason}))
        print(f"skipped: {reason}")
        return
    model_dir = ns.model
    if model_dir.startswith("embedded:"):
        from trl_ext.catalog import Catalog

        materialize, _ = Catalog.discover().models[model_dir[len("embedded:"):]]
        model_dir = str(materialize(Path(tempfile.mkdtemp(prefix="vllm-model-")), seed=0))
    rows = []
    for mode in ns.modes:
        server = start_server(model_dir, 8000) if mode == "server" else None
        try:
            for variant in VARIANTS:
                with tempfile.TemporaryDirectory() as tmp:
                    child_out = Path(tmp) / "row.json"
                    command = [sys.executable, __file__, "--out", str(child_out), "--variant", variant, "--mode", mode,
                               "--model", model_dir, "--steps", str(ns.steps), "--batch", str(ns.batch),
                               "--generations", str(ns.generations), "--completion", str(ns.completion),
                               "--server-port", "8000"]
                    proc = subprocess.run(command)
                    if proc.returncode != 0 or not child_out.is_file():
                        rows.append({"variant": variant, "mode": mode, "error": f"exit {proc.returncode}"})
                        continue
                    row = json.loads(child_out.read_text())
                row["mfu"] = 6 * row["parameters"] * row["tokens_per_s"] / (ns.peak_tflops * 1e12)
                rows.append(row)
                print(json.dumps(row), flush=True)
        finally:
            if server is not None:
                server.terminate()
                server.wait(timeout=60)
    ratios = {}
    for mode in ns.modes:
        by_variant = {r["variant"]: r for r in rows if r["mode"] == mode and "step_s" in r}
        if len(by_variant) == 2:
            ratios[mode] = by_variant["trl-ext"]["step_s"] / by_variant["trl"]["step_s"]
    out.write_text(json.dumps({"model": ns.model, "rows": rows, "step_time_ratio_trl_ext_over_trl": ratios}, indent=1))
    print(f"step-time ratio trl-ext / TRL: {ratios}")


if __name__ == "__main__":
    main()
