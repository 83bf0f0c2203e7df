"""``group_norm``: GRPO's group-relative advantage with every peer convention (std kind, epsilon, scale, baseline)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from trl_ext import Plugin, PluginParams, Slot, hookimpl
from trl_ext_plugins.advantages.math import Whitening, group_advantages, masked_whiten
from trl_ext_plugins.advantages.rollout import kept_loss_mask, kept_rewards, local, rank_reduce


class GroupNormParams(PluginParams):
    std: Literal["sample", "population", "leave_one_out"] = Field(
        "sample", description="sample: unbiased N-1 std (torch.std; TRL, verl); population: N (e.g. numpy/JAX "
        "ports); leave_one_out: sample std of the other rows of the group (group scale only; a row whose peers "
        "all tie divides by epsilon alone: binary rewards [1, 0, 0, 0] give the 1 an advantage of 0.75 / epsilon = "
        "7500 at the default, so use it with rewards that rarely tie, or with zero_std: skip).")
    epsilon: float = Field(1e-4, ge=0, description="Added to the std (TRL 1e-4; verl 1e-6).")
    scale: Literal["group", "batch", "none"] = Field(
        "group", description="group: divide by the group's std (GRPO paper, TRL scale_rewards=group, verl); batch: by "
        "the std of the whole gathered batch (TRL scale_rewards=batch); none: no division (Dr. GRPO).")
    baseline: Literal["mean", "leave_one_out"] = Field(
        "mean", description="mean: the group mean (GRPO, TRL, verl); leave_one_out: the mean of the other rows "
        "(RLOO-style centre).")
    zero_std: Literal["epsilon", "skip"] = Field(
        "epsilon", description="Where the std is 0: epsilon divides by epsilon alone (TRL, verl; epsilon 0 then "
        "leaves the value undivided instead of 0/0); skip leaves R - b undivided (NeMo-RL). They differ only where R - "
        "b is nonzero with a zero std: under std: leave_one_out a row whose peers tie (binary [1, 0, 0, 0] with "
        "baseline: leave_one_out gives the 1 an advantage of 1 with skip, 1 / epsilon with epsilon).")
    whiten: Whitening = Field(
        "none", description="After the group statistic, whiten the advantages over the loss tokens of the global "
        "batch (each row's value on each of its tokens): none (default; GRPO, TRL, verl), or with verl's, openrlhf's "
        "or areal's formula (see reinforce_pp's whitening). AReaL's GRPO/GSPO/DAPO recipes (adv_norm after "
        "reward_norm: areal) and slime's --normalize-advantages (verl's formula) do this.")
    single_sample: Literal["zero", "raw"] = Field(
        "zero", description="Groups of one sample (num_generations 1, e.g. eval): zero (TRL) or raw (verl: mean 0, "
        "std 1, A = R).")

    @model_validator(mode="after")
    def _loo_needs_group(self):
        if self.std == "leave_one_out" and self.scale != "group":
            raise ValueError("std: leave_one_out needs scale: group")
        return self


class GroupNorm(Plugin):
    """Group-relative advantages of GRPO (DeepSeekMath, arXiv 2402.03300) with the conventions frameworks differ on.

    ``A_i = (R_i - b) / (s + eps)`` per prompt group of ``G = args.num_generations`` rows, one value per sequence.
    Defaults equal TRL 1.16's own advantage (group mean, unbiased group std, eps 1e-4; tested against TRL's formula):
    the plugin exists to *name* the alternatives, ALGORITHMS.md convention 1 (``std: population`` gives 1.732 instead
    of 1.5 for the top row of [1, 0, 0, 0]; ``epsilon: 1e-6`` is verl's; ``scale: batch`` is TRL's
    ``scale_rewards=batch``; ``baseline: leave_one_out`` centres on the other rows; ``zero_std: skip`` is NeMo-RL's
    rule for a zero std, and with ``baseline: leave_one_out, std: leave_one_out, epsilon: 1e-6`` gives NeMo-RL's
    default GRPO advantage). Unscorable rows, and rows
    ``trl_ext_filter_groups`` dropped, get 0 and count in no statistic; a zero-variance group gives 0. A group of one
    sample (``num_generations: 1``, which TRL allows only in evaluation) gives 0 (TRL: R minus its own mean) or,
    with ``single_sample: raw``, verl's ``R / (1 + eps)`` (mean 0 and std 1 for a lone sample), whatever ``scale``
    says. ``whiten`` (off by default) then whitens the per-token advantages over the global batch's loss tokens, as
    AReaL's GRPO recipes (``adv_norm``, its formula ``areal``) and slime's ``--normalize-advantages`` (``verl``) do;
    the advantages are then ``(B, T)``, which TRL's loss takes as they are.
    """

    name = "group_norm"
    aliases = ("group_advantage",)
    family = "advantage"
    trainers = frozenset({"grpo"})
    slots = frozenset({Slot.ADVANTAGE})
    Params = GroupNormParams

    @hookimpl
    def trl_ext_compute_advantages(self, rewards, batch):
        p = self.params
        # rows a filter dropped count in no statistic (the batch std of scale: batch included)
        out = group_advantages(kept_rewards(rewards, batch), batch.num_generations, scale=p.scale, std=p.std,
                               baseline=p.baseline, eps=p.epsilon, single_sample=p.single_sample,
                               zero_std=p.zero_std)
        if p.whiten == "none":
            return local(out, batch)
        # (B, T): a filtered row's tokens leave the mask, so they count in no statistic and get 0
        mask = kept_loss_mask(batch)
        per_token = local(out, batch).to(mask.dtype).unsqueeze(-1).expand_as(mask)
        return masked_whiten(per_token, mask, rank_reduce(batch), p.whiten)
