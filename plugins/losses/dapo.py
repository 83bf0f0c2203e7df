"""``dapo``: the DAPO loss preset (clip-higher, token-level loss, overlong filtering, no KL)."""

from __future__ import annotations

from pydantic import Field

from trl_ext import PluginParams, hookimpl, ops
from trl_ext_plugins.losses import math
from trl_ext_plugins.losses.base import ObjectivePlugin


class DAPOParams(PluginParams):
    epsilon_high: float = Field(0.28, gt=0, description="Clip-higher upper deviation (ratio clipped at 1+eps_high); "
                                                         "the lower one stays args.epsilon (0.2). Sets args.epsilon_high.")
    token_level_loss: bool = Field(True, description="Token-mean over the whole generation batch (args.loss_type: "
                                                     "dapo); false keeps the recipe's loss_type.")
    overlong_filtering: bool = Field(True, description="Mask truncated completions out of the loss "
                                                       "(args.mask_truncated_completions).")
    no_kl: bool = Field(True, description="Force args.beta: 0 (DAPO drops the KL term).")


class DAPO(ObjectivePlugin):
    """DAPO (Yu et al. 2025, arXiv 2503.14476), the loss side.

    What selecting ``dapo`` turns on (each part can be turned off by its parameter):

    * clip-higher: ``clipobj`` with eps_low = ``args.epsilon`` (0.2) and eps_high = 0.28 (sets ``args.epsilon_high``);
    * token-level loss: ``(1/sum_i |o_i|) sum_i sum_t clipobj`` over the *global* generation batch (TRL
      ``loss_type="dapo"``, normalised by the global token count, gradient-accumulation aware);
    * overlong filtering: truncated completions are masked out (``args.mask_truncated_completions: true``);
    * no KL (``args.beta: 0``).

    Not turned on here, because they are separate plugins a recipe adds next to ``dapo``: dynamic sampling (the
    ``dynamic_sampling`` rollout plugin) and soft overlong punishment (the ``length_shaping`` reward plugin).
    Advantages are TRL's group-normalised ones (unbiased std). Parity with TRL's ``loss_type="dapo"`` with
    ``epsilon_high=0.28`` is tested.
    """

    name = "dapo"
    token_ppo_clip = True
    Params = DAPOParams

    def extra_trl_args(self):
        p = self.params
        args = {"epsilon_high": p.epsilon_high}
        if p.token_level_loss:
            args["loss_type"] = "dapo"
        if p.overlong_filtering:
            args["mask_truncated_completions"] = True
        if p.no_kl:
            args["beta"] = 0.0
        return args

    @hookimpl
    def trl_ext_policy_loss(self, inputs):
        _, log_ratio, advantages = math.masked_inputs(inputs)
        return ops.ppo_clip_objective(ops.safe_ratio(log_ratio), advantages, inputs.epsilon_low, inputs.epsilon_high)
