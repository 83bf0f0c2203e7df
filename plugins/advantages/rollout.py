"""Helpers the advantage plugins share for reading a :class:`trl_ext.batches.RolloutBatch` on any number of ranks."""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field

from trl_ext import PluginParams, hookimpl
from trl_ext.batches import RolloutBatch
from trl_ext_plugins.advantages.math import Reduce, drop_filtered_rows, kept_token_mask, masked_token_kl


class RewardKLParams(PluginParams):
    """The fields every KL-in-the-reward plugin shares (each declares its own ``kl_coef`` and ``kl_in_loss``)."""

    kl_estimator: Literal["k1", "k2", "k3", "k3+"] = Field(
        "k1", description="Per-token KL_t estimator with d = log pi_old - log pi_ref: k1 = d (OpenRLHF/TRL RLOO "
        "default, can be negative), k2 = d^2/2, k3 = e^-d - 1 + d (verl 'kl', 'mse', 'low_var_kl'); k3+ (verl "
        "'low_var_kl+') is accepted for recipes ported from verl and equals k3 here: no gradient flows through a "
        "reward, so its straight-through k2 gradient has nothing to act on.")
    kl_clamp: float | None = Field(None, gt=0.0, description="Clamp each KL_t to [-c, c] before it enters the "
                                   "reward (verl clamps low_var_kl to 10; null: no clamp, OpenRLHF/TRL).")


def rank_reduce(batch: RolloutBatch) -> Reduce:
    """A cross-rank sum for global statistics, or ``None`` on one process."""
    trainer = batch.trainer
    if trainer is None or trainer.accelerator.num_processes == 1:
        return None
    return lambda t: trainer.accelerator.reduce(t, reduction="sum")


def local(values: torch.Tensor, batch: RolloutBatch) -> torch.Tensor:
    """This rank's rows of a gathered ``(N, ...)`` tensor."""
    return values[batch.process_slice]


def kept_rewards(rewards: torch.Tensor, batch: RolloutBatch) -> torch.Tensor:
    """The gathered rewards with the rows ``trl_ext_filter_groups`` dropped marked unscorable (NaN), so batch-level
    baselines and normalisations see only the kept rows (``RolloutBatch.keep``; unchanged when nothing filters)."""
    return drop_filtered_rows(rewards, batch.keep)


def kept_loss_mask(batch: RolloutBatch) -> torch.Tensor:
    """``batch.loss_mask`` without the tokens of rows ``trl_ext_filter_groups`` dropped: the tokens a token-level
    statistic (whitening, a token mean, the critic's targets) runs over. The host zeroes the completion mask of those
    rows only after the advantages, so ``loss_mask`` itself still holds them."""
    keep = None if batch.keep is None else local(batch.keep, batch)
    return kept_token_mask(batch.loss_mask, keep)


def global_token_count(batch: RolloutBatch, rows: torch.Tensor) -> float:
    """Loss tokens of this rank's ``rows`` (a ``(B,)`` 0/1 selection; filtered rows left out) summed over every rank:
    the denominator of a term that is a token mean over the whole generation batch (VAPO's and BOND's NLL)."""
    tokens = (kept_loss_mask(batch) * rows.to(batch.loss_mask.dtype).unsqueeze(-1)).sum()
    reduce = rank_reduce(batch)
    return float(tokens if reduce is None else reduce(tokens))


def gathered(values: torch.Tensor, batch: RolloutBatch) -> torch.Tensor:
    """This rank's ``(B, ...)`` rows gathered from every rank into the ``(N, ...)`` layout of the rewards."""
    trainer = batch.trainer
    if trainer is None or trainer.accelerator.num_processes == 1:
        return values
    return trainer.accelerator.gather(values)


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


def reward_kl(batch: RolloutBatch, estimator: str, clamp: float | None, metric: str) -> torch.Tensor:
    """Per-token KL of the sampling policy to the reference, ``(B, T)`` float32, on the loss tokens of the rows
    ``trl_ext_filter_groups`` kept (0 elsewhere):
    the KL every KL-in-the-reward plugin (``ppo``, ``reinforce_pp``, ``rloo``, ``remax``) folds into its rewards.
    Logs its token mean over every rank's loss tokens as ``metric`` (TRL logs rank 0's figures, so a rank's own mean
    would report only its share of the batch)."""
    if batch.ref_per_token_logps is None:
        raise ValueError(f"{metric.split('/')[0]}: the KL in the reward needs the reference log-probs, which this "
                         "batch does not carry")
    mask = kept_loss_mask(batch)  # filtered rows get no KL and stay out of the logged mean
    kl = masked_token_kl(sampling_policy_logps(batch).float(), batch.ref_per_token_logps.float(), mask, estimator,
                         clamp)
    totals = torch.stack([kl.sum(), mask.sum().to(kl.dtype)])
    reduce = rank_reduce(batch)
    totals = totals if reduce is None else reduce(totals)
    batch.metrics[metric] = (totals[0] / totals[1].clamp(min=1.0)).item()
    return kl


def reference_only_beta(args: dict) -> dict | None:
    """TRL computes reference log-probs only when ``args.beta != 0``; a plugin that folds the KL into the reward sets
    ``beta: 1.0`` when the recipe leaves it 0 (the trainer's loss KL coefficient is then 0, see
    :func:`drop_loss_kl`), so no recipe needs a loss KL to get the reference."""
    return {"beta": 1.0} if not args.get("beta") else None


def drop_loss_kl(trainer) -> None:
    """Keep the KL out of the loss (the reference log-probs are still computed because ``args.beta != 0``)."""
    from trl_ext import ops

    term = trainer.kl_term
    trainer.kl_term = ops.KLTerm(term.estimator, term.bias_correction, term.clamp, coef=0.0,
                                 clamp_weighted=term.clamp_weighted)


class RewardKLHooks:
    """Mixin for the plugins that fold a KL to the reference into the reward (``ppo``, ``reinforce_pp``, ``rloo``,
    ``remax``): params ``kl_coef`` (> 0: the KL is in the reward) and ``kl_in_loss``.

    Whenever the KL is in the reward the plugin needs the reference, and gets it without a loss KL: when the recipe
    leaves ``args.beta`` 0 (TRL's default) the plugin sets ``beta: 1.0`` only so TRL computes the reference, and drops
    the loss term, since the recipe asked for none. With a non-zero ``args.beta``, ``kl_in_loss: true`` keeps TRL's
    ``beta`` KL loss term as well and ``false`` drops it (the KL is then in the reward only). Subclasses that implement
    the two hooks themselves call :meth:`_reward_kl_args` and :meth:`_reward_kl_trainer_created`."""

    _beta_only_for_reference = False  # set by trl_ext_configure_args: the recipe's beta was 0

    def _reward_kl_needs(self) -> frozenset:
        from trl_ext import Need

        return frozenset({Need.REFERENCE}) if self.params.kl_coef > 0 else frozenset()

    def _reward_kl_args(self, args: dict) -> dict | None:
        self._beta_only_for_reference = self.params.kl_coef > 0 and not args.get("beta")
        return reference_only_beta(args) if self.params.kl_coef > 0 else None

    def _drops_loss_kl(self) -> bool:
        return self.params.kl_coef > 0 and (self._beta_only_for_reference or not self.params.kl_in_loss)

    def uses_loss_pipeline(self, args: dict) -> bool:
        """Dropping the loss KL runs trl-ext's loss pipeline, not TRL's ``_compute_loss`` (asked by the GRPO stage
        check, after ``trl_ext_configure_args``, so the TRL options the pipeline lacks are refused, not ignored)."""
        return self._drops_loss_kl()

    def _reward_kl_trainer_created(self, trainer) -> None:
        if self._drops_loss_kl():
            drop_loss_kl(trainer)

    @hookimpl
    def trl_ext_configure_args(self, trainer, args):
        return self._reward_kl_args(args)

    @hookimpl
    def trl_ext_trainer_created(self, trainer):
        self._reward_kl_trainer_created(trainer)
