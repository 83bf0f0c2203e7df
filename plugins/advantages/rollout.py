"""Helpers the advantage plugins share for reading a :class:`trl_ext.batches.RolloutBatch` on any number of ranks."""

from __future__ import annotations

import torch

from trl_ext.batches import RolloutBatch
from trl_ext_plugins.advantages.math import Reduce


def rank_reduce(batch: RolloutBatch) -> Reduce:
    """A cross-rank sum for global statistics, or ``None`` on one process."""
    trainer = batch.trainer
    if trainer is None or trainer.accelerator.num_processes == 1:
        return None
    return lambda t: trainer.accelerator.reduce(t, reduction="sum")


def local(values: torch.Tensor, batch: RolloutBatch) -> torch.Tensor:
    """This rank's rows of a gathered ``(N, ...)`` tensor."""
    return values[batch.process_slice]


def sampling_policy_logps(batch: RolloutBatch) -> torch.Tensor:
    """Per-token log-probs of the policy that sampled the batch (``log pi_old``), ``(B, T)``, detached.

    TRL computes them only when generation and optimisation are misaligned (or for vLLM IS); otherwise the policy is
    still the sampling policy, so one no-grad forward pass of the current model gives them.
    """
    if batch.old_per_token_logps is not None:
        return batch.old_per_token_logps
    trainer = batch.trainer
    if trainer is None or batch.prompt_ids is None:
        raise ValueError("sampling-policy log-probs are needed but neither recorded nor computable for this batch")
    input_ids = torch.cat([batch.prompt_ids, batch.completion_ids], dim=1)
    attention_mask = torch.cat([batch.prompt_mask, batch.completion_mask], dim=1)
    with torch.no_grad():
        logps, _, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model, input_ids, attention_mask, batch.completion_ids.size(1)
        )
    return logps


def reference_only_beta(args: dict) -> dict | None:
    """TRL computes reference log-probs only when ``args.beta != 0``; a plugin that folds the KL into the reward and
    keeps it out of the loss sets ``beta: 1.0`` when the recipe leaves it 0 (the trainer's loss KL coefficient is then
    0, see :meth:`trl_ext.ops.KLTerm.weight`), so no recipe needs a loss KL to get the reference."""
    return {"beta": 1.0} if not args.get("beta") else None


def drop_loss_kl(trainer) -> None:
    """Keep the KL out of the loss (the reference log-probs are still computed because ``args.beta != 0``)."""
    from trl_ext import ops

    trainer.kl_term = ops.KLTerm(trainer.kl_term.estimator, trainer.kl_term.bias_correction, trainer.kl_term.clamp,
                                 coef=0.0)
