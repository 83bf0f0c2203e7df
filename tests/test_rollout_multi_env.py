"""``multi_env`` (ALGORITHMS.md item 49): hand-computed mixture counts; every generation batch holds every environment
in its proportion; rewards are routed per environment and a crashing verifier costs only its own rows; per-environment
metrics are logged in a training step; an environment with no rows is refused at validation."""

from __future__ import annotations

import pytest
import torch

from trl_ext import Plugin, hookimpl
from trl_ext.errors import RecipeError
from trl_ext.recipe import StageSpec
from trl_ext.rewards import RewardFunction
from trl_ext.runner import RunContext, _CURRENT_RUN
from trl_ext.stage import resolve_stage
from trl_ext_plugins.rollout.control_math import batch_mixture_counts, interleave_environments, mixture_counts
from trl_ext_plugins.rollout.multi_env import MultiEnv, generation_batch_prompts
from trl_ext_plugins.rollout.pass_rate_filter import PassRateFilter
from trl_ext_plugins.rewards.exact_match import ExactMatch


def arithmetic(operations, size=None, split="train"):
    params = {"format": "prompt", "operations": operations, "max_operand": 10}
    if size is not None:
        params["size"] = size
    return {"source": "embedded:arithmetic", "split": split, "params": params}


ENVS = [
    {"name": "add", "weight": 2.0, "dataset": arithmetic("+", 30), "rewards": ["exact_match"]},
    {"name": "sub", "weight": 1.0, "dataset": arithmetic("-", 12), "rewards": ["exact_match"]},
    {"name": "mul", "weight": 1.0, "dataset": arithmetic("*", 7), "rewards": ["flaky"]},
]


def test_mixture_counts_by_hand():
    assert mixture_counts([0.5, 0.25, 0.25], 8) == [4, 2, 2]
    assert mixture_counts([1, 1, 1], 8) == [3, 3, 2]  # 2.67 each: the two earliest remainders get the extra prompts
    assert mixture_counts([2, 1], 4) == [3, 1]  # 2.67 / 1.33 -> 2 + 1 by the larger remainder, 1
    assert generation_batch_prompts({"per_device_train_batch_size": 16, "num_generations": 4}, 1) == 4
    assert generation_batch_prompts({}, 1) == 1  # GRPOConfig: 8 rows per device, 8 generations per prompt
    assert generation_batch_prompts({}, 1, "rloo") == 4  # RLOOConfig draws 2 generations per prompt
    assert generation_batch_prompts({"per_device_train_batch_size": 16}, 1, "rloo") == 8
    assert generation_batch_prompts({"per_device_train_batch_size": 8, "num_generations": 4,
                                     "gradient_accumulation_steps": 2}, 2) == 8


def test_every_batch_has_every_environment_in_proportion_and_all_rows_appear():
    order = interleave_environments([30, 12, 7], [2, 1, 1], batch_prompts=4, num_batches=15, seed=0)
    for start in range(0, len(order), 4):
        envs = sorted(e for e, _ in order[start:start + 4])
        assert envs == [0, 0, 1, 2]
    assert {r for e, r in order if e == 0} == set(range(30))  # 15 batches x 2 = 30 add rows: each exactly once
    assert {r for e, r in order if e == 2} == set(range(7))  # mul rows recycled after 7


@pytest.mark.parametrize("weights, batch_prompts", [([0.7, 0.3], 2), ([1, 1, 1], 4), ([0.6, 0.25, 0.15], 8),
                                                     ([0.95, 0.05], 4)])
def test_the_runs_share_is_the_weights_share_when_a_batch_cannot_hold_it_exactly(weights, batch_prompts):
    """Rounding every batch alike kept one bias for the whole run: [0.7, 0.3] in batches of 2 trained 50/50, [1, 1, 1]
    in batches of 4 trained 50/25/25. Carried over, each environment's running count stays within one prompt of
    sum_b w_e / sum w * batch_prompts, and each batch within one prompt of its share."""
    batches = batch_mixture_counts(weights, batch_prompts, 200)
    share = [w / sum(weights) * batch_prompts for w in weights]
    assert batches[0] == mixture_counts(weights, batch_prompts)
    running = [0] * len(weights)
    for b, counts in enumerate(batches):
        assert sum(counts) == batch_prompts and all(abs(c - s) < 1 for c, s in zip(counts, share))
        running = [r + c for r, c in zip(running, counts)]
        assert all(abs(r - (b + 1) * s) < 1 for r, s in zip(running, share)), (b, running)
    assert [r / (200 * batch_prompts) for r in running] == pytest.approx([w / sum(weights) for w in weights],
                                                                         abs=1 / 200)
    order = interleave_environments([10] * len(weights), weights, batch_prompts, 200, seed=0)
    assert [sum(e == i for e, _ in order) for i in range(len(weights))] == running


class Flaky(Plugin):
    """Test verifier: exact match, but it raises on any batch holding the prompt "3*3=" (one bad row)."""

    name = "flaky"
    family = "reward"

    @hookimpl
    def trl_ext_reward_functions(self, stage):
        def flaky(completions, prompts, answer, **kwargs):
            if "3*3=" in prompts:
                raise RuntimeError("verifier crashed")
            return [float(c.strip() == a) for c, a in zip(completions, answer, strict=True)]

        return [RewardFunction(self.name, flaky)]


class AsyncVerifier(Plugin):
    """Test verifier written as ``async def`` (TRL awaits those; so must the routing)."""

    name = "async_verifier"
    family = "reward"

    @hookimpl
    def trl_ext_reward_functions(self, stage):
        async def async_verifier(completions, answer, **kwargs):
            return [float(c.strip() == a) for c, a in zip(completions, answer, strict=True)]

        return [RewardFunction(self.name, async_verifier)]


@pytest.fixture
def catalog(trl_ext_catalog, register_plugin, tmp_path):
    register_plugin(MultiEnv)
    register_plugin(ExactMatch)
    register_plugin(Flaky)
    register_plugin(AsyncVerifier)
    register_plugin(PassRateFilter)
    token = _CURRENT_RUN.set(RunContext(recipe=None, output_dir=tmp_path / "run", catalog=trl_ext_catalog))
    try:
        yield trl_ext_catalog
    finally:
        _CURRENT_RUN.reset(token)


def _stage(envs=ENVS, **args):
    return StageSpec(trainer="grpo", model="m", dataset=arithmetic("+", 30),
                     plugins=[{"multi_env": {"environments": envs}}, "exact_match"],
                     args={"per_device_train_batch_size": 16, "num_generations": 4, **args})


def test_prepared_train_split_mixes_environments_per_generation_batch(catalog):
    stage = _stage()
    plugin = MultiEnv(MultiEnv.Params(environments=ENVS))
    from trl_ext.runner import load_split

    base = load_split(stage.dataset, catalog, stage, "train", None)
    mixed = plugin.trl_ext_prepare_dataset(dataset=base, split="train", stage=stage)
    assert plugin.mixture_counts == [2, 1, 1]
    envs = mixed["env"]
    assert len(envs) % 4 == 0
    for start in range(0, len(envs), 4):
        block = envs[start:start + 4]
        assert sorted(block) == ["add", "add", "mul", "sub"]
    assert set(mixed["prompt"][i] for i, e in enumerate(envs) if e == "mul") <= {f"{a}*{b}=" for a in range(10)
                                                                                   for b in range(10)}
    assert plugin.trl_ext_prepare_dataset(dataset=base, split="eval", stage=stage) is None
    assert resolve_stage(stage, 0, catalog).args["shuffle_dataset"] is False


def test_rewards_are_routed_and_a_crashing_verifier_costs_only_its_rows(catalog):
    plugin = MultiEnv(MultiEnv.Params(environments=ENVS))
    functions = {f.name: f.fn for f in plugin.trl_ext_reward_functions(stage=_stage())}
    assert sorted(functions) == ["add/exact_match", "mul/flaky", "sub/exact_match"]
    rows = {"prompts": ["1+2=", "3*3=", "2*2=", "5-1=", "3*1="],
            "completions": ["3", "9", "4", "7", "0"],
            "answer": ["3", "9", "4", "4", "3"],
            "env": ["add", "mul", "mul", "sub", "mul"]}
    assert functions["add/exact_match"](**rows) == [1.0, None, None, None, None]
    assert functions["sub/exact_match"](**rows) == [None, None, None, 0.0, None]
    # the mul verifier raises on the batch; row by row only "3*3=" fails: it gets None, the others their reward
    assert functions["mul/flaky"](**rows) == [None, None, 1.0, None, 0.0]
    assert plugin.verifier_errors == {"add": 0, "sub": 0, "mul": 1}

    from trl_ext.batches import RolloutBatch

    totals = torch.tensor([1.0, float("nan"), 1.0, 0.0, 0.0])
    batch = RolloutBatch(rewards_per_func=totals.unsqueeze(1), reward_names=["x"], reward_weights=torch.ones(1),
                         num_generations=1, process_slice=slice(0, 5), completion_ids=torch.zeros(5, 1),
                         completion_mask=torch.ones(5, 1), completion_lengths=torch.ones(5), prompts=rows["prompts"],
                         completions=rows["completions"], inputs=[{"env": e} for e in rows["env"]])
    keep = plugin.trl_ext_filter_groups(rewards=totals, batch=batch)
    assert keep.tolist() == [True, False, True, True, True]  # only the crashed row leaves the loss
    assert batch.metrics["multi_env/mul/share"] == pytest.approx(0.6)
    assert batch.metrics["multi_env/mul/reward"] == pytest.approx(0.5)  # (1 + 0) / 2 scored rows
    assert batch.metrics["multi_env/add/reward"] == 1.0 and batch.metrics["multi_env/mul/verifier_errors"] == 1.0


def test_an_async_verifier_is_awaited_for_its_rows(catalog):
    """An async verifier's coroutine was zipped as if it were the rewards: the batch call failed, the row-by-row
    retry failed the same way, and every row of the environment was silently left unscored (None)."""
    envs = [{"name": "add", "dataset": arithmetic("+", 30), "rewards": ["exact_match"]},
            {"name": "mul", "dataset": arithmetic("*", 7), "rewards": ["async_verifier"]}]
    plugin = MultiEnv(MultiEnv.Params(environments=envs))
    functions = {f.name: f.fn for f in plugin.trl_ext_reward_functions(stage=_stage(envs))}
    rows = {"prompts": ["1+2=", "3*3=", "2*2="], "completions": ["3", "9", "5"], "answer": ["3", "9", "4"],
            "env": ["add", "mul", "mul"]}
    assert functions["mul/async_verifier"](**rows) == [None, 1.0, 0.0]
    assert plugin.verifier_errors["mul"] == 0


@pytest.mark.parametrize("envs, message", [
    ([{"name": "empty", "dataset": arithmetic("+", 0), "rewards": ["exact_match"]}],
     "environments[0] ('empty').dataset: the environment has no rows"),
    ([{"name": "a", "rewards": ["nope"]}], "environments[0] ('a').rewards[0]: plugins: unknown plugin 'nope'"),
    ([{"name": "a", "rewards": ["pass_rate_filter"]}], "plugin 'pass_rate_filter' is not a reward plugin"),
    ([{"name": "a", "rewards": [{"exact_match": {"weight": "x"}}]}], "rewards[0]: params.weight"),
    ([{"name": "a", "rewards": ["exact_match"]}, {"name": "a", "rewards": ["exact_match"]}], "repeated: a"),
    ([{"name": "a", "rewards": []}], "rewards"),
])
def test_bad_environments_are_refused_at_validation(catalog, envs, message):
    with pytest.raises(RecipeError) as err:
        resolve_stage(_stage(envs), 0, catalog)
    assert message in str(err.value) and "multi_env" in str(err.value)


def test_training_step_logs_per_environment_metrics(tiny_trainer, catalog):
    envs = [{"name": "add", "dataset": arithmetic("+", 16), "rewards": ["exact_match"]},
            {"name": "mul", "dataset": arithmetic("*", 16), "rewards": ["flaky"]}]
    plugin = MultiEnv(MultiEnv.Params(environments=envs))
    stage = _stage(envs, per_device_train_batch_size=8, num_generations=4)
    from trl_ext.runner import load_split

    data = plugin.trl_ext_prepare_dataset(dataset=load_split(stage.dataset, catalog, stage, "train", None),
                                          split="train", stage=stage)
    trainer = tiny_trainer("grpo", plugins=[plugin], dataset=data, args={"max_steps": 2, "shuffle_dataset": False})
    assert set(plugin.before) == set()  # no eval_dataset: nothing evaluated
    trainer.train()
    logged = {k for row in trainer.state.log_history for k in row}
    assert {"multi_env/add/share", "multi_env/mul/share", "multi_env/add/verifier_errors",
            "rewards/add/exact_match/mean", "rewards/mul/flaky/mean"} <= logged
    shares = [row["multi_env/add/share"] for row in trainer.state.log_history if "multi_env/add/share" in row]
    assert shares and all(s == 0.5 for s in shares)


def test_sampled_heldout_score_per_environment_is_the_mean_over_k_seeded_draws(tiny_trainer, catalog):
    """``eval_mean_at_k``: each text environment's held-out score also holds the mean over k sampled answers per
    prompt (k x n completions scored), drawn from a forked RNG seeded by the stage's seed, so the trainer's RNG stream
    is untouched (unseeded sampling would advance it). ``eval_temperature`` alone is refused at validation."""
    envs = [{"name": "add", "dataset": arithmetic("+", 16), "eval_dataset": arithmetic("+", 6, split="test"),
             "rewards": ["exact_match"]},
            {"name": "sub", "dataset": arithmetic("-", 16), "eval_dataset": arithmetic("-", 5, split="test"),
             "rewards": ["exact_match"]}]
    plugin = MultiEnv(MultiEnv.Params(environments=envs, eval_mean_at_k=3, eval_temperature=1.5))
    trainer = tiny_trainer("grpo", plugins=[plugin], args={"max_steps": 1})
    assert {env: plugin.before[env]["sampled_n"] for env in plugin.before} == {"add": 18, "sub": 15}
    assert {env: plugin.before[env]["n"] for env in plugin.before} == {"add": 6, "sub": 5}  # greedy as before
    state = torch.get_rng_state()
    again = plugin.evaluate(trainer)
    assert torch.equal(torch.get_rng_state(), state)
    assert all(0.0 <= again[env]["sampled_accuracy"] <= 1.0 for env in again)
    greedy_only = MultiEnv(MultiEnv.Params(environments=envs))
    assert "sampled_n" not in greedy_only.evaluate(trainer)["add"]

    stage = StageSpec(trainer="grpo", model="m", dataset=arithmetic("+", 30),
                      plugins=[{"multi_env": {"environments": envs, "eval_temperature": 0.7}}],
                      args={"per_device_train_batch_size": 16, "num_generations": 4})
    with pytest.raises(RecipeError) as err:
        resolve_stage(stage, 0, catalog)
    assert "eval_temperature is the sampling temperature of eval_mean_at_k; set eval_mean_at_k" in str(err.value)
    assert "Value error" not in str(err.value)


@pytest.mark.slow
def test_recipe_run_writes_per_environment_metrics_plot_and_heldout(tmp_path):
    """Through the runner: per-environment rewards in metrics.jsonl, the per-environment plot, and held-out scores
    before and after for every environment."""
    import json

    from trl_ext.catalog import Catalog
    from trl_ext.recipe import parse_recipe
    from trl_ext.runner import run_recipe

    def env(name, op):
        return {"name": name, "dataset": arithmetic(op, 32),
                "eval_dataset": arithmetic(op, 16, split="test"), "rewards": ["exact_match"]}

    recipe = parse_recipe({
        "seed": 0, "trainer": "grpo", "model": "embedded:tiny-qwen2", "dataset": arithmetic("+", 32),
        "plugins": [{"multi_env": {"environments": [env("add", "+"), env("mul", "*")]}}],
        "args": {"max_steps": 3, "per_device_train_batch_size": 8, "num_generations": 4, "max_completion_length": 4,
                 "logging_steps": 1, "save_strategy": "no", "gradient_checkpointing": False},
    })
    summary = run_recipe(recipe, tmp_path / "run", Catalog.discover(), echo=lambda m: None)
    stage_dir = tmp_path / "run" / "main"
    rows = [json.loads(line) for line in (stage_dir / "metrics.jsonl").read_text().splitlines()]
    keys = {k for r in rows for k in r}
    assert {"rewards/add/exact_match/mean", "rewards/mul/exact_match/mean", "multi_env/add/share",
            "multi_env/mul/share"} <= keys
    assert all(r["multi_env/add/share"] == 0.5 for r in rows if "multi_env/add/share" in r)
    evaluation = json.loads((stage_dir / "multi_env_eval.json").read_text())
    assert set(evaluation) == {"add", "mul"}
    assert all(evaluation[e]["before"]["n"] == 16 and evaluation[e]["after"]["n"] == 16 for e in evaluation)
    assert (stage_dir / "multi_env.png").stat().st_size > 0
    assert summary["stages"]["main"]["multi_env_eval"] == evaluation


def _mixture(parts, split="train", seed=0):
    return {"source": "embedded:mixture", "split": split, "params": {"parts": parts, "seed": seed}}


def test_mixture_holds_every_part_row_once_in_a_seeded_order(catalog):
    """``embedded:mixture`` (an SFT warm-up on every environment): each part's rows exactly once, its ``limit`` obeyed,
    columns the union (``None`` where a part lacks one), the order a shuffle fixed by the seed."""
    import trl_ext_plugins.rollout as rollout_family
    from trl_ext.runner import load_split

    catalog.add_source(rollout_family, source="rollout")
    sums_part = {"source": "embedded:arithmetic", "params": arithmetic("+", 12)["params"], "limit": 5}  # no split
    parts = [sums_part,
             {"source": "embedded:arithmetic_proposals", "params": {"format": "prompt_completion", "size": 4}}]
    stage = StageSpec(trainer="sft", model="m", dataset=_mixture(parts))
    mixed = load_split(stage.dataset, catalog, stage, "train", None)
    sums = load_split(StageSpec(trainer="sft", model="m", dataset=sums_part).dataset, catalog, stage, "train", None)
    assert len(mixed) == 9 and set(mixed.column_names) == {"prompt", "answer", "completion"}
    assert sorted(p for p, c in zip(mixed["prompt"], mixed["completion"]) if c is None) == sorted(sums["prompt"])
    assert all((a is None) == (c is not None) for a, c in zip(mixed["answer"], mixed["completion"]))
    again = load_split(stage.dataset, catalog, stage, "train", None)
    reseeded = load_split(StageSpec(trainer="sft", model="m", dataset=_mixture(parts, seed=1)).dataset, catalog,
                          stage, "train", None)
    assert again["prompt"] == mixed["prompt"] and sorted(reseeded["prompt"]) == sorted(mixed["prompt"])
    assert reseeded["prompt"] != mixed["prompt"]
    held_out = load_split(StageSpec(trainer="sft", model="m", dataset=_mixture(parts[:1], split="test")).dataset,
                          catalog, stage, "train", None)  # a part without its own split takes the mixture's
    test_sums = load_split(StageSpec(trainer="sft", model="m", dataset=sums_part | {"split": "test"}).dataset,
                           catalog, stage, "train", None)
    assert sorted(held_out["prompt"]) == sorted(test_sums["prompt"])


@pytest.mark.parametrize("parts, message", [
    ([], "mixture: give its datasets as a list"),
    ({"source": "embedded:arithmetic"}, "mixture: give its datasets as a list, parts: [{source: ..., params: ...}, "
                                        "...]; got {'source': 'embedded:arithmetic'}"),
    (["embedded:arithmetic"], "mixture parts[0]: a dataset mapping"),
    ([{"source": "embedded:arithmetc"}], "mixture parts[0].source: no embedded dataset 'arithmetc'. Did you mean: "
                                         "arithmetic"),
    ([{"sorce": "embedded:arithmetic"}], "parts[0].sorce: Extra inputs are not permitted"),
    ([{"source": "embedded:arithmetic", "params": {"max_operand": 0}}], "mixture parts[0] (embedded:arithmetic): "),
    ([arithmetic("+", 0)], "mixture parts[0] (embedded:arithmetic): no rows in split 'train'"),
    ([{"source": "./no_such_rows.jsonl"}], "mixture parts[0].source: no such file or folder './no_such_rows.jsonl'"),
])
def test_bad_mixture_is_refused_at_validation_naming_the_part(catalog, parts, message):
    import trl_ext_plugins.rollout as rollout_family

    catalog.add_source(rollout_family, source="rollout")
    stage = StageSpec(trainer="sft", model="m", dataset=_mixture(parts), plugins=[])
    with pytest.raises(RecipeError) as err:
        resolve_stage(stage, 0, catalog)
    assert "stages[0].dataset.params: " in str(err.value) and message in str(err.value)


def test_a_reward_reading_a_column_only_other_environments_have_is_an_error(catalog, tmp_path):
    """The mixture fills the columns of other environments with None: exact_match read the missing ``answer`` of the
    ``qa`` environment (gold in ``solution``) as "None" and scored every right answer 0.0, silently."""
    import json

    path = tmp_path / "qa.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"{i}+1=", "solution": str(i + 1)}) + "\n" for i in range(8)))
    envs = [{"name": "add", "dataset": arithmetic("+", 8), "rewards": ["exact_match"]},
            {"name": "qa", "dataset": str(path), "rewards": [{"exact_match": {"answer_column": "solution"}}]},
            {"name": "bad", "dataset": str(path), "rewards": ["exact_match"]}]
    stage = _stage(envs, per_device_train_batch_size=12, num_generations=4)
    plugin = MultiEnv(MultiEnv.Params(environments=envs))
    from trl_ext.runner import load_split

    mixed = plugin.trl_ext_prepare_dataset(dataset=load_split(stage.dataset, catalog, stage, "train", None),
                                           split="train", stage=stage)
    functions = {f.name: f.fn for f in plugin.trl_ext_reward_functions(stage=stage)}
    rows = mixed[:3]
    gold = [s if e != "add" else a for e, s, a in zip(rows["env"], rows["solution"], rows["answer"], strict=True)]
    columns = {k: v for k, v in rows.items() if k != "prompt"}
    assert sorted(rows["env"]) == ["add", "bad", "qa"]
    assert functions["add/exact_match"](prompts=rows["prompt"], completions=gold, **columns).count(1.0) == 1
    assert functions["qa/exact_match"](prompts=rows["prompt"], completions=gold, **columns).count(1.0) == 1
    with pytest.raises(ValueError, match="environment 'bad' reads the column 'answer'"):
        functions["bad/exact_match"](prompts=rows["prompt"], completions=gold, **columns)
    assert plugin.verifier_errors == {"add": 0, "qa": 0, "bad": 0}
