"""``reinforce_pp`` and ``reinforce_pp_baseline``: REINFORCE++ advantages with global-batch whitening."""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field

from trl_ext import Plugin, Slot, hookimpl
from trl_ext_plugins.advantages.math import (
    Whitening,
    discounted_returns,
    group_mean_baseline,
    masked_whiten,
    sequence_kl_rewards,
    token_rewards,
)
from trl_ext_plugins.advantages.rollout import (
    RewardKLHooks,
    RewardKLParams,
    gathered,
    kept_loss_mask,
    kept_rewards,
    local,
    rank_reduce,
    reward_kl,
)


WHITENING_HELP = ("How the advantages are whitened over the global batch: verl (default; unbiased variance, "
                  "(x - mean) / sqrt(var + 1e-8)), openrlhf (population variance, (x - mean) / sqrt(max(var, 1e-8)); "
                  "also NeMo-RL's), areal ((x - mean) / (unbiased std + 1e-5), AReaL's Normalization) or none (not "
                  "whitened: slime without --normalize-advantages); verl and openrlhf differ by sqrt((n - 1) / n) over "
                  "n tokens.")


class ReinforcePPBaselineParams(RewardKLParams):
    whitening: Whitening = Field("verl", description=WHITENING_HELP)
    kl_coef: float = Field(0.0, ge=0.0, description="beta of a KL to the reference folded into the reward (0, the "
                           "default: none, the paper's form, where the KL is a loss term, args.beta).")
    kl_form: Literal["sequence", "token", "returns"] = Field(
        "sequence", description="How a KL in the reward (kl_coef > 0) enters: sequence (verl's use_kl_in_reward: the "
        "score is R - beta * sum_t KL_t, centred on its group mean, then whitened), token (NeMo-RL: A_t = (R - "
        "group mean of R) - beta * KL_t, then whitened; the KL is not summed) or returns (AReaL: A_t = (R - group "
        "mean of R) - beta * sum_{s >= t} KL_s, the KL's reward-to-go, then whitened).")
    kl_in_loss: bool = Field(True, description="With a non-zero args.beta and kl_coef > 0: true keeps TRL's args.beta "
                             "k3 KL term in the loss too; false drops it (the KL only in the reward).")


class ReinforcePPParams(RewardKLParams):
    whitening: Whitening = Field("verl", description=WHITENING_HELP)
    kl_coef: float = Field(0.01, ge=0.0, description="beta of the per-token KL folded into the reward, "
                           "r_t = 1[t = last] * R - beta * KL_t (OpenRLHF init_kl_coef 0.01; 0: no reference).")
    gamma: float = Field(1.0, ge=0.0, le=1.0, description="Discount of the token returns G_t (paper: 1).")
    kl_in_loss: bool = Field(True, description="With a non-zero args.beta: true (default, as before) keeps TRL's "
                             "args.beta k3 KL term in the loss too; false drops it (the KL only in the reward). With "
                             "args.beta 0 (TRL's default) there is no loss term either way: the plugin sets args.beta "
                             "1.0 only so TRL computes the reference log-probs.")


class ReinforcePP(RewardKLHooks, Plugin):
    """REINFORCE++ (Hu et al. 2025, arXiv 2501.03262): critic-free token-level advantages.

    Token rewards ``r_t = 1[t = T] * R - beta * KL_t`` with ``KL_t`` from ``log pi_old - log pi_ref`` of the sampled
    token (k1 by default; k2/k3 selectable; optionally clamped to ``+-kl_clamp``, verl 10), returns
    ``G_t = sum_{s >= t} gamma^(s-t) r_s`` (gamma 1), then
    ``A_t = (G_t - mean) / std`` over the valid tokens of the *global* batch (all ranks; unbiased variance,
    ``sqrt(var + 1e-8)``; verl's masked_whiten) of the rows ``trl_ext_filter_groups`` kept. Returns ``(B, T)``
    advantages for a PPO-clip objective. ``whitening: openrlhf`` whitens as OpenRLHF does instead (population
    variance, ``sqrt(max(var, 1e-8))``: a factor ``sqrt((n - 1) / n)`` apart over ``n`` tokens); OpenRLHF also clamps
    the reward KL to +-10, which ``kl_clamp: 10`` reproduces (the default here is no clamp).

    Defaults (OpenRLHF): ``kl_coef`` 0.01, k1, gamma 1. The reference log-probs are computed whenever ``kl_coef > 0``
    (:class:`RewardKLHooks`): a recipe's non-zero ``args.beta`` also adds TRL's ``beta * k3`` KL term to the loss (as
    before) unless ``kl_in_loss: false`` (the paper's form, the KL in the reward only); with ``args.beta`` 0 there is
    no loss term and the plugin sets ``args.beta: 1.0`` only so TRL computes the reference. ``log pi_old`` is TRL's recorded old policy, or one no-grad forward pass of the unchanged policy when TRL
    did not record it. Unscorable rows count as reward 0 with KL only.
    """

    name = "reinforce_pp"
    family = "advantage"
    trainers = frozenset({"grpo"})
    slots = frozenset({Slot.ADVANTAGE})
    Params = ReinforcePPParams

    def __init__(self, params=None):
        super().__init__(params)
        self.needs = self._reward_kl_needs()

    @hookimpl
    def trl_ext_compute_advantages(self, rewards, batch):
        # completion tokens minus tool tokens, as the policy loss, of the rows the filters kept: whitening over the
        # batch must not see the groups dynamic sampling drops or the unfinished ones partial_rollout defers
        mask = kept_loss_mask(batch)
        kl = (reward_kl(batch, self.params.kl_estimator, self.params.kl_clamp, "reinforce_pp/kl")
              if self.params.kl_coef > 0 else None)
        per_token = token_rewards(torch.nan_to_num(local(rewards, batch)).float(), mask, kl, self.params.kl_coef)
        returns = discounted_returns(per_token, mask, self.params.gamma)
        return masked_whiten(returns, mask, rank_reduce(batch), self.params.whitening)


class ReinforcePPBaseline(RewardKLHooks, Plugin):
    """REINFORCE++-baseline (Hu et al. 2025, arXiv 2501.03262), for several samples per prompt.

    ``A' = R - mean_group(R)`` (group mean of scorable rows), broadcast to the sequence's tokens, then whitened over
    the valid tokens of the *global* batch like ``reinforce_pp`` (unbiased variance, ``sqrt(var + 1e-8)``; ``whitening:
    openrlhf`` for OpenRLHF's population variance and ``sqrt(max(var, 1e-8))``, also NeMo-RL's). By default no KL in
    the reward: the paper puts KL in the loss as a separate k2 term; here it is the GRPO trainer's ``args.beta``
    term, which is TRL's k3 estimator. Frameworks that fold a KL into the reward differ on how, so ``kl_coef > 0``
    names both (``KL_t`` from ``log pi_old - log pi_ref`` with ``kl_estimator``, k1 by default, clamped to
    ``+-kl_clamp`` if given): ``kl_form: sequence`` is verl's ``use_kl_in_reward`` (its token rewards summed into the
    score, ``S = R - beta * sum_t KL_t``, then ``S - mean_group(S)``), ``kl_form: token`` NeMo-RL's
    (``A'_t = R - mean_group(R) - beta * KL_t``; with ``whitening: openrlhf``, ``kl_clamp: 10`` and k3 its default
    reinforce_plus_plus estimator with ``use_kl_in_reward``) and ``kl_form: returns`` AReaL's (the KL's
    reward-to-go, ``A'_t = R - mean_group(R) - beta * sum_{s >= t} KL_s``; ``whitening: areal``). The reference
    log-probs are then computed as for ``reinforce_pp`` (``kl_in_loss``). Unscorable rows, and rows
    ``trl_ext_filter_groups`` dropped, get advantage 0 before whitening and are excluded from it.
    """

    name = "reinforce_pp_baseline"
    family = "advantage"
    trainers = frozenset({"grpo"})
    slots = frozenset({Slot.ADVANTAGE})
    Params = ReinforcePPBaselineParams

    def __init__(self, params=None):
        super().__init__(params)
        self.needs = self._reward_kl_needs()

    @hookimpl
    def trl_ext_compute_advantages(self, rewards, batch):
        p = self.params
        rewards = kept_rewards(rewards, batch)  # filtered rows: NaN, so out of the whitening below
        kl = reward_kl(batch, p.kl_estimator, p.kl_clamp, "reinforce_pp_baseline/kl") if p.kl_coef > 0 else None
        if kl is not None and p.kl_form == "sequence":
            rewards = sequence_kl_rewards(rewards, gathered(kl.sum(-1), batch), p.kl_coef)
        centred = local(rewards - group_mean_baseline(rewards, batch.num_generations), batch)
        mask = batch.loss_mask * (~torch.isnan(centred)).unsqueeze(-1)
        per_token = torch.where(mask.bool(), torch.nan_to_num(centred).float().unsqueeze(-1), 0.0)
        if kl is not None and p.kl_form in ("token", "returns"):
            penalty = kl if p.kl_form == "token" else discounted_returns(kl, mask)
            per_token = torch.where(mask.bool(), per_token - p.kl_coef * penalty, 0.0)
        return masked_whiten(per_token, mask, rank_reduce(batch), p.whitening)
