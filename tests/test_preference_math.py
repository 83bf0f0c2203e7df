"""Preference losses as pure functions: ALGORITHMS.md items 18-25 numbers (float64) and gradient directions."""

import math

import pytest
import torch

from trl_ext_plugins.preference import math as pm

D = torch.float64


def t(*values, grad=False):
    return torch.tensor(values, dtype=D, requires_grad=grad)


def sigmoid(x):
    return 1.0 / (1.0 + math.exp(-x))


def test_ipo_numbers_minimum_and_gradient_sign():
    # tau = 0.1 -> target 5; h = 3 -> (3 - 5)^2 = 4
    assert pm.ipo_loss(t(3.0), t(0.0), 0.1).item() == pytest.approx(4.0, abs=1e-12)
    assert pm.ipo_loss(t(2.0), t(-3.0), 0.1).item() == pytest.approx(0.0, abs=1e-12)
    for gap, sign in ((3.0, -1), (7.0, +1)):  # below target: raising chosen lowers the loss; above: the opposite
        chosen = t(gap, grad=True)
        pm.ipo_loss(chosen, t(0.0), 0.1).sum().backward()
        assert torch.sign(chosen.grad).item() == sign


@pytest.mark.parametrize("fn, expected, d_chosen, d_rejected", [
    (pm.apo_zero_loss, 0.925187, -0.024752, 0.024938),
    (pm.apo_down_loss, 0.975391, 0.000306, 0.024446),
])
def test_apo_numbers_and_gradients(fn, expected, d_chosen, d_rejected):
    chosen, rejected = t(2.0, grad=True), t(-1.0, grad=True)
    loss = fn(chosen, rejected, 0.1)
    assert loss.item() == pytest.approx(expected, abs=1e-6)
    loss.sum().backward()
    assert chosen.grad.item() == pytest.approx(d_chosen, abs=1e-6)
    assert rejected.grad.item() == pytest.approx(d_rejected, abs=1e-6)


def test_apo_at_init_is_one_and_down_has_zero_chosen_gradient():
    for fn in (pm.apo_zero_loss, pm.apo_down_loss):
        assert fn(t(0.0), t(0.0), 0.1).item() == pytest.approx(1.0, abs=1e-12)
    chosen = t(0.0, grad=True)
    pm.apo_down_loss(chosen, t(0.0), 0.1).sum().backward()
    assert chosen.grad.item() == pytest.approx(0.0, abs=1e-15)


def test_simpo_number_and_length_invariance():
    # beta 2, gamma 1, mean logps -0.5 / -1.0: margin 2*0.5 - 1 = 0 -> ln 2
    assert pm.simpo_loss(t(-0.5), t(-1.0), 2.0, 1.0).item() == pytest.approx(math.log(2), abs=1e-12)
    # the same averages from sequences twice as long give the same loss
    short = pm.simpo_loss(t(-1.0 / 2), t(-3.0 / 3), 2.0, 1.0)
    long = pm.simpo_loss(t(-2.0 / 4), t(-6.0 / 6), 2.0, 1.0)
    assert short.item() == pytest.approx(long.item(), abs=1e-12)
    chosen, rejected = t(-0.5, grad=True), t(-1.0, grad=True)
    pm.simpo_loss(chosen, rejected, 2.0, 1.0).sum().backward()
    assert chosen.grad.item() < 0 < rejected.grad.item()


def test_orpo_numbers_and_gradients():
    # mean logps -0.5 / -1.0: odds 1.541494 / 0.581977, log-odds-ratio 0.974077, L_OR 0.320300
    assert math.exp(pm.log_odds(t(-0.5)).item()) == pytest.approx(1.541494, abs=1e-6)
    assert math.exp(pm.log_odds(t(-1.0)).item()) == pytest.approx(0.581977, abs=1e-6)
    chosen, rejected = t(-0.5, grad=True), t(-1.0, grad=True)
    l_or = pm.orpo_odds_ratio_loss(chosen, rejected)
    assert l_or.item() == pytest.approx(0.320300, abs=1e-6)
    assert (0.5 + 0.1 * l_or).item() == pytest.approx(0.532030, abs=1e-6)
    l_or.sum().backward()
    assert chosen.grad.item() < 0 < rejected.grad.item()
    # stable near P = 1 (mean log-prob -> 0-)
    assert torch.isfinite(pm.log_odds(t(-1e-12))).all()


def bern_kl(p, q):  # independent scalar oracle
    return p * math.log(p / q) + (1 - p) * math.log((1 - p) / (1 - q))


def test_rpo_numbers_and_zero_at_matching_gaps():
    policy, target = t(0.3, grad=True), t(1.0)
    bwd = pm.rpo_bwd_kl_loss(policy, target)
    assert bwd.item() == pytest.approx(bern_kl(sigmoid(1.0), sigmoid(0.3)), abs=1e-12)
    assert bwd.item() == pytest.approx(0.052835, abs=5e-5)  # ALGORITHMS.md (6 digits rounded there)
    assert pm.rpo_fwd_kl_loss(t(0.3), target).item() == pytest.approx(bern_kl(sigmoid(0.3), sigmoid(1.0)), abs=1e-12)
    assert pm.rpo_sq_loss(t(0.3), target).item() == pytest.approx(0.49, abs=1e-12)
    bwd.sum().backward()
    assert policy.grad.item() < 0  # policy gap below the target: the loss pushes it up
    for fn in (pm.rpo_bwd_kl_loss, pm.rpo_fwd_kl_loss, pm.rpo_sq_loss):
        gap = t(0.7, grad=True)
        loss = fn(gap, t(0.7))
        loss.sum().backward()
        assert loss.item() == pytest.approx(0.0, abs=1e-12)
        assert gap.grad.item() == pytest.approx(0.0, abs=1e-12)  # unlike DPO, no push once the gaps agree


def test_rpo_kl_with_an_infinite_target_gap_is_finite_with_a_finite_gradient():
    """A target reward gap of +inf: Bern(1) || Bern(sigma(g)) = -log sigma(g) (the other outcome has probability 0 and
    contributes 0, not 0 * -inf); the gradient is -(1 - sigma(g))."""
    policy = t(0.3, grad=True)
    loss = pm.rpo_bwd_kl_loss(policy, t(math.inf))
    assert loss.item() == pytest.approx(-math.log(sigmoid(0.3)), abs=1e-12)
    loss.backward()
    assert policy.grad.item() == pytest.approx(-(1 - sigmoid(0.3)), abs=1e-12)
    assert pm.bernoulli_kl(t(-math.inf), t(0.0)).item() == pytest.approx(math.log(2), abs=1e-12)


def test_rpo_reports_a_nan_policy_gap_in_every_form():
    """A NaN policy gap (NaN log-probs) made rpo's fwd_kl loss 0 with a NaN gradient: the KL terms took NaN for p = 0.
    Every form now reports NaN, as dpo and NeMo-Aligner's fwd_kl do."""
    for fn in (pm.rpo_bwd_kl_loss, pm.rpo_fwd_kl_loss, pm.rpo_sq_loss):
        assert math.isnan(fn(t(math.nan), t(1.0)).item())
    assert math.isnan(pm.bernoulli_kl(t(math.nan), t(0.0)).item())


def test_qrpo_quantile_partition_and_loss():
    r_q = pm.quantile_reward(t(0.6), t(0.1, 0.5, 0.9, 0.3).unsqueeze(0))
    assert r_q.item() == pytest.approx(0.75, abs=1e-12)
    assert pm.qrpo_log_partition(0.1, exact=True) == pytest.approx(7.697370, abs=1e-6)
    assert pm.qrpo_log_partition(0.1, exact=False) == pytest.approx(7.697415, abs=1e-6)
    assert pm.qrpo_log_partition(0.5, exact=True) == pytest.approx(math.log(0.5 * (math.exp(2.0) - 1)), abs=1e-12)
    # large beta: beta * log Z = 1/2 + 1/(24 beta) + O(beta^-2) (series of log(beta (e^{1/beta} - 1))); the loss scales
    # log Z by beta, and log1p(-exp(-1/beta)) lost it to cancellation (1.6e-5 off at 1e6)
    for beta in (1e3, 1e6):
        assert beta * pm.qrpo_log_partition(beta) == pytest.approx(0.5 + 1 / (24 * beta), abs=1e-7)
    loss = pm.qrpo_loss(r_q, t(0.0), 0.1, pm.qrpo_log_partition(0.1))
    assert loss.item() == pytest.approx((0.75 - 0.769737) ** 2, abs=1e-8)
    assert loss.item() == pytest.approx(0.000390, abs=1e-6)
    # NaN-padded reference rewards are ignored
    padded = pm.quantile_reward(t(0.6, 0.6), t(0.1, 0.5, 0.9, 0.3, 0.7, 0.2, math.nan, math.nan).view(2, 4))
    assert padded.tolist() == pytest.approx([0.75, 0.5])
    # the quantile target carries no gradient; the log-ratio moves towards (r_q - beta log Z) / beta
    logratio = t(0.0, grad=True)
    pm.qrpo_loss(r_q, logratio, 0.1, pm.qrpo_log_partition(0.1)).sum().backward()
    # target log-ratio (r_q - beta log Z) / beta = -0.197 < 0: the gradient pushes the log-ratio down
    assert logratio.grad.item() == pytest.approx(-2 * 0.1 * (0.75 - 0.1 * 7.697370), abs=1e-6)
    assert logratio.grad.item() > 0


def test_kto_numbers_clamp_and_detached_kl():
    # beta 0.1: desirable r = 2, z0 = 0.5 -> 1 - sigma(0.15); undesirable r = -1, z0 = 0.5 -> same
    kl = t(0.5, grad=True)
    logratios = t(2.0, -1.0, grad=True)
    losses = pm.kto_loss(logratios, torch.tensor([True, False]), kl, 0.1)
    assert losses.tolist() == pytest.approx([1 - sigmoid(0.15)] * 2, abs=1e-12)
    assert losses[0].item() == pytest.approx(0.462570, abs=1e-6)
    losses.sum().backward()
    assert kl.grad is None  # z0 is detached
    # desirable pushed up, undesirable pushed down
    assert logratios.grad[0].item() < 0 < logratios.grad[1].item()
    clamped = pm.kto_loss(t(2.0), torch.tensor([True]), t(-3.0), 0.1)
    assert clamped.item() == pytest.approx(1 - sigmoid(0.2), abs=1e-12)  # z0 = max(0, -3) = 0
    weighted = pm.kto_loss(t(2.0, -1.0), torch.tensor([True, False]), t(0.5), 0.1, 2.0, 0.5)
    assert weighted.tolist() == pytest.approx([2 * (1 - sigmoid(0.15)), 0.5 * (1 - sigmoid(0.15))], abs=1e-12)
    unpaired = pm.apo_zero_unpaired_loss(t(2.0, -1.0), torch.tensor([True, False]), 0.1)
    assert unpaired.tolist() == pytest.approx([1 - sigmoid(0.2), sigmoid(-0.1)], abs=1e-12)


def test_dpo_nll_weight_adds_the_chosen_per_token_nll():
    import torch

    from trl_ext.batches import PreferenceInputs
    from trl_ext_plugins.preference.dpo import DPO, DPOParams

    chosen = torch.tensor([-2.0, -6.0], dtype=torch.float64, requires_grad=True)
    pref = PreferenceInputs(chosen_logps=chosen, rejected_logps=torch.tensor([-3.0, -5.0], dtype=torch.float64),
                            chosen_lengths=torch.tensor([2, 3]), rejected_lengths=torch.tensor([2, 3]),
                            ref_chosen_logps=torch.tensor([-2.5, -6.0], dtype=torch.float64),
                            ref_rejected_logps=torch.tensor([-3.0, -5.5], dtype=torch.float64), beta=0.1)
    plain = DPO().trl_ext_preference_loss(pref)
    mixed = DPO(DPOParams(nll_weight=0.5)).trl_ext_preference_loss(pref)
    # -log sigmoid(0.1 * (0.5 - 0)) and -log sigmoid(0.1 * (0 - 0.5)), by hand
    assert plain.tolist() == pytest.approx([0.668460, 0.718460], abs=1e-6)
    assert (mixed - plain).tolist() == pytest.approx([0.5 * 2.0 / 2, 0.5 * 6.0 / 3], abs=1e-12)
    mixed.sum().backward()
    assert chosen.grad[1].item() < 0  # the NLL term pushes the chosen log-prob up


@pytest.mark.parametrize("transform, beta", [("log", 0.5), ("log", 0.1), ("normal_icdf", 1.0), ("normal_icdf", 2.0)])
def test_qrpo_transform_log_partitions_are_exact_for_a_uniform_quantile(transform, beta):
    """log Z = log E_{u~U(0,1)}[exp(f(u)/beta)]: E[u^(1/beta)] = beta/(1+beta) for log, e^(1/(2 beta^2)) for the
    normal quantile (its moment generating function); checked by quadrature on a fine grid of u."""
    u = torch.linspace(0, 1, 2_000_001, dtype=torch.float64)[1:-1]
    f = torch.log(u) if transform == "log" else torch.distributions.Normal(0.0, 1.0).icdf(u)
    numeric = math.log(torch.exp(f / beta).mean().item())
    assert pm.qrpo_log_partition(beta, transform=transform) == pytest.approx(numeric, abs=2e-3)


@pytest.mark.parametrize("scale, beta", [(0.5, 1.0), (2.0, 2.0)])
def test_qrpo_scaled_normal_icdf_log_partition_is_exact_for_a_uniform_quantile(scale, beta):
    """log E_{u~U(0,1)}[exp(s Phi^-1(u) / beta)] = s^2 / (2 beta^2): the unit form times s^2, by quadrature."""
    u = torch.linspace(0, 1, 2_000_001, dtype=torch.float64)[1:-1]
    f = scale * torch.distributions.Normal(0.0, 1.0).icdf(u)
    numeric = math.log(torch.exp(f / beta).mean().item())
    assert scale**2 * pm.qrpo_log_partition(beta, transform="scaled_normal_icdf") == pytest.approx(numeric, abs=2e-3)


def test_reference_reward_std_is_the_sample_std_of_each_rows_present_rewards():
    import statistics

    refs = torch.tensor([[0.1, 0.5, 0.9, 0.3], [1.0, 2.0, float("nan"), float("nan")], [3.0] + [float("nan")] * 3],
                        dtype=torch.float64)
    assert pm.reference_reward_std(refs).tolist() == pytest.approx(
        [statistics.stdev([0.1, 0.5, 0.9, 0.3]), statistics.stdev([1.0, 2.0]), 0.0], rel=1e-12)


def test_qrpo_transformed_rewards_follow_the_reference_implementation():
    """The repository's clamps: log max(r_q, 1/n) (r_q = 0 below every reference reward), normal icdf of r_q in
    [1/n, (n-1)/n]; rows with a NaN (missing) reference reward use their own n."""
    r_q = torch.tensor([0.0, 0.5, 1.0], dtype=torch.float64)
    n = torch.tensor([4, 4, 3])
    assert pm.transformed_quantile_reward(r_q, n, "log").tolist() == pytest.approx(
        [math.log(0.25), math.log(0.5), 0.0])
    icdf = torch.distributions.Normal(0.0, 1.0).icdf
    expected = icdf(torch.tensor([0.25, 0.5, 2 / 3], dtype=torch.float64)).tolist()
    assert pm.transformed_quantile_reward(r_q, n, "normal_icdf").tolist() == pytest.approx(expected)
    assert torch.equal(pm.transformed_quantile_reward(r_q, n, "identity"), r_q)
