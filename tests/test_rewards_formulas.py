"""Pure formulas shared by the (not yet written) reward_model / prm / checklist / self_judge plugins."""

import math

import pytest
import torch

from trl_ext_plugins.rewards import formulas


def test_bradley_terry_numbers():
    loss = formulas.bradley_terry_loss(torch.tensor([2.0, 1.3], dtype=torch.float64), torch.tensor([0.0, 1.3], dtype=torch.float64))
    assert loss.tolist() == pytest.approx([0.126928, math.log(2)], abs=1e-6)
    shifted = formulas.bradley_terry_loss(torch.tensor([7.0], dtype=torch.float64), torch.tensor([5.0], dtype=torch.float64))
    assert shifted.item() == pytest.approx(loss[0].item(), abs=1e-12)  # invariant to a shared constant


def test_math_shepherd_and_step_aggregation():
    assert formulas.math_shepherd_labels(3, 8) == (1.0, 0.375)
    assert formulas.math_shepherd_labels(0, 8) == (0.0, 0.0)
    with pytest.raises(ValueError):
        formulas.math_shepherd_labels(9, 8)
    steps = torch.tensor([0.9, 0.8], dtype=torch.float64)
    assert formulas.aggregate_step_scores(steps, "product").item() == pytest.approx(0.72)
    assert formulas.aggregate_step_scores(steps, "min").item() == pytest.approx(0.8)


def test_checklist_and_copeland():
    assert formulas.checklist_score([100, 50], [80, 20]) == pytest.approx(60.0)
    # verdicts A>B, A>C, B>C as P[i, j] = P(i beats j)
    p = torch.tensor([[0.5, 1.0, 1.0], [0.0, 0.5, 1.0], [0.0, 0.0, 0.5]])
    assert formulas.copeland_win_rates(p).tolist() == pytest.approx([1.0, 0.5, 0.0])
    # relabelling the samples permutes the win rates the same way
    perm = torch.tensor([2, 0, 1])
    assert formulas.copeland_win_rates(p[perm][:, perm]).tolist() == pytest.approx([0.0, 1.0, 0.5])
