"""Pure functions of the rollout plugins (group filtering and selection for ``dynamic_sampling``; the trained
groups' figures of ``partial_rollout``)."""

from __future__ import annotations

import torch


def nonzero_variance_groups(rewards: torch.Tensor, num_generations: int) -> torch.Tensor:
    """Bool ``(N / G,)``: which groups of ``G`` consecutive rewards have non-zero variance (DAPO's
    ``0 < #correct < G``, generalised to any reward).

    NaN rewards (rows no reward function scored) are ignored; a group with fewer than two scored rows has no
    variance. "Zero" is ``torch.isclose(std, 0)``, the test TRL uses for its ``frac_reward_zero_std`` metric, so the
    kept fraction here is ``1 - frac_reward_zero_std`` of the same rewards.
    """
    grouped = rewards.view(-1, num_generations).double()
    scored = ~torch.isnan(grouped)
    count = scored.sum(1)
    filled = torch.where(scored, grouped, 0.0)
    mean = filled.sum(1, keepdim=True) / count.clamp(min=1).unsqueeze(1)
    var = (torch.where(scored, grouped - mean, 0.0) ** 2).sum(1) / (count - 1).clamp(min=1)
    std = var.sqrt()
    return (count > 1) & ~torch.isclose(std, torch.zeros_like(std))


def group_has_signal(keep: torch.Tensor, num_generations: int) -> torch.Tensor:
    """Bool ``(N / G,)`` from a per-sample keep mask ``(N,)``: a group counts when any of its samples is kept."""
    return keep.view(-1, num_generations).any(1)


def select_groups(kept_per_round: list[torch.Tensor], needed: int) -> list[tuple[int, int]]:
    """``needed`` groups as ``(round, group)`` pairs: kept groups first, in round then group order; if fewer than
    ``needed`` were kept, the rest is filled with dropped groups in the same order (the caller leaves them masked)."""
    kept = [(r, g) for r, mask in enumerate(kept_per_round) for g in torch.nonzero(mask).flatten().tolist()]
    if len(kept) >= needed:
        return kept[:needed]
    dropped = [(r, g) for r, mask in enumerate(kept_per_round) for g in torch.nonzero(~mask).flatten().tolist()]
    return kept + dropped[: needed - len(kept)]


def trained_group_rewards(rewards: torch.Tensor, keep: torch.Tensor, num_generations: int) -> tuple[float, float]:
    """(mean reward, share of zero-variance groups) over the groups that train this step.

    ``rewards`` and ``keep`` are ``(N,)`` in group order (``keep`` constant within a group). TRL's ``reward`` and
    ``frac_reward_zero_std`` also count the groups a partial rollout defers, whose rewards score unfinished text; these
    count only the groups the optimizer step sees, with the same zero-variance test (:func:`nonzero_variance_groups`).
    NaN rewards are left out of the mean (NaN when no trained row is scored); both are NaN when no group trains."""
    trained = keep.view(-1, num_generations)[:, 0].bool()
    if not trained.any():
        return float("nan"), float("nan")
    kept = rewards.view(-1, num_generations)[trained].double()
    scored = ~torch.isnan(kept)
    mean = (torch.where(scored, kept, 0.0).sum() / scored.sum()).item() if scored.any() else float("nan")
    zero_std = (~nonzero_variance_groups(rewards, num_generations)[trained]).double().mean().item()
    return mean, zero_std
