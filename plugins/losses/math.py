"""Pure per-token objective functions of the ``losses`` family (ALGORITHMS.md items 27, 31-37, 48).

Uniform shape: every objective takes detached advantages ``(B, 1)`` or ``(B, T)`` and returns the per-token loss to be
*minimised*, ``(B, T)`` or ``(B, 1)`` (one value per sequence, broadcast by the aggregation). Masking and aggregation
happen later in the trainer. Ratios are formed in log space with the +-20 clamp of :func:`trl_ext.ops.safe_ratio`.
Generic pieces (PPO clip, CISPO, SAPO, k3, aggregations) live in :mod:`trl_ext.ops` and are reused, not repeated.
"""

from __future__ import annotations

import torch

from trl_ext import ops


def masked_inputs(inputs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(per_token_logps, log_ratio, advantages)`` of a :class:`~trl_ext.batches.LossInputs` with every position
    outside ``inputs.mask`` replaced by 0 through ``torch.where`` (per-token advantages too; ``(B, 1)`` ones are kept).

    The loss pipeline already sanitises its log-prob tensors, but an objective must not rely on that: a hook called
    on raw inputs with -inf/NaN log-probs at padding would otherwise give a NaN loss (GMPO, GSPO) or NaN gradients at
    masked positions (CISPO, CE-GPPO, GSPO-token), since ``-inf - -inf`` is NaN and ``0 * NaN`` is NaN in backward.
    ``where`` passes an exactly-zero gradient to the positions it drops, so masked tokens get gradient 0.
    """
    mask = inputs.mask
    logps = ops.where_mask(inputs.per_token_logps, mask)
    log_ratio = logps - ops.where_mask(inputs.old_per_token_logps, mask)
    advantages = inputs.advantages
    if advantages.dim() == 2 and advantages.shape[-1] == mask.shape[-1] and advantages.shape[-1] != 1:
        advantages = ops.where_mask(advantages, mask)
    return logps, log_ratio, advantages


def masked_sequence_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``values`` over each sequence's unmasked tokens, shape ``(B, 1)`` (0 for a row without tokens).
    Masked positions are dropped with ``torch.where``, so -inf/NaN there cannot make the row's mean NaN."""
    return (ops.where_mask(values, mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)


def gspo_sequence_ratio(log_ratio: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """GSPO (arXiv 2507.18071) sequence ratio s_i = exp(mean_t log r_{i,t}), shape ``(B, 1)``; keeps the gradient."""
    return ops.safe_ratio(masked_sequence_mean(log_ratio, mask))


def gspo_token_ratio(per_token_logps: torch.Tensor, old_per_token_logps: torch.Tensor,
                     mask: torch.Tensor) -> torch.Tensor:
    """GSPO-token ratio s_{i,t} = sg[s_i] * pi(y_t) / sg[pi(y_t)], shape ``(B, T)``.

    Its value equals s_i on every token; its gradient w.r.t. log pi(y_t) is s_i (token-level advantages allowed).
    Positions outside ``mask`` are set to 0 with ``torch.where`` first (``x - sg(x)`` is NaN for x = -inf).
    """
    per_token_logps = ops.where_mask(per_token_logps, mask)
    old_per_token_logps = ops.where_mask(old_per_token_logps, mask)
    seq = gspo_sequence_ratio((per_token_logps - old_per_token_logps).detach(), mask)
    return seq * torch.exp(per_token_logps - per_token_logps.detach())


def gmpo_objective(log_ratio: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                   log_clip_low: float, log_clip_high: float) -> torch.Tensor:
    """GMPO (arXiv 2507.20673): -A * exp(mean_t clipped log r), one value per sequence ``(B, 1)``.

    Per token the PPO min/clip is taken in log space: for A>0 ``min(log r, clip(log r, -lo, hi))``, for A<0 the max,
    so ``sgn(A) * prod_t |min(r A, clip(r) A)|^(1/|o|) = A * exp(mean_t clipped log r)``. ``advantages`` must be one
    per sequence (the geometric mean couples a sequence's tokens).
    """
    sign = torch.sign(advantages)
    clipped = torch.clamp(log_ratio, -log_clip_low, log_clip_high)
    kept = sign * torch.min(sign * log_ratio, sign * clipped)
    return -advantages * ops.safe_ratio(masked_sequence_mean(kept, mask))


def ce_gppo_objective(log_ratio: torch.Tensor, advantages: torch.Tensor, eps_low: float, eps_high: float,
                      beta_low: float, beta_high: float, dual_clip: float | None = 3.0) -> torch.Tensor:
    """CE-GPPO (arXiv 2509.20712) per-token loss: PPO clip whose clipped tokens keep a bounded gradient.

    A<0, r<1-eps_low:  -beta_low * (1-eps_low) * r/sg(r) * A   (value = clipped value * beta_low; d/dlogpi = -beta_low(1-eps_low)A)
    A>0, r>1+eps_high: -beta_high * (1+eps_high) * r/sg(r) * A
    otherwise:         -r * A, and for A<0 the dual clip caps the loss at -dual_clip * A (zero gradient beyond).

    ``r/sg(r)`` is built as ``exp(x - sg(x))`` (value 1, gradient 1 for any log-ratio x), and ``r`` itself as
    ``exp(x - sg(x)) * sg(clamped r)`` (:func:`trl_ext.ops.straight_through_ratio`): a ratio clamped *before* the
    stop-gradient construction has zero gradient for |x| > 20, which would silently drop the bounded gradient of
    exactly the tokens CE-GPPO exists to keep.
    """
    ratio = ops.straight_through_ratio(log_ratio)
    straight_through = torch.exp(log_ratio - log_ratio.detach())  # value 1, gradient d/dlogpi = 1 for any ratio
    low = (advantages < 0) & (ratio < 1 - eps_low)
    high = (advantages > 0) & (ratio > 1 + eps_high)
    inside = -ratio * advantages
    if dual_clip is not None:
        inside = torch.where(advantages < 0, torch.minimum(inside, -dual_clip * advantages), inside)
    loss = torch.where(low, -beta_low * (1 - eps_low) * straight_through * advantages, inside)
    return torch.where(high, -beta_high * (1 + eps_high) * straight_through * advantages, loss)


def reinforce_objective(per_token_logps: torch.Tensor, advantages: torch.Tensor) -> torch.Tensor:
    """REINFORCE with a baseline (Williams 1992; arXiv 2402.14740): -(R - b) * log pi(y_t), no ratio, no clip."""
    return -advantages * per_token_logps
