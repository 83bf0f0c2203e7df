"""Issue 10 conventions made expressible as named switches (default unchanged). Every expected number is computed by
hand from the formula in the comment next to it, independently of the implementation."""

from __future__ import annotations

import math

import pytest
import torch

from trl_ext import ops
from trl_ext.batches import RolloutBatch
from trl_ext.errors import RecipeError
from trl_ext.metrics import reduce_figures
from trl_ext.recipe import StageSpec
from trl_ext.stage import resolve_stage
from trl_ext_plugins.advantages import math as adv
from trl_ext_plugins.advantages import remax as remax_module
from trl_ext_plugins.advantages.ppo import PPO, PPOParams
from trl_ext_plugins.advantages.reinforce_pp import ReinforcePP, ReinforcePPParams
from trl_ext_plugins.advantages.remax import ReMax, ReMaxParams
from trl_ext_plugins.advantages.rloo import RLOO, RLOOParams

D = torch.float64
NEG_INF = float("-inf")


def rollout_batch(rewards, old, ref, mask, group, tool_mask=None):
    """A one-process RolloutBatch with the sampling policy's (``old``) and the reference's log-probs."""
    mask = torch.as_tensor(mask, dtype=torch.float32)
    b, t = mask.shape
    rewards = torch.as_tensor(rewards, dtype=torch.float32)
    return RolloutBatch(
        rewards_per_func=rewards.unsqueeze(-1), reward_names=["r"], reward_weights=torch.ones(1), num_generations=group,
        process_slice=slice(0, b), completion_ids=torch.zeros(b, t, dtype=torch.long), completion_mask=mask,
        completion_lengths=mask.sum(-1), prompts=["p"] * b, completions=[""] * b, inputs=[{}] * b,
        old_per_token_logps=torch.as_tensor(old, dtype=torch.float32),
        ref_per_token_logps=torch.as_tensor(ref, dtype=torch.float32),
        tool_mask=None if tool_mask is None else torch.tensor(tool_mask, dtype=torch.float32),
    )


# -- 1. KL folded into the reward: rloo, remax (and the shared pieces ppo / reinforce_pp use) -------------------------

# d = log pi_old - log pi_ref on two valid tokens and one padded (-inf) position: d = [0.5, 0]
OLD, REF, MASK = [[-1.0, -0.5, NEG_INF]], [[-1.5, -0.5, NEG_INF]], [[1.0, 1.0, 0.0]]


@pytest.mark.parametrize("estimator, clamp, expected", [
    ("k1", None, [0.5, 0.0, 0.0]),  # k1 = d
    ("k2", None, [0.125, 0.0, 0.0]),  # k2 = d^2 / 2
    ("k3", None, [math.exp(-0.5) - 1 + 0.5, 0.0, 0.0]),  # k3 = e^-d - 1 + d = 0.1065306597
    ("k3+", None, [math.exp(-0.5) - 1 + 0.5, 0.0, 0.0]),  # k3's value (its k2 gradient cannot act in a reward)
    ("k1", 0.3, [0.3, 0.0, 0.0]),  # clamped to [-0.3, 0.3]
])
def test_masked_token_kl_by_hand(estimator, clamp, expected):
    kl = adv.masked_token_kl(torch.tensor(OLD, dtype=D), torch.tensor(REF, dtype=D), torch.tensor(MASK), estimator,
                             clamp)
    assert torch.isfinite(kl).all()  # -inf at the padded position never reaches the estimate
    assert kl[0].tolist() == pytest.approx(expected, abs=1e-12)


# 2 prompts x 2 samples, rewards [1, 0 | 0.5, NaN]; per-token k1 d: row0 [0.5, 0.5] (sum 1.0), row1 [-0.2, pad]
# (sum -0.2), row2 [0.1, 0.3] (sum 0.4), row3 [0.2, 0.2]. kl_coef 0.1: R' = R - 0.1 * sum d = [0.9, 0.02, 0.46, NaN];
# leave-one-out A_k = R'_k - R'_other: [0.88, -0.88]; the second group has one scorable row -> 0, unscorable -> 0.
RLOO_OLD = [[-0.5, -0.5], [-1.2, NEG_INF], [-0.9, -0.7], [-0.8, -0.8]]
RLOO_REF = [[-1.0, -1.0], [-1.0, NEG_INF], [-1.0, -1.0], [-1.0, -1.0]]
RLOO_MASK = [[1, 1], [1, 0], [1, 1], [1, 1]]


def test_rloo_sequence_kl_in_the_reward_by_hand():
    batch = rollout_batch([1.0, 0.0, 0.5, math.nan], RLOO_OLD, RLOO_REF, RLOO_MASK, group=2)
    rewards = torch.tensor([1.0, 0.0, 0.5, math.nan])
    out = RLOO(RLOOParams(kl_coef=0.1)).trl_ext_compute_advantages(rewards=rewards, batch=batch)
    assert out.tolist() == pytest.approx([0.88, -0.88, 0.0, 0.0], abs=1e-6)
    assert batch.metrics["rloo/kl"] == pytest.approx((1.0 - 0.2 + 0.4 + 0.4) / 7, abs=1e-6)  # token mean of d
    # k2 with clamp 0.1: row0 d^2/2 = 0.125 -> 0.1 each (sum 0.2), row1 0.02; R' = [0.98, -0.002] -> A = +-0.982
    out = RLOO(RLOOParams(kl_coef=0.1, kl_estimator="k2", kl_clamp=0.1)).trl_ext_compute_advantages(
        rewards=rewards, batch=batch)
    assert out[:2].tolist() == pytest.approx([0.982, -0.982], abs=1e-6)
    # default: no KL, the reference is not even read
    batch.ref_per_token_logps = None
    assert RLOO().trl_ext_compute_advantages(rewards=rewards, batch=batch).tolist() == pytest.approx([1, -1, 0, 0])


def test_rloo_kl_skips_tool_tokens():
    # row0's second token is a tool token: sum d = 0.5 only; R' = [0.95, 0.02] -> A = [0.93, -0.93]
    batch = rollout_batch([1.0, 0.0, 0.5, math.nan], RLOO_OLD, RLOO_REF, RLOO_MASK, group=2,
                          tool_mask=[[1, 0], [1, 1], [1, 1], [1, 1]])
    out = RLOO(RLOOParams(kl_coef=0.1)).trl_ext_compute_advantages(rewards=torch.tensor([1.0, 0.0, 0.5, math.nan]),
                                                                   batch=batch)
    assert out[:2].tolist() == pytest.approx([0.93, -0.93], abs=1e-6)


# ReMax, one prompt x 2 samples, R = [1, 0], greedy baseline b = 0.5, kl_coef 0.5, k1 d: row0 [0.1, 0.2, 0.3],
# row1 [0.4, -0.4, pad].
# token level (verl): r = 1[last] R - 0.5 d; row0 r = [-0.05, -0.1, 0.85] -> G = [0.7, 0.75, 0.85] -> A = G - 0.5 =
# [0.2, 0.25, 0.35]; row1 r = [-0.2, 0.2] -> G = [0, 0.2] -> A = [-0.5, -0.3, 0 (pad)].
# sequence level: R' = R - 0.5 sum d = [0.7, 0] -> A = [0.2, -0.5] on every token.
REMAX_OLD = [[-0.9, -0.8, -0.7], [-0.6, -1.4, NEG_INF]]
REMAX_REF = [[-1.0, -1.0, -1.0], [-1.0, -1.0, NEG_INF]]
REMAX_MASK = [[1, 1, 1], [1, 1, 0]]


@pytest.mark.parametrize("level, expected", [
    ("token", [[0.2, 0.25, 0.35], [-0.5, -0.3, 0.0]]),
    ("sequence", [[0.2], [-0.5]]),
])
def test_remax_kl_in_the_reward_by_hand(monkeypatch, level, expected):
    monkeypatch.setattr(remax_module, "greedy_rewards", lambda trainer, prompts, inputs: torch.tensor([0.5]))
    batch = rollout_batch([1.0, 0.0], REMAX_OLD, REMAX_REF, REMAX_MASK, group=2)
    plugin = ReMax(ReMaxParams(kl_coef=0.5, kl_level=level))
    out = plugin.trl_ext_compute_advantages(rewards=torch.tensor([1.0, 0.0]), batch=batch)
    assert out.reshape(2, -1).tolist() == [pytest.approx(row, abs=1e-6) for row in expected]
    # default unchanged: A = R - b per row, no reference read
    batch.ref_per_token_logps = None
    assert ReMax().trl_ext_compute_advantages(rewards=torch.tensor([1.0, 0.0]), batch=batch).tolist() == [0.5, -0.5]


def test_remax_token_advantages_zero_for_unscorable_rows():
    out = adv.remax_token_advantages(torch.tensor([math.nan, 1.0]), torch.tensor([0.0, math.nan]),
                                     torch.ones(2, 2), torch.full((2, 2), 1e4), 1.0)
    assert out.tolist() == [[0.0, 0.0], [0.0, 0.0]]


@pytest.mark.parametrize("plugin_cls, params", [(PPO, PPOParams), (ReinforcePP, ReinforcePPParams)])
def test_ppo_and_reinforce_pp_kl_clamp(plugin_cls, params):
    # one row, k1 d = [0.5, 0.5], clamp 0.2 -> KL_t = [0.2, 0.2]; token rewards r = [-0.1 * 0.2, 1 - 0.1 * 0.2]
    batch = rollout_batch([1.0], [[-0.5, -0.5]], [[-1.0, -1.0]], [[1, 1]], group=1)
    plugin = plugin_cls(params(kl_coef=0.1, kl_clamp=0.2))
    if plugin_cls is PPO:
        rewards = plugin.token_level_rewards(torch.tensor([1.0]), batch, batch.loss_mask)
        assert rewards[0].tolist() == pytest.approx([-0.02, 0.98], abs=1e-7)
        assert batch.metrics["ppo/kl"] == pytest.approx(0.2)
    else:
        plugin.trl_ext_compute_advantages(rewards=torch.tensor([1.0]), batch=batch)
        assert batch.metrics["reinforce_pp/kl"] == pytest.approx(0.2)


REWARD_KL_PLUGINS = [(PPO, PPOParams), (ReinforcePP, ReinforcePPParams), (RLOO, RLOOParams), (ReMax, ReMaxParams)]


@pytest.mark.parametrize("cls, params", REWARD_KL_PLUGINS, ids=lambda c: getattr(c, "name", ""))
@pytest.mark.parametrize("kl_in_loss, recipe_beta, asked, loss_coef", [
    (False, None, {"beta": 1.0}, 0.0),   # KL only in the reward: the reference, no loss term
    (False, 0.04, None, 0.0),            # the recipe's beta still gives the reference; the loss term is dropped
    (True, None, {"beta": 1.0}, 0.0),    # KL in the loss "too", but the recipe's loss beta is 0: no loss term
    (True, 0.04, None, 0.04),            # both: TRL's beta KL loss term stays
])
def test_reward_kl_always_gets_the_reference(cls, params, kl_in_loss, recipe_beta, asked, loss_coef):
    """Issue 10: reference log-probs whenever any KL form is on, for every KL-in-the-reward plugin alike."""
    from trl_ext import Need

    plugin = cls(params(kl_coef=0.05, kl_in_loss=kl_in_loss))
    assert Need.REFERENCE in plugin.needs
    args = {} if recipe_beta is None else {"beta": recipe_beta}
    assert plugin.trl_ext_configure_args(trainer="grpo", args=args) == asked
    trainer = type("T", (), {"kl_term": ops.KLTerm("k3", bias_correction=True)})()
    plugin._reward_kl_trainer_created(trainer)  # ppo's hook also builds its critic: the KL part is this
    beta = (asked or args)["beta"]
    assert trainer.kl_term.weight(beta) == loss_coef


@pytest.mark.parametrize("cls, params", REWARD_KL_PLUGINS, ids=lambda c: getattr(c, "name", ""))
def test_no_reward_kl_needs_no_reference(cls, params):
    plugin = cls(params(kl_coef=0.0))
    assert not plugin.needs and plugin.trl_ext_configure_args(trainer="grpo", args={}) is None
    trainer = type("T", (), {"kl_term": ops.KLTerm("k3", bias_correction=True)})()
    plugin._reward_kl_trainer_created(trainer)
    assert trainer.kl_term.weight(0.04) == 0.04  # the recipe's own loss KL is untouched


@pytest.fixture
def catalog(trl_ext_catalog, register_plugin):
    from trl_ext_plugins.rewards.exact_match import ExactMatch

    for cls in (ExactMatch, RLOO, ReMax, PPO, ReinforcePP):
        register_plugin(cls)
    return trl_ext_catalog


def _stage(plugin, params, **args):
    return StageSpec(trainer="grpo", model="embedded:tiny-qwen2", dataset="embedded:arithmetic",
                     plugins=[{"name": plugin, "params": params}, "exact_match"],
                     args={"num_generations": 2, "per_device_train_batch_size": 2, **args})


@pytest.mark.parametrize("plugin", ["rloo", "remax", "ppo", "reinforce_pp"])
def test_reward_kl_gets_the_reference_at_validation(catalog, plugin):
    for kl_in_loss in (False, True):  # "KL in the loss too" with no args.beta used to be refused for want of it
        resolved = resolve_stage(_stage(plugin, {"kl_coef": 0.05, "kl_in_loss": kl_in_loss}), 0, catalog)
        assert resolved.args["beta"] == 1.0
    assert resolve_stage(_stage(plugin, {"kl_coef": 0.05}, beta=0.04), 0, catalog).args["beta"] == 0.04
    assert resolve_stage(_stage(plugin, {"kl_coef": 0.0}), 0, catalog).args.get("beta", 0.0) == 0.0
    with pytest.raises(RecipeError, match="the recipe sets 0.0 but plugin"):  # an explicit 0 is not overridden
        resolve_stage(_stage(plugin, {"kl_coef": 0.05}, beta=0.0), 0, catalog)


def test_rloo_kl_parity_with_trl_rloo_trainer(tiny_trainer):
    """TRL's RLOOTrainer with beta 0.05 and the rloo plugin with kl_coef 0.05 give the same advantages from the same
    completions (policy moved away from the reference so the KL is not zero)."""
    trainer = tiny_trainer("rloo", args={"beta": 0.05})
    with torch.no_grad():
        for p in trainer.model.parameters():
            p.add_(torch.randn_like(p, generator=torch.Generator().manual_seed(0)) * 0.05)
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.25, 2.0, 0.5, math.nan, 1.0])
    trainer._calculate_rewards = lambda *a, **k: rewards.unsqueeze(1).clone()
    trainer.model.train()
    out = trainer._generate_and_score_completions([trainer.train_dataset[i // 4] for i in range(8)])
    ids = torch.cat([out["prompt_ids"], out["completion_ids"]], 1)
    attention = torch.cat([out["prompt_mask"], out["completion_mask"]], 1)
    width = out["completion_ids"].size(1)
    with torch.no_grad():
        old, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, attention, width)
        ref, _, _ = trainer._get_per_token_logps_and_entropies(trainer.ref_model, ids, attention, width)
    mask = out["completion_mask"].float()
    assert (torch.where(mask.bool(), old - ref, 0.0)).abs().sum() > 0
    batch = rollout_batch(rewards, old, ref, mask, group=4)
    ours = RLOO(RLOOParams(kl_coef=0.05)).trl_ext_compute_advantages(rewards=rewards, batch=batch)
    assert torch.allclose(ours, out["advantages"].float(), atol=1e-5)
    without_kl = RLOO().trl_ext_compute_advantages(rewards=rewards, batch=batch)
    assert not torch.allclose(without_kl, out["advantages"].float(), atol=1e-5)  # the KL term is what matches


@pytest.mark.parametrize("objective_first", [False, True])
def test_a_reward_kl_plugin_keeps_the_loss_kl_off_in_either_plugin_order(tiny_trainer, objective_first):
    """reinforce_pp sets args.beta = 1.0 only to get reference log-probs and drops the loss term; grpo rebuilt the KL
    term after it without that coefficient, so [reinforce_pp, grpo] trained a k3 loss KL at weight 1.0."""
    from trl_ext_plugins.advantages.reinforce_pp import ReinforcePP
    from trl_ext_plugins.losses.grpo import GRPO, GRPOParams

    objective = GRPO(GRPOParams(kl_estimator="k2"))
    plugins = [objective, ReinforcePP()] if objective_first else [ReinforcePP(), objective]
    trainer = tiny_trainer("grpo", plugins=plugins, args={"max_steps": 1})
    assert trainer.args.beta == 1.0 and trainer.kl_term.weight(trainer.args.beta) == 0.0
    assert trainer.kl_term.estimator == "k2"  # the objective's own estimator still applies (to the logged KL)


def test_rloo_with_kl_only_in_reward_trains(tiny_trainer):
    plugin = RLOO(RLOOParams(kl_coef=0.05))
    trainer = tiny_trainer("grpo", plugins=[plugin], args={"max_steps": 1})
    assert trainer.args.beta == 1.0 and trainer.kl_term.weight(trainer.args.beta) == 0.0
    result = trainer.train()
    assert math.isfinite(result.training_loss)


# -- 2. PPO value-loss coefficient (value clipping and critic_lr existed) ---------------------------------------------

# V = [1, 2], V_old = [0.5, 2.5], R = [2, 1], eps_v 0.2: unclipped (V - R)^2 = [1, 1]; clipped V = [0.7, 2.3] ->
# (V_c - R)^2 = [1.69, 1.69] = the max on both tokens; mean 1.69.
V, V_OLD, R = [[1.0, 2.0]], [[0.5, 2.5]], [[2.0, 1.0]]


@pytest.mark.parametrize("clip, coef, expected", [
    (0.2, 0.5, 0.5 * 1.69), (0.2, 0.05, 0.05 * 1.69), (None, 1.0, 1.0), (None, 0.05, 0.05),
])
def test_value_loss_coefficient_by_hand(clip, coef, expected):
    t = lambda x: torch.tensor(x, dtype=D)  # noqa: E731
    assert adv.clipped_value_loss(t(V), t(V_OLD), t(R), t([[1.0, 1.0]]), clip, coef).item() == pytest.approx(expected)


def test_ppo_critic_step_uses_the_value_loss_coefficient():
    from types import SimpleNamespace

    class Critic(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.v = torch.nn.Parameter(torch.tensor(V))

        def forward(self, rows):
            return self.v.expand(rows.shape[0], -1)

    trainer = SimpleNamespace(args=SimpleNamespace(seed=0), state=SimpleNamespace(global_step=0),
                              accelerator=SimpleNamespace(num_processes=1))
    plugin = PPO(PPOParams(value_loss_coef=0.05, value_clip=None, critic_max_grad_norm=None))
    plugin.critic = Critic()
    plugin.critic_optimizer = torch.optim.AdamW(plugin.critic.parameters(), lr=1e-3, weight_decay=0.0)
    grads = []
    plugin.critic.v.register_hook(lambda g: grads.append(g.clone()))
    loss = plugin.update_critic((torch.zeros(1, 2),), torch.tensor(V_OLD), torch.tensor(R), torch.ones(1, 2),
                                SimpleNamespace(trainer=trainer))
    # 0.05 * mean (V - R)^2 = 0.05; d/dV_t = 0.05 * 2 (V_t - R_t) / 2 = [-0.05, 0.05]
    assert loss == pytest.approx(0.05)
    assert grads[0].tolist() == [pytest.approx([-0.05, 0.05])]
    assert PPOParams().value_loss_coef == 0.5  # default unchanged


# -- 3. M2PO restricted to the tokens the PPO clip leaves active ------------------------------------------------------


def m2po_inputs(theta, old, advantage):
    from trl_ext.batches import LossInputs

    theta = torch.tensor([theta], dtype=D)
    mask = torch.ones_like(theta)
    return LossInputs(
        num_items_in_batch=mask.sum(), grad_accum_steps=1, steps_per_generation=1, num_processes=1, training=True,
        loss_type="dapo", max_completion_length=theta.size(1), per_token_logps=theta.requires_grad_(True),
        old_per_token_logps=torch.tensor([old], dtype=D), advantages=torch.tensor([[advantage]], dtype=D), mask=mask,
        sampling_per_token_logps=torch.zeros_like(mask), ref_per_token_logps=None, entropies=None, epsilon_low=0.2,
        epsilon_high=0.28, beta=0.0)


# log r vs the rollout (log-probs 0) = theta = [0.5, 0.3, -0.3, 0] -> (log r)^2 = [0.25, 0.09, 0.09, 0], tau 0.04.
# all: means after removing the largest k: k=0 0.1075, k=1 0.06, k=2 0.045, k=3 0 -> tokens 0, 1, 2 masked.
# ppo_active with pi_old = [0, 0.3, -0.3, 0]: token 0's PPO ratio is e^0.5 = 1.65 > 1.28 with A = +1, so the clip
# removes its gradient: it is neither counted nor masked. Active (log r)^2 = [0.09, 0.09, 0]: k=0 0.06, k=1 0.045,
# k=2 0 -> tokens 1, 2 masked. With A = -1 token 0 is active (r > 1 - 0.2): the same masking as all.
THETA, OLD_M2 = [0.5, 0.3, -0.3, 0.0], [0.0, 0.3, -0.3, 0.0]


@pytest.mark.parametrize("scope, advantage, keep", [
    ("all", 1.0, [False, False, False, True]),
    ("ppo_active", 1.0, [True, False, False, True]),
    ("ppo_active", -1.0, [False, False, False, True]),
])
def test_m2po_scope_by_hand(scope, advantage, keep):
    from trl_ext_plugins.corrections.m2po import M2PO, M2POParams

    li = m2po_inputs(THETA, OLD_M2, advantage)
    weights = M2PO(M2POParams(scope=scope)).trl_ext_token_weights(inputs=li)
    assert weights.mask.tolist() == [keep]
    second_moment = {("all", 1.0): 0.1075, ("ppo_active", 1.0): 0.06, ("ppo_active", -1.0): 0.1075}[scope, advantage]
    assert reduce_figures(li.metrics)["m2po/second_moment"] == pytest.approx(second_moment)


def test_m2po_ppo_active_would_spare_a_gspo_outlier_with_a_gradient():
    """Why ppo_active needs the per-token PPO clip: under GSPO (eps 3e-4/4e-4 on the *sequence* ratio) log r = [1, -1]
    has s = 1, so both tokens have a gradient, but the per-token test calls token 0 (r = e, A > 0) clipped: it left
    the statistic and was never masked, while its mirror token 1 was masked."""
    from trl_ext_plugins.corrections.m2po import M2PO, M2POParams
    from trl_ext_plugins.losses.gspo import GSPO, GSPOParams

    li = m2po_inputs([1.0, -1.0], [0.0, 0.0], 1.0)
    li.epsilon_low, li.epsilon_high = 3e-4, 4e-4
    loss = GSPO(GSPOParams(form="token")).trl_ext_policy_loss(inputs=li)
    (grad,) = torch.autograd.grad(loss.sum(), li.per_token_logps)
    assert (grad != 0).all()  # s = exp(mean log r) = 1 is inside the clip: both tokens move the policy
    assert M2PO(M2POParams(scope="ppo_active")).trl_ext_token_weights(inputs=li).mask.tolist() == [[True, False]]
    assert M2PO().trl_ext_token_weights(inputs=li).mask.tolist() == [[False, False]]  # scope all: both masked


def _m2po_stage(objective, **args):
    plugins = ([objective] if objective else []) + [{"m2po": {"scope": "ppo_active"}}, "exact_match"]
    return StageSpec.model_validate({"name": "s", "trainer": "grpo", "model": "embedded:tiny-qwen2",
                                     "dataset": {"source": "embedded:arithmetic", "params": {"format": "prompt"}},
                                     "plugins": plugins, "args": args})


@pytest.mark.parametrize("objective, args, refused", [
    ("gspo", {}, "'gspo'"), ("gmpo", {}, "'gmpo'"), ("cispo", {}, "'cispo'"), ("sapo", {}, "'sapo'"),
    ("ce_gppo", {}, "'ce_gppo'"), ("reinforce", {}, "'reinforce'"),
    (None, {"loss_type": "cispo"}, "loss_type 'cispo'"),
    (None, {"importance_sampling_level": "sequence"}, "loss_type 'dapo' at importance_sampling_level 'sequence'"),
    ("grpo", {}, None), ("dr_grpo", {}, None), ("dapo", {}, None), ("clip_higher", {}, None), (None, {}, None),
    (None, {"loss_type": "bnpo"}, None),
])
def test_m2po_ppo_active_needs_the_token_ppo_clip(objective, args, refused):
    from trl_ext.catalog import Catalog

    stage = _m2po_stage(objective, **args)
    if refused is None:
        resolve_stage(stage, 0, Catalog.discover())
        return
    with pytest.raises(RecipeError, match=f"plugins.m2po.scope: 'ppo_active' assumes the per-token PPO clip .* "
                                          f"the objective is {refused}"):
        resolve_stage(stage, 0, Catalog.discover())


def test_ppo_clip_active_by_hand():
    from trl_ext_plugins.corrections import math as cm

    # r = [1.3, 1.27, 0.79, 0.81, 2.0] with eps (0.2, 0.28)
    log_r = torch.log(torch.tensor([[1.3, 1.27, 0.79, 0.81, 2.0]], dtype=D))
    positive = cm.ppo_clip_active(log_r, torch.tensor([[1.0]], dtype=D), 0.2, 0.28)
    negative = cm.ppo_clip_active(log_r, torch.tensor([[-1.0]], dtype=D), 0.2, 0.28)
    zero = cm.ppo_clip_active(log_r, torch.tensor([[0.0]], dtype=D), 0.2, 0.28)
    assert positive.tolist() == [[False, True, True, True, False]]  # A > 0: clipped above 1.28
    assert negative.tolist() == [[True, True, False, True, True]]  # A < 0: clipped below 0.8
    assert zero.all()


# -- 4. dynamic sampling with a generation round size different from the target batch ----------------------------------

G4 = 4


def odd_answer_varies(completions, answer, **kwargs):
    """Zero variance for an even answer; completion-dependent (almost surely varying) for an odd one."""
    return [0.0 if int(a) % 2 == 0 else float(sum(map(ord, c)) % 97) for c, a in zip(completions, answer)]


@pytest.mark.parametrize("round_prompts, rounds, prompts", [
    # target 2 prompts; the loader's 2 (even) prompts carry no signal. Each refill draws only odd prompts.
    (None, 2, 2 + 2),  # verl default: rounds of the target size; round 2's 2 groups fill the batch
    (4, 1, 4),  # larger rounds: round 1 is completed to 4 by 2 drawn prompts, which supply both groups
    (5, 1, 5),  # round 1 completed to 5: 3 drawn groups with signal, the first 2 used, 1 surplus discarded
    (1, 3, 2 + 1 + 1),  # smaller rounds: 2 refills of 1 prompt
    (3, 2, 3 + 3),  # round 1 completed to 3 (1 drawn prompt), round 2 of 3 supplies the second group
])
def test_dynamic_sampling_round_size_by_hand(tiny_trainer, round_prompts, rounds, prompts):
    import numpy as np

    from trl_ext.embedded.arithmetic import arithmetic_dataset
    from trl_ext_plugins.rollout.dynamic_sampling import DynamicSampling

    full = arithmetic_dataset("train", format="prompt", size=64)
    odd = full.filter(lambda row: int(row["answer"]) % 2 == 1)
    even = full.filter(lambda row: int(row["answer"]) % 2 == 0)
    plugin = DynamicSampling(DynamicSampling.Params(max_rounds=5, round_prompts=round_prompts))
    trainer = tiny_trainer("grpo", plugins=[plugin], dataset=odd, reward_funcs=[odd_answer_varies],
                           args={"per_device_train_batch_size": 2 * G4, "num_generations": G4, "temperature": 1.0})
    trainer.model.train()
    torch.manual_seed(0)
    output = trainer._generate_and_score_completions([even[i] for i in (0, 1) for _ in range(G4)])
    record = plugin.history[-1]
    assert record["dynamic_sampling/rounds"] == rounds and record["dynamic_sampling/prompts"] == prompts
    assert record["dynamic_sampling/kept_groups_fraction"] == 1.0
    assert output["completion_ids"].shape[0] == 2 * G4  # the target batch, whatever the round size
    # the kept groups are the drawn prompts in draw order: generation k (k = 0 for the completion of round 1, then
    # 1, 2, ...) draws from numpy's generator seeded (seed 0, step 0, k), as the plugin documents
    draws = []
    size = round_prompts or 2
    if size > 2:
        draws += np.random.default_rng([0, 0, 0]).choice(len(odd), size=size - 2, replace=False).tolist()
    for k in range(1, rounds):
        index = k + (size > 2)
        draws += np.random.default_rng([0, 0, index]).choice(len(odd), size=size, replace=False).tolist()
    texts = trainer.processing_class.batch_decode(output["prompt_ids"], skip_special_tokens=True)
    sums = [sum(int(x) for x in t.strip().rstrip("=").split("+")) for t in texts]
    assert sums == [int(odd[draws[0]]["answer"])] * G4 + [int(odd[draws[1]]["answer"])] * G4


def test_dynamic_sampling_round_size_must_divide_over_processes():
    from types import SimpleNamespace

    from trl_ext_plugins.rollout.dynamic_sampling import DynamicSampling

    trainer = SimpleNamespace(train_dataset=[{"prompt": "p"}] * 8, num_generations=2,
                              args=SimpleNamespace(seed=0, gradient_accumulation_steps=1), _step=0,
                              state=SimpleNamespace(global_step=0),
                              accelerator=SimpleNamespace(num_processes=4, process_index=0))
    with pytest.raises(ValueError, match="3 prompts x 2 samples does not divide over 4 processes"):
        DynamicSampling()._new_rows(trainer, [{"prompt": "p"}] * 2, 1, 3)
    assert len(DynamicSampling()._new_rows(trainer, [{"prompt": "p"}] * 2, 1, 6)) == 3  # 6 x 2 / 4 rows per rank


# -- 5. reward shaping conventions -------------------------------------------------------------------------------------


def f64(*values):
    return torch.tensor(values, dtype=D)


@pytest.mark.parametrize("cap, factor, expected", [
    # L_max 100, L_cache 20: 0 up to 80, (80 - L) / 20 * factor beyond, capped at -factor beyond L_max or not
    (True, 1.0, [0.0, -0.5, -1.0, -1.0, -1.0]),  # DAPO paper
    (False, 1.0, [0.0, -0.5, -1.0, -1.5, -2.5]),  # verl DAPORewardManager: min(-(L - 80) / 20, 0)
    (True, 0.5, [0.0, -0.25, -0.5, -0.5, -0.5]),
    (False, 0.5, [0.0, -0.25, -0.5, -0.75, -1.25]),
])
def test_dapo_overlong_penalty_capped_or_not(cap, factor, expected):
    from trl_ext_plugins.rewards import formulas

    got = formulas.dapo_overlong_penalty(f64(80, 90, 100, 110, 130), 100, 20, cap, factor)
    assert got.tolist() == pytest.approx(expected)


@pytest.mark.parametrize("beyond, expected", [
    # L_max 100; rows: correct L=150, correct L=200, wrong L=150, correct L=50 (inside: 1 + 0.5 (1 + cos(pi/2)) = 1.5)
    ("exceed", [-10.0, -10.0, -10.0, 1.5]),  # the paper: r_exceed
    ("clamp", [1.0, 1.0, 0.0, 1.5]),  # L clamped to L_max: r_L (correct 1, wrong 0)
    # continued: correct 1 + 0.5 (1 + cos(1.5 pi)) = 1.5, 1 + 0.5 (1 + cos(2 pi)) = 2; wrong 0 - 5 (1 + 0) = -5
    ("extend", [1.5, 2.0, -5.0, 1.5]),
])
def test_cosine_beyond_max_length(beyond, expected):
    from trl_ext_plugins.rewards import formulas

    got = formulas.cosine_length_reward(f64(150, 200, 150, 50), torch.tensor([1, 1, 0, 1]), 100, beyond=beyond)
    assert got.tolist() == pytest.approx(expected, abs=1e-12)


def test_cosine_truncated_rule_scores_a_cut_completion_as_exceeding():
    """Yeo et al.'s released code (openrlhf/reward/cosine.py) gives the exceed reward to a generation that reaches its
    budget (gen_len + 16 >= max_len, max_len = the generation limit); the paper's text says "exceeds L_max". With
    L_max = the budget a cut completion is at L = L_max: exceed scores it r_L (0 wrong, 1 correct), truncated -10."""
    from trl_ext_plugins.rewards import formulas

    lengths, correct = f64(100, 100, 50, 150), torch.tensor([0, 1, 0, 1])
    cut = torch.tensor([True, True, False, False])  # the first two filled the budget
    assert formulas.cosine_length_reward(lengths, correct, 100).tolist() == pytest.approx([0.0, 1.0, -5.0, -10.0])
    got = formulas.cosine_length_reward(lengths, correct, 100, beyond="truncated", truncated=cut)
    assert got.tolist() == pytest.approx([-10.0, -10.0, -5.0, -10.0])
    with pytest.raises(ValueError, match="needs the truncated flags"):
        formulas.cosine_length_reward(lengths, correct, 100, beyond="truncated")


def test_stop_penalties_by_hand():
    from trl_ext_plugins.rewards import formulas

    # budget 4; rows: cut at the limit (no EOS), ended at the limit on EOS, stopped early by a stop string (no EOS),
    # empty; truncation -1, no stop -0.5
    got = formulas.stop_penalties(f64(4, 4, 3, 0), torch.tensor([False, True, False, False]), 4, -1.0, -0.5)
    assert got.tolist() == [-1.5, -1.0, -0.5, -0.5]


def shaping_batch(trainer):
    # 3 rows, weights [exact_match 1, length_shaping 2]; EOS id 2. Row 0: 4 tokens, no EOS, tokens 1-2 are a tool
    # result (2 model tokens); row 1: 2 tokens ending on EOS; row 2: 3 tokens ending on EOS.
    ids = torch.tensor([[5, 6, 7, 8], [5, 2, 0, 0], [5, 6, 2, 0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 0]])
    return RolloutBatch(
        rewards_per_func=torch.tensor([[1.0, 0.0], [0.0, 0.0], [1.0, 0.0]]), reward_names=["exact_match",
                                                                                            "length_shaping"],
        reward_weights=torch.tensor([1.0, 2.0]), num_generations=3, process_slice=slice(0, 3), completion_ids=ids,
        completion_mask=mask, completion_lengths=mask.sum(-1), prompts=["p"] * 3, completions=[""] * 3,
        inputs=[{}] * 3, trainer=trainer, tool_mask=torch.tensor([[1, 0, 0, 1], [1, 1, 1, 1], [1, 1, 1, 1]]))


@pytest.mark.parametrize("length_tokens, expected", [
    # dapo, L_max 3, L_cache 2: 0 up to 1, (1 - L) / 2 beyond, -1 beyond 3. Stop penalties: only row 0 (length 4 =
    # max_completion_length, last token 8 is no EOS): -1 - 0.5 = -1.5 on the total, -0.75 in the column (weight 2).
    ("all", [-1.0 - 0.75, -0.5, -1.0]),  # lengths [4, 2, 3]
    ("model", [-0.5 - 0.75, -0.5, -1.0]),  # lengths [2, 2, 3]: row 0's tool tokens do not count
])
def test_length_shaping_stop_penalties_and_tool_tokens(length_tokens, expected):
    from types import SimpleNamespace

    from trl_ext_plugins.rewards.length_shaping import LengthShaping, LengthShapingParams

    trainer = SimpleNamespace(eos_token_ids=[2], args=SimpleNamespace(max_completion_length=4),
                              state=SimpleNamespace(global_step=0))
    batch = shaping_batch(trainer)
    plugin = LengthShaping(LengthShapingParams(mode="dapo", max_length=3, cache_length=2, truncation_penalty=-1.0,
                                               no_stop_penalty=-0.5, length_tokens=length_tokens))
    out = plugin.trl_ext_shape_rewards(rewards_per_func=batch.rewards_per_func, batch=batch)
    assert out[:, 1].tolist() == pytest.approx(expected)
    assert out[:, 0].tolist() == [1.0, 0.0, 1.0]  # the correctness column is left as scored
    # mode none: only the penalties; refused at validation without any
    none = LengthShaping(LengthShapingParams(mode="none", no_stop_penalty=-0.5))
    assert none.trl_ext_shape_rewards(rewards_per_func=batch.rewards_per_func, batch=batch)[:, 1].tolist() == \
        [-0.25, 0.0, 0.0]
    errors = LengthShaping(LengthShapingParams(mode="none")).trl_ext_validate_stage(stage=None, plugins=[])
    assert errors and "mode: none" in errors[0]


def test_reward_shaping_sees_the_tool_mask(tiny_trainer):
    """TRL builds its tool mask only after scoring; the trainer hands the generation's tool mask to the reward-shaping
    hooks (padded with 1, as TRL pads it)."""
    from trl_ext import NoParams, Plugin, Slot, hookimpl

    class FakeTools(Plugin):
        """Marks each completion's first token as a tool token (test double)."""

        name, family, slots, Params = "fake_tools", "rollout", frozenset({Slot.GENERATION}), NoParams
        seen = []

        @hookimpl
        def trl_ext_generate(self, trainer, prompts, generate):
            out = list(generate(prompts))
            out[2] = [[0] + [1] * (len(ids) - 1) for ids in out[1]]
            return tuple(out)

        @hookimpl
        def trl_ext_shape_rewards(self, rewards_per_func, batch):
            self.seen.append((batch.tool_mask.clone(), batch.completion_mask.clone()))
            return rewards_per_func

    plugin = FakeTools()
    trainer = tiny_trainer("grpo", plugins=[plugin])
    trainer.model.train()
    trainer._generate_and_score_completions([trainer.train_dataset[i // 4] for i in range(8)])
    tool_mask, mask = plugin.seen[-1]
    assert (tool_mask[:, 0] == 0).all() and (tool_mask[:, 1:] == 1).all()
    assert ((mask * tool_mask).sum(-1) == mask.sum(-1) - 1).all()


def test_remax_token_kl_on_the_grpo_trainer(tiny_trainer, monkeypatch):
    """ReMax with the KL in the token rewards on the real trainer: the greedy pass, the reference (args.beta set by
    the plugin) and the sampling policy's log-probs give A_t = sum_{s >= t} (1[s = last] R - beta KL_s) - b."""
    seen = {}
    original = remax_module.greedy_rewards

    def recording(trainer, prompts, inputs):
        seen["baseline"] = original(trainer, prompts, inputs)
        return seen["baseline"]

    monkeypatch.setattr(remax_module, "greedy_rewards", recording)
    values = [1.0, 0.0, 0.0, 1.0, 0.0, 1.0, 1.0, 1.0]

    def reward(completions, **kwargs):
        return values[: len(completions)] if len(completions) == 8 else [0.5] * len(completions)

    trainer = tiny_trainer("grpo", plugins=[ReMax(ReMaxParams(kl_coef=0.5))], reward_funcs=[reward])
    assert trainer.args.beta == 1.0 and trainer.kl_term.weight(1.0) == 0.0
    with torch.no_grad():  # move the policy away from the reference so the KL is not zero
        for p in trainer.model.parameters():
            p.add_(torch.randn_like(p, generator=torch.Generator().manual_seed(1)) * 0.05)
    trainer.model.train()
    out = trainer._generate_and_score_completions([trainer.train_dataset[i // 4] for i in range(8)])
    mask = out["completion_mask"].double()
    ids = torch.cat([out["prompt_ids"], out["completion_ids"]], 1)
    with torch.no_grad():
        logps, _, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model, ids, torch.cat([out["prompt_mask"], out["completion_mask"]], 1), mask.shape[1])
    d = torch.where(mask.bool(), logps.double() - out["ref_per_token_logps"].double(), 0.0)
    assert d.abs().sum() > 0
    expected = torch.zeros_like(d)
    for row in range(8):
        n = int(mask[row].sum())
        r = -0.5 * d[row, :n]
        r[-1] += values[row]
        expected[row, :n] = torch.flip(torch.cumsum(torch.flip(r, [0]), 0), [0]) - seen["baseline"][row // 4].double()
    assert out["advantages"].shape == mask.shape
    assert torch.allclose(out["advantages"].double(), expected, atol=1e-4)


# -- NeMo-RL's KL weight (kl_bias_correction: score) ----------------------------------------------------------------


def test_score_weighted_kl_has_nemo_rls_value_and_gradient():
    """NeMo-RL's test_clipped_pg_loss_kl_gradient_includes_sampling_term, by hand: log pi -1.2, log pi_ref -0.9, k3.
    Value e^0.3 - 0.3 - 1 = 0.049859; gradient -(e^0.3 - 1) + 0.049859 = -0.300000 (the score term added). TRL's ratio
    weight with pi_old -1.0 gives r * k3 and r * (k3 + dk3); no weight gives dk3 = -0.349859."""
    logp = torch.tensor([-1.2], dtype=D, requires_grad=True)
    ref, old = torch.tensor([-0.9], dtype=D), torch.tensor([-1.0], dtype=D)
    k3 = math.exp(0.3) - 0.3 - 1
    grads = {}
    for mode in ("score", True, False):
        term = ops.KLTerm("k3", bias_correction=mode)
        value = term.per_token(logp, ref, torch.exp(logp - old))
        (grads[mode],) = torch.autograd.grad(value.sum(), logp)
        expected_value = k3 * (math.exp(-0.2) if mode is True else 1.0)
        assert value.item() == pytest.approx(expected_value, rel=1e-12)
    assert grads["score"].item() == pytest.approx(-0.3, abs=1e-12)
    assert grads[False].item() == pytest.approx(1 - math.exp(0.3), rel=1e-12)
    assert grads[True].item() == pytest.approx(math.exp(-0.2) * (k3 + 1 - math.exp(0.3)), rel=1e-12)


def test_score_weight_equals_trls_ratio_on_policy_and_clamps_after_weighting():
    logp = torch.tensor([-1.0, -2.0, -0.5, -4.0], dtype=D, requires_grad=True)
    ref = torch.tensor([-1.3, -1.0, -0.5, -1.0], dtype=D)
    on_policy_ratio = torch.exp(logp - logp.detach())
    score = ops.KLTerm("k3", bias_correction="score").per_token(logp, ref)
    ratio = ops.KLTerm("k3", bias_correction=True).per_token(logp, ref, on_policy_ratio)
    g_score, g_ratio = (torch.autograd.grad(x.sum(), logp)[0] for x in (score, ratio))
    assert torch.allclose(score, ratio) and torch.allclose(g_score, g_ratio)
    # d = -3 (k3 = 16.09 > 10): NeMo-RL and slime clamp the weighted value (clamp_weighted), so the gradient is 0
    # there; clamping the estimate first, w * clamp(k3) keeps 10 * grad w = 10, whichever weight
    for bias in ("score", True):
        for weighted, expected in ((True, 0.0), (False, 10.0)):
            term = ops.KLTerm("k3", bias_correction=bias, clamp=10.0, clamp_weighted=weighted)
            clamped = term.per_token(logp, ref, torch.exp(logp - logp.detach()))
            (g,) = torch.autograd.grad(clamped.sum(), logp)
            assert clamped[3].item() == pytest.approx(10.0) and g[3].item() == pytest.approx(expected)
            assert torch.allclose(clamped[:3], score[:3].detach())  # inside the clamp both orders are the estimate


def test_weighted_clamp_bounds_the_ratio_weighted_value_as_slime():
    """slime: clamp(r * k3, +-c); trl-ext's default r * clamp(k3). Clamp 1: d = 1.5 (k3 = 0.7231) with r = 2 gives
    1 against 1.4462; d = -3 (k3 = 16.09) with r = e^-1 gives 1 against e^-1."""
    logp = torch.tensor([0.0, -2.0], dtype=D, requires_grad=True)
    ref = torch.tensor([-1.5, 1.0], dtype=D)
    old = torch.tensor([-math.log(2.0), -1.0], dtype=D)
    k3 = math.exp(-1.5) - 1 + 1.5
    weighted = ops.KLTerm("k3", bias_correction=True, clamp=1.0, clamp_weighted=True)
    estimate = ops.KLTerm("k3", bias_correction=True, clamp=1.0)
    assert weighted.per_token(logp, ref, torch.exp(logp - old)).tolist() == pytest.approx([1.0, 1.0], rel=1e-12)
    assert estimate.per_token(logp, ref, torch.exp(logp - old)).tolist() == pytest.approx([2 * k3, math.exp(-1)],
                                                                                          rel=1e-12)


def test_grpo_score_kl_weight_leaves_trls_field_and_routes_its_own_term():
    from trl_ext_plugins.losses.grpo import GRPO

    plugin = GRPO(GRPO.Params(kl_bias_correction="score", kl_clamp=10.0, kl_clamp_order="weighted"))
    assert "use_bias_correction_kl" not in plugin.trl_ext_configure_args(trainer="grpo", args={})
    term = plugin.kl_term(True)
    assert term.bias_correction == "score" and term.clamp == 10.0 and term.clamp_weighted and not term.is_trl()
    assert ops.KLTerm("k3", bias_correction=False).is_trl()
    with pytest.raises(ValueError, match="bias correction"):
        ops.KLTerm("k3", bias_correction="ratio")
