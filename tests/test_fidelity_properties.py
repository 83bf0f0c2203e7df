"""Property-based numerics suite (issue 10, "Numerics under legal extremes").

Sweeps every objective, correction, aggregation and KL estimator through the real loss pipeline
(:func:`trl_ext.trainers.grpo.compose_loss`), every advantage estimator (pure functions and the plugins that need no
model), and every preference loss, over legal extremes: -inf log-probs at masked positions, log-ratios up to +-100,
all tokens masked, single-token completions, zero-variance groups, whole batches of equal rewards, log-probs of
exactly 0, NaN rollout log-probs ("not recorded"), extreme rewards (+-1e8) and advantages (+-1e4). Asserts finite
values and gradients, and exactly zero gradient on masked tokens. float32, as training runs.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trl_ext import ops
from trl_ext.batches import LossInputs, PreferenceInputs, RolloutBatch
from trl_ext.host import PluginHost
from trl_ext.trainers.grpo import DEFAULT_OBJECTIVES, compose_loss
from trl_ext_plugins.advantages import math as adv
from trl_ext_plugins.advantages.ppo import PPO, PPOParams
from trl_ext_plugins.advantages.reinforce_baseline import ReinforceBaseline, ReinforceBaselineParams
from trl_ext_plugins.advantages.reinforce_pp import ReinforcePP, ReinforcePPBaseline, ReinforcePPParams
from trl_ext_plugins.advantages.rloo import RLOO, RLOOParams
from trl_ext_plugins.corrections.icepop import IcePop
from trl_ext_plugins.corrections.m2po import M2PO, M2POParams
from trl_ext_plugins.corrections.mis import MIS, MISParams
from trl_ext_plugins.corrections.rollout_correction import RolloutCorrectionParams, UnifiedCorrection
from trl_ext_plugins.corrections.rollout_ratio import RolloutRatio
from trl_ext_plugins.corrections.tis import TIS, TISParams
from trl_ext_plugins.losses.aggregation import AGGREGATIONS, Aggregation, AggregationParams
from trl_ext_plugins.losses.ce_gppo import CEGPPO, CEGPPOParams
from trl_ext_plugins.losses.cispo import CISPO
from trl_ext_plugins.losses.clip_higher import ClipHigher
from trl_ext_plugins.losses.dapo import DAPO
from trl_ext_plugins.losses.dr_grpo import DrGRPO
from trl_ext_plugins.losses.gmpo import GMPO
from trl_ext_plugins.losses.grpo import GRPO
from trl_ext_plugins.losses.gspo import GSPO, GSPOParams
from trl_ext_plugins.losses.reinforce import REINFORCE
from trl_ext_plugins.losses.sapo import SAPO
from trl_ext_plugins.preference.apo import APO, APOParams
from trl_ext_plugins.preference.dpo import DPO, DPOParams
from trl_ext_plugins.preference.ipo import IPO, IPOParams
from trl_ext_plugins.preference.orpo import ORPO
from trl_ext_plugins.preference.qrpo import QRPO
from trl_ext_plugins.preference.rpo import RPO, RPOParams
from trl_ext_plugins.preference.simpo import SimPO

F32 = torch.float32
SETTINGS = settings(max_examples=int(__import__("os").environ.get("FIDELITY_EXAMPLES", 60)), deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)

OBJECTIVES = [None, GRPO(), DrGRPO(), DAPO(), GSPO(), GSPO(GSPOParams(form="token")), GMPO(), SAPO(), CISPO(), CEGPPO(),
              CEGPPO(CEGPPOParams(dual_clip=None)), ClipHigher(), REINFORCE(), RolloutRatio()]
CORRECTIONS = [None, TIS(), TIS(TISParams(level="sequence")), MIS(), MIS(MISParams(level="sequence")),
               MIS(MISParams(level="geometric")), MIS(MISParams(drop_from_denominator=True)), IcePop(), M2PO(),
               M2PO(M2POParams(scope="ppo_active"))] + [
    UnifiedCorrection(RolloutCorrectionParams(**p)) for p in (  # the grid: test_corrections_unified.py sweeps it all
        {"statistic": "k2", "upper": 0.02, "drop_from_denominator": True}, {"level": "geometric", "statistic": "max"},
        {"level": "sequence", "statistic": "sum", "lower": None, "upper": 3.0},
        {"preset": "tis", "level": "geometric", "lower": 0.5})]
AGGREGATION_PLUGINS = [None] + [Aggregation(AggregationParams(mode=m)) for m in AGGREGATIONS]

LOGPS = st.sampled_from([0.0, -0.0, -1e-9, -1e-3, -0.7, -1.0, -5.0, -20.0, -21.0, -50.0, -100.0, -1e4])
ADVANTAGES = st.sampled_from([0.0, 1.0, -1.0, 1e-8, -1e-8, 1e4, -1e4, 0.5])


@st.composite
def micro_batch(draw):
    b, t = draw(st.integers(1, 3)), draw(st.integers(1, 4))
    grid = lambda values: torch.tensor(draw(st.lists(values, min_size=b * t, max_size=b * t)), dtype=F32).view(b, t)  # noqa: E731
    mask = grid(st.sampled_from([0.0, 1.0, 1.0, 1.0]))
    if draw(st.booleans()) and draw(st.booleans()):
        mask = torch.zeros_like(mask)  # all tokens masked
    theta, old, rollout, ref = grid(LOGPS), grid(LOGPS), grid(LOGPS), grid(LOGPS)
    if draw(st.booleans()):  # rollout engine gave no log-prob for some loss tokens
        rollout = torch.where(grid(st.sampled_from([True, False, False])).bool(), torch.nan, rollout)
    inf = torch.tensor(float("-inf"))
    masked = ~mask.bool()
    theta, old, rollout, ref = (torch.where(masked, inf, x) for x in (theta, old, rollout, ref))  # -inf at padding
    per_token_adv = draw(st.booleans())
    advantages = grid(ADVANTAGES) if per_token_adv else torch.tensor(
        draw(st.lists(ADVANTAGES, min_size=b, max_size=b)), dtype=F32).view(b, 1)
    return mask, theta, old, rollout, ref, advantages


def loss_inputs(mask, theta, old, rollout, ref, advantages, beta, loss_type, training, num_items_scale):
    theta = theta.clone().requires_grad_(True)
    return LossInputs(
        num_items_in_batch=mask.sum() * num_items_scale, grad_accum_steps=2 if training else 1,
        steps_per_generation=2 if training else 1, num_processes=1, training=training, loss_type=loss_type,
        max_completion_length=theta.size(1), per_token_logps=theta, old_per_token_logps=old, advantages=advantages,
        mask=mask, sampling_per_token_logps=rollout, ref_per_token_logps=ref, entropies=None, epsilon_low=0.2,
        epsilon_high=0.28, beta=beta, extra={"sapo_tau_pos": 1.0, "sapo_tau_neg": 1.05},
    ), theta


@SETTINGS
@given(batch=micro_batch(), objective=st.sampled_from(OBJECTIVES), correction=st.sampled_from(CORRECTIONS),
       aggregation=st.sampled_from(AGGREGATION_PLUGINS), loss_type=st.sampled_from(sorted(DEFAULT_OBJECTIVES)),
       kl=st.sampled_from([None, *ops.KL_ESTIMATORS]), bias=st.booleans(), clamp=st.sampled_from([None, 10.0]),
       training=st.booleans(), is_ratio=st.booleans())
def test_loss_pipeline_is_finite_with_zero_gradient_on_masked_tokens(batch, objective, correction, aggregation,
                                                                     loss_type, kl, bias, clamp, training, is_ratio):
    mask, theta, old, rollout, ref, advantages = batch
    if isinstance(objective, RolloutRatio) and correction is not None and correction.name != "m2po":
        correction = None  # refused at validation (rollout_ratio with an old-policy correction)
    plugins = [p for p in (objective, correction, aggregation) if p is not None]
    li, leaf = loss_inputs(mask, theta, old, rollout, ref, advantages, 0.04 if kl else 0.0, loss_type, training, 2)
    ratio = torch.where(mask.bool(), torch.tensor(3.0), torch.tensor(0.0)) if is_ratio else None
    loss, loss_mask, per_token_kl = compose_loss(PluginHost(plugins), li, loss_type=loss_type,
                                                 kl=ops.KLTerm(kl or "k3", bias, clamp),
                                                 importance_sampling_ratio=ratio)
    assert torch.isfinite(loss), (plugins, loss)
    (grad,) = torch.autograd.grad(loss, leaf, allow_unused=True)
    if grad is not None:
        assert torch.isfinite(grad).all(), (plugins, grad)
        assert torch.all(grad[~mask.bool()] == 0), (plugins, grad)
    if per_token_kl is not None:
        assert torch.isfinite(torch.where(mask.bool(), per_token_kl, 0.0)).all()


# -- advantages -------------------------------------------------------------------------------------------------------

FINITE_REWARDS = st.sampled_from([0.0, 1.0, -1.0, 0.5, 1e8, -1e8, 1e-8])
REWARDS = st.one_of(FINITE_REWARDS, st.just(float("nan")))  # NaN: a row no reward function could score


@st.composite
def grouped_rewards(draw, min_group=1):
    group = draw(st.integers(min_group, 4))
    groups = draw(st.integers(1, 3))
    if draw(st.booleans()):  # zero-variance groups / whole batch of equal rewards
        values = [draw(REWARDS)] * (group * groups)
    else:
        values = draw(st.lists(REWARDS, min_size=group * groups, max_size=group * groups))
    return torch.tensor(values, dtype=F32), group


@st.composite
def token_mask(draw, rows):
    t = draw(st.integers(1, 5))
    values = draw(st.lists(st.sampled_from([0.0, 1.0, 1.0]), min_size=rows * t, max_size=rows * t))
    return torch.tensor(values, dtype=F32).view(rows, t)


@SETTINGS
@given(data=st.data(), normalize=st.booleans())
def test_sequence_advantages_are_finite(data, normalize):
    rewards, group = data.draw(grouped_rewards(min_group=2))
    assert torch.isfinite(adv.rloo_advantages(rewards, group, normalize)).all()
    rewards, group = data.draw(grouped_rewards())
    for scale in ("group", "batch", "none"):
        for std in ("sample", "population", "leave_one_out"):
            if std == "leave_one_out" and (group < 2 or scale != "group"):
                continue
            out = adv.group_advantages(rewards, group, scale=scale, std=std)
            assert torch.isfinite(out).all(), (scale, std, rewards, out)
    baseline = adv.group_mean_baseline(rewards, group)
    assert torch.isfinite(adv.baseline_advantages(rewards, baseline)).all()
    greedy = torch.tensor(data.draw(st.lists(REWARDS, min_size=rewards.numel() // group,
                                             max_size=rewards.numel() // group)), dtype=F32)
    assert torch.isfinite(adv.remax_advantages(rewards, greedy, group)).all()


@SETTINGS
@given(data=st.data(), gamma=st.sampled_from([1.0, 0.99, 0.0]), lam=st.sampled_from([1.0, 0.95, 0.0]))
def test_token_advantages_are_finite_and_zero_off_mask(data, gamma, lam):
    rows = data.draw(st.integers(1, 3))
    mask = data.draw(token_mask(rows))
    rewards = torch.nan_to_num(torch.tensor(data.draw(st.lists(REWARDS, min_size=rows, max_size=rows)), dtype=F32))
    values = torch.where(mask.bool(), torch.tensor(data.draw(st.lists(FINITE_REWARDS, min_size=mask.numel(),
                                                                      max_size=mask.numel())), dtype=F32).view_as(mask),
                         torch.tensor(float("nan")))  # garbage off-mask must not leak
    kl = torch.where(mask.bool(), torch.tensor(0.5), torch.tensor(float("inf")))
    per_token = adv.token_rewards(rewards, mask, kl, 0.01)
    a, ret = adv.gae(per_token, values, mask, gamma, lam)
    baselines = torch.tensor(data.draw(st.lists(REWARDS, min_size=rows, max_size=rows)), dtype=F32)
    remax = adv.remax_token_advantages(rewards, baselines, mask, kl, 0.01)  # KL in the reward, verl's ReMax form
    for x in (per_token, a, ret, adv.discounted_returns(per_token, mask, gamma), adv.masked_whiten(ret, mask), remax):
        assert torch.isfinite(x).all() and torch.all(x[~mask.bool()] == 0)
    assert torch.isfinite(adv.masked_whiten(values, mask)).all()


def rollout_batch(rewards, mask, tool_mask, logps):
    b, t = mask.shape
    return RolloutBatch(
        rewards_per_func=rewards.unsqueeze(-1), reward_names=["r"], reward_weights=torch.ones(1), num_generations=b,
        process_slice=slice(0, b), completion_ids=torch.zeros(b, t, dtype=torch.long), completion_mask=mask,
        completion_lengths=mask.sum(-1), prompts=[], completions=[], inputs=[], old_per_token_logps=logps,
        ref_per_token_logps=torch.where(mask.bool(), logps.flip(-1).clamp(min=-1e4), -torch.inf), tool_mask=tool_mask, prompt_ids=torch.zeros(b, 1, dtype=torch.long),
        prompt_mask=torch.ones(b, 1, dtype=torch.long),
    )


@settings(SETTINGS, max_examples=25)
@given(data=st.data(), estimator=st.sampled_from(["k1", "k2", "k3"]), kl_clamp=st.sampled_from([None, 10.0]))
def test_advantage_plugins_are_finite(data, estimator, kl_clamp):
    rewards, group = data.draw(grouped_rewards(min_group=2))
    rows = rewards.numel()
    mask = data.draw(token_mask(rows))
    tool = data.draw(token_mask(rows)) if data.draw(st.booleans()) else None
    if tool is not None and tool.shape != mask.shape:
        tool = None
    logps = torch.where(mask.bool(), torch.tensor(data.draw(st.lists(LOGPS, min_size=mask.numel(),
                                                                     max_size=mask.numel()))).view_as(mask),
                        torch.tensor(float("-inf")))
    batch = rollout_batch(rewards, mask, tool, logps)
    critic = lambda *inputs: torch.ones_like(mask)  # noqa: E731
    critic.eval = lambda: None
    ppo = PPO(PPOParams(kl_estimator=estimator, kl_clamp=kl_clamp))
    ppo.critic = critic
    plugins = [RLOO(), RLOO(RLOOParams(normalize=True)),
               RLOO(RLOOParams(kl_coef=0.1, kl_estimator=estimator, kl_clamp=kl_clamp, normalize=True)),
               ReinforcePP(ReinforcePPParams(kl_estimator=estimator, kl_clamp=kl_clamp)),
               ReinforcePPBaseline(), ReinforceBaseline(ReinforceBaselineParams(baseline="batch_mean")),
               ReinforceBaseline(ReinforceBaselineParams(baseline="group_mean")), ppo]
    for plugin in plugins:
        out = plugin.trl_ext_compute_advantages(rewards=rewards, batch=batch)
        assert torch.isfinite(out).all(), (plugin, out)


# -- preference losses -----------------------------------------------------------------------------------------------

SEQ_LOGPS = st.sampled_from([0.0, -1e-9, -1e-3, -1.0, -20.0, -100.0, -1e4])
PREFERENCE = [DPO(), DPO(DPOParams(nll_weight=1.0)), IPO(), IPO(IPOParams(length_normalize=False)), APO(),
              APO(APOParams(variant="down")), SimPO(), ORPO(), RPO(), RPO(RPOParams(form="fwd_kl")),
              RPO(RPOParams(form="sq")), QRPO()]


@SETTINGS
@given(data=st.data(), plugin=st.sampled_from(PREFERENCE), beta=st.sampled_from([0.01, 0.1, 1.0, 10.0]))
def test_preference_losses_are_finite(data, plugin, beta):
    b = data.draw(st.integers(1, 3))
    vec = lambda s: torch.tensor(data.draw(st.lists(s, min_size=b, max_size=b)), dtype=F32)  # noqa: E731
    chosen, rejected = vec(SEQ_LOGPS).requires_grad_(True), vec(SEQ_LOGPS).requires_grad_(True)
    lengths = st.sampled_from([1.0, 2.0, 100.0])
    rewards = st.sampled_from([0.0, 1.0, -1e8, 1e8])
    batch = {"chosen_reward": vec(rewards), "rejected_reward": vec(rewards),
             "ref_rewards": torch.tensor([data.draw(st.lists(rewards, min_size=2, max_size=3)) for _ in range(b)]
                                         if False else [[0.0, 1.0, 1e8]] * b, dtype=F32)}
    inputs = PreferenceInputs(chosen_logps=chosen, rejected_logps=rejected, chosen_lengths=vec(lengths),
                              rejected_lengths=vec(lengths), ref_chosen_logps=vec(SEQ_LOGPS),
                              ref_rejected_logps=vec(SEQ_LOGPS), beta=beta, batch=batch)
    loss = plugin.trl_ext_preference_loss(inputs=inputs).mean()
    assert torch.isfinite(loss), (plugin, loss)
    grads = torch.autograd.grad(loss, (chosen, rejected), allow_unused=True)
    assert all(g is None or torch.isfinite(g).all() for g in grads), (plugin, grads)


# -- reward shaping ----------------------------------------------------------------------------------------------------

LENGTHS = st.sampled_from([0.0, 1.0, 99.0, 100.0, 101.0, 1e6])


@SETTINGS
@given(lengths=st.lists(LENGTHS, min_size=1, max_size=6), cap=st.booleans(),
       beyond=st.sampled_from(["exceed", "clamp", "extend"]), data=st.data())
def test_length_shaping_formulas_are_finite(lengths, cap, beyond, data):
    from trl_ext_plugins.rewards import formulas

    x = torch.tensor(lengths, dtype=torch.float64)
    flags = torch.tensor(data.draw(st.lists(st.booleans(), min_size=len(lengths), max_size=len(lengths))))
    for out in (formulas.dapo_overlong_penalty(x, 100, 20, cap, 0.5),
                formulas.cosine_length_reward(x, flags, 100, beyond=beyond),
                formulas.stop_penalties(x, flags, 100, -1.0, -0.5)):
        assert torch.isfinite(out).all(), (lengths, out)


def test_leave_one_out_baseline_without_another_scorable_row_is_zero():
    """With one scorable row in a group the others' mean was 0 / 1 = 0 and the std 0: [1, NaN, NaN, NaN] gave
    A = 1 / eps = 10000 (1.0 with scale none), and G = 1 with single_sample zero gave R / eps. RLOO (and TRL's
    RLOOTrainer) gives a row without siblings 0."""
    nan = float("nan")
    for scale in ("group", "none"):
        out = adv.group_advantages(torch.tensor([1.0, nan, nan, nan, 1.0, 0.0, nan, nan]), 4, scale=scale,
                                   baseline="leave_one_out")
        # second group: [1, 0] leave-one-out centres 0 and 1 -> +1, -1 (scaled by each row's others' std 0 + eps
        # under scale group, so only the signs and zeros are checked there)
        assert out[:4].tolist() == [0.0] * 4 and out[6:].tolist() == [0.0, 0.0]
        assert out[4].item() > 0 > out[5].item()
    assert adv.group_advantages(torch.tensor([0.7, 0.2]), 1, baseline="leave_one_out").tolist() == [0.0, 0.0]
