"""Two CPU processes (gloo) under each backend train exactly what one process trains on the same global batch.

A recipe's ``distributed:`` section makes ``trl-ext train`` start torchrun itself (trl_ext/launch.py). For DDP,
FSDP2 and DeepSpeed ZeRO-2/3, SFT, DPO, GRPO (dapo + tis) and PPO with its critic (both on fixed completions:
tests/fixed_rollouts_cli.py) run one optimizer step on 2 processes x 4 rows and on 1 process x 8 rows from the same
seed; the logged loss must agree to 1e-5 (relative) and every weight to 1e-6 (absolute). The step is plain SGD at lr
0.1, so a weight moves by lr x its gradient (up to ~1e-2 here) and a weight difference is lr x the gradient difference:
a wrong reduction of the loss or the gradient (a missing 1/world_size, one rank's tokens counted twice) shows at the
size of the step itself. (Adam would amplify float rounding in near-zero gradients to ~lr, hiding nothing but making
the tolerance meaningless; the PPO critic keeps its AdamW, see the test.) FSDP2 runs only where CUDA is available:
accelerate does not enable FSDP for CPU process groups (the ranks would run DDP), so trl-ext refuses it on CPU.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from trl_ext.launch import already_launched, backend_args, launch_command
from trl_ext.recipe import DistributedSpec, parse_recipe
from tests.markers import HAS_DEEPSPEED, NEEDS_DEEPSPEED

# accelerate enables FSDP only for GPU process groups (CPU ranks stay MULTI_CPU under DDP), so trl-ext refuses fsdp2
# without CUDA and the FSDP2 cases run only where there is a GPU.
NEEDS_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="FSDP2 needs CUDA (refused on CPU)")
GLOBAL_BATCH = 8
FIXED_ROLLOUTS = Path(__file__).resolve().parent / "fixed_rollouts_cli.py"  # trl-ext's CLI + a deterministic rollout
STAGES = {
    "sft": {"dataset": {"source": "embedded:arithmetic", "params": {"format": "prompt_completion"}, "limit": 64},
            "plugins": ["sft"], "args": {"max_length": 32}},
    "dpo": {"dataset": {"source": "embedded:arithmetic", "params": {"format": "preference"}, "limit": 64},
            "plugins": ["dpo"], "args": {"max_length": 32, "beta": 0.1}},
    # GRPO family with a correction: dapo's token-level loss, TIS on the sampling log-probs, and fixed completions in
    # place of sampling (tests/fixed_rollouts_cli.py), groups of 4 never split across the 2 ranks.
    "grpo": {"dataset": {"source": "embedded:arithmetic", "params": {"format": "prompt"}, "limit": 64},
             "plugins": ["dapo", "tis", "fixed_rollouts",
                         {"python_reward": {"functions": f"{FIXED_ROLLOUTS}:completion_length"}}],
             "args": {"num_generations": 4, "max_completion_length": 8}},
    # PPO with its critic (a replicated module with its own AdamW; built from gathered shards under ZeRO-3).
    "ppo": {"trainer": "grpo",
            "dataset": {"source": "embedded:arithmetic", "params": {"format": "prompt"}, "limit": 64},
            "plugins": [{"ppo": {"critic_lr": 0.01}}, "fixed_rollouts",
                        {"python_reward": {"functions": f"{FIXED_ROLLOUTS}:completion_length"}}],
            "args": {"num_generations": 4, "max_completion_length": 8, "beta": 0.001}},
}


# -- pure parts (fast) -------------------------------------------------------------------------------------------------


def test_backend_args_select_the_trainer_backends():
    assert backend_args("ddp", cuda=True) == {}
    assert backend_args("ddp", cuda=False) == {"use_cpu": True}
    assert backend_args("zero2", cuda=True)["deepspeed"]["zero_optimization"] == {"stage": 2}
    assert backend_args("zero3", cuda=True)["deepspeed"]["zero_optimization"]["stage"] == 3
    assert backend_args("fsdp2", cuda=True) == {"fsdp": "full_shard auto_wrap", "fsdp_config": {"version": 2}}


def test_launch_command_single_and_multi_node():
    single = launch_command(DistributedSpec(num_processes=2, main_process_port=29555), ["train", "r.yaml"])
    assert single == [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29555",
                      "-m", "trl_ext.cli", "train", "r.yaml"]
    multi = DistributedSpec(num_processes=8, num_machines=2, main_process_ip="10.0.0.1", main_process_port=29500)
    command = launch_command(multi, ["train", "r.yaml"], machine_rank=1)
    assert command[command.index("--nnodes") + 1] == "2" and command[command.index("--node_rank") + 1] == "1"
    assert command[command.index("--master_addr") + 1] == "10.0.0.1"
    assert already_launched({"WORLD_SIZE": "2"}) and not already_launched({})


@pytest.mark.parametrize("section, message", [
    ({"num_processes": 0}, "distributed.num_processes"),
    ({"backend": "zero4"}, "distributed.backend"),
    ({"num_machines": 2}, "main_process_port is required"),
    ({"num_machines": 2, "machine_rank": 2, "main_process_port": 1234}, "machine_rank 2 is not below"),
])
def test_bad_distributed_sections_are_refused_naming_the_field(section, message):
    from trl_ext.errors import RecipeError

    with pytest.raises(RecipeError) as info:
        parse_recipe({"distributed": section, "trainer": "sft", "model": "m", "dataset": "d"})
    assert message in str(info.value)


def test_fsdp2_without_cuda_is_refused_not_run_as_ddp(monkeypatch):
    """On CPU ranks accelerate keeps MULTI_CPU and Trainer wraps DDP, so a recipe saying fsdp2 trained unsharded."""
    from trl_ext.runner import check_distributed

    recipe = parse_recipe({"distributed": {"num_processes": 2, "backend": "fsdp2"}, "trainer": "sft", "model": "m",
                           "dataset": "d"})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    (message,) = check_distributed(recipe)
    assert message.startswith("distributed.backend: 'fsdp2' needs CUDA") and "DDP" in message
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert check_distributed(recipe) == []
    ddp = parse_recipe({"distributed": {"num_processes": 2}, "trainer": "sft", "model": "m", "dataset": "d"})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert check_distributed(ddp) == []


@pytest.mark.skipif(HAS_DEEPSPEED, reason="checks the message shown when DeepSpeed is missing")
def test_zero_without_deepspeed_names_the_extra(tmp_path):
    recipe = _write_recipe(tmp_path / "r.yaml", "sft", per_device=4, distributed={"num_processes": 2, "backend": "zero2"})
    result = subprocess.run([sys.executable, "-m", "trl_ext.cli", "validate", str(recipe)], capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 2
    assert "distributed.backend: 'zero2' needs DeepSpeed: pip install 'trl-ext[deepspeed]'" in result.stderr


# -- two processes against one (slow) ----------------------------------------------------------------------------------


def _write_recipe(path: Path, trainer: str, per_device: int, distributed: dict | None = None) -> Path:
    stage = STAGES[trainer]
    recipe = {"seed": 0, "name": trainer, "trainer": stage.get("trainer", trainer), "model": "embedded:tiny-qwen2",
              "dataset": stage["dataset"], "plugins": stage["plugins"],
              "args": {"max_steps": 1, "per_device_train_batch_size": per_device, "learning_rate": 0.1, "optim": "sgd",
                       "logging_steps": 1, "save_strategy": "no", "gradient_checkpointing": False, **stage["args"]}}
    if distributed:
        recipe["distributed"] = distributed
    path.write_text(json.dumps(recipe))
    return path


def _command(trainer: str, distributed: dict | None) -> list[str]:
    """SFT and DPO: ``trl-ext train`` (which starts the processes itself). GRPO: the CLI with the fixed-rollouts
    plugin, under torchrun started here (the recipe's ``distributed:`` section still selects the backend)."""
    if trainer not in ("grpo", "ppo"):
        return [sys.executable, "-m", "trl_ext.cli"]
    if not distributed:
        return [sys.executable, str(FIXED_ROLLOUTS)]
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(distributed["num_processes"]),
            "--master_port", "29613", str(FIXED_ROLLOUTS)]


def _train(tmp_path: Path, trainer: str, per_device: int, distributed: dict | None = None):
    out = tmp_path / "out"
    recipe = _write_recipe(tmp_path / "recipe.yaml", trainer, per_device, distributed)
    result = subprocess.run([*_command(trainer, distributed), "train", str(recipe), "--output-dir", str(out)],
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    assert result.stdout.count("trl-ext run summary") == 1  # one main process, not two independent trainings
    rows = [json.loads(line) for line in (out / trainer / "metrics.jsonl").read_text().splitlines()]
    logged = next(row for row in rows if "loss" in row)
    return logged, _parameters(out / trainer)


def _parameters(folder: Path) -> dict[str, torch.Tensor]:
    """Parameters as the model sees them after from_pretrained (ZeRO saves tied weights under both names)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder)
    return {name: p.detach().clone() for name, p in model.named_parameters()}


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    cache: dict[str, tuple] = {}
    folders: dict[str, Path] = {}

    def get(trainer: str):
        if trainer not in cache:
            folders[trainer] = tmp_path_factory.mktemp(f"one_{trainer}")
            cache[trainer] = _train(folders[trainer], trainer, per_device=GLOBAL_BATCH)
        return cache[trainer]

    get.folder = lambda trainer: folders[trainer] / "out"
    return get


@pytest.mark.slow
@pytest.mark.parametrize("trainer", ["sft", "dpo", "grpo", "ppo"])
@pytest.mark.parametrize("backend", ["ddp", pytest.param("fsdp2", marks=NEEDS_CUDA),
                                     pytest.param("zero2", marks=NEEDS_DEEPSPEED),
                                     pytest.param("zero3", marks=NEEDS_DEEPSPEED)])
def test_two_processes_equal_one(tmp_path, one_process, backend, trainer):
    ref_logged, ref_weights = one_process(trainer)
    logged, weights = _train(tmp_path, trainer, per_device=GLOBAL_BATCH // 2,
                             distributed={"num_processes": 2, "backend": backend})
    assert logged["loss"] == pytest.approx(ref_logged["loss"], rel=1e-5, abs=1e-6)  # PPO's first-step loss is ~1e-7
    if trainer == "ppo":
        # The critic's loss is the token mean over both ranks' tokens, as on one process (not a mean of rank means).
        assert logged["ppo/value_loss"] == pytest.approx(ref_logged["ppo/value_loss"], rel=1e-5)
        ref_critic = torch.load(one_process.folder("ppo") / "ppo" / "critic.pt", weights_only=True)["model"]
        critic = torch.load(tmp_path / "out" / "ppo" / "critic.pt", weights_only=True)["model"]
        # AdamW's first step moves each weight by about lr x sign(gradient) (1e-2 here): a gradient that differed
        # would show at that size; float rounding flips only the signs of near-zero gradients.
        assert max((critic[k] - ref_critic[k]).abs().max().item() for k in ref_critic) < 1e-3
    assert weights.keys() == ref_weights.keys()
    initial = _parameters(next((tmp_path / "out" / "_embedded").glob("*")))
    moved = max((ref_weights[k].float() - initial[k].float()).abs().max().item() for k in ref_weights)
    assert moved > 1e-3  # the step really changed the weights, so equality below is not vacuous
    worst = max((weights[k].float() - ref_weights[k].float()).abs().max().item() for k in ref_weights)
    assert worst < 1e-6, f"{backend}/{trainer}: max weight difference {worst:.3g} against one process"


# -- sharded checkpoints: kill -9 mid-run under FSDP2 and ZeRO-3, rerun, get the uninterrupted result (slow) -------------


def _run_sft(out: Path, recipe: Path, crash_at: str | None = None) -> subprocess.CompletedProcess:
    import os

    env = {k: v for k, v in os.environ.items() if k != "TRL_EXT_CRASH_AT"}
    if crash_at:
        env["TRL_EXT_CRASH_AT"] = crash_at
    return subprocess.run([sys.executable, "-m", "trl_ext.cli", "train", str(recipe), "--output-dir", str(out)],
                          capture_output=True, text=True, timeout=1200, env=env)


@pytest.mark.slow
@pytest.mark.parametrize("backend", [pytest.param("fsdp2", marks=NEEDS_CUDA),
                                     pytest.param("zero3", marks=NEEDS_DEEPSPEED)])
def test_sharded_checkpoint_resumes_after_kill_to_the_uninterrupted_result(tmp_path, backend):
    data = json.loads(_write_recipe(tmp_path / "r.yaml", "sft", per_device=4,
                                    distributed={"num_processes": 2, "backend": backend}).read_text())
    data["args"].update({"max_steps": 4, "save_strategy": "steps", "save_steps": 2, "learning_rate": 1e-2})
    recipe = tmp_path / "r.yaml"
    recipe.write_text(json.dumps(data))
    straight = _run_sft(tmp_path / "straight", recipe)
    assert straight.returncode == 0, straight.stderr[-3000:]
    killed = _run_sft(tmp_path / "resumed", recipe, crash_at="checkpoint:2")  # 2nd checkpoint written, unmarked
    assert killed.returncode != 0 and not (tmp_path / "resumed" / "sft" / "stage.json").exists()
    resumed = _run_sft(tmp_path / "resumed", recipe)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming from" in resumed.stdout  # from the complete first checkpoint, not from scratch
    a, b = _parameters(tmp_path / "straight" / "sft"), _parameters(tmp_path / "resumed" / "sft")
    worst = max((a[k] - b[k]).abs().max().item() for k in a)
    assert worst < 1e-6, f"{backend}: resumed run differs from the uninterrupted one by {worst:.3g}"


# -- held-out evaluation of a sharded model (slow) ----------------------------------------------------------------------


@pytest.mark.slow
@NEEDS_DEEPSPEED
def test_held_out_evaluation_under_zero3_equals_one_process(tmp_path):
    """ZeRO-3 shards every weight: the main process alone could not evaluate (``'weight' must be 2-D`` before training,
    a hang in the engine's fetch hooks after). Every rank now evaluates in step; eval.json (greedy and seeded sampled
    completions, before and after the step) is what one process writes."""
    data = json.loads(_write_recipe(tmp_path / "r.yaml", "sft", per_device=4).read_text())
    data["evaluation"] = {"dataset": {"source": "embedded:arithmetic", "split": "test", "params": {"format": "prompt"},
                                      "limit": 4}, "reward": "exact_match", "max_new_tokens": 4, "mean_at_k": 2}
    one = tmp_path / "one.yaml"
    one.write_text(json.dumps(data))
    two = tmp_path / "two.yaml"
    args = {**data["args"], "per_device_train_batch_size": 2}  # the same global batch of 4
    two.write_text(json.dumps({**data, "args": args, "distributed": {"num_processes": 2, "backend": "zero3"}}))
    evaluations = []
    for recipe, out in ((one, tmp_path / "one"), (two, tmp_path / "two")):
        result = subprocess.run([sys.executable, "-m", "trl_ext.cli", "train", str(recipe), "--output-dir", str(out)],
                                capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, result.stderr[-3000:]
        evaluations.append(json.loads((out / "sft" / "eval.json").read_text()))
    single, sharded = evaluations
    assert set(single) == {"before", "after"} and single["before"]["n"] == 4
    assert sharded == single
