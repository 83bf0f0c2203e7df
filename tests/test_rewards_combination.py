"""How several reward functions combine: TRL's calling convention (sync or async), and the weighted sum used for
held-out evaluation against TRL's GRPO convention (None -> NaN, nansum)."""

import math

import pytest
import torch

from trl_ext.rewards import RewardFunction, weighted_reward


async def _async_half(completions, **kwargs):
    return [0.5] * len(completions)


def test_async_reward_stays_async_for_trl():
    """TRL awaits a reward function only when ``is_async_callable`` says so; the named wrapper must keep that."""
    from trl.trainer.utils import is_async_callable

    call = RewardFunction("judge", _async_half, 2.0).as_trl_callable()
    assert call.__name__ == "judge"
    assert is_async_callable(call)
    import asyncio

    assert asyncio.run(call(prompts=["p"], completions=["a", "b"])) == [0.5, 0.5]
    sync = RewardFunction("plain", lambda completions, **kw: [1.0] * len(completions)).as_trl_callable()
    assert not is_async_callable(sync) and sync(completions=["a"]) == [1.0]


def test_async_python_reward_in_a_grpo_step(tiny_trainer, tmp_path):
    """An ``async def`` user reward (TRL supports them) through ``python_reward``: one GRPO step scores with it."""
    from trl_ext_plugins.rewards.python_reward import PythonReward, PythonRewardParams

    path = tmp_path / "async_rewards.py"
    path.write_text("CALLS = []\n\nasync def judged(completions, **kwargs):\n    CALLS.append(len(completions))\n"
                    "    return [float(len(c) % 2) for c in completions]\n")
    plugin = PythonReward(PythonRewardParams(functions=[f"{path}:judged"]))
    trainer = tiny_trainer("grpo", plugins=[plugin], args={"max_steps": 1})
    trainer.train()
    logged = [row for row in trainer.state.log_history if "rewards/judged/mean" in row]
    assert logged and math.isfinite(logged[0]["rewards/judged/mean"])


def test_weighted_reward_matches_trl_nansum():
    """None and NaN from one function contribute 0 to the row, as TRL's ``nansum`` of ``rewards_per_func * w``."""
    rows = {"a": [float("nan"), 1.0, None], "b": [1.0, None, None], "c": [0.25, 0.5, 0.75]}
    weights = {"a": 2.0, "b": 3.0, "c": -1.0}
    functions = [RewardFunction(k, (lambda v: lambda completions, **kw: list(v))(v), weights[k]) for k, v in rows.items()]
    total = weighted_reward(functions)(completions=["x", "y", "z"])
    per_func = torch.tensor([[math.nan if x is None else x for x in v] for v in rows.values()]).T
    trl = (per_func * torch.tensor(list(weights.values())).unsqueeze(0)).nansum(dim=1)
    assert total == pytest.approx(trl.tolist())
    assert total == pytest.approx([3.0 - 0.25, 2.0 - 0.5, -0.75])


def test_weighted_reward_awaits_async_and_refuses_wrong_lengths():
    assert weighted_reward([RewardFunction("j", _async_half, 2.0)])(completions=["a", "b"]) == [1.0, 1.0]
    short = RewardFunction("short", lambda completions, **kw: [1.0])
    with pytest.raises(ValueError, match="'short' returned 1 rewards for 2 completions"):
        weighted_reward([short])(completions=["a", "b"])
    long = RewardFunction("long", lambda completions, **kw: [1.0, 1.0, 1.0])
    with pytest.raises(ValueError, match="'long' returned 3 rewards for 2 completions"):
        weighted_reward([long])(completions=["a", "b"])


def test_reward_function_names_must_differ(tmp_path):
    """TRL keys reward columns and metrics by name (and length_shaping finds its correctness column by name): two
    ``python_reward`` files that both define ``reward`` are refused, naming the clash."""
    from trl_ext.host import PluginHost
    from trl_ext.rewards import collect_reward_functions
    from trl_ext_plugins.rewards.python_reward import PythonReward, PythonRewardParams
    from trl_ext_plugins.rewards.verify_math import MathVerify

    for name, value in (("a", 1.0), ("b", 0.0)):
        (tmp_path / f"{name}.py").write_text(f"def reward(completions, **kw):\n    return [{value}] * len(completions)\n")
    # within one python_reward, the clash is a parameter error, found at validation before anything loads
    with pytest.raises(ValueError, match="are both named 'reward'"):
        PythonRewardParams(functions=[f"{tmp_path / 'a.py'}:reward", f"{tmp_path / 'b.py'}:reward"])
    clash = [PythonReward(PythonRewardParams(functions=[f"{tmp_path / name}.py:reward"])) for name in ("a", "b")]
    with pytest.raises(ValueError, match="two reward functions are named 'reward'"):
        collect_reward_functions(PluginHost(clash), None)
    (tmp_path / "c.py").write_text("def math_verify(completions, **kw):\n    return [1.0] * len(completions)\n")
    shadow = PythonReward(PythonRewardParams(functions=[f"{tmp_path / 'c.py'}:math_verify"]))
    with pytest.raises(ValueError, match="'math_verify' .*'math_verify' and 'python_reward'|'python_reward' and 'math"):
        collect_reward_functions(PluginHost([MathVerify(), shadow]), None)
    fine = PythonReward(PythonRewardParams(functions=[f"{tmp_path / 'a.py'}:reward"]))
    assert [f.name for f in collect_reward_functions(PluginHost([MathVerify(), fine]), None)] == ["math_verify",
                                                                                                   "reward"]


def test_held_out_evaluation_calls_a_trl_signature_reward_as_training_does(tmp_path):
    """A user reward that names TRL's keywords (completion_ids, trainer_state, log_metric) scores training and the
    held-out split alike: the evaluation used to pass none of them, so the stage failed after training with a
    TypeError."""
    import json

    from trl_ext.catalog import Catalog
    from trl_ext.recipe import parse_recipe
    from trl_ext.runner import run_recipe

    path = tmp_path / "trl_signature.py"
    path.write_text("def lengths(prompts, completions, completion_ids, trainer_state, log_metric, **kwargs):\n"
                    "    log_metric('lengths/seen', 1.0)\n"
                    "    return [float(len(ids) == 1) + 0.0 * trainer_state.global_step for ids in completion_ids]\n")
    reward = {"python_reward": {"functions": [f"{path}:lengths"]}}
    recipe = parse_recipe({"seed": 0, "stages": [{
        "name": "grpo", "trainer": "grpo", "model": "embedded:tiny-qwen2", "plugins": ["grpo", reward],
        "dataset": {"source": "embedded:arithmetic", "params": {"format": "prompt"}},
        "evaluation": {"dataset": {"source": "embedded:arithmetic", "split": "test", "params": {"format": "prompt"}},
                       "reward": {"name": "python_reward", "params": reward["python_reward"]}, "limit": 8},
        "args": {"max_steps": 1, "per_device_train_batch_size": 4, "num_generations": 2, "max_completion_length": 4,
                 "gradient_checkpointing": False}}]})
    info = run_recipe(recipe, tmp_path / "run", Catalog.discover(), echo=lambda _m: None)
    assert info["status"] == "complete"
    ev = json.loads((tmp_path / "run" / "grpo" / "eval.json").read_text())
    assert ev["before"]["n"] == ev["after"]["n"] == 8
