"""``dr_grpo``: GRPO without the 1/|o_i| length normalisation and without the std in the advantage."""

from __future__ import annotations

from trl_ext import NoParams, hookimpl, ops
from trl_ext_plugins.losses import math
from trl_ext_plugins.losses.base import ObjectivePlugin


class DrGRPO(ObjectivePlugin):
    """Dr. GRPO ("Understanding R1-Zero-Like Training", Liu et al. 2025, arXiv 2503.20783).

    Objective per token: the PPO clip ``min(r*A, clip(r, 1-eps_low, 1+eps_high)*A)`` (eps from ``args.epsilon``, 0.2).
    Advantage ``A = R - mean_G(R)`` (no division by the group std): sets ``args.scale_rewards: none``.
    Aggregation: sum over tokens divided by a *constant* ``B * L`` with ``L = args.max_completion_length``
    (verl ``seq-mean-token-sum-norm`` up to verl's missing 1/G; TRL ``loss_type="dr_grpo"``): sets
    ``args.loss_type: dr_grpo``. No KL (TRL's default ``beta`` 0). Parity with TRL's ``dr_grpo`` is tested.
    """

    name = "dr_grpo"
    token_ppo_clip = True
    Params = NoParams
    trl_args = {"loss_type": "dr_grpo", "scale_rewards": "none"}

    @hookimpl
    def trl_ext_policy_loss(self, inputs):
        _, log_ratio, advantages = math.masked_inputs(inputs)
        return ops.ppo_clip_objective(ops.safe_ratio(log_ratio), advantages, inputs.epsilon_low, inputs.epsilon_high)
