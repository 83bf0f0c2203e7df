"""``gkd`` on TRL's DistillationTrainer: parity with TRL, the on/off-policy mix, and bad input."""

import pytest
import torch
from transformers import AutoTokenizer
from trl import DistillationConfig, DistillationTrainer

from trl_ext.embedded.arithmetic import arithmetic_dataset
from trl_ext.embedded.models import materialize_model
from trl_ext.errors import RecipeError
from trl_ext.host import PluginHost
from trl_ext.recipe import StageSpec
from trl_ext.stage import resolve_stage
from trl_ext.testing import check_plugin_conformance
from trl_ext.trainers import TRAINER_KINDS, BuildContext
from trl_ext_plugins.distill import PLUGINS
from trl_ext_plugins.distill import math as dm
from trl_ext_plugins.distill.gkd import GKD, GKDParams, on_policy_draw

ARGS = dict(per_device_train_batch_size=4, max_completion_length=4, gradient_checkpointing=False, max_steps=2,
            logging_steps=1, save_strategy="no", seed=0, bf16=False, report_to="none", learning_rate=1e-3)


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
    return str(materialize_model("tiny-qwen2", tmp_path_factory.mktemp("teacher") / "t", seed=1))


@pytest.mark.parametrize("plugin", PLUGINS)
def test_conformance(plugin):
    check_plugin_conformance(plugin)


def build(student, teacher, tmp_path, plugins=(), dataset=None, **overrides):
    host = PluginHost(list(plugins))
    args = dict(ARGS)
    for impl in host.pm.hook.trl_ext_configure_args.get_hookimpls():
        args.update(impl.function(trainer="distillation", args={}) or {})
    args.update(overrides)
    dataset = dataset if dataset is not None else arithmetic_dataset("train", format="prompt", size=32)
    for impl in reversed(host.pm.hook.trl_ext_prepare_dataset.get_hookimpls()):
        dataset = impl.function(dataset=dataset, split="train", stage=None) or dataset
    ctx = BuildContext(model=student, ref_model=None, teacher=teacher,
                       config=DistillationConfig(output_dir=str(tmp_path / "ours"), **args),
                       train_dataset=dataset, eval_dataset=None, tokenizer=AutoTokenizer.from_pretrained(student),
                       peft_config=None, callbacks=[], host=host, reward_funcs=[], reward_weights=[])
    trainer = TRAINER_KINDS["distillation"].build(ctx)
    host.hook.trl_ext_trainer_created(trainer=trainer)
    return trainer


@pytest.mark.parametrize("divergence, beta", [("reverse_kl", None), ("jsd", 0.3)])  # forward KL: kernel parity in test_distill_math
def test_parity_with_trl_distillation_trainer(tiny_model_dir, teacher_dir, tmp_path, divergence, beta):
    """Same seeds, same data: the gkd plugin's run and TRL's own DistillationTrainer log identical losses."""
    params = GKDParams(divergence=divergence, **({"beta": beta} if beta is not None else {}))
    ours = build(tiny_model_dir, teacher_dir, tmp_path, [GKD(params)])
    assert ours.beta == params.trl_beta
    ours.train()
    trl = DistillationTrainer(model=tiny_model_dir, teacher_model=teacher_dir,
                              args=DistillationConfig(output_dir=str(tmp_path / "trl"), beta=params.trl_beta, **ARGS),
                              train_dataset=arithmetic_dataset("train", format="prompt", size=32),
                              processing_class=AutoTokenizer.from_pretrained(tiny_model_dir))
    trl.train()
    ours_losses = [h["loss"] for h in ours.state.log_history if "loss" in h]
    trl_losses = [h["loss"] for h in trl.state.log_history if "loss" in h]
    assert len(ours_losses) == 2 and ours_losses[0] > 0
    assert ours_losses == pytest.approx(trl_losses, abs=1e-6)
    for (name, a), (_, b) in zip(ours.model.named_parameters(), trl.model.named_parameters()):
        assert torch.allclose(a, b, atol=1e-6), name


def test_off_policy_batch_uses_dataset_completions_and_the_divergence(tiny_model_dir, teacher_dir, tmp_path):
    """lmbda = 0: every batch is the dataset's (x, y); the loss is the token-mean JSD over the full vocabulary."""
    dataset = arithmetic_dataset("train", format="prompt_completion", size=8)
    trainer = build(tiny_model_dir, teacher_dir, tmp_path, [GKD(GKDParams(divergence="jsd", beta=0.5, lmbda=0.0))],
                    dataset=dataset, max_completion_length=8)
    trainer.model.train()
    rows = [dataset[i] for i in range(4)]
    batch = trainer._generate_and_score_completions(rows)
    tok = trainer.processing_class
    for i, row in enumerate(rows):
        ids = batch["completion_ids"][i][batch["completion_mask"][i].bool()].tolist()
        assert tok.decode(ids) == row["completion"]  # e.g. "37<eos>": the dataset answer, eos included once
    loss = trainer.compute_loss(trainer.model, batch)

    input_ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    attention = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    width = batch["completion_ids"].size(1)
    with torch.no_grad():
        s = trainer.model(input_ids=input_ids, attention_mask=attention).logits[:, -width - 1:-1]
        t = trainer.teacher_model(input_ids=input_ids, attention_mask=attention).logits[:, -width - 1:-1]
    per_token = dm.generalized_jsd(t, s, 0.5)
    mask = batch["completion_mask"].bool()
    expected = torch.where(mask, per_token, 0).sum() / mask.sum()
    assert loss.item() == pytest.approx(expected.item(), abs=1e-6)


def test_lambda_draw_is_seeded_and_has_the_right_rate():
    draws = [on_policy_draw(0, step, 0.25) for step in range(4000)]
    assert draws == [on_policy_draw(0, step, 0.25) for step in range(4000)]  # every rank draws the same sides
    assert abs(sum(draws) / len(draws) - 0.25) < 0.03
    assert all(on_policy_draw(0, s, 1.0) for s in range(50)) and not any(on_policy_draw(0, s, 0.0) for s in range(50))


def test_params_refuse_beta_without_jsd():
    with pytest.raises(ValueError, match="beta applies only to divergence 'jsd'"):
        GKDParams(divergence="reverse_kl", beta=0.2)


def _stage(student, teacher, **params):
    return StageSpec(trainer="distillation", model=student, teacher=teacher,
                     dataset={"source": "embedded:arithmetic", "params": {"format": "prompt"}},
                     plugins=[{"name": "gkd", "params": params}])


def test_teacher_with_another_tokenizer_is_refused_naming_both(tiny_model_dir, tmp_path, trl_ext_catalog):
    other = tmp_path / "other-teacher"
    materialize_model("tiny-qwen2", other, seed=1)
    tok = AutoTokenizer.from_pretrained(other)
    tok.add_tokens(["<extra>"])
    tok.save_pretrained(other)
    trl_ext_catalog.add_plugin(GKD)
    with pytest.raises(RecipeError) as err:
        resolve_stage(_stage(tiny_model_dir, str(other)), 0, trl_ext_catalog)
    text = str(err.value)
    assert "different tokenizers" in text and str(other) in text and tiny_model_dir in text


def test_missing_teacher_is_refused_at_validation(tiny_model_dir, tmp_path, trl_ext_catalog):
    trl_ext_catalog.add_plugin(GKD)
    with pytest.raises(RecipeError, match="teacher .*does not exist"):
        resolve_stage(_stage(tiny_model_dir, str(tmp_path / "nope")), 0, trl_ext_catalog)
    (tmp_path / "empty").mkdir()
    with pytest.raises(RecipeError, match="no config.json"):
        resolve_stage(_stage(tiny_model_dir, str(tmp_path / "empty")), 0, trl_ext_catalog)


def test_recipe_beta_conflicting_with_divergence_is_refused(tiny_model_dir, teacher_dir, trl_ext_catalog):
    trl_ext_catalog.add_plugin(GKD)
    stage = _stage(tiny_model_dir, teacher_dir, divergence="forward_kl")
    stage.args["beta"] = 1.0
    with pytest.raises(RecipeError, match="args.beta: the recipe sets 1.0 but plugin 'gkd' requires 0.0"):
        resolve_stage(stage, 0, trl_ext_catalog)


def test_off_policy_without_completion_column_is_refused():
    with pytest.raises(ValueError, match="no 'completion' column"):
        GKD(GKDParams(lmbda=0.5)).trl_ext_prepare_dataset(arithmetic_dataset("train", format="prompt", size=4),
                                                         "train", None)


def test_tokenizers_are_compared_by_their_ids_only(tiny_model_dir):
    """The teacher scores the student's ids, so only the token -> id map must agree: a pad-less tokenizer (Llama 3,
    Mistral), whose pad the runner and TRL set to EOS for the student only, was refused as "different tokenizers"
    distilling a model into itself; an instruct teacher whose EOS is another token of the same vocabulary was too."""
    from trl_ext_plugins.distill import teachers as tch

    student = AutoTokenizer.from_pretrained(tiny_model_dir)
    teacher = AutoTokenizer.from_pretrained(tiny_model_dir)
    student.pad_token, teacher.pad_token = student.eos_token, None
    vocab = teacher.get_vocab()
    teacher.eos_token = next(token for token in vocab if token != student.eos_token and vocab[token] > 3)
    tch.check_same_tokenizer(student, teacher, "student", "teacher")  # no error
    teacher.add_tokens(["<only-in-teacher>"])
    with pytest.raises(tch.TeacherError, match=r"vocabularies differ \(\d+ vs \d+ tokens"):
        tch.check_same_tokenizer(student, teacher, "student", "teacher")
