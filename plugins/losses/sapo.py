"""``sapo``: Soft Adaptive Policy Optimization (a smooth gate instead of the hard clip)."""

from __future__ import annotations

from pydantic import Field

from trl_ext import PluginParams, hookimpl, ops
from trl_ext_plugins.losses import math
from trl_ext_plugins.losses.base import ObjectivePlugin


class SAPOParams(PluginParams):
    tau_pos: float = Field(1.0, gt=0, description="Gate temperature for A>0 (sets args.sapo_temperature_pos).")
    tau_neg: float = Field(1.05, gt=0, description="Gate temperature for A<=0 (sets args.sapo_temperature_neg).")


class SAPO(ObjectivePlugin):
    """SAPO (Gao et al. 2025, Qwen, arXiv 2511.20347).

    Per token ``-f(r) A`` with ``f(r) = sigmoid(tau (r - 1)) * 4/tau``, ``tau = tau_pos`` if A>0 else ``tau_neg``.
    The gradient weight w.r.t. log pi is ``r f'(r)``, ``f'(r) = 4 s (1 - s)``, ``s = sigmoid(tau(r-1))``: 1 on policy,
    decaying smoothly off policy. Defaults tau_pos 1.0, tau_neg 1.05 (paper, verl, TRL). Aggregation
    seq-mean-token-mean (``args.loss_type: sapo``). Parity with TRL's ``loss_type="sapo"`` is tested.
    """

    name = "sapo"
    Params = SAPOParams

    def extra_trl_args(self):
        return {"loss_type": "sapo", "sapo_temperature_pos": self.params.tau_pos,
                "sapo_temperature_neg": self.params.tau_neg}

    @hookimpl
    def trl_ext_policy_loss(self, inputs):
        _, log_ratio, advantages = math.masked_inputs(inputs)
        return ops.sapo_objective(ops.safe_ratio(log_ratio), advantages, self.params.tau_pos, self.params.tau_neg)
