"""Advantage estimators as pure functions, against the numbers of ALGORITHMS.md items 27-30, 38, 39."""

import math

import pytest
import torch

from trl_ext_plugins.advantages import math as adv

D = torch.float64


def t(values):
    return torch.tensor(values, dtype=D)


# -- RLOO (item 29) --------------------------------------------------------------------------------------------------


def test_rloo_example_and_closed_form():
    assert torch.allclose(adv.rloo_advantages(t([1, 0, 0, 0]), 4), t([1, -1 / 3, -1 / 3, -1 / 3]), atol=1e-12)
    rewards = torch.rand(6, 5, dtype=D, generator=torch.Generator().manual_seed(0)).view(-1)
    grouped = rewards.view(6, 5)
    closed = 5 / 4 * (grouped - grouped.mean(1, keepdim=True))  # K/(K-1) (R_k - mean)
    assert torch.allclose(adv.rloo_advantages(rewards, 5), closed.view(-1), atol=1e-12)


def test_rloo_sums_to_zero_and_is_shift_invariant():
    rewards = torch.randn(32, dtype=D, generator=torch.Generator().manual_seed(1))
    a = adv.rloo_advantages(rewards, 4)
    assert torch.allclose(a.view(8, 4).sum(1), torch.zeros(8, dtype=D), atol=1e-12)
    assert torch.allclose(adv.rloo_advantages(rewards + 7.5, 4), a, atol=1e-12)


def test_group_of_one_sample_gives_zero_as_trl_or_the_raw_reward_as_verl():
    rewards = torch.tensor([1.0, 0.0, 2.0, float("nan")])
    assert adv.group_advantages(rewards, 1).tolist() == [0.0, 0.0, 0.0, 0.0]  # TRL: R - mean(R) over one row
    raw = adv.group_advantages(rewards, 1, single_sample="raw", eps=1e-6)  # verl: mean 0, std 1 for a lone sample
    assert raw.tolist() == pytest.approx([1 / (1 + 1e-6), 0.0, 2 / (1 + 1e-6), 0.0])  # unscorable row: 0
    grouped = torch.tensor([1.0, 0.0, 0.0, 0.0])
    assert adv.group_advantages(grouped, 4, single_sample="raw", eps=0.0)[0].item() == pytest.approx(1.5)  # G > 1


def test_rloo_rejects_one_sample_per_prompt():
    with pytest.raises(ValueError, match="num_generations >= 2"):
        adv.rloo_advantages(t([1.0, 0.0]), 1)


def test_rloo_unscorable_rows_are_left_out():
    # group 1: third row unscorable -> baseline of the others averages the 2 scorable siblings only
    a = adv.rloo_advantages(t([1, 0, math.nan, 0, 5, math.nan, math.nan, math.nan]), 4)
    assert torch.allclose(a, t([1 - 0, 0 - 0.5, 0, 0 - 0.5, 0, 0, 0, 0]), atol=1e-12)


# -- REINFORCE with a baseline (item 27) -----------------------------------------------------------------------------


def test_reinforce_baselines():
    rewards = t([1, 0])
    assert torch.allclose(adv.baseline_advantages(rewards, 0.5), t([0.5, -0.5]))
    assert torch.allclose(adv.baseline_advantages(rewards, adv.group_mean_baseline(rewards, 2)), t([0.5, -0.5]))
    rewards = t([1, 0, 0, 0, 1, 1])
    assert torch.allclose(adv.group_mean_baseline(rewards, 2), t([0.5, 0.5, 0, 0, 1, 1]))
    assert torch.allclose(adv.batch_mean_baseline(rewards), torch.full((6,), 0.5, dtype=D))
    # constant shift of rewards and baseline leaves the advantages unchanged
    assert torch.allclose(adv.baseline_advantages(rewards + 3, adv.group_mean_baseline(rewards + 3, 2)),
                          adv.baseline_advantages(rewards, adv.group_mean_baseline(rewards, 2)))
    assert adv.ema_update(0.0, t([1.0, math.nan, 0.0]), 0.9) == pytest.approx(0.05)
    assert adv.ema_update(0.3, t([math.nan]), 0.9) == 0.3


def test_baseline_does_not_bias_the_gradient_monte_carlo():
    """E_y[b * grad log pi(y)] = 0: a constant baseline changes no expected gradient (small categorical policy)."""
    logits = torch.tensor([0.3, -0.2, 0.5, 0.0], dtype=D, requires_grad=True)
    probs = torch.softmax(logits, 0)
    # exact expectation over the 4 outcomes of b * grad log pi(y)
    grad = torch.autograd.grad((probs.detach() * 2.5 * torch.log_softmax(logits, 0)).sum(), logits)[0]
    assert torch.allclose(grad, torch.zeros(4, dtype=D), atol=1e-12)
    # Monte-Carlo estimate of the same, 20000 samples
    ys = torch.multinomial(probs.detach(), 20000, replacement=True, generator=torch.Generator().manual_seed(0))
    mc = torch.autograd.grad((2.5 * torch.log_softmax(logits, 0)[ys]).mean(), logits)[0]
    assert mc.abs().max() < 0.05


# -- ReMax (item 28) -------------------------------------------------------------------------------------------------


def test_remax_example():
    assert torch.equal(adv.remax_advantages(t([1, 0, 1]), t([1, 1, 0]), 1), t([0, -1, 1]))
    # several samples per prompt share the prompt's greedy baseline; NaN (unscorable) gives 0
    a = adv.remax_advantages(t([1, 0, math.nan, 1]), t([0.5, math.nan]), 2)
    assert torch.equal(a, t([0.5, -0.5, 0, 0]))
    with pytest.raises(ValueError, match="one greedy reward per prompt"):
        adv.remax_advantages(t([1, 0]), t([1, 1]), 2)


# -- token rewards, KL, returns, REINFORCE++ (item 30) ---------------------------------------------------------------


def test_kl_estimators():
    logp, ref = t([math.log(0.5)]), t([math.log(0.25)])
    d = math.log(2)
    assert adv.kl_estimate(logp, ref, "k1").item() == pytest.approx(d)
    assert adv.kl_estimate(logp, ref, "k2").item() == pytest.approx(d * d / 2)
    assert adv.kl_estimate(logp, ref, "k3").item() == pytest.approx(0.5 - 1 + d)  # e^-d - 1 + d
    assert adv.kl_estimate(logp, ref, "k3").item() == pytest.approx(0.193147, abs=1e-6)


def test_reinforce_pp_returns_example():
    mask = t([[1, 1, 1, 0]])
    kl = t([[0.1, 0.2, 0.1, 9.0]])  # the padded position must not count
    r = adv.token_rewards(t([1.0]), mask, kl, kl_coef=0.01)
    assert torch.allclose(r, t([[-0.001, -0.002, 0.999, 0.0]]), atol=1e-12)
    assert torch.allclose(adv.discounted_returns(r, mask, 1.0), t([[0.996, 0.997, 0.999, 0.0]]), atol=1e-12)
    g = adv.discounted_returns(r, mask, 0.5)
    assert g[0, 0].item() == pytest.approx(-0.001 + 0.5 * -0.002 + 0.25 * 0.999)


def test_global_whitening_mean_zero_std_one_over_valid_tokens():
    gen = torch.Generator().manual_seed(3)
    values = torch.randn(5, 7, dtype=D, generator=gen) * 3 + 2
    mask = (torch.arange(7) < torch.tensor([[7], [3], [1], [5], [0]])).to(D)
    w = adv.masked_whiten(values, mask)
    valid = w[mask.bool()]
    assert valid.mean().item() == pytest.approx(0.0, abs=1e-12)
    assert valid.std().item() == pytest.approx(1.0, abs=1e-6)  # unbiased std
    assert torch.equal(w[~mask.bool()], torch.zeros(int((1 - mask).sum()), dtype=D))
    expected = (values - values[mask.bool()].mean()) / torch.sqrt(values[mask.bool()].var() + 1e-8)
    assert torch.allclose(w[mask.bool()], expected[mask.bool()], atol=1e-12)


# -- GAE (item 38) and length-adaptive lambda (item 39) --------------------------------------------------------------


def test_gae_example():
    rewards, values, mask = t([[0, 0, 1]]), t([[0.5, 0.6, 0.8]]), t([[1, 1, 1]])
    a, ret = adv.gae(rewards, values, mask, gamma=1.0, lam=0.95)
    assert torch.allclose(a, t([[0.4705, 0.39, 0.2]]), atol=1e-12)
    assert torch.allclose(ret, a + values, atol=1e-12)
    a1, _ = adv.gae(rewards, values, mask, gamma=1.0, lam=1.0)  # lambda 1: return - V
    assert torch.allclose(a1, t([[1, 1, 1]]) - values, atol=1e-12)


def test_gae_bootstraps_a_truncated_row_from_the_value_after_its_last_token():
    # One row cut off after 3 tokens, V after the last token 0.7, gamma 0.9, lam 0.8 (gamma * lam = 0.72):
    # delta_2 = 1 + 0.9 * 0.7 - 0.4 = 1.23; delta_1 = 0.9 * 0.4 - 0.2 = 0.16, A_1 = 0.16 + 0.72 * 1.23 = 1.0456;
    # delta_0 = 0.9 * 0.2 - 0.5 = -0.32, A_0 = -0.32 + 0.72 * 1.0456 = 0.432832
    rewards, values, mask = t([[0, 0, 1, 0]]), t([[0.5, 0.2, 0.4, 9.0]]), t([[1, 1, 1, 0]])
    a, ret = adv.gae(rewards, values, mask, gamma=0.9, lam=0.8, bootstrap=t([0.7]))
    assert torch.allclose(a, t([[0.432832, 1.0456, 1.23, 0]]), atol=1e-12)
    assert torch.allclose(ret, t([[0.932832, 1.2456, 1.63, 0]]), atol=1e-12)  # the last target: r + gamma V_next
    # bootstrap 0 is the terminal row; a row with no valid token stays 0 whatever its bootstrap value
    a0, _ = adv.gae(rewards, values, mask, gamma=0.9, lam=0.8)
    assert torch.equal(adv.gae(rewards, values, mask, gamma=0.9, lam=0.8, bootstrap=t([0.0]))[0], a0)
    empty, _ = adv.gae(rewards, values, torch.zeros_like(mask), gamma=0.9, lam=0.8, bootstrap=t([5.0]))
    assert torch.equal(empty, torch.zeros_like(empty))


def test_gae_bootstrap_matches_a_direct_sum_with_the_bootstrap_as_the_last_value():
    gen = torch.Generator().manual_seed(7)
    rewards, values = torch.randn(3, 5, dtype=D, generator=gen), torch.randn(3, 5, dtype=D, generator=gen)
    lengths, boot = [5, 3, 1], t([0.3, -1.2, 2.0])
    mask = (torch.arange(5) < torch.tensor(lengths).unsqueeze(1)).to(D)
    a, _ = adv.gae(rewards, values, mask, gamma=0.95, lam=0.9, bootstrap=boot)
    for row, n in enumerate(lengths):
        v = values[row, :n].tolist() + [boot[row].item()]
        deltas = [rewards[row, i].item() + 0.95 * v[i + 1] - v[i] for i in range(n)]
        want = [sum((0.95 * 0.9) ** k * deltas[i + k] for k in range(n - i)) for i in range(n)]
        assert torch.allclose(a[row, :n], t(want), atol=1e-12)


def _gae_reference(rewards, values, gamma, lam):
    """Direct sum A_t = sum_l (gamma lam)^l delta_{t+l} for one unpadded sequence."""
    n = len(rewards)
    v = list(values) + [0.0]
    deltas = [rewards[i] + gamma * v[i + 1] - v[i] for i in range(n)]
    return [sum((gamma * lam) ** l * deltas[i + l] for l in range(n - i)) for i in range(n)]


def test_gae_variable_lengths_and_per_sequence_lambda():
    gen = torch.Generator().manual_seed(4)
    rewards = torch.randn(3, 6, dtype=D, generator=gen)
    values = torch.randn(3, 6, dtype=D, generator=gen)
    lengths = [6, 2, 4]
    mask = (torch.arange(6) < torch.tensor(lengths).unsqueeze(1)).to(D)
    lam = t([0.9, 0.0, 0.5])
    a, ret = adv.gae(rewards, values, mask, gamma=0.99, lam=lam)
    for row, n in enumerate(lengths):
        ref = _gae_reference(rewards[row, :n].tolist(), values[row, :n].tolist(), 0.99, lam[row].item())
        assert torch.allclose(a[row, :n], t(ref), atol=1e-12)
        assert torch.equal(a[row, n:], torch.zeros(6 - n, dtype=D))
        assert torch.equal(ret[row, n:], torch.zeros(6 - n, dtype=D))


def test_length_adaptive_lambda():
    lam = adv.length_adaptive_lambda(torch.tensor([20, 100, 1000, 5]), alpha=0.05)
    assert torch.allclose(lam, t([0.0, 0.8, 0.98, 0.0]), atol=1e-12)  # alpha*l clamped to >= 1



def test_openrlhf_whitening_uses_the_population_variance_and_a_clamped_floor():
    """OpenRLHF's experience maker: var = sum m (x - mean)^2 / sum m, A = (x - mean) * rsqrt(max(var, 1e-8)); verl's
    masked_whiten divides by n - 1 and adds 1e-8. Over n valid tokens the two differ by sqrt((n - 1) / n)."""
    values = t([[1.0, 2.0, 4.0, 99.0], [3.0, 5.0, -7.0, 8.0]])
    mask = t([[1, 1, 1, 0], [1, 1, 0, 0]])
    xs = [1.0, 2.0, 4.0, 3.0, 5.0]
    mean = sum(xs) / 5
    population = sum((x - mean) ** 2 for x in xs) / 5
    expected = [(x - mean) / population ** 0.5 for x in xs]
    w = adv.masked_whiten(values, mask, convention="openrlhf")
    assert w[mask.bool()].tolist() == pytest.approx(expected, rel=1e-12)
    assert w[~mask.bool()].tolist() == [0.0, 0.0, 0.0]
    verl = adv.masked_whiten(values, mask)
    assert verl[mask.bool()].tolist() == pytest.approx((w[mask.bool()] * (4 / 5) ** 0.5).tolist(), rel=1e-7)
    # constant values: verl divides 0 by sqrt(1e-8), OpenRLHF by sqrt(max(0, 1e-8)): both 0, finite
    flat = adv.masked_whiten(t([[2.0, 2.0]]), t([[1, 1]]), convention="openrlhf")
    assert flat.tolist() == [[0.0, 0.0]]
    # a variance below the floor: OpenRLHF clamps it to 1e-8, verl adds 1e-8
    tiny = t([[0.0, 1e-5]])
    o = adv.masked_whiten(tiny, t([[1, 1]]), convention="openrlhf")[0, 1].item()
    assert o == pytest.approx(0.5e-5 / 1e-4, rel=1e-9)  # population var 2.5e-11 -> 1e-8
    v = adv.masked_whiten(tiny, t([[1, 1]]))[0, 1].item()
    assert v == pytest.approx(0.5e-5 / (5e-11 + 1e-8) ** 0.5, rel=1e-9)



# -- the zero-std rule (NeMo-RL cross-check) ------------------------------------------------------------------------


def test_epsilon_zero_keeps_group_advantages_finite():
    """epsilon: 0 is allowed, and gave 0/0 = NaN for a tied group (and inf for a leave-one-out row whose peers tie),
    which reached the loss unchecked; nothing is divided where s + eps is 0."""
    r = torch.tensor([1.0, 1, 1, 1, 1, 0, 0, 0])
    assert adv.group_advantages(r, 4, eps=0.0).tolist() == pytest.approx([0, 0, 0, 0, 1.5, -0.5, -0.5, -0.5])
    loo = adv.group_advantages(r, 4, eps=0.0, std="leave_one_out", baseline="leave_one_out")
    assert loo.tolist() == pytest.approx([0, 0, 0, 0, 1.0] + [-(1 / 3) / math.sqrt(1 / 3)] * 3)
    assert adv.group_advantages(torch.ones(4), 4, scale="batch", eps=0.0).tolist() == [0.0] * 4


@pytest.mark.parametrize("rewards, expected", [
    ([1.0, 0.0], [1.0, -1.0]),  # each row's single peer has std 0: no division
    ([1.0, 0.0, 0.0, 0.0], [1.0] + [-(1 / 3) / (math.sqrt(1 / 3) + 1e-6)] * 3),
    ([1.0, 1.0, 1.0, 1.0], [0.0] * 4),
])
def test_zero_std_skip_is_nemo_rls_default_grpo_advantage(rewards, expected):
    """NeMo-RL's GRPO advantage (use_leave_one_out_baseline, its default): leave-one-out baseline, the sample std of
    the other rows, epsilon 1e-6, and no division where that std is 0. The default rule divides by epsilon alone."""
    r = torch.tensor(rewards, dtype=torch.float64)
    nemo = dict(baseline="leave_one_out", std="leave_one_out", eps=1e-6)
    assert adv.group_advantages(r, len(rewards), zero_std="skip", **nemo).tolist() == pytest.approx(expected)
    if rewards[0] != rewards[1]:
        assert adv.group_advantages(r, len(rewards), **nemo)[0] == pytest.approx(1e6 * (1.0 - sum(rewards[1:]) /
                                                                                        (len(rewards) - 1)))


def test_zero_std_rules_agree_wherever_the_std_is_positive():
    r = torch.rand(64, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    for kw in (dict(), dict(baseline="leave_one_out", std="leave_one_out", eps=1e-6), dict(scale="batch")):
        assert torch.equal(adv.group_advantages(r, 8, **kw), adv.group_advantages(r, 8, zero_std="skip", **kw))


def test_areal_and_no_whitening():
    """AReaL's Normalization: (x - mean) / (unbiased std + 1e-5); none leaves the values (slime's default); padding 0
    in both, -inf there included."""
    x = torch.tensor([[1.0, 2.0, float("-inf")], [4.0, 0.5, 3.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]], dtype=torch.float64)
    valid = torch.tensor([1.0, 2.0, 4.0, 0.5, 3.0], dtype=torch.float64)
    areal = adv.masked_whiten(x, mask, convention="areal")
    expected = (valid - valid.mean()) / (valid.std() + 1e-5)
    assert areal[mask.bool()].tolist() == pytest.approx(expected.tolist(), rel=1e-12)
    assert areal[0, 2].item() == 0.0
    none = adv.masked_whiten(x, mask, convention="none")
    assert none[mask.bool()].tolist() == valid.tolist() and none[0, 2].item() == 0.0
