"""``ce_gppo``: gradient-preserving clipping with bounded coefficients (CE-GPPO)."""

from __future__ import annotations

from pydantic import Field

from trl_ext import PluginParams, hookimpl
from trl_ext_plugins.losses import math
from trl_ext_plugins.losses.base import ObjectivePlugin


class CEGPPOParams(PluginParams):
    beta_low: float = Field(0.75, ge=0, description="Gradient coefficient of tokens clipped below (A<0, r<1-eps_low).")
    beta_high: float = Field(1.0, ge=0, description="Gradient coefficient of tokens clipped above (A>0, r>1+eps_high).")
    epsilon_high: float = Field(0.28, gt=0, description="Upper clip deviation (sets args.epsilon_high); the lower "
                                                         "one is args.epsilon (0.2).")
    dual_clip: float | None = Field(3.0, gt=1, description="Dual-clip constant c for A<0 (loss capped at -c*A); "
                                                            "None disables it.")


class CEGPPO(ObjectivePlugin):
    """CE-GPPO (Su et al. 2025, Kuaishou Klear, arXiv 2509.20712; GPPO from arXiv 2508.07629).

    Per token, with r = pi/pi_old: if A<0 and r<1-eps_l the loss is ``-beta1 (1-eps_l) r/sg(r) A``; if A>0 and
    r>1+eps_h it is ``-beta2 (1+eps_h) r/sg(r) A``; otherwise ``-r A`` (and for A<0 the dual clip c=3 caps it at
    ``-c A``). Forward values equal the PPO-clipped ones scaled by beta; the gradient w.r.t. log pi of a clipped token is
    ``-beta1 (1-eps_l) A`` or ``-beta2 (1+eps_h) A`` instead of PPO's 0. Defaults beta1 0.75, beta2 1.0 (reference
    code), eps 0.2/0.28 and token-mean aggregation (``args.loss_type: dapo``), as it builds on DAPO.
    """

    name = "ce_gppo"
    Params = CEGPPOParams
    trl_args = {"loss_type": "dapo"}

    def extra_trl_args(self):
        return {"epsilon_high": self.params.epsilon_high}

    @hookimpl
    def trl_ext_policy_loss(self, inputs):
        p = self.params
        _, log_ratio, advantages = math.masked_inputs(inputs)
        return math.ce_gppo_objective(log_ratio, advantages, inputs.epsilon_low, inputs.epsilon_high,
                                      p.beta_low, p.beta_high, p.dual_clip)
