"""``gmpo``: Geometric-Mean Policy Optimization."""

from __future__ import annotations

from pydantic import Field

from trl_ext import PluginParams, hookimpl
from trl_ext_plugins.losses import math
from trl_ext_plugins.losses.base import ObjectivePlugin


class GMPOParams(PluginParams):
    epsilon_low: float = Field(0.4, gt=0, description="Lower clip bound in log space (ratio >= e^-eps); sets "
                                                       "args.epsilon.")
    epsilon_high: float = Field(0.4, gt=0, description="Upper clip bound in log space (ratio <= e^eps); sets "
                                                        "args.epsilon_high.")
    kl_bias_correction: bool | None = Field(
        None, description="With args.beta > 0: multiply the per-token k3 KL by the ratio pi_theta/pi_old (TRL GRPO's "
        "use_bias_correction_kl). null: off, as TRL's GMPOTrainer adds the plain per-sequence mean of k3, unless the "
        "recipe sets args.use_bias_correction_kl itself; true/false: sets it.")


class GMPO(ObjectivePlugin):
    """GMPO (Zhao et al. 2025, arXiv 2507.20673).

    ``J = (1/G) sum_i sgn(A_i) prod_t |min(r_it A_i, clip(r_it, e^-eps1, e^eps2) A_i)|^(1/|o_i|)``: the PPO min/clip
    is taken per token *in log space*, then the sequence's geometric mean ratio multiplies A_i. Defaults
    ``(eps1, eps2) = (0.4, 0.4)`` in log space (ratio range (0.670320, 1.491825)), as the paper, TRL's experimental
    GMPOTrainer (``epsilon=0.4``) and verl ``geo_mean``. Clip bounds are log-space (convention 9): this plugin sets
    ``args.epsilon``/``args.epsilon_high`` to them. One loss per sequence, aggregated seq-mean (``args.loss_type:
    grpo``), which equals TRL GMPO's plain mean over sequences (parity tested). Needs one advantage per sequence.
    With ``args.beta > 0`` the KL term is TRL GMPO's, k3 without the ratio factor of TRL GRPO's
    ``use_bias_correction_kl`` (``kl_bias_correction``: null keeps TRL GMPO's unless the recipe sets that field).
    """

    name = "gmpo"
    Params = GMPOParams

    def extra_trl_args(self):
        return {"loss_type": "grpo", "epsilon": self.params.epsilon_low, "epsilon_high": self.params.epsilon_high}

    @hookimpl
    def trl_ext_configure_args(self, trainer, args):
        wanted = super().trl_ext_configure_args(trainer=trainer, args=args)
        bias = self.params.kl_bias_correction
        if bias is not None:
            wanted["use_bias_correction_kl"] = bias
        elif "use_bias_correction_kl" not in args:
            # TRL's GMPOTrainer adds beta * (plain k3, sequence mean); TRL's GRPO default (True) would multiply k3 by
            # the ratio, so with beta > 0 the loss and gradient differed from TRL GMPO's
            wanted["use_bias_correction_kl"] = False
        return wanted

    @hookimpl
    def trl_ext_policy_loss(self, inputs):
        _, log_ratio, advantages = math.masked_inputs(inputs)
        return math.gmpo_objective(log_ratio, advantages, inputs.mask, inputs.epsilon_low, inputs.epsilon_high)
