"""Shared shape of the train/inference mismatch corrections (tis, mis, icepop)."""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field, model_validator

from trl_ext import Need, Plugin, PluginParams, hookimpl, ops
from trl_ext.batches import TokenWeights
from trl_ext_plugins.corrections import math
from trl_ext_plugins.losses.base import recipe_off_policy_reason, trainer_off_policy_reason


def reciprocal_lower(upper, who: str) -> float:
    """The lower bound ``1/C`` of the band ``[1/C, C]`` when only ``C`` is given (MIS, verl's rollout_rs lower
    default); a C below 1 leaves no such band, so the lower bound must then be given."""
    if not isinstance(upper, (int, float)) or isinstance(upper, bool) or upper <= 0:
        return upper  # the field's own validation refuses it with its message
    if upper < 1:
        raise ValueError(f"{who}: upper {upper} < 1 leaves no band [1/upper, upper]; give lower explicitly")
    return 1.0 / upper


class CorrectionParams(PluginParams):
    support: Literal["full", "sampled"] = Field(
        "full", description="Support of the trainer-side log pi_old in rho. full: the trainer's full-vocabulary "
        "log-probs (TRL, verl). sampled: renormalised over the support the sampler kept (args.temperature, top_k, "
        "top_p, min_p), like the rollout log-probs, so truncated sampling does not bias rho (costs one no-grad "
        "forward with full logits per micro-batch; on-policy batches only: num_iterations 1 and steps_per_generation "
        "<= gradient_accumulation_steps).")

    def band(self) -> tuple[float | None, float | None]:
        """(lower, upper) ratio bounds of this correction; (None, None) where it has none to check."""
        return None, None

    @model_validator(mode="after")
    def _band_not_inverted(self):
        # An inverted band is never what was meant and fails silently: a band weight is 0 for every token (no
        # gradient at all) and torch.clamp(min > max) truncates every token to the upper bound.
        lower, upper = self.band()
        if lower is not None and upper is not None and lower > upper:
            raise ValueError(f"lower ({lower}) must not exceed the upper bound ({upper})")
        return self


def sampler_support_logps(inputs) -> torch.Tensor:
    """log pi_old of the sampled tokens renormalised over the sampler's kept support, ``(B, T)``, detached.

    One no-grad forward of the loss's model (on-policy: its weights are still pi_old's) with full logits, truncated
    as the sampler truncated them (:func:`trl_ext.ops.truncated_logits`)."""
    extra = inputs.extra
    completion_ids = extra["completion_ids"]
    input_ids = torch.cat([extra["prompt_ids"], completion_ids], dim=1)
    attention_mask = torch.cat([extra["prompt_mask"], extra["completion_mask"]], dim=1)
    with torch.no_grad():
        logits = extra["model"](input_ids=input_ids, attention_mask=attention_mask).logits
        logits = logits[:, -completion_ids.size(1) - 1 : -1]
        return ops.truncated_token_logprobs(logits, completion_ids, **extra["sampling_params"])


class RolloutCorrection(Plugin):
    """Base of corrections that weight the loss by rho = pi_old / pi_rollout (detached).

    Needs the rollout engine's per-token log-probs (vLLM, or the ``rollout_logprobs`` plugin without vLLM) and the old
    policy's (the trainer recomputes them, or they equal the current ones when the batch is used once). Sets
    ``args.vllm_importance_sampling_correction: false`` so TRL's own vLLM correction is not applied on top (a recipe that
    sets it true is refused, naming the plugin). Logs, per micro-batch (:func:`math.mismatch_stats`):
    ``<name>/logp_diff/{mean,max}``, ``<name>/rho/{mean,std,max}``, ``<name>/weight/{min,mean,max}``,
    ``<name>/changed_fraction`` and ``<name>/changed_sequence_fraction`` (tokens / sequences truncated or masked),
    ``<name>/ess`` (effective sample size fraction of the weights) and ``<name>/mismatch_kl/{k1,k3}``
    (KL(pi_rollout || pi_old) on the rollout's samples).
    Subclasses implement :meth:`weights` returning ``(weight, changed)`` from rho's log.

    Truncated sampling (issue 10 defect 5): the rollout log-probs are those of the distribution actually sampled
    (renormalised over the top-k/top-p/min-p support; vLLM's processed log-probs, ``rollout_logprobs``), while TRL's
    pi_old is the full-vocabulary softmax, so rho = pi_old/pi_rollout is biased below 1 by the kept mass. Parameter
    ``support: sampled`` renormalises pi_old over the same support (``full``, the default, keeps TRL's/verl's rho).
    """

    family = "correction"
    trainers = frozenset({"grpo"})
    needs = frozenset({Need.SAMPLING_LOGPROBS, Need.OLD_POLICY_LOGPROBS})
    drops_from_denominator = False  # True: out-of-band tokens leave the aggregation denominator (a mask, not weight 0)

    def weights(self, log_rho: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Abstract: each correction (tis, mis, icepop, m2po) returns (detached weight, changed-token flags)."""
        raise NotImplementedError(f"{type(self).__name__} must implement weights()")

    @hookimpl
    def trl_ext_configure_args(self, trainer, args):
        return {"vllm_importance_sampling_correction": False}

    @hookimpl
    def trl_ext_validate_stage(self, stage, plugins):
        if getattr(self.params, "support", "full") != "sampled":
            return None
        reason = recipe_off_policy_reason(stage.args)
        return [self._sampled_support_refusal(reason)] if reason else None

    @hookimpl
    def trl_ext_trainer_created(self, trainer):
        # generation_batch_size sets steps_per_generation through the process count, known only now
        if getattr(self.params, "support", "full") != "sampled":
            return
        reason = trainer_off_policy_reason(trainer.args)
        if reason:
            raise ValueError(self._sampled_support_refusal(reason))

    def _sampled_support_refusal(self, reason: str) -> str:
        return (f"plugins.{self.name}.support: 'sampled' recomputes pi_old from the current weights, so it needs "
                f"on-policy batches (args.num_iterations 1, args.steps_per_generation <= gradient_accumulation_steps), "
                f"but {reason}")

    @hookimpl
    def trl_ext_token_weights(self, inputs):
        if inputs.sampling_per_token_logps is None:
            raise RuntimeError(f"plugin {self.name!r}: the batch carries no sampling log-probs; generate with vLLM "
                               "or select the 'rollout_logprobs' plugin")
        old = inputs.old_per_token_logps
        if getattr(self.params, "support", "full") == "sampled":
            old = ops.where_mask(sampler_support_logps(inputs), inputs.mask)
        log_rho = math.rollout_log_rho(old, inputs.sampling_per_token_logps, inputs.mask)
        weight, changed = self.weights(log_rho, inputs.mask)
        inputs.metrics.update({f"{self.name}/{k}": v for k, v in
                               math.mismatch_stats(log_rho, weight, changed, inputs.mask).items()})
        if self.drops_from_denominator:
            return TokenWeights(weight=torch.where(changed, torch.ones_like(weight), weight), mask=~changed)
        return TokenWeights(weight=weight)
