"""``vapo``: PPO with value pre-training, decoupled and length-adaptive GAE, clip-higher, token-level loss and a
positive-example NLL term."""

from __future__ import annotations

import dataclasses

import torch
from pydantic import Field

from trl_ext import hookimpl, ops
from trl_ext import metrics as figures
from trl_ext.trainers.grpo import global_token_mean
from trl_ext_plugins.advantages.ppo import PPO, PPOParams
from trl_ext_plugins.advantages.rollout import global_token_count, kept_rewards, local

POSITIVE = "vapo_positive"  # (B,) 1.0 for correct samples (reward > positive_threshold)
POSITIVE_TOKENS = "vapo_positive_tokens"  # (B,) the global count of completion tokens of correct samples


class VAPOParams(PPOParams):
    critic_lr: float = Field(2e-6, gt=0.0, description="AdamW learning rate of the critic (VAPO: 2e-6).")
    critic_warmup_steps: int = Field(50, ge=0, description="Value pre-training: optimizer steps of critic-only "
                                     "training on Monte-Carlo returns of the starting policy (lam_critic 1, gamma 1).")
    lam_critic: float | None = Field(1.0, ge=0.0, le=1.0, description="GAE lambda of the critic targets (VAPO: 1.0, "
                                     "unbiased Monte-Carlo returns).")
    length_adaptive_alpha: float | None = Field(0.05, gt=0.0, description="Policy lambda 1 - 1/(alpha * l) per "
                                                "sequence of length l (VAPO: 0.05; None: fixed lam).")
    kl_coef: float = Field(0.0, ge=0.0, description="KL in the reward (VAPO: none, 0).")
    nll_coef: float = Field(0.1, ge=0.0, description="mu of the positive-example NLL term mu * L_NLL (VAPO: 0.1; 0: off).")
    positive_threshold: float = Field(0.0, description="A sample is correct (in the NLL set) when its total reward "
                                      "is > this.")
    clip_higher: bool = Field(True, description="Set args.epsilon_high to epsilon_high (decoupled clip).")
    epsilon_high: float = Field(0.28, gt=0.0, description="Upper clip range when clip_higher (VAPO: 0.28).")
    token_level_loss: bool = Field(True, description="Set args.loss_type to dapo (token mean over the global batch).")


class VAPO(PPO):
    """VAPO (Yue et al., ByteDance Seed, 2025, arXiv 2504.05118): value-based augmented PPO for long reasoning.

    The ``ppo`` plugin (critic, GAE, clipped value loss, checkpointing) with VAPO's parts, each switchable:

    * value pre-training: ``critic_warmup_steps`` (50) steps in which only the critic learns, on the starting policy's
      samples, with ``lam_critic`` 1 and gamma 1, i.e. on Monte-Carlo returns (advantages 0 and no NLL term);
    * decoupled GAE: critic targets with ``lam_critic`` 1.0, policy advantages with the length-adaptive
      ``lambda = 1 - 1/(alpha * l)`` (alpha 0.05; ``alpha * l`` clamped to >= 1 so lambda is in [0, 1], NeMo-RL);
    * clip-higher: ``args.epsilon_high`` 0.28 (with the recipe's ``epsilon`` 0.2 as the lower side);
    * token-level loss: ``args.loss_type: dapo``;
    * positive-example NLL: ``mu * L_NLL``, ``L_NLL = -(1 / sum_{o in T} |o|) sum_{o in T} sum_t log pi(o_t)`` over the
      correct samples T (total reward > ``positive_threshold``) of the whole generation batch on all ranks, the
      denominator counted over that batch (as the token-level policy loss); mu 0.1; ``nll_coef: 0`` gives
      PPO + clip-higher;
    * group sampling: ``args.num_generations`` samples per prompt (paper 16); the recipe sets it.

    Defaults differ from ``ppo`` where the paper says so: critic lr 2e-6, no KL in the reward (kl_coef 0), value
    warm-up 50 steps. Advantages are whitened over the batch as in ``ppo`` (``whiten_advantages``).
    """

    name = "vapo"
    Params = VAPOParams

    @hookimpl
    def trl_ext_configure_args(self, trainer, args):
        out = dict(super().trl_ext_configure_args(trainer, args) or {})
        if self.params.clip_higher:
            out["epsilon_high"] = self.params.epsilon_high
        if self.params.token_level_loss:
            out["loss_type"] = "dapo"
        return out or None

    @hookimpl
    def trl_ext_compute_advantages(self, rewards, batch):
        advantages = super().trl_ext_compute_advantages(rewards, batch)
        # Value pre-training trains the critic alone: the NLL term would move the policy on its own (its gradient does
        # not go through the zeroed advantages), so no positive set is formed during the warm-up.
        if self.params.nll_coef > 0 and not self.in_critic_warmup(batch.trainer):
            # a filtered row is in no positive set: its tokens would count in the NLL's denominator, not its sum
            kept = kept_rewards(rewards, batch)
            positive = torch.nan_to_num(kept, nan=float("-inf")) > self.params.positive_threshold
            mine = local(positive, batch).to(torch.float32)
            batch.loss_extras[POSITIVE] = mine
            batch.loss_extras[POSITIVE_TOKENS] = torch.full_like(mine, global_token_count(batch, mine))
            rows = positive.numel() if batch.keep is None else batch.keep.sum().clamp(min=1)  # kept rows
            batch.metrics["vapo/positive_fraction"] = (positive.float().sum() / rows).item()
        return advantages

    @hookimpl
    def trl_ext_extra_loss(self, inputs):
        if self.params.nll_coef <= 0 or POSITIVE not in inputs.extra:
            return None
        positive = inputs.extra[POSITIVE].to(inputs.mask.dtype)
        mask = inputs.mask * positive.unsqueeze(-1)
        total = inputs.extra[POSITIVE_TOKENS]
        ctx = dataclasses.replace(inputs, num_items_in_batch=total[0] if total.numel() else 0)
        nll = global_token_mean(-inputs.per_token_logps, mask, ctx)
        nll_tokens = ops.where_mask(-inputs.per_token_logps.detach(), mask)  # where, not * mask: -inf at padding
        inputs.metrics["vapo/nll"] = figures.mean(nll_tokens.sum(), mask.sum())  # over every rank's tokens
        return self.params.nll_coef * nll
