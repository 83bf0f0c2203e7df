"""Every hook in trl_ext/hookspecs.py is documented and runs in a real recipe; runs resume; the quickstart's
machinery (stages, metrics.jsonl, run.json, evaluation, plot) works end to end on the tiny model."""

import inspect
import json

import pytest
import torch

from trl_ext import Need, NoParams, Plugin, Slot, hookimpl, hookspecs
from trl_ext.batches import TokenWeights
from trl_ext.catalog import REGISTRATION_HOOKS, SPEC_NAMES
from trl_ext.recipe import parse_recipe
from trl_ext.runner import run_recipe
from trl_ext.testing import fresh_catalog
from trl_ext_plugins.preference.dpo import DPO
from trl_ext_plugins.rewards.exact_match import ExactMatch
from trl_ext_plugins.trainers.sft import SFT

CALLS: dict[str, int] = {}


def _seen(name):
    CALLS[name] = CALLS.get(name, 0) + 1


class Recorder(Plugin):
    """Implements every run hook with neutral answers and counts the calls (test plugin)."""

    name = "recorder"
    slots = frozenset({Slot.OBJECTIVE, Slot.AGGREGATION, Slot.ADVANTAGE, Slot.GENERATION, Slot.REFILL,
                       Slot.TRAIN_SAMPLER})
    Params = NoParams

    @hookimpl
    def trl_ext_validate_stage(self, stage, plugins):
        _seen("trl_ext_validate_stage")
        return []

    @hookimpl
    def trl_ext_configure_args(self, trainer, args):
        _seen("trl_ext_configure_args")
        return {"logging_steps": 1}

    @hookimpl
    def trl_ext_prepare_dataset(self, dataset, split, stage):
        _seen("trl_ext_prepare_dataset")
        return dataset.select(range(32))

    @hookimpl
    def trl_ext_reward_functions(self, stage):
        _seen("trl_ext_reward_functions")
        return None

    @hookimpl
    def trl_ext_trainer_kwargs(self, stage, tokenizer):
        _seen("trl_ext_trainer_kwargs")
        return None

    @hookimpl
    def trl_ext_trainer_created(self, trainer):
        _seen("trl_ext_trainer_created")

    @hookimpl
    def trl_ext_train_sampler(self, trainer, dataset):
        _seen("trl_ext_train_sampler")
        return None

    @hookimpl
    def trl_ext_generate(self, trainer, prompts, generate):
        _seen("trl_ext_generate")
        return generate(prompts)

    @hookimpl
    def trl_ext_model_forward(self, trainer, model, phase, inputs):
        _seen("trl_ext_model_forward")
        _seen(f"model_forward:{phase}")
        return None

    @hookimpl
    def trl_ext_shape_rewards(self, rewards_per_func, batch):
        _seen("trl_ext_shape_rewards")
        assert rewards_per_func.shape == (batch.completion_lengths.numel(), len(batch.reward_names))
        return rewards_per_func + 0.0

    @hookimpl
    def trl_ext_filter_groups(self, rewards, batch):
        _seen("trl_ext_filter_groups")
        return torch.ones_like(rewards, dtype=torch.bool)

    @hookimpl
    def trl_ext_refill_groups(self, trainer, inputs, score):
        _seen("trl_ext_refill_groups")
        output, keep = score(inputs)  # one round, as the host would run it
        assert keep is not None and keep.all()  # the filter above keeps everything
        return output

    @hookimpl
    def trl_ext_compute_advantages(self, rewards, batch):
        _seen("trl_ext_compute_advantages")
        return None

    @hookimpl
    def trl_ext_policy_loss(self, inputs):
        _seen("trl_ext_policy_loss")
        return None

    @hookimpl
    def trl_ext_token_weights(self, inputs):
        _seen("trl_ext_token_weights")
        return TokenWeights(weight=torch.ones_like(inputs.mask))

    @hookimpl
    def trl_ext_aggregate_loss(self, per_token_loss, mask, inputs):
        _seen("trl_ext_aggregate_loss")
        return None

    @hookimpl
    def trl_ext_extra_loss(self, inputs):
        _seen("trl_ext_extra_loss")
        return torch.zeros((), device=inputs.mask.device)

    @hookimpl
    def trl_ext_after_stage(self, stage, output_dir, trainer):
        _seen("trl_ext_after_stage")
        return {"recorder_saw_model": (output_dir and __import__("os").path.exists(f"{output_dir}/config.json"))}


class PreferenceRecorder(Plugin):
    """Counts preference-loss calls and delegates to the DPO formula (test plugin)."""

    name = "preference_recorder"
    slots = frozenset({Slot.PREFERENCE_LOSS})
    needs = frozenset({Need.REFERENCE})

    @hookimpl
    def trl_ext_preference_loss(self, inputs):
        _seen("trl_ext_preference_loss")
        return DPO().trl_ext_preference_loss(inputs)


def _catalog():
    catalog = fresh_catalog()
    for cls in (Recorder, PreferenceRecorder, ExactMatch, SFT, DPO):
        catalog.add_plugin(cls)
    return catalog


def test_every_hook_is_documented():
    for name in SPEC_NAMES:
        doc = inspect.getdoc(getattr(hookspecs, name)) or ""
        assert "Since" in doc and ("Called" in doc or "called" in doc), f"{name}: say when it is called and since when"
        assert "None" in doc or "nothing" in doc.lower(), f"{name}: say what None / no result means"


def test_recipe_runs_every_hook_and_writes_outputs(tmp_path):
    CALLS.clear()
    recipe = parse_recipe({
        "seed": 0,
        "stages": [
            {"name": "sft", "trainer": "sft", "model": "embedded:tiny-qwen2", "plugins": ["recorder"],
             "dataset": {"source": "embedded:arithmetic", "params": {"format": "prompt_completion"}},
             "evaluation": {"dataset": {"source": "embedded:arithmetic", "split": "test", "params": {"format": "prompt"}},
                            "reward": "exact_match", "limit": 16},
             "args": {"max_steps": 2, "per_device_train_batch_size": 8, "max_length": 32}},
            {"name": "grpo", "trainer": "grpo", "model": "stage:sft", "plugins": ["recorder", "exact_match"],
             "dataset": {"source": "embedded:arithmetic", "params": {"format": "prompt"}},
             "args": {"max_steps": 2, "per_device_train_batch_size": 8, "num_generations": 4, "beta": 0.01,
                      "max_completion_length": 4, "gradient_checkpointing": False}},
            {"name": "dpo", "trainer": "dpo", "model": "stage:sft", "ref_model": "stage:sft",
             "plugins": ["preference_recorder"],
             "dataset": {"source": "embedded:arithmetic", "params": {"format": "preference"}, "limit": 16},
             "args": {"max_steps": 1, "per_device_train_batch_size": 4, "max_length": 32}},
        ],
    })
    info = run_recipe(recipe, tmp_path, _catalog(), echo=lambda _m: None)
    run_hooks = SPEC_NAMES - REGISTRATION_HOOKS
    phases = {name for name in CALLS if name.startswith("model_forward:")}
    assert phases == {"model_forward:generate", "model_forward:reference", "model_forward:train"}  # beta != 0
    assert set(CALLS) - phases == run_hooks, f"never called: {sorted(run_hooks - set(CALLS))}"

    run = json.loads((tmp_path / "run.json").read_text())
    assert run["status"] == "complete" and info["status"] == "complete"
    assert [p["name"] for p in run["plugins"]["grpo"]] == ["recorder", "exact_match"]
    assert run["plugins"]["grpo"][1]["distribution"] == "<manual>"
    assert run["resolved_args"]["grpo"]["logging_steps"] == 1  # configure_args applied
    for stage in ("sft", "grpo", "dpo"):
        assert (tmp_path / stage / "config.json").exists() and (tmp_path / stage / "stage.json").exists()
        rows = [json.loads(line) for line in (tmp_path / stage / "metrics.jsonl").read_text().splitlines()]
        assert rows and all("step" in row for row in rows)
    assert "reward" in json.loads((tmp_path / "grpo" / "metrics.jsonl").read_text().splitlines()[0])
    assert run["stages"]["sft"]["recorder_saw_model"] is True
    ev = json.loads((tmp_path / "sft" / "eval.json").read_text())
    assert ev["before"]["n"] == 16 and 0.0 <= ev["after"]["accuracy"] <= 1.0
    assert (tmp_path / "curves.png").stat().st_size > 1000

    # Running again into the same directory reruns nothing.
    CALLS.clear()
    run_recipe(recipe, tmp_path, _catalog(), echo=lambda _m: None)
    assert "trl_ext_trainer_created" not in CALLS


def _sft_recipe(max_steps):
    return parse_recipe({
        "seed": 0, "trainer": "sft", "model": "embedded:tiny-qwen2", "name": "sft", "plugins": ["sft"],
        "dataset": {"source": "embedded:arithmetic", "params": {"format": "prompt_completion"}},
        "args": {"max_steps": max_steps, "per_device_train_batch_size": 8, "max_length": 32, "save_steps": 2,
                 "learning_rate": 1e-2, "logging_steps": 1},
    })


class Interrupt(Exception):
    pass


def test_interrupted_stage_resumes_to_the_same_final_state(tmp_path):
    from safetensors.torch import load_file
    from transformers import TrainerCallback

    class StopAfterCheckpoint(TrainerCallback):
        def on_save(self, args, state, control, **kwargs):
            if state.global_step == 4:
                raise Interrupt()

    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    run_recipe(_sft_recipe(6), straight, _catalog(), echo=lambda _m: None)
    try:
        run_recipe(_sft_recipe(6), resumed, _catalog(), extra_callbacks=[StopAfterCheckpoint()], echo=lambda _m: None)
    except Interrupt:
        pass
    assert not (resumed / "sft" / "stage.json").exists()
    assert json.loads((resumed / "run.json").read_text())["status"] == "running"
    messages = []
    run_recipe(_sft_recipe(6), resumed, _catalog(), echo=messages.append)
    assert any("resuming from" in m and "checkpoint-4" in m for m in messages)
    a = load_file(straight / "sft" / "model.safetensors")
    b = load_file(resumed / "sft" / "model.safetensors")
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=1e-6)
    def loss_steps(run_dir):
        rows = [json.loads(line) for line in (run_dir / "sft" / "metrics.jsonl").read_text().splitlines()]
        return [row["step"] for row in rows if "loss" in row]

    assert loss_steps(resumed) == loss_steps(straight) == [1, 2, 3, 4, 5, 6]  # no rows lost or duplicated


def test_peft_stage_saves_adapter_and_a_merged_model_the_next_stage_loads(tmp_path):
    recipe = parse_recipe({
        "seed": 0,
        "stages": [
            {"name": "lora", "trainer": "sft", "model": "embedded:tiny-qwen2", "plugins": ["sft"],
             "dataset": {"source": "embedded:arithmetic", "params": {"format": "prompt_completion"}, "limit": 32},
             "peft": {"type": "lora", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]},
             "args": {"max_steps": 2, "per_device_train_batch_size": 8, "max_length": 32, "learning_rate": 1e-2}},
            {"name": "after", "trainer": "sft", "model": "stage:lora", "plugins": ["sft"],
             "dataset": {"source": "embedded:arithmetic", "params": {"format": "prompt_completion"}, "limit": 16},
             "args": {"max_steps": 1, "per_device_train_batch_size": 8, "max_length": 32}},
        ],
    })
    run_recipe(recipe, tmp_path, _catalog(), echo=lambda _m: None)
    assert (tmp_path / "lora" / "adapter" / "adapter_config.json").exists()
    assert not (tmp_path / "lora" / "adapter_config.json").exists()  # the top level is a plain, merged model
    from transformers import AutoModelForCausalLM

    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "lora")
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "_embedded" / "tiny-qwen2")
    changed = [n for n, p in merged.named_parameters() if not torch.equal(p, dict(base.named_parameters())[n])]
    assert changed and all("q_proj" in n or "v_proj" in n for n in changed)  # LoRA touched only its targets
    assert (tmp_path / "after" / "stage.json").exists()
    summary = json.loads((tmp_path / "run.json").read_text())["stages"]
    assert summary["lora"]["model"] == str(tmp_path / "lora")


def test_a_lora_stage_no_later_stage_loads_saves_only_its_adapter_unless_asked(tmp_path):
    from transformers import AutoModelForCausalLM

    def recipe(**peft):
        return parse_recipe({"seed": 0, "stages": [{
            "name": "lora", "trainer": "sft", "model": "embedded:tiny-qwen2", "plugins": ["sft"],
            "dataset": {"source": "embedded:arithmetic", "params": {"format": "prompt_completion"}, "limit": 16},
            "peft": {"type": "lora", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"], **peft},
            "args": {"max_steps": 1, "per_device_train_batch_size": 8, "max_length": 32}}]})

    info = run_recipe(recipe(), tmp_path / "lean", _catalog(), echo=lambda _m: None)
    stage = tmp_path / "lean" / "lora"
    assert (stage / "adapter" / "adapter_model.safetensors").exists() and (stage / "stage.json").exists()
    assert not (stage / "model.safetensors").exists()  # no merged copy: nothing asked for it
    assert info["stages"]["lora"]["model"] == str(stage / "adapter")
    from peft import AutoPeftModelForCausalLM

    assert AutoPeftModelForCausalLM.from_pretrained(stage / "adapter") is not None  # the adapter loads on its base

    run_recipe(recipe(save_merged=True), tmp_path / "merged", _catalog(), echo=lambda _m: None)
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "merged" / "lora") is not None

    from trl_ext.errors import RecipeError
    from trl_ext.runner import resolve_recipe

    with pytest.raises(RecipeError, match="peft.save_merged: true or false"):
        resolve_recipe(recipe(save_merged="yes"), _catalog())


def test_checkpoints_are_pruned_once_the_stage_is_complete_unless_kept(tmp_path):
    from trl_ext.runner import prune_checkpoints

    messages = []
    run_recipe(_sft_recipe(4), tmp_path / "pruned", _catalog(), echo=messages.append)
    stage = tmp_path / "pruned" / "sft"
    assert (stage / "stage.json").exists() and (stage / "model.safetensors").exists()
    assert not (stage / "checkpoints").exists() and not (stage / ".removing-checkpoints").exists()
    assert any("removed its training checkpoints" in m for m in messages)

    kept = _sft_recipe(4).model_copy(update={"keep_checkpoints": True})
    run_recipe(kept, tmp_path / "kept", _catalog(), echo=lambda _m: None)
    assert sorted(p.name for p in (tmp_path / "kept" / "sft" / "checkpoints").glob("checkpoint-*")) == \
        ["checkpoint-2", "checkpoint-4"]

    # A kill between the rename and the deletion leaves the renamed folder: the next run (stage already complete)
    # finishes deleting it, and nothing else of the stage is touched.
    (stage / ".removing-checkpoints" / "checkpoint-2").mkdir(parents=True)
    run_recipe(_sft_recipe(4), tmp_path / "pruned", _catalog(), echo=lambda _m: None)
    assert not (stage / ".removing-checkpoints").exists() and (stage / "model.safetensors").exists()
    prune_checkpoints(stage, messages.append)  # nothing left to prune: a no-op
