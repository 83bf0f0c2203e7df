"""First-party plugins pass the conformance kit (``trl_ext.testing.assert_conforms``): value and gradient in float64 to
1e-9 through the real loss pipeline, against references written here from each paper's formula with plain torch ops
(no trl-ext function is called by a reference). Aggregation: TRL ``bnpo`` (sum over loss tokens / their count)
unless a case names another ``loss_type``.
"""

from __future__ import annotations

import math

import pytest
import torch

from trl_ext.metrics import reduce_figures
from trl_ext.testing import assert_conforms
from trl_ext_plugins.advantages.group_norm import GroupNorm, GroupNormParams
from trl_ext_plugins.advantages.reinforce_baseline import ReinforceBaseline
from trl_ext_plugins.advantages.rloo import RLOO
from trl_ext_plugins.corrections.icepop import IcePop
from trl_ext_plugins.corrections.m2po import M2PO
from trl_ext_plugins.corrections.mis import MIS
from trl_ext_plugins.corrections.tis import TIS
from trl_ext_plugins.losses.aggregation import Aggregation, AggregationParams
from trl_ext_plugins.losses.ce_gppo import CEGPPO
from trl_ext_plugins.losses.cispo import CISPO
from trl_ext_plugins.losses.gmpo import GMPO
from trl_ext_plugins.losses.grpo import GRPO
from trl_ext_plugins.losses.gspo import GSPO
from trl_ext_plugins.losses.reinforce import REINFORCE
from trl_ext_plugins.losses.sapo import SAPO

D = torch.float64

# Two sequences, 3 tokens, one padded; log-ratios spread over clipped and unclipped regions; both advantage signs.
BASE = {"theta": [[-0.5, -1.2, -0.1], [-2.0, -0.3, -0.7]], "old": [[-0.7, -1.0, -0.1], [-1.5, -0.31, -0.2]],
        "rollout": [[-0.6, -1.9, -0.1], [-1.4, -0.3, -0.7]], "mask": [[1, 1, 1], [1, 1, 0]],
        "advantages": [[1.5], [-0.8]]}
PER_TOKEN = {**BASE, "advantages": [[1.0, -2.0, 0.5], [0.3, -1.0, 2.0]]}
CASES = [BASE, PER_TOKEN, {**BASE, "mask": [[1, 0, 0], [0, 0, 0]]}]


def tensors(case, theta):
    t = lambda key: torch.tensor(case[key], dtype=D)  # noqa: E731
    adv = t("advantages")
    return theta, t("old"), t("mask"), adv if adv.dim() == 2 else adv.unsqueeze(-1)


def token_mean(loss, mask):
    return (loss * mask).sum() / max(mask.sum().item(), 1.0)


def ppo_terms(theta, old, adv, lo, hi):
    r = torch.exp(theta - old)
    return -torch.minimum(r * adv, torch.clamp(r, 1 - lo, 1 + hi) * adv)


def test_grpo_objective():
    def ref(case, theta):
        theta, old, mask, adv = tensors(case, theta)
        return token_mean(ppo_terms(theta, old, adv, 0.2, 0.2), mask)
    assert_conforms(GRPO(), ref, CASES)


def test_cispo_objective():
    def ref(case, theta):  # -sg(min(r, 1 + eps_high)) * A * log pi, eps_high 4.0
        theta, old, mask, adv = tensors(case, theta)
        w = torch.clamp(torch.exp(theta - old), max=5.0).detach()
        return token_mean(-w * adv * theta, mask)
    assert_conforms(CISPO(), ref, CASES)


def test_sapo_objective():
    def ref(case, theta):  # -sigmoid(tau (r - 1)) 4/tau A, tau 1.0 (A > 0) or 1.05
        theta, old, mask, adv = tensors(case, theta)
        tau = torch.where(adv > 0, 1.0, 1.05).to(D)
        return token_mean(-torch.sigmoid(tau * (torch.exp(theta - old) - 1)) * 4 / tau * adv, mask)
    assert_conforms(SAPO(), ref, CASES)


def test_reinforce_objective():
    def ref(case, theta):
        theta, _, mask, adv = tensors(case, theta)
        return token_mean(-adv * theta, mask)
    assert_conforms(REINFORCE(), ref, CASES)


def test_gspo_sequence_objective():
    def ref(case, theta):  # s_i = exp(mean_t log r), clip deviations 3e-4 / 4e-4, one loss per sequence
        theta, old, mask, adv = tensors(case, theta)
        n = mask.sum(-1, keepdim=True).clamp(min=1)
        s = torch.exp(((theta - old) * mask).sum(-1, keepdim=True) / n)
        seq = -torch.minimum(s * adv, torch.clamp(s, 1 - 3e-4, 1 + 4e-4) * adv)
        return token_mean(seq.expand_as(mask), mask)
    cases = [{**c, "epsilon_low": 3e-4, "epsilon_high": 4e-4} for c in (BASE, CASES[2])]
    assert_conforms(GSPO(), ref, cases)


def test_gmpo_objective():
    def ref(case, theta):  # -A exp(mean_t of the sign-aware log-space clip, bounds +-0.4)
        theta, old, mask, adv = tensors(case, theta)
        x = theta - old
        kept = torch.where(adv > 0, torch.minimum(x, torch.clamp(x, -0.4, 0.4)), torch.maximum(x, torch.clamp(x, -0.4, 0.4)))
        seq = -adv * torch.exp((kept * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1))
        return token_mean(seq.expand_as(mask), mask)
    cases = [{**c, "epsilon_low": 0.4, "epsilon_high": 0.4} for c in (BASE, CASES[2])]
    assert_conforms(GMPO(), ref, cases)


def test_ce_gppo_objective():
    def ref(case, theta):  # paper's piecewise loss; clipped tokens keep gradient beta (1 -+ eps) A via r/sg(r)
        theta, old, mask, adv = tensors(case, theta)
        r = torch.exp(theta - old)
        st = r / r.detach()
        inside = torch.where(adv < 0, torch.minimum(-r * adv, -3.0 * adv), -r * adv)
        loss = torch.where((adv < 0) & (r < 0.8), -0.75 * 0.8 * st * adv, inside)
        loss = torch.where((adv > 0) & (r > 1.28), -1.0 * 1.28 * st * adv, loss)
        return token_mean(loss, mask)
    cases = [{**c, "epsilon_high": 0.28} for c in CASES]
    assert_conforms(CEGPPO(), ref, cases)


def test_tis_and_icepop_and_mis_corrections_on_the_default_objective():
    def weighted(weight_fn):
        def ref(case, theta):
            theta, old, mask, adv = tensors(case, theta)
            rho = torch.exp(old - torch.tensor(case["rollout"], dtype=D))
            return token_mean(ppo_terms(theta, old, adv, 0.2, 0.2) * weight_fn(rho), mask)
        return ref
    assert_conforms(TIS(), weighted(lambda rho: torch.clamp(rho, max=2.0)), CASES)
    band = lambda rho: torch.where((rho >= 0.5) & (rho <= 2.0), rho, 0.0)  # noqa: E731
    assert_conforms(IcePop(), weighted(band), CASES)
    assert_conforms(MIS(), weighted(band), CASES)


def test_m2po_mask_leaves_the_denominator():
    # (log pi_theta - log pi_rollout)^2 on loss tokens; drop largest until the mean of the rest <= 0.04
    def ref(case, theta):
        theta, old, mask, adv = tensors(case, theta)
        sq = ((theta.detach() - torch.tensor(case["rollout"], dtype=D)) ** 2)
        items = sorted(((sq[i, j].item(), i, j) for i in range(2) for j in range(3) if mask[i, j]), reverse=True)
        keep = mask.clone()
        while items and sum(v for v, _, _ in items) / len(items) > 0.04:
            _, i, j = items.pop(0)
            keep[i, j] = 0
        return token_mean(ppo_terms(theta, old, adv, 0.2, 0.2), keep)
    assert_conforms(M2PO(), ref, CASES)


@pytest.mark.parametrize("mode", ["token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_aggregations(mode):
    def ref(case, theta):
        theta, old, mask, adv = tensors(case, theta)
        loss = ppo_terms(theta, old, adv, 0.2, 0.2) * mask
        per_seq = loss.sum(-1)
        return {"token-sum": loss.sum(), "seq-mean-token-sum": per_seq.mean(),
                "seq-mean-token-mean": (per_seq / mask.sum(-1).clamp(min=1)).mean(),
                "seq-mean-token-sum-norm": loss.sum() / (2 * 5)}[mode]
    assert_conforms(Aggregation(AggregationParams(mode=mode, constant=5)), ref, CASES)


# -- advantages -------------------------------------------------------------------------------------------------------

REWARD_CASES = [{"rewards": [1.0, 0.0, 0.0, 0.0, 0.5, 0.5, 0.2, 0.9], "num_generations": 4},
                {"rewards": [1.0, 1.0, 1.0, 1.0, 3.0, float("nan"), 0.0, 1.0], "num_generations": 4}]


def _groups(case):
    g = case["num_generations"]
    r = case["rewards"]
    return [r[i:i + g] for i in range(0, len(r), g)]


def test_rloo_advantages():
    def ref(case):
        out = []
        for group in _groups(case):
            valid = [x for x in group if not math.isnan(x)]
            out += [0.0 if math.isnan(x) else x - (sum(valid) - x) / (len(valid) - 1) for x in group]
        return out
    assert_conforms(RLOO(), ref, REWARD_CASES)


def test_reinforce_group_mean_baseline():
    def ref(case):
        out = []
        for group in _groups(case):
            valid = [x for x in group if not math.isnan(x)]
            out += [0.0 if math.isnan(x) else x - sum(valid) / len(valid) for x in group]
        return out
    assert_conforms(ReinforceBaseline(), ref, REWARD_CASES)


@pytest.mark.parametrize("std, eps", [("sample", 1e-4), ("population", 1e-6), ("leave_one_out", 1e-4)])
def test_group_norm_advantages(std, eps):
    def ref(case):
        out = []
        for group in _groups(case):
            valid = [x for x in group if not math.isnan(x)]
            mean = sum(valid) / len(valid)
            for k, x in enumerate(group):
                if math.isnan(x):
                    out.append(0.0)
                    continue
                if std == "leave_one_out":
                    others = [y for j, y in enumerate(group) if j != k and not math.isnan(y)]
                    m = sum(others) / len(others)
                    s = math.sqrt(sum((y - m) ** 2 for y in others) / max(len(others) - 1, 1))
                else:
                    dof = len(valid) - 1 if std == "sample" else len(valid)
                    s = math.sqrt(sum((y - mean) ** 2 for y in valid) / max(dof, 1))
                out.append((x - mean) / (s + eps))
        return out
    assert_conforms(GroupNorm(GroupNormParams(std=std, epsilon=eps)), ref, REWARD_CASES)


def test_group_norm_convention_1_numbers():
    # ALGORITHMS.md convention 1: [1, 0, 0, 0] gives 1.5 (unbiased std) vs 1.732 (population) for the top sample
    case = [{"rewards": [1.0, 0.0, 0.0, 0.0], "num_generations": 4}]
    assert_conforms(GroupNorm(GroupNormParams(epsilon=0.0)), lambda c: [1.5, -0.5, -0.5, -0.5], case)
    third = 1 / math.sqrt(3)
    assert_conforms(GroupNorm(GroupNormParams(std="population", epsilon=0.0)),
                    lambda c: [math.sqrt(3), -third, -third, -third], case)
    # scale: batch over [1,0,0,0,0,0,0,1] (two groups): group means 0.25, 0.25; batch sample std sqrt(2*0.75^2... )
    case = [{"rewards": [1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0], "num_generations": 4}]
    s = math.sqrt((2 * 0.75 ** 2 + 6 * 0.25 ** 2) / 7)  # batch mean 0.25, unbiased
    assert_conforms(GroupNorm(GroupNormParams(scale="batch", epsilon=0.0)),
                    lambda c: [0.75 / s] + [-0.25 / s] * 6 + [0.75 / s], case)


def test_conformance_failure_names_plugin_case_and_error():
    with pytest.raises(AssertionError, match=r"plugin 'grpo', case 0: loss differs"):
        assert_conforms(GRPO(), lambda case, theta: theta.sum() * 0 + 123.0, [BASE])


def test_correction_diagnostics_by_hand():
    from trl_ext_plugins.corrections import math as cm

    # rho = [1, 2, 4 (masked by the band), pad]; weights [1, 2, 0]; sequences: row 0 tokens 0-1, row 1 token 2
    log_rho = torch.tensor([[0.0, math.log(2.0)], [math.log(4.0), 0.0]], dtype=D)
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]], dtype=D)
    weight = torch.tensor([[1.0, 2.0], [0.0, 0.0]], dtype=D)
    changed = torch.tensor([[False, False], [True, False]])
    stats = reduce_figures(cm.mismatch_stats(log_rho, weight, changed, mask))
    assert stats["rho/mean"] == pytest.approx(7 / 3)
    assert stats["rho/std"] == pytest.approx(math.sqrt(((1 - 7 / 3) ** 2 + (2 - 7 / 3) ** 2 + (4 - 7 / 3) ** 2) / 2))
    assert stats["rho/max"] == pytest.approx(4.0)
    assert stats["ess"] == pytest.approx(3 ** 2 / (3 * 5))  # (1 + 2 + 0)^2 / (3 * (1 + 4 + 0))
    assert stats["changed_fraction"] == pytest.approx(1 / 3)
    assert stats["changed_sequence_fraction"] == pytest.approx(1 / 2)
    assert stats["mismatch_kl/k1"] == pytest.approx(-(math.log(2) + math.log(4)) / 3)
    assert stats["mismatch_kl/k3"] == pytest.approx(((2 - 1 - math.log(2)) + (4 - 1 - math.log(4))) / 3)


@pytest.mark.parametrize("ratio, value, slope", [
    # A = -1, eps 0.2, c = 3. r = 5: PPO loss -min(5*-1, 1.2*-1) = 5, capped at -c*A = 3, gradient 0
    (5.0, 3.0, 0.0),
    # r = 2: PPO loss 2 < 3, unclipped, gradient d(-r A)/dlogpi = -r A = 2
    (2.0, 2.0, 2.0),
    # r = 0.5: the PPO clip binds (loss -0.8 * -1 = 0.8, gradient 0); the dual clip does not
    (0.5, 0.8, 0.0),
])
def test_grpo_dual_clip_by_hand(ratio, value, slope):
    from trl_ext_plugins.losses.grpo import GRPOParams

    case = {"theta": [[math.log(ratio)]], "old": [[0.0]], "advantages": [[-1.0]]}
    assert_conforms(GRPO(GRPOParams(dual_clip=3.0)), lambda c, theta: (torch.tensor(value, dtype=D), torch.tensor([[slope]], dtype=D)),
                    [case])


@pytest.mark.parametrize("normalization, expected_nll", [("mean", 6.0 / 3), ("sum", 6.0)])
def test_dpo_nll_term_mean_or_sum_by_hand(normalization, expected_nll):
    from trl_ext.batches import PreferenceInputs
    from trl_ext_plugins.preference.dpo import DPO, DPOParams

    # chosen log pi = -6 over 3 tokens, equal to the reference on both sides: DPO term ln 2; NLL 6/3 or 6; alpha 0.5
    inputs = PreferenceInputs(chosen_logps=torch.tensor([-6.0], dtype=D), rejected_logps=torch.tensor([-4.0], dtype=D),
                              chosen_lengths=torch.tensor([3.0], dtype=D), rejected_lengths=torch.tensor([2.0], dtype=D),
                              ref_chosen_logps=torch.tensor([-6.0], dtype=D),
                              ref_rejected_logps=torch.tensor([-4.0], dtype=D), beta=0.1)
    loss = DPO(DPOParams(nll_weight=0.5, nll_normalization=normalization)).trl_ext_preference_loss(inputs=inputs)
    assert loss.item() == pytest.approx(math.log(2) + 0.5 * expected_nll, rel=1e-12)


def test_dpo_nll_term_batch_token_mean_by_hand():
    """TRL's 'sft' term: the chosen tokens' NLL summed over the micro-batch over their count, one value for all rows."""
    from trl_ext.batches import PreferenceInputs
    from trl_ext_plugins.preference.dpo import DPO, DPOParams

    # chosen log pi = [-6 over 3 tokens, -1 over 1 token] -> 7 / 4 = 1.75 per row (per-row means would be 2 and 1);
    # pi = pi_ref on both sides: DPO term ln 2 per row; alpha 0.5 -> ln 2 + 0.875 on each row
    chosen = torch.tensor([-6.0, -1.0], dtype=D, requires_grad=True)
    inputs = PreferenceInputs(chosen_logps=chosen, rejected_logps=torch.tensor([-4.0, -2.0], dtype=D),
                              chosen_lengths=torch.tensor([3.0, 1.0], dtype=D),
                              rejected_lengths=torch.tensor([2.0, 1.0], dtype=D),
                              ref_chosen_logps=torch.tensor([-6.0, -1.0], dtype=D),
                              ref_rejected_logps=torch.tensor([-4.0, -2.0], dtype=D), beta=0.1)
    loss = DPO(DPOParams(nll_weight=0.5, nll_normalization="batch_token_mean")).trl_ext_preference_loss(inputs=inputs)
    assert loss.tolist() == pytest.approx([math.log(2) + 0.875] * 2, rel=1e-12)
    loss.mean().backward()
    # d/d chosen_i of mean_i(-0.1 logsigmoid-term...) : DPO part -beta * sigmoid(0) / 2 = -0.025 per row; NLL part
    # 0.5 * (-1 / 4) for each row's summed log-prob (each row's share of the batch-token mean), shared by both rows
    assert chosen.grad.tolist() == pytest.approx([-0.025 - 0.125, -0.025 - 0.125], rel=1e-12)
