"""``clip_higher``: the PPO clip with a raised upper bound (DAPO's clip-higher on its own)."""

from __future__ import annotations

from pydantic import Field

from trl_ext import PluginParams, hookimpl, ops
from trl_ext_plugins.losses import math
from trl_ext_plugins.losses.base import ObjectivePlugin


class ClipHigherParams(PluginParams):
    epsilon_high: float = Field(0.28, gt=0, description="Upper clip deviation (ratio clipped at 1+eps_high); the "
                                                         "lower one stays args.epsilon. Sets args.epsilon_high.")


class ClipHigher(ObjectivePlugin):
    """Clip-higher (DAPO, Yu et al. 2025, arXiv 2503.14476, section 3.1).

    Per token ``min(r*A, clip(r, 1-eps_low, 1+eps_high)*A)`` with eps_high (0.28) > eps_low (``args.epsilon``, 0.2), so
    low-probability tokens with A>0 can grow further before the clip stops their gradient. Only the objective: the
    aggregation is the recipe's ``loss_type`` (TRL default ``dapo``) or the ``aggregation`` plugin. Clip bounds are
    deviations from 1 (convention 9). For the bounded-gradient variant see ``ce_gppo``.
    """

    name = "clip_higher"
    token_ppo_clip = True
    Params = ClipHigherParams

    def extra_trl_args(self):
        return {"epsilon_high": self.params.epsilon_high}

    @hookimpl
    def trl_ext_policy_loss(self, inputs):
        _, log_ratio, advantages = math.masked_inputs(inputs)
        return ops.ppo_clip_objective(ops.safe_ratio(log_ratio), advantages, inputs.epsilon_low, inputs.epsilon_high)
