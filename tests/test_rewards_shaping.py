"""length_shaping: each mode against ALGORITHMS.md item 17 numbers, column filling, and a GRPO run."""

import math

import pytest
import torch

from trl_ext.testing import check_plugin_conformance
from trl_ext_plugins.rewards import formulas
from trl_ext_plugins.rewards.length_shaping import LengthShaping, LengthShapingParams, shape_length_column
from trl_ext_plugins.rewards.verify_math import MathVerify

T = lambda *v: torch.tensor(v, dtype=torch.float64)  # noqa: E731


def test_kimi_numbers():
    # lens [100, 200, 300] all correct -> [0.5, 0, -0.5]
    got = formulas.kimi_length_reward(T(100, 200, 300), torch.tensor([1, 1, 1]), 3)
    assert got.tolist() == pytest.approx([0.5, 0.0, -0.5])
    # wrong: len 100 -> min(0, 0.5) = 0, len 300 -> -0.5
    got = formulas.kimi_length_reward(T(100, 200, 300), torch.tensor([0, 1, 0]), 3)
    assert got.tolist() == pytest.approx([0.0, 0.0, -0.5])
    # groups are independent; a single-length group gets 0 (no NaN)
    got = formulas.kimi_length_reward(T(100, 200, 300, 50, 50, 50), torch.ones(6), 3)
    assert got.tolist() == pytest.approx([0.5, 0.0, -0.5, 0.0, 0.0, 0.0])


def test_dapo_numbers():
    got = formulas.dapo_overlong_penalty(T(16000, 16384, 18432, 20480, 21000), 20480, 4096)
    assert got.tolist() == pytest.approx([0.0, 0.0, -0.5, -1.0, -1.0])


def test_overlong_buffer_settings_that_give_inf_or_nan_are_refused():
    """L_cache 0 uncapped is a slope of 1/0 (-inf beyond L_max), a buffer longer than L_max starts the penalty below
    0 tokens, and L_max 0 divides the cosine by 0; the capped L_cache 0 is TRL's hard -1 and stays allowed."""
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="slope 1/0"):
        LengthShapingParams(mode="dapo", max_length=20, cache_length=0, overlong_cap=False)
    with pytest.raises(ValidationError, match="must not exceed max_length"):
        LengthShapingParams(mode="dapo", max_length=20, cache_length=30)
    with pytest.raises(ValidationError, match="greater than 0"):
        LengthShapingParams(mode="cosine", max_length=0, cache_length=0)
    with pytest.raises(ValidationError, match="greater than or equal to 0"):
        LengthShapingParams(mode="dapo", cache_length=-1)
    p = LengthShapingParams(mode="dapo", max_length=20, cache_length=0)
    got = formulas.dapo_overlong_penalty(T(0, 20, 21), p.max_length, p.cache_length, p.overlong_cap)
    assert got.tolist() == [0.0, 0.0, -1.0]  # TRL get_soft_overlong_punishment(20, 0): 0, 0, -1
    assert LengthShapingParams(mode="cosine", max_length=1000).cache_length == 4096  # unused outside dapo


def test_cosine_numbers():
    lmax = 1000
    got = formulas.cosine_length_reward(T(0, 500, 500, 1000, 1001), torch.tensor([1, 1, 0, 1, 1]), lmax)
    assert got.tolist() == pytest.approx([2.0, 1.5, -5.0, 1.0, -10.0])
    # independent formula at an arbitrary length (wrong sample, L=250)
    expected = 0 + 0.5 * (-10 - 0) * (1 + math.cos(math.pi * 250 / lmax))
    assert formulas.cosine_length_reward(T(250), torch.tensor([0]), lmax).item() == pytest.approx(expected)


def test_budget_and_l1_numbers():
    got = formulas.budget_reward(T(100, 151, 150), T(1.0, 1.0, 0.0), T(100, 100, 100), tau=1.5)
    assert got.tolist() == [1.0, -1.0, 0.0]
    assert formulas.l1_exact_reward(T(2000), torch.tensor([1]), T(1000), 3e-4).item() == pytest.approx(0.7)
    # L1-Max: 1 * clip(3e-4 * (1000 - 2000) + 0.5, 0, 1) = clip(0.2) ; over-long by 5000 -> 0
    got = formulas.l1_max_reward(T(2000, 6000), torch.tensor([1, 1]), T(1000, 1000), 3e-4, 0.5)
    assert got.tolist() == pytest.approx([0.2, 0.0])


NAMES = ["math_verify", "length_shaping"]


def _shape(mode, correct, lengths, weights=(1.0, 1.0), column=None, group=3, **kw):
    rewards = torch.tensor([[c, 0.0] for c in correct], dtype=torch.float32)
    params = LengthShapingParams(mode=mode, **kw)
    col = (lambda: torch.tensor(column, dtype=torch.float64)) if column is not None else (lambda: 1 / 0)
    return shape_length_column(rewards, NAMES, torch.tensor(weights), "length_shaping",
                               torch.tensor(lengths), group, params, col)


def test_additive_mode_fills_own_column_and_keeps_correctness():
    out = _shape("kimi", [1.0, 1.0, 1.0], [100, 200, 300])
    assert out[:, 0].tolist() == [1.0, 1.0, 1.0]
    assert out[:, 1].tolist() == pytest.approx([0.5, 0.0, -0.5])


def test_replacing_mode_total_equals_formula_for_any_weights():
    # cosine replaces correctness: weighted total must equal R(L) whatever the two weights are
    weights = (2.0, 0.5)
    out = _shape("cosine", [1.0, 0.0, float("nan")], [0, 500, 500], weights=weights, max_length=1000)
    total = (out.double() * torch.tensor(weights, dtype=torch.float64)).nansum(dim=1)
    assert total.tolist() == pytest.approx([2.0, -5.0, -5.0], abs=1e-5)  # NaN correctness counts as wrong
    assert out[:2, 0].tolist() == [1.0, 0.0]  # correctness column left as scored
    # budget: beyond tau*b0 the total is -1, otherwise the task reward is unchanged
    out = _shape("budget", [1.0, 1.0, 0.0], [100, 200, 300], column=[150, 150, 150], tau=1.0)
    total = out.double().nansum(dim=1)
    assert total.tolist() == pytest.approx([1.0, -1.0, -1.0])


def test_missing_correctness_column_is_a_clear_error():
    with pytest.raises(ValueError, match="correctness_reward 'nope'"):
        _shape("kimi", [1.0, 1.0, 1.0], [1, 2, 3], correctness_reward="nope")


def test_conformance_and_zero_weight_refused():
    check_plugin_conformance(LengthShaping)
    assert LengthShaping(LengthShapingParams(weight=0.0)).trl_ext_validate_stage(None, [])


class RecordingShaping(LengthShaping):
    """length_shaping that keeps what each shaping call saw and returned: (before, after, lengths, batch)."""

    def __init__(self, params):
        super().__init__(params)
        self.seen = []

    def trl_ext_shape_rewards(self, rewards_per_func, batch):
        out = super().trl_ext_shape_rewards(rewards_per_func, batch)
        self.seen.append((rewards_per_func.clone(), out.clone(), batch.completion_lengths.clone(), batch))
        return out


RecordingShaping.trl_ext_shape_rewards.trl_ext_impl = LengthShaping.trl_ext_shape_rewards.trl_ext_impl


def _one_grpo_step(tiny_trainer, params):
    spy = RecordingShaping(params)
    tiny_trainer("grpo", plugins=[MathVerify(), spy],
                 args={"max_steps": 1, "max_completion_length": 6, "temperature": 1.0}).train()
    assert spy.seen
    return spy.seen[0]


def test_grpo_math_verify_plus_kimi_end_to_end(tiny_trainer):
    """GRPO on the tiny model with math_verify + length_shaping(kimi): the shaped column reaches the trainer."""
    before, after, lengths, batch = _one_grpo_step(tiny_trainer, LengthShapingParams(mode="kimi"))
    names = batch.reward_names
    assert names == ["math_verify", "length_shaping"]
    assert torch.equal(before[:, 0].nan_to_num(-7), after[:, 0].nan_to_num(-7))
    expected = formulas.kimi_length_reward(lengths, before[:, 0].nan_to_num(0) > 0.5, 4)
    assert after[:, 1].double().tolist() == pytest.approx(expected.tolist(), abs=1e-6)


def test_cosine_truncated_rule_in_a_grpo_step(tiny_trainer):
    """cosine_beyond_max: truncated in training: a completion that fills max_completion_length totals cosine_exceed,
    the others the cosine of their length (L_max = the budget, 6 tokens)."""
    params = LengthShapingParams(mode="cosine", max_length=6, cosine_beyond_max="truncated")
    before, after, lengths, batch = _one_grpo_step(tiny_trainer, params)
    weights = batch.reward_weights
    total = (after.double().nan_to_num(0) * weights.double()).sum(1)
    cosine = formulas.cosine_length_reward(lengths, before[:, 0].nan_to_num(0) > 0.5, 6)
    cut = lengths >= 6
    assert cut.any()  # the untrained model runs into the budget
    assert total.tolist() == pytest.approx(torch.where(cut, -10.0, cosine).tolist(), abs=1e-5)
