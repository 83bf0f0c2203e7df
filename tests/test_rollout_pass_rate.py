"""``pass_rate_filter`` (ALGORITHMS.md item 46): the hand-computed keep-set and curriculum order, bounds validation
before any model loads, and on the tiny model: kept prompts' rates lie inside the bounds, a fixed seed reproduces the
keep-set (from the on-disk cache, and recomputed), and the zero-variance group fraction falls against the unfiltered
prompts."""

from __future__ import annotations

import json

import pytest

from trl_ext import Plugin, hookimpl
from trl_ext.embedded.arithmetic import arithmetic_dataset
from trl_ext.errors import RecipeError
from trl_ext.recipe import StageSpec
from trl_ext.rewards import RewardFunction
from trl_ext.runner import RunContext, _CURRENT_RUN
from trl_ext.stage import resolve_stage
from trl_ext_plugins.rollout.control_math import pass_rates, select_and_order, zero_variance_fraction
from trl_ext_plugins.rollout.pass_rate_filter import PassRateFilter


def test_item_46_keep_set_and_curriculum_order():
    rates = [1.0, 0.0, 0.3, 0.7]
    keep = select_and_order(rates, 0.0, 1.0, inclusive=False, order="easy_to_hard")
    assert [rates[i] for i in keep] == [0.7, 0.3]  # kept {0.3, 0.7}, easy (high pass rate) first
    assert keep == [3, 2]
    assert select_and_order(rates, 0.0, 1.0, order="hard_to_easy") == [2, 3]
    assert select_and_order(rates, 0.0, 1.0, order="none") == [2, 3]
    assert select_and_order(rates, 0.0, 1.0, inclusive=True, order="none") == [0, 1, 2, 3]
    assert select_and_order(rates, 0.3, 0.7, inclusive=True, order="none") == [2, 3]
    assert select_and_order(rates, 0.3, 0.7, inclusive=False, order="none") == []


def test_pass_rate_is_the_share_of_solved_samples():
    assert pass_rates([[True, False, False, False], [True] * 10, [False] * 3]) == [0.25, 1.0, 0.0]
    assert zero_variance_fraction([[1, 1], [0, 1], [0, 0], [1, 0]]) == 0.5


def _validation_error(catalog, register_plugin, params) -> RecipeError:
    """The error validating a grpo stage with pass_rate_filter(``params``) and exact_match."""
    from trl_ext_plugins.rewards.exact_match import ExactMatch

    register_plugin(PassRateFilter)
    register_plugin(ExactMatch)
    stage = StageSpec(trainer="grpo", model="no-such-model", dataset={"source": "embedded:arithmetic"},
                      plugins=[{"name": "pass_rate_filter", "params": params}, "exact_match"])
    with pytest.raises(RecipeError) as err:
        resolve_stage(stage, 0, catalog)
    return err.value


@pytest.mark.parametrize("params, message", [
    ({"lower": 0.8, "upper": 0.2}, "lower (0.8) must not exceed upper (0.2)"),
    ({"lower": 0.5, "upper": 0.5}, "keeps no prompt"),
    ({"k": 0}, "k"),
])
def test_bad_bounds_are_refused_at_validation(trl_ext_catalog, register_plugin, params, message):
    err = _validation_error(trl_ext_catalog, register_plugin, params)
    text = str(err)
    assert "stages[0].plugins[0].params" in text and "pass_rate_filter" in text and message in text


@pytest.mark.parametrize("params, message", [
    ({"reward": "exact_matchh"}, "params.reward: unknown plugin 'exact_matchh'. Did you mean: exact_match?"),
    ({"reward": "pass_rate_filter"}, "params.reward: plugin 'pass_rate_filter' is not a reward plugin"),
    ({"reward": "exact_match", "reward_params": {"nope": 1}},
     "params.reward_params.nope: Extra inputs are not permitted (plugin 'exact_match')"),
    ({"reward_params": {"weight": "x"}}, "params.reward_params.weight: "),
])
def test_bad_reward_selection_is_refused_at_validation(trl_ext_catalog, register_plugin, params, message):
    """A bad ``reward``/``reward_params`` passed validation and failed only after the profiling model had loaded."""
    lines = [m for m in _validation_error(trl_ext_catalog, register_plugin, params).messages if "pass_rate_filter" in m]
    assert len(lines) == 1 and lines[0].startswith("stages[0]: plugin 'pass_rate_filter': ") and message in lines[0]


def test_a_reward_plugin_of_the_recipes_catalog_is_accepted(trl_ext_catalog, register_plugin):
    """The reward selection is checked against the catalog the recipe is validated with: checked against the
    installed plugins only, a plugin registered by the caller (a test, an embedding program) was 'unknown'."""

    class OwnReward(Plugin):
        name = "own_reward"
        family = "reward"
        trainers = frozenset({"grpo"})

        @hookimpl
        def trl_ext_reward_functions(self, stage):
            return [RewardFunction(self.name, lambda completions, **kw: [0.0] * len(completions))]

    register_plugin(PassRateFilter)
    register_plugin(OwnReward)
    stage = StageSpec(trainer="grpo", model="no-such-model", dataset={"source": "embedded:arithmetic"},
                      plugins=[{"name": "pass_rate_filter", "params": {"reward": "own_reward"}}, "own_reward"])
    assert resolve_stage(stage, 0, trl_ext_catalog).host.names() == ["pass_rate_filter", "own_reward"]


def test_the_reward_is_built_before_the_model_loads(monkeypatch, tmp_path):
    import trl_ext_plugins.preference.generation as gen
    from trl_ext.errors import UnknownPluginError

    monkeypatch.setattr(gen, "load_policy", lambda path: pytest.fail("the model loaded before the reward was built"))
    plugin = PassRateFilter(PassRateFilter.Params(reward="exact_matchh", cache_dir=str(tmp_path)))
    with pytest.raises(UnknownPluginError, match="exact_matchh"):
        plugin.estimate(arithmetic_dataset("train", format="prompt", size=2), "no-such-model")


def test_curriculum_keeps_the_dataset_order(trl_ext_catalog, register_plugin):
    register_plugin(PassRateFilter)
    from trl_ext_plugins.rewards.exact_match import ExactMatch

    register_plugin(ExactMatch)
    stage = StageSpec(trainer="grpo", model="m", dataset={"source": "embedded:arithmetic"},
                      plugins=["pass_rate_filter", "exact_match"])
    assert resolve_stage(stage, 0, trl_ext_catalog).args["shuffle_dataset"] is False
    stage = StageSpec(trainer="grpo", model="m", dataset={"source": "embedded:arithmetic"},
                      plugins=[{"pass_rate_filter": {"order": "none"}}, "exact_match"])
    assert "shuffle_dataset" not in resolve_stage(stage, 0, trl_ext_catalog).args


# -- on the tiny model ---------------------------------------------------------------------------------------------


def digit_task_reward(completions, answer):
    """Prompts of three difficulties: answer % 3 == 0 always solved, == 1 never, == 2 solved when the completion starts
    with a digit (the untrained tiny model does that sometimes)."""
    table = {0: lambda c: 1.0, 1: lambda c: 0.0, 2: lambda c: float(c[:1].isdigit())}
    return [table[int(a) % 3](c) for c, a in zip(completions, answer, strict=True)]


class StartsWithDigit(Plugin):
    """Test reward: :func:`digit_task_reward`."""

    name = "starts_with_digit"
    family = "reward"

    @hookimpl
    def trl_ext_reward_functions(self, stage):
        def starts_with_digit(completions, answer, **kwargs):
            return digit_task_reward(completions, answer)

        return [RewardFunction(self.name, starts_with_digit)]


@pytest.fixture
def run_with_digit_reward(trl_ext_catalog, register_plugin, tmp_path):
    register_plugin(StartsWithDigit)
    token = _CURRENT_RUN.set(RunContext(recipe=None, output_dir=tmp_path / "run", catalog=trl_ext_catalog))
    try:
        yield tmp_path / "run"
    finally:
        _CURRENT_RUN.reset(token)


def _filter(**params):
    return PassRateFilter(PassRateFilter.Params(reward="starts_with_digit", k=6, max_new_tokens=2, temperature=2.0,
                                                **params))


def test_kept_rates_inside_bounds_cached_and_reproducible(tiny_model_dir, run_with_digit_reward):
    data = arithmetic_dataset("train", format="prompt", size=48)
    stage = StageSpec(trainer="grpo", model=tiny_model_dir, dataset={"source": "embedded:arithmetic"})
    first = _filter(seed=3)
    kept = first.trl_ext_prepare_dataset(dataset=data, split="train", stage=stage)
    rates = first.last_rates
    assert first.cache_hit is False
    assert {0.0, 1.0} <= set(rates) and any(0.0 < r < 1.0 for r in rates)  # there is something to filter
    assert all(0.0 < r < 1.0 for r in kept["pass_rate"])
    assert len(kept) == sum(0.0 < r < 1.0 for r in rates)
    assert kept["pass_rate"] == sorted(kept["pass_rate"], reverse=True)  # easy -> hard
    # the pass_rate column matches each kept prompt's own estimate
    by_prompt = dict(zip(data["prompt"], rates))
    assert all(by_prompt[p] == r for p, r in zip(kept["prompt"], kept["pass_rate"]))
    assert first.trl_ext_prepare_dataset(dataset=data, split="eval", stage=stage) is None  # held-out untouched

    again = _filter(seed=3)
    assert again.trl_ext_prepare_dataset(dataset=data, split="train", stage=stage)["prompt"] == kept["prompt"]
    assert again.cache_hit is True
    cache_files = list((run_with_digit_reward / "_cache" / "pass_rate_filter").glob("*.json"))
    assert len(cache_files) == 1 and json.loads(cache_files[0].read_text())["rates"] == rates
    cache_files[0].unlink()  # recomputed from scratch with the same seed: the same estimate
    recomputed = _filter(seed=3)
    assert recomputed.trl_ext_prepare_dataset(dataset=data, split="train", stage=stage)["prompt"] == kept["prompt"]
    assert recomputed.cache_hit is False and recomputed.last_rates == rates

    other_seed = _filter(seed=4)
    other_seed.trl_ext_prepare_dataset(dataset=data, split="train", stage=stage)
    assert other_seed.cache_hit is False  # the seed is part of the cache key
    # so are the prompts' batching (the seeded samples depend on it) and the columns the reward reads
    other_batching = _filter(seed=3, batch_size=8)
    other_batching.trl_ext_prepare_dataset(dataset=data, split="train", stage=stage)
    assert other_batching.cache_hit is False
    relabelled = data.map(lambda row, i: {"answer": str(int(row["answer"]) + 1) if i == 0 else row["answer"]},
                          with_indices=True)
    other_answers = _filter(seed=3)
    other_answers.trl_ext_prepare_dataset(dataset=relabelled, split="train", stage=stage)
    assert other_answers.cache_hit is False


def test_zero_variance_groups_fall_after_filtering(tiny_model_dir, run_with_digit_reward):
    from trl_ext_plugins.preference.generation import load_policy, sample_completions

    data = arithmetic_dataset("train", format="prompt", size=48)
    stage = StageSpec(trainer="grpo", model=tiny_model_dir, dataset={"source": "embedded:arithmetic"})
    kept = _filter(seed=0).trl_ext_prepare_dataset(dataset=data, split="train", stage=stage)

    # fresh GRPO-style groups of 4 (another seed than the estimate) on every prompt vs on the kept prompts
    model, tokenizer = load_policy(tiny_model_dir)

    def groups(rows):
        samples = sample_completions(model, tokenizer, rows["prompt"], num_samples=4, max_new_tokens=2,
                                     do_sample=True, temperature=2.0, seed=123)
        return [digit_task_reward(row, [a] * len(row)) for row, a in zip(samples, rows["answer"], strict=True)]

    before, after = zero_variance_fraction(groups(data)), zero_variance_fraction(groups(kept))
    print(f"zero-variance group fraction: unfiltered {before:.3f}, filtered {after:.3f}")
    assert after < before


class EqualsAnswer(Plugin):
    """Test reward: 1 when the completion is exactly the ``answer`` column (no stripping of any kind)."""

    name = "equals_answer"
    family = "reward"

    @hookimpl
    def trl_ext_reward_functions(self, stage):
        def equals_answer(completions, answer, **kwargs):
            return [float(c == a) for c, a in zip(completions, answer, strict=True)]

        return [RewardFunction(self.name, equals_answer)]


def test_samples_are_scored_on_the_text_training_rewards(monkeypatch, trl_ext_catalog, register_plugin, tmp_path):
    """The estimate decoded samples with special tokens kept (``12<|im_end|>`` with the tool tokenizer), so a reward
    that reads the text exactly saw another completion than GRPO hands it (``12``, TRL's skip_special_tokens decode):
    a prompt always solved in training was estimated never solved."""
    import trl_ext_plugins.preference.generation as gen
    from datasets import Dataset

    from tests.test_preference_generation import ScriptedModel, action_ids, tool_tokenizer

    register_plugin(EqualsAnswer)
    tokenizer = tool_tokenizer()
    ids = action_ids(tokenizer, "12")
    assert tokenizer.batch_decode([ids], skip_special_tokens=True) == ["12"]  # what GRPO's reward would see
    monkeypatch.setattr(gen, "load_policy", lambda path: (ScriptedModel(ids, tokenizer.pad_token_id), tokenizer))
    data = Dataset.from_dict({"prompt": ["9+3=", "9+4="], "answer": ["12", "13"]})
    token = _CURRENT_RUN.set(RunContext(recipe=None, output_dir=tmp_path / "run", catalog=trl_ext_catalog))
    try:
        plugin = PassRateFilter(PassRateFilter.Params(reward="equals_answer", k=3))
        assert plugin.estimate(data, "scripted-model") == [1.0, 0.0]
    finally:
        _CURRENT_RUN.reset(token)


def test_fewer_kept_prompts_than_one_generation_batch_is_an_error(monkeypatch):
    """TRL's sampler drops an incomplete generation batch: 1 kept prompt with 2 prompts per generation batch
    (8 completions / 4 generations) trained zero steps and ended the stage as if it had trained."""
    data = arithmetic_dataset("train", format="prompt", size=4)
    stage = StageSpec(trainer="grpo", model="m", dataset={"source": "embedded:arithmetic"},
                      args={"per_device_train_batch_size": 8, "num_generations": 4})
    plugin = PassRateFilter(PassRateFilter.Params())
    monkeypatch.setattr(plugin, "estimate", lambda dataset, model: [1.0, 0.5, 0.0, 1.0])
    with pytest.raises(ValueError, match="only 1 of 4 prompts .* fewer than the 2 prompts of one generation batch"):
        plugin.trl_ext_prepare_dataset(dataset=data, split="train", stage=stage)
    monkeypatch.setattr(plugin, "estimate", lambda dataset, model: [1.0, 0.5, 0.0, 0.25])
    kept = plugin.trl_ext_prepare_dataset(dataset=data, split="train", stage=stage)
    assert kept["pass_rate"] == [0.5, 0.25] and kept["prompt"] == [data["prompt"][1], data["prompt"][3]]
