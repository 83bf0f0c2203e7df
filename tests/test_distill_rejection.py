"""``rejection_sampling``: selection by hand (ALGORITHMS.md item 2), one E-step on the tiny model, extra rounds with
acceptance logged and plotted, the ReST-EM restart from the base model, PEFT rounds (each trains the stage's adapter and
the stage folder ends as the runner saves it) and every round's checkpoints in ``<checkpoints>/round-<r>``."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from trl_ext.embedded.arithmetic import arithmetic_dataset
from trl_ext.recipe import StageSpec
from trl_ext_plugins.distill.rejection_sampling import (RejectionSampling, RejectionSamplingParams,
                                                        next_round_trainer, select_accepted)


def test_selection_by_hand():
    # rewards [1, 0, 1, 0] for K = 4 -> exactly 2 kept; an all-zero prompt contributes nothing
    kept = select_accepted([["a", "b", "c", "d"], ["e", "f", "g", "h"]], [[1, 0, 1, 0], [0, 0, 0, 0]], 1.0, None,
                           dedupe=False)
    assert kept == [(0, "a"), (0, "c")]
    # dedupe keeps one copy; the cap stops at max_per_prompt; None (unscorable) is rejected
    assert select_accepted([["x", "x", "y", "z"]], [[1, 1, 1, 1]], 1.0, None, dedupe=True) == [(0, "x"), (0, "y"),
                                                                                              (0, "z")]
    assert select_accepted([["x", "y", "z", "w"]], [[1, 1, 1, 1]], 1.0, 2, dedupe=True) == [(0, "x"), (0, "y")]
    assert select_accepted([["x", "y"]], [[None, 1.0]], 1.0, None, dedupe=True) == [(0, "y")]
    nan = float("nan")  # an unscorable sample is not accepted (NaN < 1 is False, so it used to pass)
    assert select_accepted([["x", "y"], ["u", "v"]], [[nan, 1.0], [nan, nan]], 1.0, None, dedupe=True) == [(0, "y")]
    # a verifier that accepts everything: the data is exactly the self-samples (RFT = SFT on self-samples)
    assert select_accepted([["p", "q"]], [[1, 1]], 1.0, None, dedupe=False) == [(0, "p"), (0, "q")]


def test_e_step_keeps_only_verified_samples(tiny_model_dir, tmp_path):
    plugin = RejectionSampling(RejectionSamplingParams(k=4, max_new_tokens=4, verifier="exact_match", min_reward=0.0))
    stage = StageSpec(trainer="sft", model=tiny_model_dir, dataset={"source": "embedded:arithmetic"})
    data = plugin.trl_ext_prepare_dataset(dataset=arithmetic_dataset("train", size=6), split="train", stage=stage)
    # min_reward 0 accepts every sample: 6 prompts x 4 samples, deduplicated per prompt
    assert plugin.history[0]["acceptance_rate"] == 1.0
    assert 6 <= len(data) <= 24 and set(data.column_names) >= {"prompt", "completion", "answer"}
    strict = RejectionSampling(RejectionSamplingParams(k=4, max_new_tokens=4, verifier="exact_match"))
    with pytest.raises(ValueError, match="round 1: the verifier 'exact_match' accepted none of the 24 samples"):
        strict.trl_ext_prepare_dataset(dataset=arithmetic_dataset("train", size=6), split="train", stage=stage)


@pytest.mark.parametrize("restart", [False, True])
def test_next_round_starts_from_the_right_model(tiny_trainer, tiny_model_dir, restart):
    trainer = tiny_trainer("sft", args={"learning_rate": 1e-2, "max_steps": 1})
    trainer.train()
    trained = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    data = arithmetic_dataset("train", format="prompt_completion", size=8)
    start = tiny_model_dir if restart else trainer.model
    nxt = next_round_trainer(trainer, start, data, 2, trainer.args.output_dir)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    reference = base if restart else trained
    assert all(torch.equal(v, reference[k]) for k, v in nxt.model.state_dict().items())
    assert nxt.args.output_dir.endswith("round-2")


def test_rounds_log_and_plot_acceptance(tiny_trainer, tiny_model_dir, tmp_path):
    plugin = RejectionSampling(RejectionSamplingParams(rounds=2, k=2, max_new_tokens=4, min_reward=0.0))
    stage = StageSpec(trainer="sft", model=tiny_model_dir, dataset={"source": "embedded:arithmetic"})
    data = plugin.trl_ext_prepare_dataset(dataset=arithmetic_dataset("train", size=4), split="train", stage=stage)
    trainer = tiny_trainer("sft", plugins=[plugin], dataset=data, args={"max_steps": 1})
    trainer.train()
    summary = plugin.trl_ext_after_stage(stage=stage, output_dir=str(tmp_path), trainer=trainer)
    rounds = json.loads((tmp_path / "rejection_sampling.json").read_text())
    assert [r["round"] for r in rounds] == [1, 2] == [r["round"] for r in summary["rejection_sampling"]]
    assert (tmp_path / "rejection_sampling.png").stat().st_size > 0
    assert (tmp_path / "config.json").exists()  # the last round's model is the stage output


def _trainable(model) -> dict[str, int]:
    return {n: p.numel() for n, p in model.named_parameters() if p.requires_grad}


def _changed(model, before) -> set[str]:
    return {n for n, p in model.named_parameters() if not torch.equal(p.detach(), before[n])}


def _snapshot(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _files(directory):
    return {str(p.relative_to(directory)) for p in directory.rglob("*")
            if p.is_file() and p.relative_to(directory).parts[0] != "checkpoints"}


@pytest.mark.parametrize("restart", [False, True])
@pytest.mark.parametrize("save_merged", [True, False])
def test_peft_rounds_train_the_stage_adapter_and_save_as_the_runner_does(tiny_model_dir, tmp_path, monkeypatch,
                                                                         restart, save_merged):
    """Round 2 trains exactly what round 1 trains (the LoRA weights), and the stage folder ends with the runner's save
    of a one-round PEFT stage (adapter/, plus the merged model when asked), holding the last round's weights."""
    from peft import get_peft_model_state_dict
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    from trl_ext.host import PluginHost
    from trl_ext.runner import save_stage_model
    from trl_ext.stage import build_peft_config, default_args
    from trl_ext.trainers import TRAINER_KINDS, BuildContext, plugin_trainer_kwargs
    from trl_ext_plugins.distill import rejection_sampling as rs

    plugin = RejectionSampling(RejectionSamplingParams(rounds=2, k=2, max_new_tokens=4, min_reward=0.0,
                                                       restart_from_base=restart))
    stage = StageSpec(trainer="sft", model=tiny_model_dir, dataset={"source": "embedded:arithmetic"},
                      peft={"type": "lora", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"],
                            "save_merged": save_merged})
    data = plugin.trl_ext_prepare_dataset(dataset=arithmetic_dataset("train", size=4), split="train", stage=stage)
    stage_dir = tmp_path / "stage"
    # Round 1 as the runner builds, trains and saves it (run_stage with the stage's peft_config)
    kind, host = TRAINER_KINDS["sft"], PluginHost([plugin])
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    args = {**default_args(kind), "max_steps": 2, "learning_rate": 1e-2, "per_device_train_batch_size": 8,
            "max_length": 32, "save_strategy": "no", "seed": 0, "report_to": []}
    trainer = kind.build(BuildContext(
        model=tiny_model_dir, ref_model=None, teacher=None,
        config=kind.config_cls(output_dir=str(stage_dir / "checkpoints"), **args), train_dataset=data,
        eval_dataset=None, tokenizer=tokenizer, peft_config=build_peft_config(stage.peft), callbacks=[], host=host,
        reward_funcs=[], reward_weights=[], trainer_kwargs=plugin_trainer_kwargs(host, stage, tokenizer)))
    before = _snapshot(trainer.model)
    trainer.train()
    round_one = _trainable(trainer.model), _changed(trainer.model, before)
    assert round_one[0] and all("lora_" in n for n in round_one[0]) and round_one[1] == set(round_one[0])
    save_stage_model(trainer, tokenizer, stage_dir, is_main=True, merged=save_merged)
    one_round_layout = _files(stage_dir)
    assert ("model.safetensors" in one_round_layout) == save_merged

    rounds = []  # (trainer, its parameters before training) of every later round

    def recording(*a, **kw):
        nxt = next_round(*a, **kw)
        rounds.append((nxt, _snapshot(nxt.model)))
        return nxt

    next_round = rs.next_round_trainer
    monkeypatch.setattr(rs, "next_round_trainer", recording)
    plugin.trl_ext_after_stage(stage=stage, output_dir=str(stage_dir), trainer=trainer)
    (last, last_before), = rounds
    assert (_trainable(last.model), _changed(last.model, last_before)) == round_one

    assert _files(stage_dir) == one_round_layout | {"rejection_sampling.json", "rejection_sampling.png"}
    saved = load_file(stage_dir / "adapter" / "adapter_model.safetensors")
    assert saved.keys() == get_peft_model_state_dict(last.model).keys()
    assert all(torch.equal(v.cpu(), saved[k]) for k, v in get_peft_model_state_dict(last.model).items())
    if save_merged:  # the top-level model is the last round's adapter merged into the base
        import copy

        merged = copy.deepcopy(last.model).merge_and_unload().state_dict()
        top = AutoModelForCausalLM.from_pretrained(stage_dir).state_dict()
        assert top.keys() == merged.keys() and all(torch.equal(top[k], v) for k, v in merged.items())


def test_every_round_checkpoints_into_the_stage_checkpoints_folder(tiny_trainer, tiny_model_dir, tmp_path):
    """Round r's checkpoints are <checkpoints>/round-<r> for every r, not nested in the previous round's folder."""
    plugin = RejectionSampling(RejectionSamplingParams(rounds=4, k=2, max_new_tokens=4, min_reward=0.0))
    stage = StageSpec(trainer="sft", model=tiny_model_dir, dataset={"source": "embedded:arithmetic"})
    data = plugin.trl_ext_prepare_dataset(dataset=arithmetic_dataset("train", size=4), split="train", stage=stage)
    trainer = tiny_trainer("sft", plugins=[plugin], dataset=data,
                           args={"max_steps": 1, "save_strategy": "steps", "save_steps": 1})
    trainer.train()
    checkpoints = tmp_path / "out"  # tiny_trainer's output_dir: the stage's checkpoints folder
    plugin.trl_ext_after_stage(stage=stage, output_dir=str(tmp_path / "stage"), trainer=trainer)
    found = sorted(str(p.relative_to(checkpoints)) for p in checkpoints.rglob("checkpoint-*") if p.is_dir())
    assert found == ["checkpoint-1", "round-2/checkpoint-1", "round-3/checkpoint-1", "round-4/checkpoint-1"]
