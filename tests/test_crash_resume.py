"""Kill -9 at every write point of a run, rerun the same command, get the uninterrupted run's result bit for bit.

For an SFT, a GRPO, a BOND (moving EMA anchor), an MoE GRPO (routing replay, bfloat16 sampling copy), an on-policy
distillation (GKD, a teacher and sampled completions), an MTP-head (frozen trunk, cached samples) and a DPO stage
(tiny embedded model, 4 steps, a checkpoint every 2): one uninterrupted run, then for each write point a run killed
there (``TRL_EXT_CRASH_AT``, trl_ext/faults.py: ``os._exit(137)``, which is what SIGKILL leaves: no cleanup, no
``finally``) followed by the same command again.
The resumed run's final weights (``model.safetensors``, compared tensor by tensor with ``torch.equal``) and every
per-step metrics row must equal the uninterrupted run's, and so must ``train_loss`` (the end-of-training row's and the
stage summary's: Trainer's running-loss accounting is checkpointed); the rest of the end-of-training row is runtimes,
so only its presence is compared.

Each trainer runs in one subprocess that imports TRL once and forks a child per run (fork keeps the cost at training
time, not import time); the child calls ``trl_ext.cli.main`` exactly as the command line does.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent

COMMON_ARGS = {"max_steps": 4, "save_steps": 2, "logging_steps": 1, "learning_rate": 1e-3, "seed": 0,
               "lr_scheduler_type": "linear", "dataloader_num_workers": 0}
RECIPES = {
    "sft": {
        "trainer": "sft", "model": "embedded:tiny-qwen2-small", "plugins": ["sft"],
        "dataset": {"source": "embedded:arithmetic", "params": {"format": "prompt_completion"}, "limit": 64},
        "args": {**COMMON_ARGS, "per_device_train_batch_size": 8, "max_length": 32},
    },
    "grpo": {
        "trainer": "grpo", "model": "embedded:tiny-qwen2-small", "plugins": ["grpo", "exact_match"],
        "dataset": {"source": "embedded:arithmetic", "params": {"format": "prompt"}, "limit": 64},
        "args": {**COMMON_ARGS, "per_device_train_batch_size": 4, "num_generations": 2, "max_completion_length": 4,
                 "temperature": 1.0},
    },
    "bond": {  # BOND's moving (EMA) anchor is state outside the policy: the checkpoint must carry it
        "trainer": "grpo", "model": "embedded:tiny-qwen2-small",
        "dataset": {"source": "embedded:arithmetic", "params": {"format": "prompt"}, "limit": 64},
        "plugins": ["grpo", {"bond": {"beta": 0.5, "anchor": "ema", "ema_rate": 0.5}}],
        "args": {**COMMON_ARGS, "per_device_train_batch_size": 4, "num_generations": 2, "max_completion_length": 4,
                 "temperature": 1.0},
    },
    # An MoE policy (experts fused in memory, saved per expert: resume must convert them) sampled by a bfloat16 copy
    # (built at a session's first rollout: it must not draw from the restored RNG) with its routing replayed.
    "moe_grpo": {
        "trainer": "grpo", "model": "embedded:tiny-qwen3-moe",
        "plugins": ["grpo", {"routing_replay": {"mode": "R3"}}, {"rollout_logprobs": {"dtype": "bfloat16"}},
                    "exact_match"],
        "dataset": {"source": "embedded:arithmetic", "params": {"format": "prompt"}, "limit": 64},
        "args": {**COMMON_ARGS, "per_device_train_batch_size": 4, "num_generations": 2, "max_completion_length": 4,
                 "temperature": 1.0, "gradient_checkpointing": False},
    },
    # On-policy distillation: the student samples completions (the restored RNG must redraw them) and a teacher scores
    # them; GKD's mixing draw (lmbda 0.5: on-policy or the dataset's completion) is random per step too.
    "gkd": {
        "trainer": "distillation", "model": "embedded:tiny-qwen2-small", "teacher": "embedded:tiny-qwen2",
        "plugins": [{"gkd": {"divergence": "jsd", "lmbda": 0.5}}],
        "dataset": {"source": "embedded:arithmetic", "params": {"format": "prompt_completion"}, "limit": 64},
        "args": {**COMMON_ARGS, "per_device_train_batch_size": 4, "max_completion_length": 4, "temperature": 1.0,
                 "gradient_checkpointing": False},
    },
    # MTP heads on a frozen trunk: the heads are the trained state and the sample cache the data, both resumed.
    "mtp": {
        "trainer": "mtp", "model": "embedded:tiny-glm4-moe-mtp",
        "plugins": [{"mtp_heads": {"samples_per_prompt": 2, "max_new_tokens": 4, "acceptance_prompts": 4,
                                     "acceptance_max_new_tokens": 4,
                                     "held_out": {"source": "embedded:arithmetic", "split": "test",
                                                  "params": {"format": "prompt"}}}}],
        "dataset": {"source": "embedded:arithmetic", "params": {"format": "prompt"}, "limit": 32},
        "args": {**COMMON_ARGS, "per_device_train_batch_size": 4},
    },
    "dpo": {
        "trainer": "dpo", "model": "embedded:tiny-qwen2-small", "plugins": ["dpo"],
        "dataset": {"source": "embedded:arithmetic", "params": {"format": "preference"}, "limit": 64},
        "args": {**COMMON_ARGS, "per_device_train_batch_size": 4, "max_length": 32, "beta": 0.1},
    },
}
# Every write point of a stage (see trl_ext/faults.py), with the occurrence to kill at: the 2nd checkpoint's marker
# (the first one is complete, so the rerun resumes from step 2), a metrics line mid-way, after training, during the
# final save, and the atomic writes of the stage's completion marker and of run.json.
ALL_POINTS = ["checkpoint:2", "metrics:3", "train_end:1", "final_save:1", "write:stage.json:1",
              "write:started.json:1", "write:run.json:2"]
# Every point for SFT; for GRPO and DPO the ones inside and right after their training (the rest is trainer-agnostic
# runner code), which keeps each test to a few minutes on 2 CPU cores.
CRASH_POINTS = {"sft": ALL_POINTS, "grpo": ["checkpoint:2", "metrics:3", "final_save:1"], "bond": ["checkpoint:2"],
                "moe_grpo": ["checkpoint:2", "final_save:1"],
                "dpo": ["checkpoint:2", "metrics:3", "final_save:1"], "gkd": ["checkpoint:2"], "mtp": ["checkpoint:2"]}


def _driver(workdir: str, trainer: str) -> None:
    """Runs in a subprocess: the uninterrupted run, then crash + rerun per point; prints one JSON line of results."""
    import torch

    torch.set_num_threads(1)
    from trl_ext.cli import main

    work = Path(workdir)
    recipe = work / f"{trainer}.yaml"
    spec = dict(RECIPES[trainer])
    if spec["trainer"] == "grpo":
        # The untrained tiny model never answers right, so exact_match would give zero advantages and zero gradients
        # (weights trivially equal); a reward that differs between samples makes every step move the weights.
        (work / "varied.py").write_text("def reward(completions, **kwargs):\n"
                                        "    return [float(sum(map(ord, str(c))) % 7) for c in completions]\n")
        spec["plugins"] = [p for p in spec["plugins"] if p != "exact_match"] + [
            {"python_reward": {"functions": [f"{work / 'varied.py'}:reward"]}}]
    recipe.write_text(json.dumps({"seed": 0, **spec}))

    def run(out: Path, crash_at: str | None) -> int:
        pid = os.fork()
        if pid == 0:  # child: the command line, as a user would run it
            if crash_at:
                os.environ["TRL_EXT_CRASH_AT"] = crash_at
            else:
                os.environ.pop("TRL_EXT_CRASH_AT", None)
            code = 1
            try:
                code = main(["train", str(recipe), "--output-dir", str(out)])
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])

    results = {"reference": run(work / "reference", None), "crashes": {}}
    for point in CRASH_POINTS[trainer]:
        out = work / point.replace(":", "_")
        crashed = run(out, point)
        resumed = run(out, None)
        results["crashes"][point] = [crashed, resumed]
    print("RESULTS " + json.dumps(results), flush=True)


def _weights(folder: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


def _step_rows(folder: Path) -> tuple[list[dict], int]:
    """Per-step rows without wall-clock figures (GRPO logs `step_time`), and how many end-of-training rows."""
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]  # no torn line left
    summary = [r for r in rows if "train_runtime" in r]
    steps = [{k: v for k, v in r.items() if not k.endswith("_time")} for r in rows if "train_runtime" not in r]
    return steps, len(summary)


def _train_loss(folder: Path) -> tuple:
    """``train_loss`` of the end-of-training row and of the stage summary."""
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    end = next(r["train_loss"] for r in rows if "train_runtime" in r)
    return end, json.loads((folder / "stage.json").read_text())["summary"]["train_loss"]


@pytest.mark.slow
@pytest.mark.parametrize("trainer", sorted(RECIPES))
def test_killed_at_every_write_point_resumes_to_the_uninterrupted_result(tmp_path, trainer):
    import torch

    env = {**os.environ, "TRL_EXT_DISABLE_PLUGIN_AUTOLOAD": "0", "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    env.pop("TRL_EXT_CRASH_AT", None)
    proc = subprocess.run([sys.executable, __file__, str(tmp_path), trainer], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=1500)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULTS ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads(lines[-1][len("RESULTS "):])
    assert results["reference"] == 0, proc.stderr[-3000:]

    reference = tmp_path / "reference" / "main"
    ref_weights = _weights(reference)
    ref_rows, ref_summaries = _step_rows(reference)
    assert [r["step"] for r in ref_rows] == [1, 2, 3, 4] and ref_summaries == 1
    assert sum(r["grad_norm"] > 0 for r in ref_rows) >= 2, "the comparison needs steps that change the weights"
    for point, (crashed, resumed) in results["crashes"].items():
        assert crashed == 137, f"{point}: the run was not killed at the point (exit {crashed})"
        assert resumed == 0, f"{point}: the rerun failed (exit {resumed}): {proc.stderr[-3000:]}"
        stage = tmp_path / point.replace(":", "_") / "main"
        assert (stage / "stage.json").is_file(), point
        weights = _weights(stage)
        assert weights.keys() == ref_weights.keys()
        different = [k for k in weights if not torch.equal(weights[k], ref_weights[k])]
        assert not different, f"{point}: resumed weights differ from the uninterrupted run in {different[:3]}"
        rows, summaries = _step_rows(stage)
        assert rows == ref_rows, f"{point}: metrics rows differ\n{rows}\n{ref_rows}"
        assert summaries == 1, point
        assert _train_loss(stage) == _train_loss(reference), f"{point}: train_loss differs from the uninterrupted run"
        assert not (stage.parent / ".trl-ext.lock").exists(), f"{point}: lock left behind after the rerun"
        assert not list(stage.glob(".final-save")), point


def test_atomic_writes_reach_the_disk_before_the_rename(tmp_path, monkeypatch):
    """write_json_atomic, the metrics file rewrite and the checkpoint marker: the temporary file's data is fsynced
    before the rename and the folder after it (they were renamed unflushed: after a power loss a file system may keep
    the rename and lose the data, leaving an empty run.json or a marker beside empty checkpoint files)."""
    from trl_ext.callbacks import CHECKPOINT_COMPLETE, CheckpointCompletionCallback, rewrite_jsonl
    from trl_ext.files import write_json_atomic

    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))))
        real_fsync(fd)

    def replace(src, dst):
        events.append(("replace", os.path.basename(dst)))
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    write_json_atomic(tmp_path / "run.json", {"a": 1})
    assert events == [("fsync", f".run.json.tmp-{os.getpid()}"), ("replace", "run.json"), ("fsync", tmp_path.name)]
    events.clear()
    rewrite_jsonl(tmp_path / "metrics.jsonl", [{"step": 1}])
    assert events[0] == ("fsync", f".metrics.jsonl.tmp-{os.getpid()}") and events[1] == ("replace", "metrics.jsonl")

    folder = tmp_path / "checkpoint-2"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"weights")
    events.clear()
    args, state = type("A", (), {"output_dir": str(tmp_path)})(), type("S", (), {"global_step": 2,
                                                                                 "is_world_process_zero": True})()
    CheckpointCompletionCallback().on_save(args, state, None)
    marker = events.index(("replace", CHECKPOINT_COMPLETE))
    assert ("fsync", "model.safetensors") in events[:marker]
    assert json.loads((folder / CHECKPOINT_COMPLETE).read_text()) == {"global_step": 2}


@pytest.mark.parametrize("name, converted", [("tiny-qwen3-moe", True), ("tiny-qwen2-small", False)])
def test_resume_loads_weights_transformers_converts_on_saving(tmp_path, name, converted):
    """An MoE model's experts are fused in memory and saved one expert at a time. Trainer's resume loads the file with
    load_state_dict(strict=False), which finds none of them and keeps the initial experts; the trainers load such a
    checkpoint through from_pretrained instead (a dense model keeps Trainer's path)."""
    from safetensors.torch import load_file

    from trl_ext.embedded.models import build_model
    from trl_ext.trainers.base import load_converted_weights

    trained = build_model(name, seed=0)
    with torch.no_grad():
        for parameter in trained.parameters():
            parameter.add_(torch.randn_like(parameter))
    trained.save_pretrained(tmp_path / "checkpoint-2")
    resumed = build_model(name, seed=0)
    as_trainer_does = build_model(name, seed=0)
    as_trainer_does.load_state_dict(load_file(str(tmp_path / "checkpoint-2" / "model.safetensors")), strict=False)
    stale = [n for n, p in as_trainer_does.state_dict().items() if not torch.equal(p, trained.state_dict()[n])]
    assert bool(stale) == converted  # e.g. model.layers.0.mlp.experts.gate_up_proj

    assert load_converted_weights(resumed, tmp_path / "checkpoint-2") == converted
    if converted:
        assert all(torch.equal(p, trained.state_dict()[n]) for n, p in resumed.state_dict().items())


if __name__ == "__main__":
    _driver(sys.argv[1], sys.argv[2])
