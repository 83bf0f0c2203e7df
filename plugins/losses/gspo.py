"""``gspo``: Group Sequence Policy Optimization (sequence-level importance ratio and clipping)."""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field

from trl_ext import PluginParams, hookimpl, ops
from trl_ext_plugins.losses import math
from trl_ext_plugins.losses.base import ObjectivePlugin


class GSPOParams(PluginParams):
    epsilon_low: float = Field(3e-4, gt=0, description="Lower clip deviation of the sequence ratio (sets args.epsilon).")
    epsilon_high: float = Field(4e-4, gt=0, description="Upper clip deviation of the sequence ratio "
                                                         "(sets args.epsilon_high).")
    form: Literal["sequence", "token"] = Field(
        "sequence", description="'sequence': s_i = exp(mean_t log r) per sequence (TRL importance_sampling_level="
                                "sequence); 'token': GSPO-token, s_it = sg[s_i] * pi/sg[pi], same value, per-token "
                                "gradient, allows per-token advantages.")
    advantage: Literal["token", "sequence_mean"] = Field(
        "token", description="Per-token advantages (reinforce_pp, ppo) with the sequence ratio: token (each token "
        "its own A; TRL, verl) or sequence_mean (each sequence's masked mean of A first, AReaL). Identical when A is "
        "one value per sequence (every group advantage).")


class GSPO(ObjectivePlugin):
    """GSPO (Zheng et al. 2025, Qwen, arXiv 2507.18071).

    ``J = (1/G) sum_i min(s_i A_i, clip(s_i, 1-eps_l, 1+eps_r) A_i)`` with the length-normalised sequence ratio
    ``s_i = exp((1/|y_i|) sum_t log r_it)``. Defaults eps_l = 3e-4, eps_r = 4e-4 (the paper's; tiny because s_i is a
    per-token geometric mean). Aggregation seq-mean-token-mean (``args.loss_type: grpo``, as verl). Form
    ``sequence`` returns one loss per sequence and sets ``args.importance_sampling_level: sequence`` (TRL's GSPO; parity
    tested); form ``token`` is GSPO-token: the same value on every token, gradient ``s_i * grad log pi(y_t)``, equal to
    the sequence form's gradient after seq-mean-token-mean when A is per sequence (tested). With per-token
    advantages, ``advantage: sequence_mean`` replaces them by each sequence's mean first (AReaL's GSPO); the default
    keeps each token's own (TRL, verl).
    """

    name = "gspo"
    Params = GSPOParams

    def extra_trl_args(self):
        p = self.params
        return {"loss_type": "grpo", "epsilon": p.epsilon_low, "epsilon_high": p.epsilon_high,
                "importance_sampling_level": "sequence" if p.form == "sequence" else "token"}

    @hookimpl
    def trl_ext_policy_loss(self, inputs):
        _, log_ratio, advantages = math.masked_inputs(inputs)
        if self.params.advantage == "sequence_mean" and advantages.shape[-1] > 1:
            valid = inputs.mask.bool()
            advantages = (torch.where(valid, advantages, torch.zeros_like(advantages)).sum(-1, keepdim=True)
                          / inputs.mask.sum(-1, keepdim=True).clamp(min=1.0))
        if self.params.form == "sequence":
            ratio = math.gspo_sequence_ratio(log_ratio, inputs.mask)
        else:
            ratio = math.gspo_token_ratio(inputs.per_token_logps, inputs.old_per_token_logps, inputs.mask)
        return ops.ppo_clip_objective(ratio, advantages, inputs.epsilon_low, inputs.epsilon_high)
