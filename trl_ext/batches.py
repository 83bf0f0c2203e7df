"""Typed bundles the host passes to run hooks, so hook signatures stay short and stable.

Shapes: ``B`` sequences on this rank, ``T`` completion tokens (right-padded), ``N`` sequences on all ranks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class RolloutBatch:
    """What a GRPO-family rollout produced, as seen by reward shaping, group filtering and advantage hooks.

    ``rewards_per_func`` is gathered across ranks; token tensors are this rank's.
    """

    rewards_per_func: torch.Tensor  # (N, F), NaN where a reward function did not apply
    reward_names: list[str]
    reward_weights: torch.Tensor  # (F,)
    num_generations: int  # G: samples per prompt; groups are consecutive runs of G rows
    process_slice: slice  # this rank's rows within the gathered N
    completion_ids: torch.Tensor  # (B, T)
    completion_mask: torch.Tensor  # (B, T)
    completion_lengths: torch.Tensor  # (N,) gathered token counts
    prompts: list[Any]  # this rank's prompts
    completions: list[Any]  # this rank's decoded completions
    inputs: list[dict[str, Any]]  # this rank's dataset rows (extra columns, e.g. "answer")
    old_per_token_logps: torch.Tensor | None = None  # (B, T) trainer policy at sampling time, if computed
    sampling_per_token_logps: torch.Tensor | None = None  # (B, T) rollout engine's log-probs, if recorded
    ref_per_token_logps: torch.Tensor | None = None  # (B, T) reference policy, if computed
    prompt_ids: torch.Tensor | None = None  # (B, P) this rank's left-padded prompt ids (for extra forward passes)
    prompt_mask: torch.Tensor | None = None  # (B, P)
    trainer: Any = None  # the trl-ext trainer, for plugins that must generate or score (e.g. ReMax, PPO critic)
    tool_mask: torch.Tensor | None = None  # (B, T) 0 on tool/observation tokens inside multi-turn completions
    # (N,) bool, gathered: the rows trl_ext_filter_groups kept (AND of the filters), None when no filter answered; set
    # before trl_ext_compute_advantages. Filtered rows are masked after the advantages, not removed, so a statistic
    # over the whole batch (whitening, a batch mean or std, a running baseline) must leave them out itself.
    keep: torch.Tensor | None = None
    metrics: dict[str, float] = field(default_factory=dict)  # plugins add figures here; the host logs them
    # this rank's (B, ...) tensors a plugin hands to its loss hooks: split into micro-batches with the rollout and
    # passed as LossInputs.extra[key] (use a plugin-specific key prefix)
    loss_extras: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def num_groups(self) -> int:
        return self.rewards_per_func.shape[0] // self.num_generations

    @property
    def loss_mask(self) -> torch.Tensor:
        """``(B, T)`` float: the tokens the policy loss trains on (completion tokens minus tool tokens), as the GRPO
        loss masks them; token-level advantage estimators (returns, GAE, whitening) use it."""
        mask = self.completion_mask.to(torch.float32)
        return mask if self.tool_mask is None else mask * self.tool_mask.to(torch.float32)


@dataclass
class AggregationContext:
    """What a loss aggregation needs to know about the batch it reduces (shared by the GRPO and SFT trainers)."""

    num_items_in_batch: torch.Tensor | int  # global count of loss tokens in the (generation) batch
    grad_accum_steps: int  # current gradient accumulation steps (1 in eval)
    steps_per_generation: int  # GRPO: micro-batches per generation batch (1 for SFT)
    num_processes: int
    training: bool
    loss_type: str  # the TRL config's loss_type (the default aggregation)
    max_completion_length: int | None  # constant normaliser for Dr. GRPO-style aggregation
    # Rows trl_ext_filter_groups kept / all rows of the generation batch (every rank). Filtered rows are masked, not
    # removed, so an aggregation that divides by the micro-batch's row count (seq-mean-*, Dr. GRPO's B * L) divides
    # by this share of it: a filtered row then leaves the row count as its tokens leave token counts.
    kept_row_fraction: float = field(default=1.0, kw_only=True)


@dataclass
class LossInputs(AggregationContext):
    """Everything a per-token loss, weight or aggregation hook may need for one micro-batch on this rank."""

    per_token_logps: torch.Tensor  # (B, T) current policy, requires grad
    old_per_token_logps: torch.Tensor  # (B, T) policy that sampled the batch (trainer copy), detached
    advantages: torch.Tensor  # (B, 1) or (B, T), detached
    mask: torch.Tensor  # (B, T) float: completion tokens that count in the loss
    sampling_per_token_logps: torch.Tensor | None  # (B, T) rollout engine log-probs, detached, if recorded
    ref_per_token_logps: torch.Tensor | None  # (B, T) reference policy, detached, if computed
    entropies: torch.Tensor | None  # (B, T) detached
    epsilon_low: float
    epsilon_high: float
    beta: float
    extra: dict[str, Any] = field(default_factory=dict)  # other micro-batch keys (e.g. "completion_ids")
    metrics: dict[str, float] = field(default_factory=dict)  # plugins add figures here; the host logs them

    @property
    def log_ratio(self) -> torch.Tensor:
        """log pi_theta - log pi_old per token (the PPO ratio in log space)."""
        return self.per_token_logps - self.old_per_token_logps


@dataclass
class TokenWeights:
    """One plugin's contribution to per-token weighting.

    ``weight`` multiplies the per-token loss (must carry no gradient); ``mask`` (bool/0-1) removes tokens from the loss
    and from the aggregation denominator. Either may be ``None``. Shapes broadcast to ``(B, T)``.
    """

    weight: torch.Tensor | None = None
    mask: torch.Tensor | None = None


@dataclass
class PreferenceInputs:
    """Log-probabilities of one preference micro-batch (chosen and rejected halves aligned row by row)."""

    chosen_logps: torch.Tensor  # (B,) summed over completion tokens, requires grad
    rejected_logps: torch.Tensor  # (B,)
    chosen_lengths: torch.Tensor  # (B,) completion token counts
    rejected_lengths: torch.Tensor  # (B,)
    ref_chosen_logps: torch.Tensor | None  # (B,) detached, when a plugin needs the reference
    ref_rejected_logps: torch.Tensor | None
    beta: float
    batch: dict[str, Any] = field(default_factory=dict)  # other collated columns (e.g. reward columns)
    metrics: dict[str, float] = field(default_factory=dict)

    @property
    def chosen_mean_logps(self) -> torch.Tensor:
        return self.chosen_logps / self.chosen_lengths.clamp(min=1)

    @property
    def rejected_mean_logps(self) -> torch.Tensor:
        return self.rejected_logps / self.rejected_lengths.clamp(min=1)
