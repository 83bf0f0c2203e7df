"""Distillation formulas against numbers computed by hand (ALGORITHMS.md items 4-7 and 51) and against TRL's kernel."""

import math

import pytest
import torch
from trl.kernels.chunked_divergence import ChunkedDivergenceFunction

from trl_ext_plugins.distill import math as dm

P = torch.tensor([0.9, 0.1]).log()  # teacher
Q = torch.tensor([0.5, 0.5]).log()  # student


# KL(P||Q) = 0.9 ln(0.9/0.5) + 0.1 ln(0.1/0.5) = 0.368064; KL(Q||P) = 0.5 ln(0.5/0.9) + 0.5 ln(0.5/0.1) = 0.510826;
# JSD_0.5 with M = [0.7, 0.3]: 0.5 (0.9 ln(9/7) + 0.1 ln(1/3)) + 0.5 (0.5 ln(5/7) + 0.5 ln(5/3)) = 0.101749.
@pytest.mark.parametrize("beta, expected", [(0.0, 0.368064), (1.0, 0.510826), (0.5, 0.101749)])
def test_divergences_by_hand(beta, expected):
    assert dm.generalized_jsd(P, Q, beta).item() == pytest.approx(expected, abs=1e-6)


def test_jsd_is_zero_iff_equal_and_reverse_kl_is_mode_seeking():
    assert dm.generalized_jsd(P, P, 0.5).item() == pytest.approx(0.0, abs=1e-7)
    assert dm.generalized_jsd(P, Q, 0.5).item() > 0
    # student mass where the teacher has almost none costs far more under reverse KL than forward KL
    teacher = torch.tensor([1 - 1e-6, 1e-6]).log()
    # reverse: 0.5 ln 0.5 + 0.5 ln(0.5e6) = 6.2146; forward: ~ln 2
    assert dm.generalized_jsd(teacher, Q, 1.0).item() == pytest.approx(6.2146, abs=1e-3)
    assert dm.generalized_jsd(teacher, Q, 0.0).item() == pytest.approx(math.log(2), abs=1e-4)


def test_reverse_kl_gradient_by_hand():
    # d KL(q||p) / d z_q = q (log q - log p - KL) = 0.5 * [ln(5/9) - 0.510826, ln 5 - 0.510826] = [-0.549306, 0.549306]
    student = Q.clone().requires_grad_(True)
    dm.generalized_jsd(P, student, 1.0).backward()
    assert student.grad.tolist() == pytest.approx([-0.549306, 0.549306], abs=1e-6)


def test_kl_ignores_zero_probability_terms():
    zero = torch.tensor([0.0, -math.inf])
    assert dm.generalized_jsd(zero, Q, 0.0).item() == pytest.approx(math.log(2), abs=1e-6)
    assert torch.isfinite(dm.generalized_jsd(zero, Q, 0.0))


@pytest.mark.parametrize("beta", [0.0, 0.3, 0.5, 1.0])
def test_tokens_both_models_exclude_give_finite_values_and_zero_gradient(beta):
    """A vocabulary-padding logit of -inf in teacher and student (or a top-k-truncated pair): the divergence equals the
    one over the real vocabulary, and no NaN reaches the student's gradient (logaddexp(-inf, -inf) and p * (-inf) at
    p = 0 both have NaN backward passes unless masked with torch.where first)."""
    teacher = torch.tensor([[2.0, 0.5, -1.0, -math.inf]], dtype=torch.float64)
    student_real = torch.tensor([[0.3, 1.1, -0.4]], dtype=torch.float64, requires_grad=True)
    student = torch.cat([student_real, torch.full((1, 1), -math.inf, dtype=torch.float64)], dim=-1)
    padded = dm.generalized_jsd(teacher, student, beta)
    (grad,) = torch.autograd.grad(padded.sum(), student_real)
    real = student_real.detach().clone().requires_grad_(True)
    expected = dm.generalized_jsd(teacher[:, :3], real, beta)
    (expected_grad,) = torch.autograd.grad(expected.sum(), real)
    assert torch.isfinite(padded).all() and padded.item() == pytest.approx(expected.item(), abs=1e-12)
    assert torch.isfinite(grad).all() and torch.allclose(grad, expected_grad, atol=1e-12)


def test_kl_where_p_is_zero_has_zero_gradient():
    log_p = torch.tensor([0.0, -math.inf], dtype=torch.float64, requires_grad=True)  # p = [1, 0]
    log_q = torch.tensor([-0.5, -math.inf], dtype=torch.float64, requires_grad=True)
    value = dm.kl_from_logprobs(log_p, log_q)
    assert value.item() == pytest.approx(0.5)
    grad_p, grad_q = torch.autograd.grad(value, (log_p, log_q))
    assert torch.isfinite(grad_p).all() and torch.isfinite(grad_q).all() and grad_q[1] == 0 and grad_p[1] == 0


def test_float64_logits_keep_float64_and_half_precision_computes_in_float32():
    assert dm.generalized_jsd(P.double(), Q.double(), 0.5).dtype == torch.float64
    assert dm.generalized_jsd(P.bfloat16(), Q.bfloat16(), 0.5).dtype == torch.float32


@pytest.mark.parametrize("beta", [0.0, 0.1, 0.5, 1.0])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_reference_matches_trl_chunked_kernel(beta, temperature):
    """The full-vocabulary reference and TRL's chunked kernel agree at 1e-6 on values and student gradients."""
    torch.manual_seed(0)
    n, h, v = 6, 8, 50
    h_s, h_t = torch.randn(n, h, dtype=torch.float64), torch.randn(n, h, dtype=torch.float64)
    w_s, w_t = torch.randn(v, h, dtype=torch.float64), torch.randn(v, h, dtype=torch.float64)
    a = h_s.clone().requires_grad_(True)
    trl, _ = ChunkedDivergenceFunction.apply(a, w_s, None, h_t, w_t, None, beta, temperature, 1.0, None, 1.0, None)
    trl.sum().backward()
    b = h_s.clone().requires_grad_(True)
    ours = dm.generalized_jsd(h_t @ w_t.T, b @ w_s.T, beta, temperature)
    ours.sum().backward()
    assert torch.allclose(ours.double(), trl.double(), atol=1e-6)
    assert torch.allclose(a.grad, b.grad.double(), atol=1e-6)


def test_opd_advantage_by_hand_and_detached():
    teacher = torch.tensor([[-0.5, -math.inf]])
    student = torch.tensor([[-1.5, -2.0]], requires_grad=True)
    mask = torch.tensor([[1, 0]])
    adv = dm.opd_advantages(teacher, student, mask)
    assert adv.tolist() == [[1.0, 0.0]]  # -0.5 - (-1.5) = +1.0; masked -inf token gives exactly 0
    assert not adv.requires_grad
    assert dm.opd_advantages(student, student, torch.ones(1, 2)).abs().max() == 0


def test_combined_and_weighted_advantages():
    opd = torch.tensor([[1.0, 2.0], [0.5, -1.0]])
    assert dm.combine_advantages(opd, torch.tensor([0.5, -1.0]), alpha=2.0).tolist() == [[2.0, 3.0], [-1.5, -3.0]]
    assert dm.combine_advantages(opd, None, alpha=2.0).tolist() == opd.tolist()
    assert dm.weighted_by_row(opd, torch.tensor([2.0, 0.5])).tolist() == [[2.0, 4.0], [0.25, -0.5]]


def test_bon_log_density_by_hand():
    # ln 4 + 3 ln 0.5 = 1.386294 - 2.079442 = -0.693147
    assert dm.bon_log_ratio(torch.tensor(0.5), 4).item() == pytest.approx(-0.693147, abs=1e-6)
    assert dm.bon_log_ratio(torch.tensor(1.0), 1).item() == 0.0  # best-of-1 is the reference itself


def test_p_le_estimates():
    assert dm.empirical_p_le(torch.tensor([0.5, 2.0]), torch.tensor([0.0, 1.0, 0.5, 3.0])).tolist() == [0.5, 0.75]
    # rewards [1, 0, 1, 0] in one group: a 1 is >= all four, a 0 is >= the two zeros
    assert dm.group_p_le(torch.tensor([1.0, 0.0, 1.0, 0.0]), 4).tolist() == [1.0, 0.5, 1.0, 0.5]


def test_jeffreys_endpoints():
    fwd, rev = torch.tensor(0.3), torch.tensor(0.7)
    assert dm.jeffreys(fwd, rev, 0.0).item() == pytest.approx(0.3)
    assert dm.jeffreys(fwd, rev, 1.0).item() == pytest.approx(0.7)
    assert dm.jeffreys(fwd, rev, 0.5).item() == pytest.approx(0.5)


def test_ema_update():
    anchor = {"w": torch.tensor([0.0, 2.0])}
    dm.ema_update(anchor, {"w": torch.tensor([1.0, 0.0])}, rate=0.25)
    assert anchor["w"].tolist() == [0.25, 1.5]
