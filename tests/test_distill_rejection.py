"""``rejection_sampling``: selection by hand (ALGORITHMS.md item 2), one E-step on the tiny model, extra rounds with
acceptance logged and plotted, and the ReST-EM restart from the base model."""

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
    nxt = next_round_trainer(trainer, start, data, 2)
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
