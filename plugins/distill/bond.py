"""``bond``: Best-of-N distillation with the Jeffreys divergence, and J-BOND's moving (EMA) anchor."""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field
from transformers import TrainerCallback

from trl_ext import Plugin, PluginParams, Slot, hookimpl
from trl_ext import metrics as figures
from trl_ext_plugins.distill import math as dm

BEST_KEY = "bond_best"  # per-row flag handed to the loss: this sample is its group's best (a BoN sample)
BEST_TOKENS_KEY = "bond_best_tokens"  # (B,) the count of best samples' loss tokens over every rank's generation batch


class BONDParams(PluginParams):
    beta: float = Field(0.5, ge=0.0, le=1.0, description="Jeffreys weight: J = (1 - beta) KL(pi_BoN || pi) + beta "
                                                          "KL(pi || pi_BoN); 0: pure forward KL (SFT on best-of-N), "
                                                          "1: pure reverse KL (RL). Paper default 0.5.")
    n: int | None = Field(None, ge=2, description="N of best-of-N (None: args.num_generations, so each group's best "
                                                  "sample is a best-of-N sample).")
    anchor: Literal["reference", "ema"] = Field("reference", description="`reference`: KL to the fixed initial "
                                                                         "policy (BOND); `ema`: the KL anchor is an "
                                                                         "EMA of the policy (J-BOND).")
    ema_rate: float = Field(0.02, gt=0.0, le=1.0, description="J-BOND anchor update rate per optimizer step "
                                                              "(anchor <- (1 - rate) anchor + rate policy).")
    bon_nll_mean: Literal["global", "micro_batch"] = Field(
        "global", description="The forward part's token mean: `global`, over the best samples' tokens of the whole "
        "generation batch on every rank (as the token-level policy loss and VAPO's NLL; one process and several give "
        "the same gradient); `micro_batch`, over this rank's micro-batch (TRL bnpo-like: a rank whose micro-batch "
        "holds no best sample adds 0 and the term shrinks with the rank count).")


class BOND(Plugin):
    """BOND (Sessa et al., ICLR 2025, arXiv 2407.14622): distil the best-of-N policy
    ``log pi_BoN(y) = log pi_ref(y) + log N + (N - 1) log p_le(y)`` into the policy with the Jeffreys divergence
    ``J_beta = (1 - beta) KL(pi_BoN || pi) + beta KL(pi || pi_BoN)``.

    Implemented on the GRPO trainer, per group of ``G = num_generations`` samples of a prompt:

    * backward part (``beta``): ``KL(pi || pi_BoN)`` is RL with reward ``(N - 1) log p_le(y)`` and KL coefficient 1 to
      the anchor, scaled by ``beta``: sequence advantage ``beta (N - 1) (log p_le - mean_group log p_le)`` (the group
      mean is a variance-reducing baseline) and TRL's KL term with ``args.beta = beta`` (set by the plugin; the
      reference model is TRL's);
    * forward part (``1 - beta``): ``KL(pi_BoN || pi)`` is SFT on best-of-N samples: the NLL of each group's
      highest-reward sample (first on ties), token mean over those samples' tokens in the whole generation batch on
      every rank (``bon_nll_mean: global``, the default; ``micro_batch``: over the micro-batch on each rank), weight
      ``1 - beta``, added through ``trl_ext_extra_loss``.

    Conventions: ``p_le(y)`` is estimated from the group itself (the G samples act as the anchor's samples, the sample
    counts itself, ties are "<=", so ``p_le >= 1/G`` and the log is finite; an unscorable sample, NaN reward, is
    left out of its group's estimates, mean and best, with advantage 0); samples come from the current policy,
    which is J-BOND's on-policy regime rather than BOND's sampling from ``pi_ref``. ``anchor: ema`` makes TRL's
    reference model an exponential moving average of the policy (updated after every optimizer step with
    ``ema_rate``, J-BOND default about 0.02, not verified), so the KL regulariser follows a moving anchor; J-BOND's
    additional KL to the initial reference is not added. ``anchor: ema`` is refused with ``peft`` (TRL then keeps no
    reference model to move). Under DeepSpeed ZeRO-3 every rank gathers the policy and the anchor for the update (and
    for the anchor's checkpoint), since each rank holds only empty ``.data`` partitions of both. Defaults:
    ``beta = 0.5``, ``N = num_generations``.
    """

    name = "bond"
    family = "distill"
    trainers = frozenset({"grpo"})
    slots = frozenset({Slot.ADVANTAGE})
    Params = BONDParams

    @hookimpl
    def trl_ext_configure_args(self, trainer, args):
        return {"beta": self.params.beta}

    @hookimpl
    def trl_ext_validate_stage(self, stage, plugins):
        errors = []
        if self.params.n is not None and self.params.n != stage.args.get("num_generations", 8):
            errors.append(f"plugin 'bond': params.n={self.params.n} must equal args.num_generations "
                          f"({stage.args.get('num_generations', 8)}): the group's best sample is the best-of-N sample")
        if self.params.anchor == "ema" and stage.peft is not None:
            # Under PEFT TRL keeps no reference model (the reference is the base with the adapter disabled), so the
            # EMA callback would find nothing to move and the anchor would silently stay the initial policy.
            errors.append("plugin 'bond': anchor 'ema' needs a full reference model, which TRL does not keep under "
                          "PEFT; use anchor: reference or remove `peft`")
        return errors

    @hookimpl
    def trl_ext_compute_advantages(self, rewards, batch):
        group = batch.num_generations
        n = self.params.n or group
        advantages = bond_advantages(rewards.float(), group, n, self.params.beta)
        best = best_in_group(rewards.float(), group)
        mine = best[batch.process_slice].to(batch.completion_mask.device)
        batch.loss_extras[BEST_KEY] = mine
        if self.params.bon_nll_mean == "global":
            from trl_ext_plugins.advantages.rollout import global_token_count

            batch.loss_extras[BEST_TOKENS_KEY] = torch.full_like(mine, global_token_count(batch, mine))
        best_rows = best.bool() if batch.keep is None else best.bool() & batch.keep.to(best.device)
        batch.metrics["bond/best_reward"] = rewards[best_rows].nanmean().item()  # groups a filter dropped left out
        return advantages[batch.process_slice].to(batch.completion_mask.device)

    @hookimpl
    def trl_ext_extra_loss(self, inputs):
        if self.params.beta == 1.0:
            return None
        best = inputs.extra[BEST_KEY].to(inputs.mask.dtype).unsqueeze(1)
        if self.params.bon_nll_mean == "global" and BEST_TOKENS_KEY in inputs.extra:  # see the param
            import dataclasses

            from trl_ext.trainers.grpo import global_token_mean

            total = inputs.extra[BEST_TOKENS_KEY]
            ctx = dataclasses.replace(inputs, num_items_in_batch=total[0] if total.numel() else 0)
            picked = inputs.mask * best
            inputs.metrics["bond/bon_nll"] = figures.mean(
                torch.where(picked.bool(), -inputs.per_token_logps.detach(), torch.zeros_like(picked)).sum(),
                picked.sum())
            return (1.0 - self.params.beta) * global_token_mean(-inputs.per_token_logps, picked, ctx)
        nll = bon_nll(inputs.per_token_logps, inputs.mask * best)
        # the token mean over every rank's best-of-n tokens (this rank's nll is its slice)
        picked = inputs.mask * best
        inputs.metrics["bond/bon_nll"] = figures.mean(
            torch.where(picked.bool(), -inputs.per_token_logps.detach(), torch.zeros_like(picked)).sum(), picked.sum())
        return (1.0 - self.params.beta) * nll / inputs.grad_accum_steps

    @hookimpl
    def trl_ext_trainer_created(self, trainer):
        if self.params.anchor == "ema":
            from trl_ext.callbacks import ReferenceModelCheckpoint

            trainer.add_callback(EMAAnchor(trainer, self.params.ema_rate))
            # The moving anchor is TRL's reference model, which checkpoints do not hold: without this a resumed stage
            # restarts the anchor from the initial model.
            trainer.add_callback(ReferenceModelCheckpoint(trainer))


def bond_advantages(rewards: torch.Tensor, group_size: int, n: int, beta: float) -> torch.Tensor:
    """``beta (N - 1) (log p_le - group mean of log p_le)`` per sample, ``(N_rows,)``.

    Unscorable samples (NaN reward) get 0 and stay out of their group's estimates and mean (the project's rule for
    unscorable rows; before, a NaN counted as the worst reward and raised the others' ``p_le``)."""
    log_p = torch.log(dm.group_p_le(rewards, group_size)).view(-1, group_size)
    scorable = ~torch.isnan(log_p)
    count = scorable.sum(dim=1, keepdim=True).clamp(min=1)
    mean = torch.where(scorable, log_p, torch.zeros_like(log_p)).sum(dim=1, keepdim=True) / count
    advantages = beta * (n - 1) * (log_p - mean)
    return torch.where(scorable, advantages, torch.zeros_like(advantages)).reshape(-1)


def best_in_group(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """1.0 for each group's highest-reward row (the first one on ties), else 0.0, ``(N_rows,)``; an unscorable (NaN)
    row is never the best, and a group with no scorable row has none."""
    grouped = rewards.view(-1, group_size)
    scorable = ~torch.isnan(grouped)
    ranked = torch.where(scorable, grouped, torch.full_like(grouped, -torch.inf))
    best = torch.zeros_like(grouped)
    best.scatter_(1, ranked.argmax(dim=1, keepdim=True), 1.0)
    return torch.where(scorable.any(dim=1, keepdim=True), best, torch.zeros_like(best)).reshape(-1)


def bon_nll(per_token_logps: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Token-mean NLL over the masked tokens (0 with a graph when none are masked in)."""
    total = torch.where(mask.bool(), -per_token_logps, torch.zeros_like(per_token_logps)).sum()
    return total / mask.sum().clamp(min=1.0)


class EMAAnchor(TrainerCallback):
    """After each optimizer step, move TRL's reference model towards the policy (J-BOND's moving anchor)."""

    def __init__(self, trainer, rate: float):
        self.trainer, self.rate = trainer, rate

    def on_step_end(self, args, state, control, **kwargs):
        ref = getattr(self.trainer, "ref_model", None)
        if ref is None:
            return
        from trl_ext.callbacks import zero3_gathered

        policy = dict(self.trainer.accelerator.unwrap_model(self.trainer.model).named_parameters())
        anchor = dict(self.trainer.accelerator.unwrap_model(ref).named_parameters())
        # ZeRO-3 holds each parameter as this rank's partition (``.data`` is empty): every rank gathers both models and
        # updates the full tensors, and DeepSpeed re-partitions rank 0's result (the same on every rank).
        with zero3_gathered(self.trainer.accelerator, [*policy.values(), *anchor.values()], modifier_rank=0):
            dm.ema_update({k: v.data for k, v in anchor.items()}, {k: policy[k].data for k in anchor}, self.rate)
