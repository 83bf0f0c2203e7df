"""Regression tests for the five fidelity defects of issue 10; every expected number is computed by hand from the
formula in the comment next to it (float64), independently of the implementation.

Three policies as in ALGORITHMS.md convention 7: ``theta`` (current, requires grad), ``old``, ``rollout``.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from trl_ext import ops
from trl_ext.batches import LossInputs, RolloutBatch
from trl_ext.host import PluginHost
from trl_ext.trainers.grpo import compose_loss
from trl_ext_plugins.advantages import math as adv
from trl_ext_plugins.advantages.ppo import PPO, PPOParams
from trl_ext_plugins.advantages.reinforce_pp import ReinforcePP, ReinforcePPParams
from trl_ext_plugins.corrections.m2po import M2PO
from trl_ext_plugins.corrections.mis import MIS, MISParams
from trl_ext_plugins.losses import math as lm
from trl_ext_plugins.losses.aggregation import Aggregation, AggregationParams
from trl_ext_plugins.losses.grpo import GRPO, GRPOParams
from trl_ext_plugins.losses.reinforce import REINFORCE

D = torch.float64


def loss_inputs(theta, old=None, advantages=None, mask=None, rollout=None, ref=None, *, num_items=None,
                training=False, grad_accum=1, steps_per_generation=1, processes=1, beta=0.0, loss_type="dapo"):
    theta = torch.as_tensor(theta, dtype=D).reshape(1, -1) if not torch.is_tensor(theta) else theta
    theta = theta.clone().requires_grad_(True)
    mask = torch.ones_like(theta.detach()) if mask is None else torch.as_tensor(mask, dtype=D).reshape(theta.shape)
    as_t = lambda v: None if v is None else torch.as_tensor(v, dtype=D).reshape(theta.shape)  # noqa: E731
    adv_t = torch.ones(theta.size(0), 1, dtype=D) if advantages is None else torch.as_tensor(advantages, dtype=D)
    return LossInputs(
        num_items_in_batch=torch.as_tensor(float(mask.sum()) if num_items is None else num_items, dtype=D),
        grad_accum_steps=grad_accum, steps_per_generation=steps_per_generation, num_processes=processes,
        training=training, loss_type=loss_type, max_completion_length=theta.size(1), per_token_logps=theta,
        old_per_token_logps=theta.detach().clone() if old is None else as_t(old), advantages=adv_t.reshape(theta.size(0), -1),
        mask=mask, sampling_per_token_logps=as_t(rollout), ref_per_token_logps=as_t(ref), entropies=None,
        epsilon_low=0.2, epsilon_high=0.28, beta=beta, extra={},
    )


def run(plugins, li, loss_type="dapo", kl=None, reduce=None):
    theta = li.per_token_logps
    loss, loss_mask, _ = compose_loss(PluginHost(plugins), li, loss_type=loss_type, kl=kl or ops.KLTerm(), reduce=reduce)
    (grad,) = torch.autograd.grad(loss, theta)
    return loss.item(), grad, loss_mask


# -- defect 1: token-mean denominators follow the token masks ----------------------------------------------------------

# One sequence of 4 tokens, ratio 1 (old = theta), per-token advantages A = [1, 2, 3, 4] under REINFORCE: per-token loss
# -A_t * log pi_t. M2PO (threshold 0.04): rollout log-probs make (log r)^2 = [0, 0, 0, 1] -> the 4th token is masked
# (mean of the rest, 0, is <= 0.04).
THETA = [-1.0, -1.0, -1.0, -1.0]
ROLLOUT = [-1.0, -1.0, -1.0, -2.0]
ADV = [[1.0, 2.0, 3.0, 4.0]]


def test_m2po_masked_token_leaves_the_global_token_mean_denominator():
    li = loss_inputs(THETA, advantages=ADV, rollout=ROLLOUT)
    value, grad, loss_mask = run([REINFORCE(), M2PO(), Aggregation()], li)
    assert loss_mask.tolist() == [[1, 1, 1, 0]]
    # sum_t -A_t logp_t over the 3 kept tokens / 3 kept tokens = (1 + 2 + 3) * 1 / 3 = 2 (the old bug divided by 4: 1.5)
    assert value == pytest.approx(2.0, abs=1e-12)
    # d/dlogp_t = -A_t / 3 on kept tokens, exactly 0 on the masked one
    assert close(grad, [[-1 / 3, -2 / 3, -1.0, 0.0]], abs=1e-12)
    assert grad[0, 3].item() == 0.0


def test_mask_aware_count_keeps_trl_accumulation_semantics():
    # Generation batch: 2 micro-batches of 4 tokens (num_items_in_batch 8), GA 2 = steps_per_generation 2, training.
    # This micro-batch keeps 3 of 4 -> count 8 * 3/4 = 6; TRL's window normaliser 6 / 1 process * 2/2 = 6, so the
    # micro-batch loss is (1+2+3)/6 = 1 and two such micro-batches sum to 12/6 = the exact mean over 6 kept tokens.
    li = loss_inputs(THETA, advantages=ADV, rollout=ROLLOUT, num_items=8, training=True, grad_accum=2,
                     steps_per_generation=2)
    value, _, _ = run([REINFORCE(), M2PO(), Aggregation()], li)
    assert value == pytest.approx(1.0, abs=1e-12)
    assert li.num_items_in_batch.item() == pytest.approx(6.0)


def test_mask_aware_count_sums_kept_tokens_over_processes():
    # Two processes: the other keeps 1 of its 4 tokens (reduce adds its counts). num_items 8 over both ranks; kept
    # fraction (3 + 1) / 8 -> count 4; normaliser 4 / 2 processes = 2; this rank's loss (1+2+3)/2 = 3. DDP averages the
    # two ranks: (6/2 + s_other/2)/2 = (6 + s_other)/4, the exact mean over the 4 kept tokens.
    li = loss_inputs(THETA, advantages=ADV, rollout=ROLLOUT, num_items=8, processes=2)
    value, _, _ = run([REINFORCE(), M2PO(), Aggregation()], li, reduce=lambda t: t + torch.tensor([1.0, 4.0]))
    assert value == pytest.approx(3.0, abs=1e-12)


@pytest.mark.parametrize("mode, expected", [
    # batch-token-mean: kept sum / kept count of the micro-batch = 6 / 3
    ("batch-token-mean", 2.0),
    # seq-mean-token-mean: (6 / 3 kept tokens of the sequence) / 1 sequence
    ("seq-mean-token-mean", 2.0),
    # constant normalisers ignore counts: seq-mean-token-sum-norm 6 / (1 * L=4); token-sum 6; seq-mean-token-sum 6 / 1
    ("seq-mean-token-sum-norm", 1.5), ("token-sum", 6.0), ("seq-mean-token-sum", 6.0),
])
def test_every_aggregation_excludes_masked_tokens(mode, expected):
    li = loss_inputs(THETA, advantages=ADV, rollout=ROLLOUT)
    value, _, _ = run([REINFORCE(), M2PO(), Aggregation(AggregationParams(mode=mode))], li)
    assert value == pytest.approx(expected, abs=1e-12)


def test_mis_weight_zero_keeps_denominator_and_drop_option_removes_it():
    # rho = pi_old / pi_rollout per token: old = theta; rollout makes rho = [1, 1, 1, e] (e > 2: outside [0.5, 2]).
    li = loss_inputs(THETA, advantages=ADV, rollout=ROLLOUT)
    value, _, _ = run([REINFORCE(), MIS(), Aggregation()], li)
    assert value == pytest.approx(6 / 4, abs=1e-12)  # weight 0, still counted: (1+2+3+0)/4
    li = loss_inputs(THETA, advantages=ADV, rollout=ROLLOUT)
    value, _, _ = run([REINFORCE(), MIS(MISParams(drop_from_denominator=True)), Aggregation()], li)
    assert value == pytest.approx(6 / 3, abs=1e-12)  # masked: (1+2+3)/3


def test_no_mask_leaves_num_items_untouched():
    li = loss_inputs(THETA, advantages=ADV, num_items=8)
    before = li.num_items_in_batch
    run([REINFORCE(), Aggregation()], li)
    assert li.num_items_in_batch is before


# -- defect 2: CE-GPPO keeps its bounded gradient for any log-ratio -----------------------------------------------------


@pytest.mark.parametrize("x", [20.0, 100.0])
def test_ce_gppo_gradient_holds_for_large_positive_log_ratio(x):
    # A>0, r = e^x > 1+eps_h: loss -beta_h (1+eps_h) r/sg(r) A; d/dlogpi = -beta_h (1+eps_h) A = -1 * 1.28 * 1
    theta = torch.tensor([[x]], dtype=D, requires_grad=True)
    loss = lm.ce_gppo_objective(theta - 0.0, torch.ones(1, 1, dtype=D), 0.2, 0.28, 0.75, 1.0)
    (grad,) = torch.autograd.grad(loss.sum(), theta)
    assert loss.item() == pytest.approx(-1.28) and grad.item() == pytest.approx(-1.28)


@pytest.mark.parametrize("x", [-20.0, -100.0])
def test_ce_gppo_gradient_holds_for_large_negative_log_ratio(x):
    # A<0, r = e^x < 1-eps_l: loss -beta_l (1-eps_l) r/sg(r) A; d/dlogpi = -0.75 * 0.8 * (-1) = 0.6
    theta = torch.tensor([[x]], dtype=D, requires_grad=True)
    loss = lm.ce_gppo_objective(theta, -torch.ones(1, 1, dtype=D), 0.2, 0.28, 0.75, 1.0)
    (grad,) = torch.autograd.grad(loss.sum(), theta)
    assert loss.item() == pytest.approx(0.6) and grad.item() == pytest.approx(0.6)


def test_ce_gppo_unclipped_branch_gradient_is_the_clamped_ratio_not_zero():
    # A<0, r = e^100 without dual clip: loss -r A with r clamped to e^20 in value; gradient -r A = e^20 (finite, != 0)
    theta = torch.tensor([[100.0]], dtype=D, requires_grad=True)
    loss = lm.ce_gppo_objective(theta, -torch.ones(1, 1, dtype=D), 0.2, 0.28, 0.75, 1.0, dual_clip=None)
    (grad,) = torch.autograd.grad(loss.sum(), theta)
    assert grad.item() == pytest.approx(math.exp(20.0), rel=1e-12)
    # A>0, r = e^-100: the unclipped branch's true gradient -r A is ~0; here -e^-20 (clamped value), finite
    theta = torch.tensor([[-100.0]], dtype=D, requires_grad=True)
    loss = lm.ce_gppo_objective(theta, torch.ones(1, 1, dtype=D), 0.2, 0.28, 0.75, 1.0)
    (grad,) = torch.autograd.grad(loss.sum(), theta)
    assert grad.item() == pytest.approx(-math.exp(-20.0), rel=1e-12)


# -- defect 3: the KL estimator is a named option and the docstring's behaviour ----------------------------------------

LOG2 = math.log(2.0)


@pytest.mark.parametrize("estimator, bias, value, slope", [
    # d = log pi - log pi_ref = log 2; objective term is 0 (A = 0); beta 0.04; seq-mean-token-mean over one token.
    ("k3", False, 0.5 - 1 + LOG2, 1 - 0.5),  # k3 = e^-d - 1 + d = 0.193147; dk3/dd = 1 - e^-d
    ("k1", False, LOG2, 1.0),  # k1 = d
    ("k2", False, LOG2 ** 2 / 2, LOG2),  # k2 = d^2/2; dk2/dd = d
    ("k3+", False, 0.5 - 1 + LOG2, LOG2),  # k3's value with k2's gradient
    # TRL's bias correction: k3 * r with r = pi/pi_old = e^0.1 (value); gradient d(k3 r)/dlogpi = (1 - e^-d) r + k3 r
    ("k3", True, (0.5 - 1 + LOG2) * math.exp(0.1), (0.5 + 0.5 - 1 + LOG2) * math.exp(0.1)),
])
def test_grpo_kl_estimators_by_hand(estimator, bias, value, slope):
    plugin = GRPO(GRPOParams(kl_estimator=estimator, kl_bias_correction=bias))
    trainer = SimpleNamespace(args=SimpleNamespace(use_bias_correction_kl=True))
    plugin.trl_ext_trainer_created(trainer=trainer)
    assert trainer.kl_term.estimator == estimator and trainer.kl_term.bias_correction is bias
    li = loss_inputs([-1.0], old=[-1.1], ref=[-1.0 - LOG2], advantages=[[0.0]], beta=0.04, loss_type="grpo")
    loss, grad, _ = run([plugin], li, loss_type="grpo", kl=trainer.kl_term)
    assert loss == pytest.approx(0.04 * value, rel=1e-12)
    assert grad.item() == pytest.approx(0.04 * slope, rel=1e-12)


def test_grpo_kl_bias_correction_follows_trl_field_by_default_and_sets_it_when_given():
    assert "use_bias_correction_kl" not in GRPO().trl_ext_configure_args(trainer="grpo", args={})
    assert GRPO(GRPOParams(kl_bias_correction=False)).trl_ext_configure_args(
        trainer="grpo", args={})["use_bias_correction_kl"] is False
    assert GRPO().kl_term(True).bias_correction and not GRPO().kl_term(False).bias_correction
    assert GRPO().kl_term(True).estimator == "k3"


def test_k3_is_finite_for_extreme_log_ratios():
    logp = torch.tensor([0.0, -100.0, 0.0], dtype=D, requires_grad=True)
    ref = torch.tensor([-100.0, 0.0, 0.0], dtype=D)
    for estimator in ops.KL_ESTIMATORS:
        kl = ops.kl_estimate(logp, ref, estimator)
        (grad,) = torch.autograd.grad(kl.sum(), logp)
        assert torch.isfinite(kl).all() and torch.isfinite(grad).all()
    # |d| <= 20 agrees with the unclamped formula: d = -log 2 -> e^{log 2} - 1 - log 2 = 0.306853
    assert ops.kl_estimate(torch.tensor([-LOG2]), torch.tensor([0.0])).item() == pytest.approx(2 - 1 - LOG2)


def test_k3_never_rewards_moving_further_below_the_reference():
    """Below d = -20 (log pi far under log pi_ref) k3 may saturate but must not fall as d falls: clamping only the
    exponent gave e^20 - 1 + d there, gradient +1, so the penalty pushed such tokens further down, and -inf at
    log pi = -inf. Exact e^-d - 1 + d down to d = -20 (gradient 1 - e^-d), constant and >= 0 below it."""
    logp = torch.tensor([-19.0, -21.0, -25.0, -1e4, float("-inf")], dtype=D, requires_grad=True)
    for estimator in ("k3", "k3+"):
        kl = ops.kl_estimate(logp, torch.zeros(5, dtype=D), estimator)
        assert torch.isfinite(kl).all() and (kl >= 0).all()
        assert kl[0].item() == pytest.approx(math.exp(19) - 1 - 19)
        assert (kl[1:] >= kl[0]).all()  # non-increasing in d: further below the reference never costs less
    (grad,) = torch.autograd.grad(ops.kl_estimate(logp, torch.zeros(5, dtype=D), "k3").sum(), logp)
    assert grad[0].item() == pytest.approx(1 - math.exp(19)) and (grad[1:] == 0).all()


def test_k3_plus_clamp_bounds_the_value_not_the_k2_gradient():
    """verl's ``kl_penalty(..., "low_var_kl+")`` (docs: k2's gradient "regardless of the kl value estimation"):
    value = k3 clamped to +-10, gradient = k2's, d. Clamping the straight-through sum instead gave gradient 0 wherever
    k3 > 10, i.e. for d < -2.6 or d > 11, the tokens furthest from the reference."""
    d = [LOG2, -3.0, 12.0]
    logp = torch.tensor(d, dtype=D, requires_grad=True)
    kl = ops.kl_estimate(logp, torch.zeros(3, dtype=D), "k3+", clamp=10.0)
    (grad,) = torch.autograd.grad(kl.sum(), logp)
    expected = [min(math.exp(-x) - 1 + x, 10.0) for x in d]  # 0.193147, 10 (k3 = 16.09), 10 (k3 = 11.000006)
    assert kl.tolist() == pytest.approx(expected, rel=1e-12)
    assert grad.tolist() == pytest.approx(d, rel=1e-12)  # d/dlogp of 0.5 d^2
    # k3 itself keeps verl's low_var_kl clamp: constant 10 (zero gradient) beyond it
    (grad_k3,) = torch.autograd.grad(ops.kl_estimate(logp, torch.zeros(3, dtype=D), "k3", clamp=10.0).sum(), logp)
    assert grad_k3.tolist() == pytest.approx([1 - 0.5, 0.0, 0.0], rel=1e-12)


def test_k3_plus_is_finite_where_the_reference_log_prob_is_minus_infinity():
    """NeMo-RL cross-check: log pi_ref = -inf on a loss token (d = +inf) made k3+ NaN, clamp or not (k2 = inf, then
    inf - inf); k2 now comes from d clamped to +-20, so the value is k3's clamped value and the gradient 0 there."""
    logp = torch.tensor([-1.0, -1.0], dtype=D, requires_grad=True)
    ref = torch.tensor([float("-inf"), -1.5], dtype=D)
    kl = ops.kl_estimate(logp, ref, "k3+", clamp=10.0)
    (grad,) = torch.autograd.grad(kl.sum(), logp)
    assert kl.tolist() == pytest.approx([10.0, math.exp(-0.5) - 1 + 0.5], rel=1e-12)
    assert grad.tolist() == pytest.approx([0.0, 0.5], rel=1e-12)
    unclamped = ops.kl_estimate(logp.detach(), ref, "k3+")
    assert math.isinf(unclamped[0].item()) and unclamped[0] > 0 and torch.isfinite(unclamped[1])


@pytest.mark.parametrize("weighted", [False, True], ids=["clamp-estimate", "clamp-weighted"])
@pytest.mark.parametrize("estimator, bias", [("k2", False), ("k2", True), ("k3", "score"), ("k1", "score"),
                                             ("k2", "score"), ("k3", True), ("k3+", False)])
def test_a_clamped_kl_keeps_finite_gradients_where_the_reference_log_prob_is_minus_infinity(estimator, bias, weighted):
    """AReaL/slime cross-check: log pi_ref = -inf on a loss token (the reference gives a sampled token probability 0).
    With a clamp the estimate there is the bound; k2 (any weight) and a clamped weighted value back-propagated
    0 * inf = NaN through the clamp. The gradient is now finite everywhere: on that token 0 where the clamp binds last
    (no weight, or the weighted value clamped), c * grad w where the estimate is clamped before its weight."""
    logp = torch.tensor([-1.0, -0.5, -0.7], dtype=D, requires_grad=True)
    ref = torch.tensor([-1.2, float("-inf"), -0.9], dtype=D)
    term = ops.KLTerm(estimator, bias_correction=bias, clamp=10.0, clamp_weighted=weighted)
    kl = term.per_token(logp, ref, torch.exp(logp - logp.detach()))
    (grad,) = torch.autograd.grad(kl.sum(), logp)
    assert torch.isfinite(kl).all() and torch.isfinite(grad).all()
    assert kl[1].item() == pytest.approx(10.0)
    weight_after_clamp = bias is not False and not weighted and estimator != "k3+"
    assert grad[1].item() == pytest.approx(10.0 if weight_after_clamp else 0.0)


# -- defect 4: returns and GAE skip interior masked (tool) tokens --------------------------------------------------------


def close(actual, expected, abs=0.0, rel=0.0):
    """Element-wise |actual - expected| <= abs + rel * |expected| (pytest.approx takes no nested lists)."""
    expected = torch.as_tensor(expected, dtype=D)
    return torch.allclose(actual.detach().to(D), expected, atol=abs, rtol=rel)


def t(rows):
    return torch.tensor(rows, dtype=D)


def test_gae_carries_values_and_advantages_across_a_tool_gap():
    # mask [1, 1, 0, 0, 1]: tokens 2-3 are a tool response. Values there (9.0) and rewards there must be ignored.
    rewards, values, mask = t([[0, 0, 5, 5, 1]]), t([[0.5, 0.6, 9, 9, 0.8]]), t([[1, 1, 0, 0, 1]])
    # gamma 1, lam 0.95: identical to the gap-free sequence [0.5, 0.6, 0.8] with reward 1 at the end:
    # A_4 = 1 - 0.8 = 0.2; A_1 = (0.8 - 0.6) + 0.95 * 0.2 = 0.39; A_0 = (0.6 - 0.5) + 0.95 * 0.39 = 0.4705
    a, ret = adv.gae(rewards, values, mask, gamma=1.0, lam=0.95)
    assert close(a, [[0.4705, 0.39, 0, 0, 0.2]], abs=1e-12)
    assert close(ret, [[0.9705, 0.99, 0, 0, 1.0]], abs=1e-12)
    # gamma 0.9: the gap costs no discount step. A_4 = 0.2; delta_1 = 0.9*0.8 - 0.6 = 0.12, A_1 = 0.12 + 0.855*0.2
    # = 0.291; delta_0 = 0.9*0.6 - 0.5 = 0.04, A_0 = 0.04 + 0.855*0.291 = 0.288805
    a, _ = adv.gae(rewards, values, mask, gamma=0.9, lam=0.95)
    assert close(a, [[0.288805, 0.291, 0, 0, 0.2]], abs=1e-12)


def test_returns_and_token_rewards_with_a_trailing_tool_token():
    mask = t([[1, 1, 0, 1, 0]])  # token 2 tool, token 4 tool at the very end
    r = adv.token_rewards(t([1.0]), mask, t([[0.1, 0.2, 7.0, 0.1, 7.0]]), kl_coef=0.01)
    # reward R at the last *valid* token (index 3), -0.01 KL on valid tokens, 0 elsewhere
    assert close(r, [[-0.001, -0.002, 0.0, 0.999, 0.0]], abs=1e-12)
    # G_3 = 0.999; G_1 = -0.002 + 0.5 * 0.999 = 0.4975; G_0 = -0.001 + 0.5 * 0.4975 = 0.24775
    assert close(adv.discounted_returns(r, mask, 0.5), [[0.24775, 0.4975, 0, 0.999, 0]], abs=1e-12)


def rollout_batch(rewards, completion_mask, tool_mask):
    completion_mask = torch.as_tensor(completion_mask)
    b, n = completion_mask.shape
    zeros = torch.zeros(b, n)
    return RolloutBatch(
        rewards_per_func=torch.tensor(rewards).unsqueeze(-1), reward_names=["r"], reward_weights=torch.ones(1),
        num_generations=b, process_slice=slice(0, b), completion_ids=torch.zeros(b, n, dtype=torch.long),
        completion_mask=completion_mask, completion_lengths=completion_mask.sum(-1), prompts=[], completions=[],
        inputs=[], old_per_token_logps=zeros, ref_per_token_logps=zeros,
        tool_mask=None if tool_mask is None else torch.as_tensor(tool_mask), prompt_ids=torch.zeros(b, 1, dtype=torch.long),
        prompt_mask=torch.ones(b, 1, dtype=torch.long),
    )


def test_reinforce_pp_honours_the_tool_mask():
    # seq 0: R=1, tokens [1, 1, tool, 1]; seq 1: R=0, tokens [1, 1, 1, pad]; no KL. Returns on loss tokens:
    # [1, 1, -, 1] and [0, 0, 0]: mean 0.5, unbiased var 6 * 0.25 / 5 = 0.3 -> whitened +-0.5 / sqrt(0.3 + 1e-8).
    batch = rollout_batch([1.0, 0.0], [[1, 1, 1, 1], [1, 1, 1, 0]], [[1, 1, 0, 1], [1, 1, 1, 1]])
    out = ReinforcePP(ReinforcePPParams(kl_coef=0.0)).trl_ext_compute_advantages(rewards=torch.tensor([1.0, 0.0]),
                                                                                  batch=batch)
    z = 0.5 / math.sqrt(0.3 + 1e-8)
    assert close(out, [[z, z, 0.0, z], [-z, -z, -z, 0.0]], rel=1e-6)


def test_ppo_honours_the_tool_mask_in_gae():
    # Critic values [0.5, 0.6, 9 (tool), 0.8]; R = 1; no KL, no whitening: GAE over the loss tokens only (see above).
    batch = rollout_batch([1.0], [[1, 1, 1, 1]], [[1, 1, 0, 1]])
    plugin = PPO(PPOParams(kl_coef=0.0, whiten_advantages=False, gamma=1.0, lam=0.95))
    plugin.critic = SimpleNamespace(eval=lambda: None, __call__=None)
    values = torch.tensor([[0.5, 0.6, 9.0, 0.8]])
    plugin.critic = lambda *inputs: values
    plugin.critic.eval = lambda: None
    out = plugin.trl_ext_compute_advantages(rewards=torch.tensor([1.0]), batch=batch)
    assert close(out, [[0.4705, 0.39, 0.0, 0.2]], abs=1e-6)


# -- defect 5: log-probs under truncated sampling (top-k / top-p / min-p) ------------------------------------------------

LOGITS = [2.0, 1.0, 0.0, -1.0]
LSE_ALL = math.log(sum(math.exp(v) for v in LOGITS))  # full softmax normaliser
LSE_TOP2 = math.log(math.exp(2.0) + math.exp(1.0))  # normaliser over the two kept tokens


@pytest.mark.parametrize("sampling, token, expected", [
    # top-k 2 keeps tokens {0, 1}: log p(0) = 2 - log(e^2 + e^1) = -0.313262
    ({"top_k": 2}, 0, 2.0 - LSE_TOP2),
    # top-p 0.7: p = [0.6439, 0.2369, 0.0871, 0.0321]; mass above token 1 is 0.6439 < 0.7 (kept), above token 2 is
    # 0.8808 (dropped): support {0, 1}, log p(1) = 1 - log(e^2 + e) = -1.313262
    ({"top_p": 0.7}, 1, 1.0 - LSE_TOP2),
    # min-p 0.2: threshold 0.2 * 0.6439 = 0.1288 keeps {0, 1}
    ({"min_p": 0.2}, 1, 1.0 - LSE_TOP2),
    # temperature 0.5 then top-k 3: logits [4, 2, 0, -2], keep 3: log p(2) = 0 - log(e^4 + e^2 + 1)
    ({"temperature": 0.5, "top_k": 3}, 2, -math.log(math.exp(4) + math.exp(2) + 1)),
    # a token outside the support has probability 0
    ({"top_k": 2}, 3, float("-inf")),
    # no truncation: the full softmax
    ({}, 0, 2.0 - LSE_ALL),
])
def test_truncated_distribution_by_hand(sampling, token, expected):
    logits = torch.tensor([[LOGITS]])
    got = ops.truncated_token_logprobs(logits, torch.tensor([[token]]), **sampling).item()
    assert got == pytest.approx(expected, abs=1e-6) if math.isfinite(expected) else got == expected


@pytest.mark.parametrize("sampling", [{"top_k": 2}, {"top_p": 0.7}, {"min_p": 0.2}, {"temperature": 0.5, "top_k": 3}])
def test_rollout_records_the_renormalised_truncated_distribution(sampling):
    # The rollout_logprobs plugin records log_softmax of the scores transformers sampled from; those scores come from
    # generate's own logits processors for these settings, so the recorded log-prob is the truncated one above.
    from transformers import GenerationConfig
    from transformers.generation.logits_process import (LogitsProcessorList, MinPLogitsWarper, TemperatureLogitsWarper,
                                                        TopKLogitsWarper, TopPLogitsWarper)

    from trl_ext_plugins.rollout.rollout_logprobs import sampled_token_logprobs

    config = GenerationConfig(do_sample=True, **{"top_k": 0, **sampling})
    processors = LogitsProcessorList([TemperatureLogitsWarper(config.temperature or 1.0)])
    if config.top_k:
        processors.append(TopKLogitsWarper(config.top_k))
    if config.top_p is not None and config.top_p < 1:
        processors.append(TopPLogitsWarper(config.top_p))
    if config.min_p:
        processors.append(MinPLogitsWarper(config.min_p))
    scores = processors(torch.zeros(1, 1, dtype=torch.long), torch.tensor([LOGITS]))
    for token in range(4):
        recorded = sampled_token_logprobs((scores,), torch.tensor([[token]])).item()
        ours = ops.truncated_token_logprobs(torch.tensor([[LOGITS]]), torch.tensor([[token]]), **sampling).item()
        assert recorded == pytest.approx(ours, abs=1e-6) or recorded == ours == float("-inf")


class FixedLogits(torch.nn.Module):
    """A 'model' whose logits predicting the completion token are LOGITS (prompt of one token, completion of one)."""

    def forward(self, input_ids, attention_mask):
        logits = torch.zeros(input_ids.size(0), input_ids.size(1), 4)
        logits[:, -2] = torch.tensor(LOGITS)
        return SimpleNamespace(logits=logits)


@pytest.mark.parametrize("support, expected_rho", [
    # full: rho = pi_old(full softmax) / pi_rollout(top-2) = e^(-LSE_ALL) / e^(-LSE_TOP2) = kept mass 0.880797 (biased)
    ("full", math.exp(LSE_TOP2 - LSE_ALL)),
    # sampled: pi_old renormalised over the same top-2 support -> rho = 1 (no mismatch, no bias)
    ("sampled", 1.0),
])
def test_tis_rho_on_the_sampled_support(support, expected_rho):
    from trl_ext_plugins.corrections.tis import TIS, TISParams

    li = loss_inputs([2.0 - LSE_ALL], rollout=[2.0 - LSE_TOP2])
    li.extra.update(model=FixedLogits(), completion_ids=torch.tensor([[0]]), prompt_ids=torch.tensor([[0]]),
                    prompt_mask=torch.ones(1, 1, dtype=torch.long), completion_mask=torch.ones(1, 1, dtype=torch.long),
                    sampling_params={"temperature": 1.0, "top_k": 2, "top_p": 1.0, "min_p": None})
    weights = TIS(TISParams(support=support, upper=5.0)).trl_ext_token_weights(inputs=li)
    assert weights.weight.item() == pytest.approx(expected_rho, abs=1e-6)


def test_sampled_support_is_refused_off_policy():
    from trl_ext_plugins.corrections.mis import MIS, MISParams

    plugin = MIS(MISParams(support="sampled"))
    assert plugin.trl_ext_validate_stage(stage=SimpleNamespace(args={}), plugins=[]) is None
    errors = plugin.trl_ext_validate_stage(stage=SimpleNamespace(args={"num_iterations": 2}), plugins=[])
    assert errors and "plugins.mis.support" in errors[0]


def test_sampled_support_is_refused_when_generation_batch_size_makes_it_off_policy():
    """generation_batch_size 64 with 8 rows per device on one process is steps_per_generation 8 > accumulation 1: the
    recipe names no steps_per_generation, so validation passes and the trainer's resolved args must refuse it (else
    pi_old is recomputed from weights already updated 7 times)."""
    from trl_ext_plugins.corrections.tis import TIS, TISParams

    recipe_args = {"generation_batch_size": 64, "per_device_train_batch_size": 8}
    plugin = TIS(TISParams(support="sampled"))
    assert plugin.trl_ext_validate_stage(stage=SimpleNamespace(args=recipe_args), plugins=[]) is None
    resolved = SimpleNamespace(num_iterations=1, steps_per_generation=8, gradient_accumulation_steps=1)
    with pytest.raises(ValueError, match="plugins.tis.support.*steps_per_generation 8 > gradient_accumulation_steps 1"):
        plugin.trl_ext_trainer_created(trainer=SimpleNamespace(args=resolved))
    on_policy = SimpleNamespace(num_iterations=1, steps_per_generation=2, gradient_accumulation_steps=2)
    plugin.trl_ext_trainer_created(trainer=SimpleNamespace(args=on_policy))
    TIS().trl_ext_trainer_created(trainer=SimpleNamespace(args=resolved))  # support full: pi_old is TRL's own


# -- KL only in the reward: reference log-probs without a loss KL term -----------------------------------------------------


def test_kl_only_in_reward_loads_the_reference_without_a_loss_term():
    from trl_ext.trainers import TRAINER_KINDS
    from trl_ext.plugin import Need

    plugin = ReinforcePP(ReinforcePPParams(kl_in_loss=False))
    args = plugin.trl_ext_configure_args(trainer="grpo", args={})
    assert args == {"beta": 1.0}  # the reference is computed ...
    assert Need.REFERENCE in TRAINER_KINDS["grpo"].capabilities(SimpleNamespace(teacher=None, teachers=None), args)
    assert plugin.trl_ext_configure_args(trainer="grpo", args={"beta": 0.04}) is None  # recipe's own beta kept
    assert ReinforcePP().trl_ext_configure_args(trainer="grpo", args={"beta": 0.04}) is None  # default unchanged
    # (the default without a beta used to be refused for want of the reference; it now gets it with no loss term)
    trainer = SimpleNamespace(kl_term=ops.KLTerm("k3", bias_correction=True))
    plugin.trl_ext_trainer_created(trainer=trainer)
    assert trainer.kl_term.weight(1.0) == 0.0 and not trainer.kl_term.is_trl()  # ... but adds no loss term
    # through the pipeline: beta 1.0, reference far away, A = 0 -> the loss is exactly 0 (no KL), gradient 0
    li = loss_inputs([-1.0], ref=[-9.0], advantages=[[0.0]], beta=1.0, loss_type="grpo")
    loss, grad, _ = run([REINFORCE()], li, loss_type="grpo", kl=trainer.kl_term)
    assert loss == 0.0 and grad.item() == 0.0
    ppo = PPO(PPOParams(kl_in_loss=False))
    assert ppo.trl_ext_configure_args(trainer="grpo", args={}) == {"beta": 1.0}
    assert PPO(PPOParams(kl_in_loss=False, kl_coef=0.0)).trl_ext_configure_args(trainer="grpo", args={}) is None
