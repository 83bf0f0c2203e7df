"""``opd_reward``, ``multi_teacher_opd`` and ``stage_teachers`` on the GRPO trainer: per-token advantages against an
independent full-logit computation, composition with corrections, routing, and bad input."""

import pytest
import torch

from trl_ext.embedded.arithmetic import arithmetic_dataset
from trl_ext.embedded.models import materialize_model
from trl_ext.errors import RecipeError
from trl_ext.recipe import Recipe, StageSpec, validate_recipe
from trl_ext.stage import resolve_stage
from trl_ext_plugins.advantages.math import group_advantages
from trl_ext_plugins.distill.opd import (MultiTeacherOPD, MultiTeacherParams, OPDReward, OPDRewardParams,
                                         StageTeachersParams)


@pytest.fixture(scope="module")
def teachers(tmp_path_factory):
    root = tmp_path_factory.mktemp("teachers")
    return {name: str(materialize_model("tiny-qwen2", root / name, seed=seed)) for name, seed in (("a", 1), ("b", 2))}


class Spy:
    """Wraps an advantage plugin to keep the RolloutBatch it saw."""

    def __init__(self, plugin):
        self.plugin, self.batch = plugin, None
        original = plugin.trl_ext_compute_advantages

        def wrapped(rewards, batch):
            self.batch, self.rewards = batch, rewards
            return original(rewards=rewards, batch=batch)

        wrapped.trl_ext_impl = original.trl_ext_impl  # pluggy's hookimpl marker
        plugin.trl_ext_compute_advantages = wrapped


def domains_dataset(size=16):
    ds = arithmetic_dataset("train", format="prompt", size=size)
    return ds.add_column("domain", ["a" if i % 2 == 0 else "b" for i in range(size)])


def rollout(trainer, rows=8, group=4):
    trainer.model.train()
    inputs = [trainer.train_dataset[i // group] for i in range(rows)]
    return trainer._generate_and_score_completions(inputs)


@torch.no_grad()
def full_logit_logps(model_or_dir, batch, temperature):
    """Independent reference: log-softmax over the full vocabulary, gathered at the sampled tokens."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_or_dir) if isinstance(model_or_dir, str) else model_or_dir
    ids = torch.cat([batch.prompt_ids, batch.completion_ids], 1)
    mask = torch.cat([batch.prompt_mask, batch.completion_mask], 1)
    width = batch.completion_ids.size(1)
    logits = model(input_ids=ids, attention_mask=mask).logits[:, -width - 1:-1].float() / temperature
    return torch.log_softmax(logits, -1).gather(-1, batch.completion_ids.unsqueeze(-1)).squeeze(-1)


def test_opd_advantages_equal_teacher_minus_student_logps(tiny_trainer, teachers):
    plugin = OPDReward(OPDRewardParams(), teacher=teachers["a"])
    spy = Spy(plugin)
    trainer = tiny_trainer("grpo", plugins=[plugin], args={"temperature": 0.7})
    out = rollout(trainer)
    batch, mask = spy.batch, out["completion_mask"].bool()
    expected = full_logit_logps(teachers["a"], batch, 0.7) - full_logit_logps(trainer.model, batch, 0.7)
    assert out["advantages"].shape == out["completion_ids"].shape
    assert torch.allclose(out["advantages"][mask], expected[mask], atol=1e-5)
    assert (out["advantages"][~mask] == 0).all()
    assert out["advantages"][mask].abs().min() > 0  # a different teacher: a real signal on every token
    assert not out["advantages"].requires_grad


def test_teacher_identical_to_student_gives_zero_advantage_and_zero_gradient(tiny_trainer, tiny_model_dir):
    plugin = OPDReward(OPDRewardParams(), teacher=tiny_model_dir)
    trainer = tiny_trainer("grpo", plugins=[plugin])
    out = rollout(trainer)
    assert out["advantages"].abs().max() == 0.0
    trainer.current_gradient_accumulation_steps = 1  # set by HF's training loop; this test calls the loss directly
    loss = trainer.compute_loss(trainer.model, {k: v[:4] if torch.is_tensor(v) and v.dim() else v
                                                for k, v in out.items()})
    loss.backward()
    grads = [p.grad for p in trainer.model.parameters() if p.grad is not None]
    assert all(g.abs().max() == 0 for g in grads)


def test_tool_tokens_carry_no_advantage_and_are_not_in_the_reverse_kl_metric(tiny_trainer, teachers):
    """Tokens a tool wrote inside a completion (tool_mask 0) were not sampled from the student: no reverse-KL sample
    there. The metric was the mean over every completion token, tool tokens included."""
    plugin = OPDReward(OPDRewardParams(), teacher=teachers["a"])
    spy = Spy(plugin)
    trainer = tiny_trainer("grpo", plugins=[plugin])
    out = rollout(trainer)
    batch = spy.batch
    valid = batch.completion_mask.bool()
    tool = torch.zeros_like(valid)
    tool[:, 1::2] = True  # every other position written by a tool
    tool &= valid
    assert tool.any() and (valid & ~tool).any()
    batch.tool_mask = (~tool).long()
    batch.metrics.clear()
    advantages = plugin.trl_ext_compute_advantages(rewards=spy.rewards, batch=batch)
    gap = full_logit_logps(teachers["a"], batch, 1.0) - full_logit_logps(trainer.model, batch, 1.0)
    own = valid & ~tool
    assert (advantages[tool] == 0).all()
    assert torch.allclose(advantages[own], gap[own], atol=1e-5)
    assert batch.metrics["opd/reverse_kl"] == pytest.approx((-gap[own]).mean().item(), abs=1e-5)
    assert out["advantages"].shape == advantages.shape


def test_alpha_adds_the_trl_group_normalized_task_advantage(tiny_trainer, teachers):
    plugin = OPDReward(OPDRewardParams(alpha=0.5, coef=2.0), teacher=teachers["a"])
    spy = Spy(plugin)
    trainer = tiny_trainer("grpo", plugins=[plugin])
    out = rollout(trainer)
    batch, mask = spy.batch, out["completion_mask"].bool()
    opd = full_logit_logps(teachers["a"], batch, 1.0) - full_logit_logps(trainer.model, batch, 1.0)
    task = group_advantages(spy.rewards.float(), 4)
    expected = 2.0 * opd + 0.5 * task.unsqueeze(1)
    assert torch.allclose(out["advantages"][mask], expected[mask], atol=1e-5)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_task_advantage_is_trl_grpos_under_each_scale_rewards(tiny_trainer, tiny_model_dir, scale):
    """The task term alpha * A_task is TRL GRPO's own advantage under the run's scale_rewards: TRL's trainer without
    the plugin, and the plugin with the teacher equal to the student (so A_opd = 0), give the same advantages."""
    values = [1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0]

    def reward(completions, **kwargs):
        return values[: len(completions)]

    trl = rollout(tiny_trainer("grpo", reward_funcs=[reward], args={"scale_rewards": scale}))["advantages"]
    assert torch.allclose(trl, group_advantages(torch.tensor(values), 4, scale=scale), atol=1e-6)
    plugin = OPDReward(OPDRewardParams(alpha=1.0), teacher=tiny_model_dir)  # the student's own starting weights
    out = rollout(tiny_trainer("grpo", plugins=[plugin], reward_funcs=[reward], args={"scale_rewards": scale}))
    mask = out["completion_mask"].bool()
    assert torch.allclose(out["advantages"][mask], trl.unsqueeze(1).expand_as(out["advantages"])[mask], atol=1e-5)


def test_composes_with_rollout_corrections(tiny_trainer, teachers):
    """opd_reward + icepop (on rollout_logprobs' sampling log-probs) trains: finite loss, weights move."""
    from trl_ext_plugins.corrections.icepop import IcePop
    from trl_ext_plugins.rollout.rollout_logprobs import RolloutLogprobs

    plugins = [OPDReward(OPDRewardParams(), teacher=teachers["a"]), RolloutLogprobs(), IcePop()]
    trainer = tiny_trainer("grpo", plugins=plugins, args={"learning_rate": 1e-3})
    before = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert losses and all(torch.isfinite(torch.tensor(losses)))
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))


# -- multi-teacher ---------------------------------------------------------------------------------------------------


def test_multi_teacher_routes_weights_and_matches_each_domain_alone(tiny_trainer, teachers):
    params = MultiTeacherParams(teachers=teachers, weights={"a": 2.0, "b": 0.5})
    plugin = MultiTeacherOPD(params)
    spy = Spy(plugin)
    trainer = tiny_trainer("grpo", plugins=[plugin], dataset=domains_dataset())
    seen = {name: [] for name in teachers}
    out = rollout(trainer)  # rows 0-3 are domain a, rows 4-7 domain b
    batch, mask = spy.batch, out["completion_mask"].bool()
    student = full_logit_logps(trainer.model, batch, 1.0)
    for name, weight, rows in (("a", 2.0, slice(0, 4)), ("b", 0.5, slice(4, 8))):
        expected = weight * (full_logit_logps(teachers[name], batch, 1.0) - student)
        assert torch.allclose(out["advantages"][rows][mask[rows]], expected[rows][mask[rows]], atol=1e-5)

    # a prompt never reads another domain's teacher: record what each teacher's forward receives
    for name, model in plugin.pool.loaded.items():
        model.register_forward_pre_hook(lambda m, args, kwargs, name=name: seen[name].append(kwargs["input_ids"]),
                                        with_kwargs=True)
    again = plugin.trl_ext_compute_advantages(rewards=spy.rewards, batch=batch)
    ids = torch.cat([batch.prompt_ids, batch.completion_ids], 1)
    assert torch.equal(torch.cat(seen["a"]), ids[:4]) and torch.equal(torch.cat(seen["b"]), ids[4:])
    assert torch.equal(again, out["advantages"])

    # identical to running domain a alone with its weight (a single-teacher run, coef = w_a)
    alone = OPDReward(OPDRewardParams(coef=2.0), teacher=teachers["a"])
    alone_adv = alone.trl_ext_compute_advantages(rewards=spy.rewards, batch=batch)
    assert torch.allclose(alone_adv[:4], out["advantages"][:4], atol=1e-6)


def test_teachers_loaded_one_at_a_time_give_the_same_advantages(tiny_trainer, teachers):
    resident = MultiTeacherOPD(MultiTeacherParams(teachers=teachers))
    spy = Spy(resident)
    out = rollout(tiny_trainer("grpo", plugins=[resident], dataset=domains_dataset()))
    one_at_a_time = MultiTeacherOPD(MultiTeacherParams(teachers=teachers, max_resident_teachers=1))
    again = one_at_a_time.trl_ext_compute_advantages(rewards=spy.rewards, batch=spy.batch)
    assert torch.allclose(again, out["advantages"], atol=1e-6)
    assert len(one_at_a_time.pool.loaded) == 1 and one_at_a_time.pool.loads == 2


def test_effort_level_teachers(tiny_trainer, teachers):
    params = MultiTeacherParams(teachers={"a": teachers["a"], "a@high": teachers["b"], "b": teachers["b"]},
                                effort_column="effort")
    plugin = MultiTeacherOPD(params)
    assert plugin.route({"domain": "a", "effort": "high"}) == ("a@high", 1.0)
    assert plugin.route({"domain": "a", "effort": "low"}) == ("a", 1.0)


def test_unknown_domain_is_an_error_naming_it(teachers):
    plugin = MultiTeacherOPD(MultiTeacherParams(teachers={"a": teachers["a"]}))
    ds = domains_dataset(4)
    with pytest.raises(ValueError, match=r"domain\(s\) \['b'\] with no teacher; teachers: \['a'\]"):
        plugin.trl_ext_prepare_dataset(dataset=ds, split="train", stage=None)
    with pytest.raises(ValueError, match="no routing column 'topic'"):
        MultiTeacherOPD(MultiTeacherParams(teachers=teachers, column="topic")).trl_ext_prepare_dataset(
            dataset=ds, split="train", stage=None)


def test_effort_teachers_are_checked_per_row_before_training(teachers):
    """A 'math@high' teacher alone does not serve rows of effort 'low'; the dataset check looked only at the domain
    prefix, so training failed at the first such batch with 'domain 'a' has no teacher; known domains: ['a']'."""
    from datasets import Dataset

    plugin = MultiTeacherOPD(MultiTeacherParams(teachers={"a@high": teachers["a"], "b": teachers["b"]},
                                                effort_column="effort"))
    rows = Dataset.from_dict({"prompt": ["1", "2", "3"], "domain": ["a", "a", "b"], "effort": ["high", "low", "low"]})
    with pytest.raises(ValueError, match=r"domain\(s\) \['a \(effort low\)'\] with no teacher; "
                                         r"teachers: \['a@high', 'b'\]"):
        plugin.trl_ext_prepare_dataset(dataset=rows, split="train", stage=None)
    with pytest.raises(ValueError, match="no teacher for domain 'a' \\(column 'domain'\\) and effort 'low'"):
        plugin.route({"domain": "a", "effort": "low"})
    assert plugin.trl_ext_prepare_dataset(dataset=rows.select([0, 2]), split="train", stage=None) is None
    with pytest.raises(ValueError, match="no effort column 'effort'"):
        plugin.trl_ext_prepare_dataset(dataset=rows.remove_columns("effort"), split="train", stage=None)


def _grpo_stage(name, plugins, model="embedded:tiny-qwen2", teacher=None):
    return {"name": name, "trainer": "grpo", "model": model, "teacher": teacher,
            "dataset": {"source": "embedded:arithmetic", "params": {"format": "prompt"}},
            "plugins": plugins}


def _sft_stage(name):
    return {"name": name, "trainer": "sft", "model": "embedded:tiny-qwen2",
            "dataset": {"source": "embedded:arithmetic"}, "plugins": ["sft"]}


def test_bad_multi_teacher_recipe_is_refused_before_training():
    from trl_ext.catalog import Catalog

    stage = _grpo_stage("opd", [{"multi_teacher_opd": {"teachers": {"math": "/no/such/teacher"},
                                                       "weights": {"code": 1.0}}}, "exact_match"])
    with pytest.raises(RecipeError) as err:
        resolve_stage(StageSpec.model_validate(stage), 0, Catalog.discover())
    assert "teacher 'math': teacher '/no/such/teacher' does not exist" in str(err.value)
    assert "weights names domains without a teacher: ['code']" in str(err.value)


def test_stage_teachers_must_be_earlier_stages():
    from trl_ext.catalog import Catalog

    catalog = Catalog.discover()
    good = {"stages": [_sft_stage("sft"), _grpo_stage("opd", [{"stage_teachers": {"teachers": {"math": "sft"}}},
                                                               "exact_match"])]}
    assert validate_recipe(Recipe.model_validate(good), catalog) == []
    later = {"stages": [_grpo_stage("opd", [{"stage_teachers": {"teachers": {"math": "rl", "chat": "opd"}}},
                                            "exact_match"]), _sft_stage("rl")]}
    errors = validate_recipe(Recipe.model_validate(later), catalog)
    assert "stages[0].plugins[0].params.teachers.math: 'stage:rl' does not name an earlier stage" in "\n".join(errors)
    assert any("teachers.chat: 'stage:opd'" in e for e in errors)
    assert StageTeachersParams(teachers={"x": "sft"}).teachers == {"x": "stage:sft"}


def test_opd_reward_needs_the_stage_teacher():
    from trl_ext.catalog import Catalog

    with pytest.raises(RecipeError, match="plugin 'opd_reward' needs 'teacher'"):
        resolve_stage(StageSpec.model_validate(_grpo_stage("opd", ["opd_reward", "exact_match"])), 0,
                      Catalog.discover())
