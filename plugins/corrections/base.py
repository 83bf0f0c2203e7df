"""Shared shape of the train/inference mismatch corrections (tis, mis, icepop)."""

from __future__ import annotations

import torch

from trl_ext import Need, Plugin, hookimpl
from trl_ext.batches import TokenWeights
from trl_ext_plugins.corrections import math


class RolloutCorrection(Plugin):
    """Base of corrections that weight the loss by rho = pi_old / pi_rollout (detached).

    Needs the rollout engine's per-token log-probs (vLLM, or the ``rollout_logprobs`` plugin without vLLM) and the old
    policy's (the trainer recomputes them, or they equal the current ones when the batch is used once). Sets
    ``args.vllm_importance_sampling_correction: false`` so TRL's own vLLM correction is not applied on top (a recipe that
    sets it true is refused, naming the plugin). Logs, per micro-batch, ``<name>/logp_diff/{mean,max}``,
    ``<name>/changed_fraction`` (tokens truncated or masked) and ``<name>/weight/{min,mean,max}``.
    Subclasses implement :meth:`weights` returning ``(weight, changed)`` from rho's log.
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
    def trl_ext_token_weights(self, inputs):
        if inputs.sampling_per_token_logps is None:
            raise RuntimeError(f"plugin {self.name!r}: the batch carries no sampling log-probs; generate with vLLM "
                               "or select the 'rollout_logprobs' plugin")
        log_rho = math.rollout_log_rho(inputs.old_per_token_logps, inputs.sampling_per_token_logps, inputs.mask)
        weight, changed = self.weights(log_rho, inputs.mask)
        inputs.metrics.update({f"{self.name}/{k}": v for k, v in
                               math.mismatch_stats(log_rho, weight, changed, inputs.mask).items()})
        if self.drops_from_denominator:
            return TokenWeights(weight=torch.where(changed, torch.ones_like(weight), weight), mask=~changed)
        return TokenWeights(weight=weight)
