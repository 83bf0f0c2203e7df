"""``cispo``: Clipped IS-weight Policy Optimization (MiniMax-M1)."""

from __future__ import annotations

from pydantic import Field

from trl_ext import PluginParams, hookimpl, ops
from trl_ext_plugins.losses import math
from trl_ext_plugins.losses.base import ObjectivePlugin


class CISPOParams(PluginParams):
    epsilon_high: float = Field(4.0, gt=0, description="Upper deviation of the IS weight: weight <= 1 + eps_high. "
                                                        "Default 4.0, i.e. TRL's recommended absolute cap 5.0 (ScaleRL).")
    epsilon_low: float | None = Field(None, gt=0, lt=1, description="Lower deviation (weight >= 1 - eps_low); None = "
                                                                     "no lower bound, as MiniMax-M1.")


class CISPO(ObjectivePlugin):
    """CISPO (MiniMax-M1 report, arXiv 2506.13585).

    Per token ``-sg(clip(r, 1-eps_low, 1+eps_high)) * A * log pi``: the IS weight is clipped and detached, so every
    token keeps the REINFORCE gradient ``w * A * grad log pi`` (no token is dropped as by the PPO clip).
    Convention: the bounds are *deviations* from 1 as in the paper (r=1.5, eps_high=0.28 -> weight 1.28); TRL's
    ``epsilon_high`` for ``loss_type="cispo"`` is the absolute cap, so this plugin's ``epsilon_high: 4.0`` equals
    TRL's recommended ``epsilon_high=5.0``. No lower bound by default (M1). Aggregation: global token mean
    (``args.loss_type: cispo``, as the paper's 1/sum|o_i|). Parity with TRL's ``cispo`` is tested.
    """

    name = "cispo"
    Params = CISPOParams
    trl_args = {"loss_type": "cispo"}

    @hookimpl
    def trl_ext_policy_loss(self, inputs):
        p = self.params
        logps, log_ratio, advantages = math.masked_inputs(inputs)
        low = None if p.epsilon_low is None else 1 - p.epsilon_low
        return ops.cispo_objective(ops.safe_ratio(log_ratio), logps, advantages, 1 + p.epsilon_high, low)
