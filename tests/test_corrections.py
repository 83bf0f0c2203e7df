"""Formula and gradient tests of the ``corrections`` family (ALGORITHMS.md items 40-43, conventions 5-8).

Fixtures name the three policies (convention 7): ``old`` = pi_old (trainer copy at sampling time), ``rollout`` =
pi_rollout (engine), ``theta`` = the current policy (requires grad).
"""

from __future__ import annotations

import math

import pytest
import torch

from test_losses import D, make_inputs, token_grad
from trl_ext import Need
from trl_ext.metrics import reduce_figures
from trl_ext_plugins.corrections import math as cm
from trl_ext_plugins.corrections.icepop import IcePop
from trl_ext_plugins.corrections.m2po import M2PO
from trl_ext_plugins.corrections.mis import MIS
from trl_ext_plugins.corrections.rollout_ratio import RolloutRatio
from trl_ext_plugins.corrections.tis import TIS
from trl_ext_plugins.losses.grpo import GRPO


def with_rho(rhos, **kw):
    """Inputs whose tokens have rho = pi_old / pi_rollout = rhos (log pi_old = log pi_theta = -1)."""
    old = torch.full((1, len(rhos)), -1.0, dtype=D)
    rollout = old - torch.log(torch.tensor([rhos], dtype=D))
    return make_inputs(old.clone(), old=old, rollout=rollout, **kw)


def weights_of(plugin, rhos, **kw):
    return plugin.trl_ext_token_weights(inputs=with_rho(rhos, **kw)).weight


def test_tis_and_mis_numbers():
    assert weights_of(TIS(), [3.0, 0.4, 1.0]).flatten().tolist() == pytest.approx([2.0, 0.4, 1.0])
    assert weights_of(MIS(), [3.0, 0.4, 1.0]).flatten().tolist() == pytest.approx([0.0, 0.0, 1.0])
    assert weights_of(TIS(TIS.Params(lower=0.5)), [0.4]).flatten().tolist() == pytest.approx([0.5])


def test_sequence_levels():
    rhos = [1.5, 1.5, 1.2]  # product 2.7, geometric mean 2.7^(1/3)
    assert weights_of(TIS(TIS.Params(level="sequence")), rhos).flatten().tolist() == pytest.approx([2.0])
    assert weights_of(MIS(MIS.Params(level="sequence")), rhos).flatten().tolist() == pytest.approx([0.0])
    geo = MIS(MIS.Params(level="geometric"))
    assert weights_of(geo, rhos).flatten().tolist() == pytest.approx([2.7 ** (1 / 3)])


def test_icepop_band_and_zero_gradient():
    li = with_rho([1.8, 2.5, 0.4, 1.0, 0.5, 2.0])
    tw = IcePop().trl_ext_token_weights(inputs=li)
    assert tw.weight.flatten().tolist() == pytest.approx([1.8, 0.0, 0.0, 1.0, 0.5, 2.0])  # bounds inclusive
    assert not tw.weight.requires_grad and tw.mask is None  # weight 0, the token stays in the denominator
    li.per_token_logps.data += torch.tensor([[0.1, 0.1, -0.1, 0.0, 0.0, 0.0]], dtype=D)  # move theta off pi_old
    loss = GRPO().trl_ext_policy_loss(inputs=li) * tw.weight
    grad = token_grad(loss, li)
    assert grad[0, 1] == 0 and grad[0, 2] == 0 and grad[0, 0] != 0
    # rho = 1 everywhere: plain GRPO
    assert weights_of(IcePop(), [1.0, 1.0]).tolist() == [[1.0, 1.0]]
    assert weights_of(IcePop(IcePop.Params(beta=5.0, lower=0.5)), [4.0, 0.45]).flatten().tolist() == pytest.approx([4.0, 0.0])


def test_weights_are_detached_even_from_a_differentiable_old_policy():
    li = with_rho([1.5, 3.0])
    li.old_per_token_logps = li.old_per_token_logps.clone().requires_grad_(True)
    for plugin in (TIS(), MIS(), IcePop()):
        assert not plugin.trl_ext_token_weights(inputs=li).weight.requires_grad


def test_mis_drop_from_denominator_is_a_mask():
    tw = MIS(MIS.Params(drop_from_denominator=True)).trl_ext_token_weights(inputs=with_rho([3.0, 1.2]))
    assert tw.mask.tolist() == [[False, True]] and tw.weight.flatten().tolist() == pytest.approx([1.0, 1.2])


def test_mismatch_statistics_logged():
    li = with_rho([3.0, 0.4, 1.0])
    MIS().trl_ext_token_weights(inputs=li)
    m = reduce_figures(li.metrics)
    assert m["mis/logp_diff/max"] == pytest.approx(math.log(3.0))
    assert m["mis/logp_diff/mean"] == pytest.approx((math.log(3.0) + abs(math.log(0.4))) / 3)
    assert m["mis/changed_fraction"] == pytest.approx(2 / 3)
    assert (m["mis/weight/min"], m["mis/weight/max"], m["mis/weight/mean"]) == pytest.approx((0.0, 1.0, 1 / 3))


def test_missing_sampling_logprobs_is_a_clear_error():
    with pytest.raises(RuntimeError, match="rollout_logprobs"):
        TIS().trl_ext_token_weights(inputs=make_inputs([[0.0]]))


def test_corrections_declare_their_needs():
    for plugin in (TIS, MIS, IcePop):
        assert {Need.SAMPLING_LOGPROBS, Need.OLD_POLICY_LOGPROBS} <= plugin.needs
    assert RolloutRatio.needs == {Need.SAMPLING_LOGPROBS} and not M2PO.needs


# -- rollout_ratio (GLM-5 direct double-sided IS) ---------------------------------------------------------------------


def test_rollout_ratio_band_and_cispo_style_gradient():
    theta = torch.full((1, 3), -1.0, dtype=D)
    rollout = theta - torch.log(torch.tensor([[1.1, 1.3, 0.75]], dtype=D))  # r = pi_theta / pi_rollout
    # pi_old is deliberately different: the objective must not use it
    li = make_inputs(theta, old=torch.full((1, 3), -7.0), rollout=rollout, advantages=[[2.0]])
    loss = RolloutRatio().trl_ext_policy_loss(inputs=li)
    assert token_grad(loss, li).flatten().tolist() == pytest.approx([-1.1 * 2.0, 0.0, 0.0])  # -sg(f(r)) * A
    assert loss.flatten().tolist() == pytest.approx([-1.1 * 2.0 * -1.0, 0.0, 0.0])


def test_rollout_ratio_refuses_old_policy_corrections_naming_both():
    messages = RolloutRatio().trl_ext_validate_stage(stage=None, plugins=[RolloutRatio(), IcePop(), M2PO()])
    assert len(messages) == 1 and "'rollout_ratio'" in messages[0] and "'icepop'" in messages[0]


# -- M2PO -------------------------------------------------------------------------------------------------------------


def test_m2po_masks_largest_second_moment_first():
    log_r = torch.tensor([[0.5, 0.1, -0.1, 0.05]], dtype=D)
    mask = torch.ones(1, 4, dtype=D)
    assert ((log_r ** 2).mean()).item() == pytest.approx(0.068125)
    keep = cm.m2_keep_mask(log_r, mask, 0.04)
    assert keep.tolist() == [[False, True, True, True]]
    assert (log_r[keep] ** 2).mean().item() == pytest.approx(0.0075)
    assert cm.m2_keep_mask(log_r * 0.1, mask, 0.04).all()  # all small: nothing masked
    padded = cm.m2_keep_mask(torch.tensor([[0.5, 9.0]], dtype=D), torch.tensor([[1.0, 0.0]], dtype=D), 0.04)
    assert padded.tolist() == [[False, False]]  # padding never kept, never counted


def test_m2po_plugin_uses_rollout_logprobs_and_masks():
    theta = torch.tensor([[0.5, 0.1, -0.1, 0.05]], dtype=D)
    li = make_inputs(theta, old=theta, rollout=torch.zeros(1, 4))
    tw = M2PO().trl_ext_token_weights(inputs=li)
    assert tw.weight is None and tw.mask.tolist() == [[False, True, True, True]]
    assert reduce_figures(li.metrics)["m2po/changed_fraction"] == pytest.approx(0.25)


def test_m2po_policy_old_measures_the_proximal_policy_as_areal():
    """AReaL takes M2 of log pi_prox - log pi_behave (trl-ext's pi_old), the paper of pi_theta: the same on the first
    micro-batch, apart once pi_theta has moved. Here pi_old sits where theta did above (the first token masked), while
    pi_theta has moved back to the behaviour policy (nothing to mask)."""
    old = torch.tensor([[0.5, 0.1, -0.1, 0.05]], dtype=D)
    li = make_inputs(torch.zeros(1, 4, dtype=D), old=old, rollout=torch.zeros(1, 4))
    assert M2PO().trl_ext_token_weights(inputs=li).mask.all()
    tw = M2PO(M2PO.Params(policy="old")).trl_ext_token_weights(inputs=li)
    assert tw.mask.tolist() == [[False, True, True, True]]


# -- Hostile values at padding and cancellation -----------------------------------------------------------------------


def _hostile_padding(theta, old, rollout, mask):
    """Copies of the log-probs with -inf (and a NaN "not recorded") at the padded positions, as raw model outputs or an
    engine's missing log-probs can be there."""
    theta_h, old_h, rollout_h = (torch.tensor(x, dtype=D) for x in (theta, old, rollout))
    pad = ~torch.tensor(mask, dtype=torch.bool)
    theta_h[pad] = -math.inf
    old_h[pad] = -math.inf
    rollout_h[pad] = -math.inf
    rollout_h[0, -1] = math.nan
    return theta_h, old_h, rollout_h


@pytest.mark.parametrize("plugin", [TIS(), MIS(), IcePop(), M2PO(), TIS(TIS.Params(level="sequence")),
                                    MIS(MIS.Params(level="geometric"))], ids=lambda p: f"{p.name}")
def test_correction_weights_ignore_infinite_padding(plugin):
    """-inf - -inf is NaN: the weights and masks on real tokens must equal those of clean padding, and be finite."""
    theta = [[-0.3, -1.2, -0.7, 0.0], [-2.0, -0.1, 0.0, 0.0]]
    old = [[-0.5, -1.0, -0.6, 0.0], [-1.7, -0.2, 0.0, 0.0]]
    rollout = [[-0.9, -1.1, -0.2, 0.0], [-1.0, -0.3, 0.0, 0.0]]
    mask = [[1, 1, 1, 0], [1, 1, 0, 0]]
    clean = plugin.trl_ext_token_weights(inputs=make_inputs(theta, old=old, rollout=rollout, mask=mask))
    theta_h, old_h, rollout_h = _hostile_padding(theta, old, rollout, mask)
    hostile = plugin.trl_ext_token_weights(inputs=make_inputs(theta_h, old=old_h, rollout=rollout_h, mask=mask))
    real = torch.tensor(mask, dtype=torch.bool)
    for got, want in ((hostile.weight, clean.weight), (hostile.mask, clean.mask)):
        assert (got is None) == (want is None)
        if got is not None:
            got, want = got.expand(real.shape), want.expand(real.shape)
            assert torch.isfinite(got.to(D)).all()
            assert torch.equal(got[real], want[real])


def test_rollout_ratio_is_finite_with_zero_gradient_at_infinite_padding():
    theta = [[-0.3, -1.2, -0.7, 0.0], [-2.0, -0.1, 0.0, 0.0]]
    rollout = [[-0.4, -1.0, -0.9, 0.0], [-1.9, -0.3, 0.0, 0.0]]
    mask = [[1, 1, 1, 0], [1, 1, 0, 0]]
    theta_h, _, rollout_h = _hostile_padding(theta, theta, rollout, mask)
    advantages = torch.tensor([[1.5, 1.5, 1.5, math.nan], [-0.5, -0.5, math.nan, math.nan]], dtype=D)
    clean_inputs = make_inputs(theta, rollout=rollout, advantages=advantages.nan_to_num(0.0), mask=mask)
    hostile_inputs = make_inputs(theta_h, rollout=rollout_h, advantages=advantages, mask=mask)
    clean = RolloutRatio().trl_ext_policy_loss(inputs=clean_inputs)
    loss = RolloutRatio().trl_ext_policy_loss(inputs=hostile_inputs)
    real = torch.tensor(mask, dtype=torch.bool)
    assert torch.isfinite(loss).all() and torch.equal(loss[real], clean[real])
    grad = token_grad(loss, hostile_inputs)
    assert torch.isfinite(grad).all() and (grad[~real] == 0).all()
    assert torch.equal(grad[real], token_grad(clean, clean_inputs)[real])


def test_m2po_keep_mask_has_no_cancellation_and_survives_infinity():
    """Removing the largest token must leave the exact mean of the rest: with the old ``total - prefix`` sum a 1e4
    log-ratio (1e8 squared) absorbed the small ones in float32 (mean of [0.3, 0.3] read as 0), and inf - inf was NaN."""
    log_r = torch.tensor([[1e4, 0.3, 0.3, 0.01]], dtype=torch.float32)
    mask = torch.ones(1, 4)
    # removing 1e4 leaves mean (0.09 + 0.09 + 1e-4) / 3 = 0.06003 > 0.04, so the two 0.3s go too
    assert cm.m2_keep_mask(log_r, mask, 0.04).tolist() == [[False, False, False, True]]
    assert cm.m2_keep_mask(log_r, mask, 0.07).tolist() == [[False, True, True, True]]
    infinite = torch.tensor([[math.inf, 0.1, 0.1]])
    assert cm.m2_keep_mask(infinite, torch.ones(1, 3), 0.04).tolist() == [[False, True, True]]
    assert cm.suffix_sums(torch.tensor([3.0, 2.0, 1.0])).tolist() == [6.0, 3.0, 1.0]


def test_masked_log_ratio_where_before_subtraction():
    num = torch.tensor([[-1.0, -math.inf, -2.0]], dtype=D, requires_grad=True)
    den = torch.tensor([[-1.5, -math.inf, math.nan]], dtype=D)
    mask = torch.tensor([[1.0, 0.0, 1.0]], dtype=D)
    out = cm.masked_log_ratio(num, den, mask)
    assert out.tolist() == [[0.5, 0.0, 0.0]]  # padding and "not recorded" (NaN) give 0
    (grad,) = torch.autograd.grad(out.sum(), num)
    assert grad.tolist() == [[1.0, 0.0, 0.0]]


@pytest.mark.parametrize("plugin, params", [(TIS, {"lower": 3.0, "upper": 2.0}), (MIS, {"lower": 3.0, "upper": 2.0}),
                                            (IcePop, {"lower": 3.0, "beta": 2.0})], ids=lambda x: getattr(x, "name", ""))
def test_inverted_band_is_refused(plugin, params):
    """lower > upper gave MIS/IcePop weight 0 on every token (no gradient at all) and TIS weight 2 on every token
    (torch.clamp with min > max returns max), silently; rollout_correction already refused it."""
    with pytest.raises(ValueError, match=r"lower \(3.0\) must not exceed the upper bound \(2.0\)"):
        plugin.Params(**params)
    equal = {**params, "lower": 2.0}  # a one-point band is legal
    assert weights_of(plugin(plugin.Params(**equal)), [2.0, 1.0]).tolist()[0][0] == pytest.approx(2.0)


def test_mis_lower_bound_follows_the_upper_one_when_only_c_is_given():
    """Band [1/C, C]: with only C = 4 set, the lower bound stayed at 0.5, so rho = 0.3 was masked although it lies in
    [0.25, 4] (verl's rollout_rs lower bound defaults to 1/upper)."""
    from trl_ext_plugins.corrections.mis import MISParams
    from trl_ext_plugins.corrections.rollout_correction import RolloutCorrectionParams

    assert MISParams(upper=4.0).band() == (0.25, 4.0)
    assert MISParams().band() == (0.5, 2.0) and MISParams(upper=4.0, lower=None).band() == (None, 4.0)
    assert MISParams(upper=4.0, lower=0.1).band() == (0.1, 4.0)
    rho = torch.tensor([[0.3, 3.0, 5.0]])
    weight, _ = MIS(MISParams(upper=4.0)).weights(rho.log(), torch.ones_like(rho))
    assert weight[0].tolist() == pytest.approx([0.3, 3.0, 0.0])
    assert RolloutCorrectionParams(preset="mis", upper=4.0).lower == 0.25
    assert RolloutCorrectionParams(preset="mis").lower == 0.5
    with pytest.raises(ValueError, match=r"upper 0.5 < 1 leaves no band \[1/upper, upper\]; give lower"):
        MISParams(upper=0.5)


def test_a_sequence_with_opposite_infinite_log_ratios_gets_weight_zero_not_nan():
    """+inf (the engine gave its sampled token probability 0) and -inf (the trainer gives another token 0) in one
    sequence summed to NaN: every sequence and geometric weight was NaN and the 'sum' statistic rejected nothing."""
    from trl_ext_plugins.corrections.mis import MISParams
    from trl_ext_plugins.corrections.rollout_correction import correction_weights
    from trl_ext_plugins.corrections.tis import TISParams

    inf = math.inf
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    log_rho = cm.rollout_log_rho(torch.tensor([[-1.0, -inf, -2.0, -inf]]), torch.tensor([[-inf, -1.0, -2.0, -inf]]),
                                 mask)
    assert cm.sequence_log_rho(log_rho, mask).item() == -inf
    assert TIS(TISParams(level="sequence")).weights(log_rho, mask)[0].item() == pytest.approx(math.exp(-20))  # +-20 clamp
    for level in ("sequence", "geometric"):
        assert MIS(MISParams(level=level)).weights(log_rho, mask)[0].tolist() == [[0.0]]
    weight, rejected = correction_weights(log_rho, mask, "token", "mask", "sum", 0.5, 2.0)
    assert bool(torch.isfinite(weight).all()) and bool(rejected.all()) and weight.abs().sum() == 0
