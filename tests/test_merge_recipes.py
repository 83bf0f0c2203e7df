"""Merge plugins inside recipes: validation, plugin conformance, a merge-only stage through the runner (fast), and the
WARP recipe end to end on the tiny model (slow): EMA anchor = TRL's per-step mix, final weights = SLERP + LITI of the
stage outputs, resumption skips finished stages."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from trl_ext.errors import RecipeError
from trl_ext.recipe import parse_recipe
from trl_ext.runner import resolve_recipe, run_recipe
from trl_ext.testing import check_plugin_conformance, fresh_catalog
from trl_ext_plugins.merge.checkpoint_average import CheckpointAverage
from trl_ext.callbacks import REFERENCE_FILE as ANCHOR_FILE
from trl_ext_plugins.merge.warp import Warp
from trl_ext_plugins.rewards.exact_match import ExactMatch
from trl_ext_plugins.trainers.sft import SFT

PROMPTS = {"source": "embedded:arithmetic", "split": "train", "params": {"format": "prompt"}}


def _catalog():
    catalog = fresh_catalog()
    for cls in (CheckpointAverage, Warp, ExactMatch, SFT):
        catalog.add_plugin(cls)
    return catalog


def _errors(recipe):
    with pytest.raises(RecipeError) as err:
        resolve_recipe(parse_recipe(recipe), _catalog())
    return "\n".join(err.value.messages)


def test_conformance():
    check_plugin_conformance(CheckpointAverage)
    check_plugin_conformance(Warp)


def test_validation_names_the_field():
    merge = {"name": "m", "trainer": "merge", "model": "embedded:tiny-qwen2"}
    errors = _errors({"stages": [{**merge, "plugins": [{"checkpoint_average": {"mode": "weighted"}}]}]})
    assert "stages[0].plugins[0].params" in errors and "needs `weights`" in errors
    errors = _errors({"stages": [{**merge, "plugins": ["checkpoint_average"]}]})
    assert "params.sources must list the models" in errors
    # the merge trainer's own check (TrainerKind.check) refuses a merge stage that selects no merge plugin
    from trl_ext.host import PluginHost
    from trl_ext.trainers.merge import check_stage

    (message,) = check_stage(PluginHost([]), None, {}, "stages[0]")
    assert message.startswith("stages[0].plugins: the merge trainer needs a merge plugin")
    assert check_stage(PluginHost([Warp()]), None, {}, "stages[0]") == []
    errors = _errors({"stages": [{**merge, "plugins": [{"warp": {"runs": ["stage:a"]}}]}]})
    assert "M >= 2" in errors
    # a merge stage reads no dataset (one given would be ignored: refused); a training stage must have one
    errors = _errors({"stages": [{**merge, "dataset": PROMPTS, "plugins": ["warp"]}]})
    assert "stages[0].dataset: the merge trainer reads no dataset; remove it" in errors
    errors = _errors({"stages": [{"name": "s", "trainer": "sft", "model": "embedded:tiny-qwen2", "plugins": ["sft"]}]})
    assert "stages[0].dataset: the sft trainer trains on a dataset" in errors
    errors = _errors({"stages": [{**merge, "plugins": [{"warp": {"runs": ["a", "b", "c"], "slerp_t": 0.2}}]}]})
    assert "slerp_t applies to M = 2" in errors
    sft = {"name": "s", "trainer": "sft", "model": "embedded:tiny-qwen2", "dataset": "embedded:arithmetic"}
    errors = _errors({"stages": [{**sft, "plugins": [{"checkpoint_average": {"mode": "weighted", "weights": [1, 2]}}],
                                  "args": {"save_total_limit": 1}}]})
    assert "params.weights needs params.last_n" in errors
    errors = _errors({"stages": [{**sft, "plugins": [{"checkpoint_average": {"last_n": 3}}],
                                  "args": {"save_total_limit": 2}}]})
    assert "save_total_limit 2 keeps fewer checkpoints than params.last_n 3" in errors
    errors = _errors({"stages": [{**sft, "plugins": [{"checkpoint_average": {}}], "peft": {"type": "lora"}}]})
    assert "PEFT" in errors
    errors = _errors({"stages": [{**sft, "plugins": ["warp"]}]})
    assert "works with trainer(s)" in errors
    rl = {"name": "r", "trainer": "rloo", "model": "embedded:tiny-qwen2", "dataset": PROMPTS,
          "plugins": ["warp", "exact_match"], "args": {"beta": 0.5}}
    assert "args.beta: the recipe sets 0.5 but plugin 'warp' requires 0.1" in _errors({"stages": [rl]})


def test_warp_sets_trl_ema_anchor_args():
    rl = {"name": "r", "trainer": "rloo", "model": "embedded:tiny-qwen2", "dataset": PROMPTS,
          "plugins": [{"warp": {"ema_rate": 0.02}}, "exact_match"]}
    (resolved,) = resolve_recipe(parse_recipe({"stages": [rl]}), _catalog())
    assert {k: resolved.args[k] for k in ("beta", "sync_ref_model", "ref_model_mixup_alpha", "ref_model_sync_steps")
            } == {"beta": 0.1, "sync_ref_model": True, "ref_model_mixup_alpha": 0.02, "ref_model_sync_steps": 1}


def _save_perturbed(folder, out, seed):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    model.save_pretrained(out)
    return str(out)


def test_merge_only_stage_through_the_runner(tmp_path):
    """A `merge` stage averages two folders; its output loads with from_pretrained and later stages can use it."""
    from transformers import AutoModelForCausalLM

    from trl_ext.embedded.models import materialize_model

    base = str(materialize_model("tiny-qwen2", tmp_path / "base", seed=0))
    a, b = _save_perturbed(base, tmp_path / "a", 1), _save_perturbed(base, tmp_path / "b", 2)
    recipe = parse_recipe({"seed": 0, "stages": [{
        "name": "soup", "trainer": "merge", "model": base,
        "plugins": [{"checkpoint_average": {"sources": [a, b], "mode": "weighted", "weights": [1.0, 3.0]}}],
        "evaluation": {"dataset": {"source": "embedded:arithmetic", "split": "test", "params": {"format": "prompt"}},
                       "reward": "exact_match", "limit": 4}}]})
    info = run_recipe(recipe, tmp_path / "run", _catalog(), echo=lambda _m: None)
    summary = info["stages"]["soup"]
    assert summary["global_step"] == 0 and summary["checkpoint_average"]["weights"] == [0.25, 0.75]
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "soup").state_dict()
    wa, wb = load_file(f"{a}/model.safetensors"), load_file(f"{b}/model.safetensors")
    for key in wa:
        expected = (0.25 * wa[key].double() + 0.75 * wb[key].double()).float()
        assert torch.equal(merged[key], expected), key
    assert (tmp_path / "run" / "soup" / "tokenizer_config.json").is_file()
    assert summary["eval"]["before"]["n"] == summary["eval"]["after"]["n"] == 4  # the stand-in model loads on use


@pytest.mark.slow
def test_warp_recipe_end_to_end(tmp_path):
    """Two RLOO runs (2 steps each) with the EMA anchor, then SLERP + LITI; checked against the formula written out
    here from the stage outputs; a rerun skips every stage."""
    rl_args = {"max_steps": 2, "per_device_train_batch_size": 8, "num_generations": 4, "max_completion_length": 4,
               "learning_rate": 1e-3, "save_steps": 1, "logging_steps": 1, "gradient_checkpointing": False}
    rl = {"trainer": "rloo", "model": "embedded:tiny-qwen2", "dataset": PROMPTS, "plugins": ["warp", "exact_match"]}
    recipe = parse_recipe({"seed": 0, "keep_checkpoints": True, "stages": [  # the test reads the checkpoints
        {**rl, "name": "rl_a", "args": {**rl_args, "seed": 1}},
        {**rl, "name": "rl_b", "args": {**rl_args, "seed": 2}},
        {"name": "warp", "trainer": "merge", "model": "embedded:tiny-qwen2",
         "plugins": [{"warp": {"runs": ["stage:rl_a", "stage:rl_b"], "eta": 0.3}}]},
    ]})
    run = tmp_path / "run"
    info = run_recipe(recipe, run, _catalog(), echo=lambda _m: None)
    init = load_file(str(run / "_embedded" / "tiny-qwen2" / "model.safetensors"))
    ra, rb = (load_file(str(run / name / "model.safetensors")) for name in ("rl_a", "rl_b"))
    merged = load_file(str(run / "warp" / "model.safetensors"))
    assert info["stages"]["warp"]["warp"]["linear_fallback_tensors"] == 0
    for key in init:  # theta = init + eta * (sin(W/2)/sin W) (d_a + d_b), W the angle of d_a and d_b in this tensor
        da, db = (ra[key] - init[key]).double().flatten(), (rb[key] - init[key]).double().flatten()
        omega = torch.arccos(da @ db / (da.norm() * db.norm()))
        expected = init[key].double().flatten() + 0.3 * torch.sin(omega / 2) / torch.sin(omega) * (da + db)
        assert torch.allclose(merged[key].double().flatten(), expected, atol=1e-6, rtol=0), key
    # the EMA anchor is TRL's per-step mix with mu = 0.01 (saved with each checkpoint):
    # e_1 = 0.99 init + 0.01 theta_1, e_2 = 0.99 e_1 + 0.01 theta_2
    ckpt = run / "rl_a" / "checkpoints"
    theta = [load_file(str(ckpt / f"checkpoint-{s}" / "model.safetensors")) for s in (1, 2)]
    anchor = load_file(str(ckpt / "checkpoint-2" / ANCHOR_FILE))
    shared = anchor.keys() & theta[1].keys()
    assert len(shared) > 10
    for key in shared:
        e1 = 0.99 * init[key].double() + 0.01 * theta[0][key].double()
        assert torch.allclose(anchor[key].double(), 0.99 * e1 + 0.01 * theta[1][key].double(), atol=1e-7), key
    assert not torch.equal(theta[1]["model.layers.0.mlp.up_proj.weight"], init["model.layers.0.mlp.up_proj.weight"])
    # a rerun (e.g. after a crash) skips every finished stage and leaves the merge as it was
    before = (run / "warp" / "model.safetensors").read_bytes()
    messages = []
    run_recipe(recipe, run, _catalog(), echo=messages.append)
    assert sum("already complete, skipping" in m for m in messages) == 3
    assert (run / "warp" / "model.safetensors").read_bytes() == before
    assert json.loads((run / "warp" / "stage.json").read_text())["summary"]["trainer"] == "merge"


@pytest.mark.slow
def test_checkpoint_average_on_a_training_stage(tmp_path):
    """SFT for 6 steps saving every 2; LAWA over the last 2 checkpoints replaces the stage's model, which a later
    stage reads; held-out evaluation runs on the averaged model."""
    recipe = parse_recipe({"seed": 0, "keep_checkpoints": True, "stages": [{  # the test reads the checkpoints
        "name": "sft", "trainer": "sft", "model": "embedded:tiny-qwen2",
        "dataset": {"source": "embedded:arithmetic", "params": {"format": "prompt_completion"}},
        "plugins": ["sft", {"checkpoint_average": {"last_n": 2}}],
        "evaluation": {"dataset": {"source": "embedded:arithmetic", "split": "test", "params": {"format": "prompt"}},
                       "reward": "exact_match", "limit": 16},
        "args": {"max_steps": 6, "per_device_train_batch_size": 8, "save_steps": 2, "learning_rate": 1e-3,
                 "logging_steps": 1, "max_length": 32}}]})
    run = tmp_path / "run"
    info = run_recipe(recipe, run, _catalog(), echo=lambda _m: None)
    summary = info["stages"]["sft"]["checkpoint_average"]
    ckpt = run / "sft" / "checkpoints"
    assert summary["sources"] == [str(ckpt / "checkpoint-4"), str(ckpt / "checkpoint-6")]  # step 6 is checkpointed
    assert summary["weights"] == [0.5, 0.5] and summary["trainer_model_updated"] is True
    four, six = (load_file(str(ckpt / f"checkpoint-{s}" / "model.safetensors")) for s in (4, 6))
    averaged = load_file(str(run / "sft" / "model.safetensors"))
    assert averaged.keys() == six.keys()
    for key in six:
        assert torch.equal(averaged[key], ((four[key].double() + six[key].double()) / 2).float()), key
    assert not torch.equal(four["model.layers.0.mlp.up_proj.weight"], six["model.layers.0.mlp.up_proj.weight"])
    assert "after" in info["stages"]["sft"]["eval"]


@pytest.mark.slow
def test_warp_anchor_survives_a_crash(tmp_path):
    """Killed (as by SIGKILL) while marking checkpoint-3 of an RL stage; the rerun resumes from checkpoint-2 with the
    EMA anchor of step 2 restored, so the anchor at step 3 is 0.99 e_2 + 0.01 theta_3 (not 0.99 theta_init + ...)."""
    import os
    import subprocess
    import sys

    recipe = tmp_path / "warp_rl.yaml"
    recipe.write_text(json.dumps({"seed": 0, "keep_checkpoints": True, "stages": [{  # the test reads the checkpoints
        "name": "rl", "trainer": "rloo", "model": "embedded:tiny-qwen2", "dataset": PROMPTS,
        "plugins": ["warp", "exact_match"],
        "args": {"max_steps": 3, "per_device_train_batch_size": 8, "num_generations": 4, "max_completion_length": 4,
                 "learning_rate": 1e-3, "save_steps": 1, "gradient_checkpointing": False}}]}))
    out = tmp_path / "run"
    command = [sys.executable, "-m", "trl_ext.cli", "train", str(recipe), "--output-dir", str(out)]
    crashed = subprocess.run(command, env={**os.environ, "TRL_EXT_CRASH_AT": "checkpoint:3"}, capture_output=True,
                             text=True, timeout=900)
    assert crashed.returncode == 137, crashed.stderr[-2000:]
    ckpt = out / "rl" / "checkpoints"
    anchor_2 = load_file(str(ckpt / "checkpoint-2" / ANCHOR_FILE))
    resumed = subprocess.run(command, capture_output=True, text=True, timeout=900)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resuming from" in resumed.stdout + resumed.stderr
    init = load_file(str(out / "_embedded" / "tiny-qwen2" / "model.safetensors"))
    theta_3 = load_file(str(ckpt / "checkpoint-3" / "model.safetensors"))
    anchor_3 = load_file(str(ckpt / "checkpoint-3" / ANCHOR_FILE))
    key = "model.layers.0.mlp.up_proj.weight"
    continued = 0.99 * anchor_2[key].double() + 0.01 * theta_3[key].double()
    restarted = 0.99 * init[key].double() + 0.01 * theta_3[key].double()
    assert torch.allclose(anchor_3[key].double(), continued, atol=1e-7)
    assert not torch.allclose(anchor_3[key].double(), restarted, atol=1e-7)


def test_a_merge_stage_killed_while_moving_files_in_reruns_to_the_merge(tmp_path, monkeypatch):
    """`model:` a single file, sources sharded: a kill after the first shard moved in left that shard beside the copied
    model.safetensors; the rerun copies `model:` again and must not read the leftover with it (the stale index of a
    later kill made every rerun fail on a missing shard)."""
    import trl_ext_plugins.merge.streaming as streaming
    from transformers import AutoModelForCausalLM

    from trl_ext.embedded.models import materialize_model

    base = str(materialize_model("tiny-qwen2", tmp_path / "base", seed=0))
    sources = []
    for seed in (1, 2):
        folder = _save_perturbed(base, tmp_path / f"s{seed}", seed)
        AutoModelForCausalLM.from_pretrained(folder).save_pretrained(folder, max_shard_size="100KB")
        assert (Path(folder) / "model.safetensors.index.json").is_file()
        sources.append(folder)
    recipe = parse_recipe({"seed": 0, "stages": [{
        "name": "soup", "trainer": "merge", "model": base,
        "plugins": [{"checkpoint_average": {"sources": sources}}]}]})
    real = streaming.os.replace

    def killed_after_one_move(src, dst):
        if Path(dst).parent.name == "soup" and any(Path(dst).parent.glob("model-*.safetensors")):
            raise KeyboardInterrupt("killed")
        real(src, dst)

    monkeypatch.setattr(streaming.os, "replace", killed_after_one_move)
    with pytest.raises(KeyboardInterrupt):
        run_recipe(recipe, tmp_path / "run", _catalog(), echo=lambda _m: None)
    stage = tmp_path / "run" / "soup"
    assert len(list(stage.glob("model-*.safetensors"))) == 1 and (stage / "model.safetensors").is_file()
    leftover = next(stage.glob("model-*.safetensors")).name
    monkeypatch.setattr(streaming.os, "replace", real)
    run_recipe(recipe, tmp_path / "run", _catalog(), echo=lambda _m: None)
    merged = AutoModelForCausalLM.from_pretrained(stage).state_dict()
    first, second = (AutoModelForCausalLM.from_pretrained(s).state_dict() for s in sources)
    for key, value in merged.items():
        assert torch.equal(value, (0.5 * first[key].double() + 0.5 * second[key].double()).float()), key
    assert not (stage / "model.safetensors").exists() and (stage / leftover).is_file()
