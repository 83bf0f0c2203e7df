"""The MTP-healing recipe (configs/mtp_heads.yaml) through the runner, shrunk to a few steps: SFT -> MTP heads (fresh,
sampled from the SFT policy) -> GRPO -> healing with the pre-RL heads. Checks the plumbing end to end: sampled
completions cached, acceptance measured before/after and for the heads_from checkpoint, summary and plot written, the
trunk untouched by the mtp stages, the healed folder loading through transformers with its heads. The acceptance
figures of the full recipe are measured by running it (see the plugin's report); a few steps here prove no trend."""

import json
from pathlib import Path

import pytest
import torch
import yaml

from trl_ext.catalog import Catalog
from trl_ext.recipe import parse_recipe
from trl_ext.runner import run_recipe
from tests.markers import NEEDS_DEEPSPEED

RECIPE = Path(__file__).resolve().parents[1] / "configs" / "mtp_heads.yaml"


def _shrunk() -> dict:
    data = yaml.safe_load(RECIPE.read_text())
    for stage in data["stages"]:
        stage["args"]["max_steps"] = 2
        stage["args"]["logging_steps"] = 1
        stage["args"].pop("save_steps", None)
        stage["args"]["save_strategy"] = "no"
        if "evaluation" in stage:
            stage["evaluation"]["limit"] = 8
        if stage["trainer"] == "mtp":
            stage["dataset"]["limit"] = 8
            stage["args"]["per_device_train_batch_size"] = 8
            params = stage["plugins"][0]["mtp_heads"]
            params.update(samples_per_prompt=2, acceptance_prompts=4)
        if stage["trainer"] == "grpo":
            stage["args"]["per_device_train_batch_size"] = 16
    return data


@pytest.mark.slow
def test_mtp_healing_recipe_end_to_end(tmp_path):
    from transformers import AutoModelForCausalLM
    from transformers.modeling_layers import MtpModel

    run = tmp_path / "run"
    info = run_recipe(parse_recipe(_shrunk()), run, Catalog.discover(), echo=lambda _m: None)
    assert info["status"] == "complete"
    assert not list(run.rglob(".mtp-before-*"))  # the "before" copy is saved in the stage folder and removed
    mtp_sft, heal = info["stages"]["mtp_sft"], info["stages"]["heal"]
    assert {"mtp_acceptance_before", "mtp_acceptance_after"} <= set(mtp_sft)
    assert "mtp_acceptance_heads_from" not in mtp_sft  # fresh heads there
    assert {"mtp_acceptance_heads_from", "mtp_acceptance_before", "mtp_acceptance_after"} <= set(heal)
    for name, summary in (("mtp_sft", mtp_sft), ("heal", heal)):
        figures = json.loads((run / name / "mtp_acceptance.json").read_text())
        assert {f"mtp_acceptance_{k}" for k in figures} | {"mtp_acceptance_plot"} == \
            {k for k in summary if k.startswith("mtp_acceptance_") and not k.startswith("mtp_acceptance_rate_")}
        for key, figure in figures.items():
            length, rate = summary[f"mtp_acceptance_{key}"], summary[f"mtp_acceptance_rate_{key}"]
            if figure["drafted"] == 0:  # a 2-step SFT policy often answers <eos> at once: nothing drafted, undefined
                assert length is None and rate is None and figure["tokens_per_step"] is None
            else:
                assert 0.0 <= length <= 1.0 and 0.0 <= rate <= 1.0
        assert Path(summary["mtp_acceptance_plot"]).stat().st_size > 0
    header, *samples = [json.loads(line) for line in (run / "heal" / "mtp_samples.jsonl").read_text().splitlines()]
    assert set(header) == {"key"}  # model, prompts and sampling settings the samples were drawn with
    assert len(samples) == 8 * 2 and all(row["completion_ids"] for row in samples)

    # The mtp stage leaves the RL trunk bit-identical and adds heads transformers loads.
    grpo = AutoModelForCausalLM.from_pretrained(run / "grpo")
    healed = AutoModelForCausalLM.from_pretrained(run / "heal")
    for (name, a), (_, b) in zip(grpo.named_parameters(), healed.named_parameters()):
        assert torch.equal(a, b), name
    healed_heads = dict(MtpModel.from_pretrained(healed).named_parameters())
    source_heads = dict(MtpModel.from_pretrained(AutoModelForCausalLM.from_pretrained(run / "mtp_sft"))
                        .named_parameters())
    changed = [n for n in source_heads if n.startswith("layers.") and not torch.equal(source_heads[n], healed_heads[n])]
    assert changed, "healing did not change the heads it started from"


@pytest.mark.slow
@NEEDS_DEEPSPEED
def test_mtp_heads_stage_on_two_deepspeed_processes(tmp_path):
    """mtp_heads saved the starting model from the main process with ``trainer.save_model`` before training, whose
    DeepSpeed path (ZeRO-2 too) needs the engine that does not exist yet: 'MtpModel' object has no attribute
    'save_checkpoint'. Two ZeRO-2 processes now train the heads; the saved heads load with their shapes and moved."""
    import subprocess
    import sys

    from transformers import AutoModelForCausalLM
    from transformers.modeling_layers import MtpModel

    from trl_ext.trainers.mtp import fresh_heads

    recipe = {"seed": 0, "name": "mtp", "trainer": "mtp", "model": "embedded:tiny-glm4-moe-mtp",
              "dataset": {"source": "embedded:arithmetic", "split": "train", "params": {"format": "prompt"},
                          "limit": 8},
              "plugins": [{"mtp_heads": {"samples_per_prompt": 2, "max_new_tokens": 4, "acceptance_prompts": 4,
                                         "acceptance_max_new_tokens": 4,
                                         "held_out": {"source": "embedded:arithmetic", "split": "test",
                                                      "params": {"format": "prompt"}}}}],
              "args": {"max_steps": 2, "per_device_train_batch_size": 4, "learning_rate": 0.01, "logging_steps": 1,
                       "save_strategy": "no"},
              "distributed": {"num_processes": 2, "backend": "zero2"}}
    path, out = tmp_path / "mtp.json", tmp_path / "out"
    path.write_text(json.dumps(recipe))
    result = subprocess.run([sys.executable, "-m", "trl_ext.cli", "train", str(path), "--output-dir", str(out)],
                            check=False, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    assert set(json.loads((out / "mtp" / "mtp_acceptance.json").read_text())) == {"before", "after"}
    # The embedded model has no heads: the stage starts from fresh ones seeded by args.seed (the recipe's seed).
    trunk = AutoModelForCausalLM.from_pretrained(next((out / "_embedded").glob("*")))
    start = dict(fresh_heads(trunk, 1, 0).named_parameters())
    saved = dict(MtpModel.from_pretrained(AutoModelForCausalLM.from_pretrained(out / "mtp")).named_parameters())
    heads = [n for n in start if n.startswith("layers.")]
    assert heads and all(saved[n].shape == start[n].shape and saved[n].numel() for n in heads)
    assert any(not torch.equal(saved[n], start[n]) for n in heads)  # the trained heads, not the starting ones
