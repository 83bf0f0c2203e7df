"""reasoning-gym task families as ``multi_env`` environments: the embedded dataset, the family's verifier as a reward,
and a mixture of a reasoning-gym environment with an arithmetic one."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("reasoning_gym", reason="the reasoning-gym extra is not installed (pip install 'trl-ext[reasoning-gym]')")

from trl_ext.embedded.splits import hash_split  # noqa: E402
from trl_ext.recipe import StageSpec  # noqa: E402
from trl_ext.runner import RunContext, _CURRENT_RUN, load_split  # noqa: E402
from trl_ext_plugins.rollout.multi_env import MultiEnv  # noqa: E402
from trl_ext_plugins.rollout.reasoning_gym_env import (  # noqa: E402
    ReasoningGymScore,
    _split_entries,
    reasoning_gym_dataset,
)


def test_dataset_rows_and_splits():
    train = reasoning_gym_dataset("train", task="basic_arithmetic", size=4, seed=0)
    test = reasoning_gym_dataset("test", task="basic_arithmetic", size=4, seed=0)
    assert set(train.column_names) == {"prompt", "answer", "rg_entry"}
    entry = json.loads(train[0]["rg_entry"])
    assert train[0]["prompt"] == entry["question"] + "\nAnswer: " and train[0]["answer"] == str(entry["answer"])
    assert reasoning_gym_dataset("train", task="basic_arithmetic", size=4, seed=0)["prompt"] == train["prompt"]


def test_held_out_questions_never_appear_in_training():
    """Splits by question hash: disjoint whatever the sizes (splitting by seed put all 64 test problems of this config
    in the 512-row train split), distinct within a split, and a split's first rows do not depend on its size."""
    config = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2}
    train = reasoning_gym_dataset("train", size=512, config=config)
    test = reasoning_gym_dataset("test", size=64, config=config)
    assert len(set(train["prompt"])) == 512 and len(set(test["prompt"])) == 64
    assert not set(train["prompt"]) & set(test["prompt"])
    assert {hash_split(json.loads(e)["question"]) for e in test["rg_entry"]} == {"test"}
    assert reasoning_gym_dataset("test", size=8, config=config)["prompt"] == test["prompt"][:8]
    warm = reasoning_gym_dataset("train", size=4, config=config, format="prompt_completion")
    assert warm["completion"] == warm["answer"] == train["answer"][:4]


def test_skip_gives_the_questions_after_the_first_ones():
    """An RL stage can take questions its SFT warm-up never saw: ``skip`` continues the split where ``size`` ended."""
    config = {"min_terms": 2, "max_terms": 2, "max_digits": 2, "operators": ["+"]}
    first = reasoning_gym_dataset("train", size=12, config=config)
    later = reasoning_gym_dataset("train", size=5, skip=7, config=config)
    assert later["prompt"] == first["prompt"][7:] and later["rg_entry"] == first["rg_entry"][7:]
    with pytest.raises(ValueError, match="skip at least 0, got size=4, skip=-1"):
        reasoning_gym_dataset("train", size=4, skip=-1, config=config)


def test_an_exhausted_family_is_refused_with_its_count():
    questions = [f"q{i}" for i in range(40)]
    held_out = sum(hash_split(q) == "test" for q in questions)
    entries = _split_entries(lambda n: [{"question": questions[i % 40]} for i in range(n)], "test", held_out, "t")
    assert [e["question"] for e in entries] == [q for q in questions if hash_split(q) == "test"]
    with pytest.raises(ValueError, match=f"only {held_out} distinct test questions .* {held_out + 1} asked"):
        _split_entries(lambda n: [{"question": questions[i % 40]} for i in range(n)], "test", held_out + 1, "t")


def test_family_verifier_as_reward():
    rows = reasoning_gym_dataset("train", task="basic_arithmetic", size=2, seed=0)
    (reward,) = ReasoningGymScore().trl_ext_reward_functions(stage=None)
    right, wrong = rows[0]["answer"], str(int(rows[1]["answer"]) + 1)
    assert reward.fn(completions=[right + "\nmore", wrong, "anything"],
                     rg_entry=[rows[0]["rg_entry"], rows[1]["rg_entry"], None]) == [1.0, 0.0, None]


def test_each_family_scorer_is_built_once_per_reward(monkeypatch):
    """reasoning-gym builds a dataset object (spell_backward: its word list, 28 ms) on every get_score_answer_fn call;
    scoring a batch must not pay that per row."""
    import reasoning_gym

    built = []
    real = reasoning_gym.get_score_answer_fn
    monkeypatch.setattr(reasoning_gym, "get_score_answer_fn", lambda name: built.append(name) or real(name))
    sums = reasoning_gym_dataset("train", task="basic_arithmetic", size=3, seed=0)
    words = reasoning_gym_dataset("train", task="spell_backward", size=3, seed=0)
    (reward,) = ReasoningGymScore().trl_ext_reward_functions(stage=None)
    for _ in range(2):  # two batches
        scores = reward.fn(completions=[*sums["answer"], *words["answer"], "x"],
                           rg_entry=[*sums["rg_entry"], *words["rg_entry"], words["rg_entry"][0]])
        assert scores == [1.0] * 6 + [0.0]
    assert sorted(built) == ["basic_arithmetic", "spell_backward"]


def test_credit_full_takes_away_the_substring_credit_of_the_family_scorer():
    rows = reasoning_gym_dataset("train", task="basic_arithmetic", size=1, seed=0)
    answer, entry = rows[0]["answer"], rows[0]["rg_entry"]
    padded, repeated = answer + "2", answer + answer  # wrong answers that contain the right one
    completions = [answer, padded, repeated, str(int(answer) + 1)]
    (family,) = ReasoningGymScore().trl_ext_reward_functions(stage=None)
    # reasoning-gym's base scorer: len(answer) / len(completion) where the answer is a substring
    assert family.fn(completions=completions, rg_entry=[entry] * 4) == pytest.approx(
        [1.0, len(answer) / (len(answer) + 1), 0.5, 0.0])
    (full,) = ReasoningGymScore(ReasoningGymScore.Params(credit="full")).trl_ext_reward_functions(stage=None)
    assert full.fn(completions=completions, rg_entry=[entry] * 4) == [1.0, 0.0, 0.0, 0.0]


def test_mixture_with_an_arithmetic_environment(trl_ext_catalog, register_plugin, tmp_path):
    from trl_ext_plugins.rewards.exact_match import ExactMatch

    import trl_ext_plugins.rollout as rollout_family

    trl_ext_catalog.add_source(rollout_family, source="rollout")  # its plugins and embedded datasets
    register_plugin(ExactMatch)
    token = _CURRENT_RUN.set(RunContext(recipe=None, output_dir=tmp_path, catalog=trl_ext_catalog))
    try:
        arithmetic = {"source": "embedded:arithmetic", "params": {"format": "prompt", "size": 8}}
        envs = [{"name": "add", "rewards": ["exact_match"]},
                {"name": "legs", "rewards": ["reasoning_gym"],
                 "dataset": {"source": "embedded:reasoning_gym", "params": {"task": "leg_counting", "size": 8}}}]
        stage = StageSpec(trainer="grpo", model="m", dataset=arithmetic, args={"per_device_train_batch_size": 8,
                                                                               "num_generations": 4})
        plugin = MultiEnv(MultiEnv.Params(environments=envs))
        mixed = plugin.trl_ext_prepare_dataset(dataset=load_split(stage.dataset, trl_ext_catalog, stage, "train", None),
                                               split="train", stage=stage)
        assert sorted(mixed["env"][:2]) == ["add", "legs"] and len(mixed) == 16
        assert all((e == "legs") == (entry is not None) for e, entry in zip(mixed["env"], mixed["rg_entry"]))
        functions = {f.name: f.fn for f in plugin.trl_ext_reward_functions(stage=stage)}
        legs = [i for i, e in enumerate(mixed["env"]) if e == "legs"][0]
        columns = {c: mixed[c] for c in mixed.column_names if c != "prompt"}
        completions = ["0"] * len(mixed)
        completions[legs] = mixed["answer"][legs]
        scores = functions["legs/reasoning_gym"](prompts=mixed["prompt"], completions=completions, **columns)
        assert scores[legs] == 1.0 and all(s is None for i, s in enumerate(scores) if mixed["env"][i] == "add")
    finally:
        _CURRENT_RUN.reset(token)


def test_warm_up_mixture_of_the_family_and_arithmetic(trl_ext_catalog, tmp_path):
    """The SFT warm-up of configs/reasoning_gym.yaml: one dataset holding the family's rows and the addition rows,
    every row with its completion, the family's rows with their entry."""
    import trl_ext_plugins.rollout as rollout_family

    trl_ext_catalog.add_source(rollout_family, source="rollout")
    token = _CURRENT_RUN.set(RunContext(recipe=None, output_dir=tmp_path, catalog=trl_ext_catalog))
    try:
        family = {"source": "embedded:reasoning_gym",
                  "params": {"task": "basic_arithmetic", "size": 6, "format": "prompt_completion",
                             "config": {"min_terms": 2, "max_terms": 2, "max_digits": 2, "operators": ["+"]}}}
        sums = {"source": "embedded:arithmetic", "params": {"format": "prompt_completion"}, "limit": 3}
        stage = StageSpec(trainer="sft", model="m", dataset={"source": "embedded:mixture",
                                                             "params": {"parts": [family, sums]}})
        mixed = load_split(stage.dataset, trl_ext_catalog, stage, "train", None)
    finally:
        _CURRENT_RUN.reset(token)
    assert len(mixed) == 9 and all(mixed["completion"])
    assert sum(entry is not None for entry in mixed["rg_entry"]) == 6
    assert sorted(c for p, c in zip(mixed["prompt"], mixed["completion"]) if p.startswith("Calculate")) == \
        sorted(reasoning_gym_dataset("train", **family["params"])["completion"])


@pytest.mark.parametrize("config, said", [({"min_digits": 3, "max_digits": 1}, "max_digits must be >= min_digits"),
                                          ({"operators": [None]}, "unsupported operator: None")])
def test_a_config_the_family_refuses_is_a_validation_error(tmp_path, capsys, config, said):
    # reasoning-gym checks configs with assert: validation used to end in "AssertionError", exit 1.
    from trl_ext.cli import main

    recipe = tmp_path / "rg.yaml"
    recipe.write_text(json.dumps({"trainer": "sft", "model": "embedded:tiny-qwen2", "dataset": {
        "source": "embedded:reasoning_gym", "params": {"task": "basic_arithmetic", "size": 8, "config": config}}}))
    assert main(["validate", str(recipe)]) == 2
    err = capsys.readouterr().err
    assert "error: invalid recipe: stages[0].dataset.params: reasoning_gym task 'basic_arithmetic': config " in err
    assert said in err and "AssertionError" not in err
