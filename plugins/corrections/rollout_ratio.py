"""``rollout_ratio``: ratio against the rollout log-probs directly, double-sided mask, no old-policy forward."""

from __future__ import annotations

from pydantic import Field

from trl_ext import Need, Plugin, PluginParams, Slot, hookimpl, ops
from trl_ext import metrics as figures
from trl_ext_plugins.corrections import math
from trl_ext_plugins.losses.math import masked_inputs


class RolloutRatioParams(PluginParams):
    epsilon_low: float = Field(0.2, gt=0, lt=1, description="Tokens with r <= 1 - eps_low are masked (weight 0).")
    epsilon_high: float = Field(0.28, gt=0, description="Tokens with r >= 1 + eps_high are masked (weight 0).")


class RolloutRatio(Plugin):
    """GLM-5 direct double-sided importance sampling (arXiv 2602.15763 section 4.1.2; verl bypass mode, slime
    ``--use-rollout-logprobs``).

    ``r_t = exp(log pi_theta - log pi_rollout)`` against the engine's log-probs (no stored old policy),
    ``f(r) = r if 1-eps_l < r < 1+eps_h else 0``, per-token loss ``-sg(f(r)) * A * log pi_theta``. Conventions: f is a
    stop-gradient weight (CISPO-style; otherwise the gradient would flow twice through r), the bounds are strict and
    are deviations (defaults 0.2/0.28, the report's reasoning-RL values; its agentic values are not stated). Masked
    tokens get weight 0 and stay in the denominator. This *is* the objective (slot ``objective``), so it cannot be
    combined with another objective, nor with a correction that weights by pi_old (tis, mis, icepop): the validator
    refuses those, naming both. Sets ``args.vllm_importance_sampling_correction: false``, so with vLLM TRL skips its
    old-policy forward unless gradient accumulation and generation are misaligned (then TRL still runs it; this loss
    ignores it).
    """

    name = "rollout_ratio"
    aliases = ("ddis",)
    family = "correction"
    trainers = frozenset({"grpo"})
    slots = frozenset({Slot.OBJECTIVE})
    needs = frozenset({Need.SAMPLING_LOGPROBS})
    Params = RolloutRatioParams

    @hookimpl
    def trl_ext_configure_args(self, trainer, args):
        # Its ratio is per token; TRL's sequence level would be ignored by this loss (as every objective, it pins it).
        return {"vllm_importance_sampling_correction": False, "importance_sampling_level": "token"}

    @hookimpl
    def trl_ext_validate_stage(self, stage, plugins):
        return [f"plugins: {self.name!r} takes its ratio against the rollout log-probs and needs no old-policy "
                f"forward, but {other.name!r} weights by the old policy; select one of them"
                for other in plugins if Need.OLD_POLICY_LOGPROBS in other.needs]

    @hookimpl
    def trl_ext_policy_loss(self, inputs):
        if inputs.sampling_per_token_logps is None:
            raise RuntimeError("plugin 'rollout_ratio': the batch carries no sampling log-probs; generate with vLLM or "
                               "select the 'rollout_logprobs' plugin")
        # Padding is dropped with torch.where before any arithmetic (losses.math.masked_inputs, corrections'
        # masked_log_ratio): the former `(logp - rollout).nan_to_num() * mask` and `-w * A * logp` gave an inf/NaN
        # per-token loss at -inf padding and a NaN gradient there when per-token advantages were NaN at padding.
        logps, _, advantages = masked_inputs(inputs)
        log_ratio = math.masked_log_ratio(logps, inputs.sampling_per_token_logps, inputs.mask)
        ratio = ops.safe_ratio(log_ratio)
        weight = math.double_sided_weight(ratio, self.params.epsilon_low, self.params.epsilon_high)
        valid = inputs.mask.bool()
        diff = log_ratio.detach().abs()
        inputs.metrics.update({  # over every rank's tokens (figure parts the trainer reduces)
            f"{self.name}/logp_diff/mean": figures.masked_mean(diff, valid),
            f"{self.name}/logp_diff/max": figures.masked_max(diff, valid),
            f"{self.name}/changed_fraction": figures.mean(((weight == 0) & valid).sum(), valid.sum()),
            f"{self.name}/weight/mean": figures.masked_mean(weight.detach(), valid),
        })
        return -weight * advantages * logps


