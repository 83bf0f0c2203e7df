"""With no plugin, each trl-ext trainer is TRL's trainer; a plugin that re-expresses TRL's math matches TRL's path.

Each test trains TRL's own trainer and the trl-ext subclass from the same seed, model folder and data for a few steps
and compares every logged loss.
"""

import math

import pytest
import trl

from trl_ext.embedded.arithmetic import arithmetic_dataset
from trl_ext.host import PluginHost
from trl_ext.testing import _FORMATS, _small_defaults
from trl_ext.trainers import TRAINER_KINDS, BuildContext
from trl_ext_plugins.losses.grpo import GRPO
from trl_ext_plugins.preference.dpo import DPO
from trl_ext_plugins.trainers.sft import SFT, SFTParams

TRL_CLASSES = {
    "sft": trl.SFTTrainer, "grpo": trl.GRPOTrainer, "rloo": trl.RLOOTrainer, "dpo": trl.DPOTrainer,
    "kto": trl.KTOTrainer, "reward": trl.RewardTrainer, "distillation": trl.DistillationTrainer,
}
STEPS = 3


def length_reward(completions, **kwargs):
    """A reward that varies within every group on a random model (exact match would be all zeros)."""
    return [float(len(c)) for c in completions]


def _losses(trainer):
    trainer.train()
    return [row["loss"] for row in trainer.state.log_history if "loss" in row]


def _build(name, model_dir, tmp_path, cls, host, args):
    from transformers import AutoTokenizer

    kind = TRAINER_KINDS[name]
    config = kind.config_cls(output_dir=str(tmp_path), bf16=False, report_to="none", max_steps=STEPS,
                             logging_steps=1, save_strategy="no", seed=0, **{**_small_defaults(name), **args})
    kwargs = dict(args=config, train_dataset=arithmetic_dataset("train", format=_FORMATS[name], size=48),
                  processing_class=AutoTokenizer.from_pretrained(model_dir))
    if kind.uses_rewards:
        kwargs["reward_funcs"] = [length_reward]
    if name == "distillation":
        kwargs["teacher_model"] = model_dir
    if host is None:
        return cls(model=model_dir, **kwargs)
    ctx = BuildContext(model=model_dir, ref_model=None, teacher=kwargs.get("teacher_model"), config=config,
                       train_dataset=kwargs["train_dataset"], eval_dataset=None,
                       tokenizer=kwargs["processing_class"], peft_config=None, callbacks=[], host=host,
                       reward_funcs=kwargs.get("reward_funcs", []), reward_weights=[])
    return kind.build(ctx)


@pytest.mark.parametrize("name", sorted(TRL_CLASSES))
def test_no_plugin_trainer_is_trl_bit_for_bit(name, tiny_model_dir, tmp_path):
    args = {"temperature": 1.0} if name in ("grpo", "rloo") else {}
    theirs = _losses(_build(name, tiny_model_dir, tmp_path / "trl", TRL_CLASSES[name], None, args))
    ours = _losses(_build(name, tiny_model_dir, tmp_path / "ext", None, PluginHost([]), args))
    assert len(theirs) == STEPS and all(math.isfinite(x) for x in theirs)
    assert ours == theirs  # exact equality: the same code path ran


def test_grpo_plugin_matches_trl_grpo_loss_type(tiny_model_dir, tmp_path):
    # beta != 0 exercises the KL term and reference model; num_iterations=2 makes the ratio differ from 1 so the
    # clipping branch is live on the second pass over each generation batch.
    args = {"loss_type": "grpo", "beta": 0.04, "num_iterations": 2, "learning_rate": 1e-2, "temperature": 1.0}
    theirs = _losses(_build("grpo", tiny_model_dir, tmp_path / "trl", trl.GRPOTrainer, None, args))
    ours = _losses(_build("grpo", tiny_model_dir, tmp_path / "ext", None, PluginHost([GRPO()]), args))
    assert ours == pytest.approx(theirs, rel=1e-5, abs=1e-6)
    assert any(abs(x) > 0 for x in theirs)


def test_dpo_plugin_matches_trl_sigmoid(tiny_model_dir, tmp_path):
    args = {"loss_type": ["sigmoid"], "beta": 0.1, "learning_rate": 1e-2}
    theirs = _losses(_build("dpo", tiny_model_dir, tmp_path / "trl", trl.DPOTrainer, None, args))
    ours = _losses(_build("dpo", tiny_model_dir, tmp_path / "ext", None, PluginHost([DPO()]), args))
    assert theirs[0] == pytest.approx(math.log(2), abs=1e-6)  # pi == pi_ref at the first step
    assert ours == pytest.approx(theirs, rel=1e-5, abs=1e-6)


def test_sft_plugin_token_normalisation_is_trl(tiny_model_dir, tmp_path):
    theirs = _losses(_build("sft", tiny_model_dir, tmp_path / "trl", trl.SFTTrainer, None, {}))
    ours = _losses(_build("sft", tiny_model_dir, tmp_path / "ext", None, PluginHost([SFT()]), {}))
    assert ours == theirs


def test_sft_sequence_normalisation_differs_and_trains(tiny_model_dir, tmp_path):
    plugin = SFT(SFTParams(normalization="sequence"))
    losses = _losses(_build("sft", tiny_model_dir, tmp_path / "ext", None, PluginHost([plugin]), {"learning_rate": 1e-2}))
    assert len(losses) == STEPS and all(math.isfinite(x) for x in losses)
    assert losses[-1] < losses[0]
