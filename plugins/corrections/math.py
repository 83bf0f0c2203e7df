"""Pure functions of the ``corrections`` family (ALGORITHMS.md items 40-43; conventions 5-9).

Three policies are named explicitly (convention 7): ``pi_rollout`` (the engine that sampled the tokens; its per-token
log-probs are ``sampling_per_token_logps``), ``pi_old`` (the trainer's copy at sampling time) and ``pi_theta``.
TIS / MIS / IcePop weight by rho = pi_old / pi_rollout; the rollout-ratio objective uses pi_theta / pi_rollout; M2PO
masks by the second moment of log(pi_theta / pi_behaviour). Weights returned here are detached; ratios are formed in log
space with the +-20 clamp of :func:`trl_ext.ops.safe_ratio`.
"""

from __future__ import annotations

import math

import torch

from trl_ext import metrics as figures
from trl_ext import ops


def masked_log_ratio(numerator_logps: torch.Tensor, denominator_logps: torch.Tensor,
                     mask: torch.Tensor) -> torch.Tensor:
    """``log p - log q`` on loss tokens, exactly 0 elsewhere and where either side is NaN ("not recorded").

    Both operands are replaced by 0 off the mask with ``torch.where`` *before* the subtraction: padding often holds
    -inf, ``-inf - -inf`` is NaN, and a mask applied by multiplication (``NaN * 0``, ``inf * 0``) stays NaN in the
    value or in the backward pass. Keeps the gradient of ``numerator_logps`` on loss tokens (exactly 0 elsewhere)."""
    valid = mask.bool()
    diff = ops.where_mask(numerator_logps, valid) - ops.where_mask(denominator_logps, valid)
    return torch.where(valid & ~torch.isnan(diff), diff, torch.zeros_like(diff))


def rollout_log_rho(old_per_token_logps: torch.Tensor, sampling_per_token_logps: torch.Tensor,
                    mask: torch.Tensor) -> torch.Tensor:
    """log rho = log pi_old - log pi_rollout on loss tokens, 0 elsewhere and where the engine gave no log-prob (NaN)."""
    return masked_log_ratio(old_per_token_logps, sampling_per_token_logps, mask).detach()


def sequence_log_rho(log_rho: torch.Tensor, mask: torch.Tensor, geometric: bool = False) -> torch.Tensor:
    """Sequence-level log rho, ``(B, 1)``: the sum over tokens (log of prod_t rho_t, TRL ``sequence_*`` modes), or the
    mean (geometric-mean ratio, "Geo-RS").

    A sequence holding both a +inf (the rollout engine gave its sampled token probability 0) and a -inf log rho (the
    trainer gives it 0) has no ratio: inf - inf is NaN, which every band test lets through (comparisons with NaN are
    False) and every weight carries. It counts as ratio 0 (log rho -inf): weight 0 under every mode, rejected by
    every statistic."""
    total = log_rho.sum(-1, keepdim=True)
    total = torch.where(torch.isnan(total), torch.full_like(total, -torch.inf), total)
    return total / mask.sum(-1, keepdim=True).clamp(min=1.0) if geometric else total


def truncated_weight(rho: torch.Tensor, lower: float | None, upper: float | None) -> torch.Tensor:
    """TIS: clamp(rho, lower, upper) (upper-only when ``lower`` is None)."""
    return torch.clamp(rho, min=lower, max=upper)


def band_weight(rho: torch.Tensor, lower: float | None, upper: float | None) -> torch.Tensor:
    """MIS / IcePop: rho where lower <= rho <= upper, else 0 (bounds inclusive, absolute ratio bounds)."""
    outside = torch.zeros_like(rho, dtype=torch.bool)
    if lower is not None:
        outside = outside | (rho < lower)
    if upper is not None:
        outside = outside | (rho > upper)
    return rho.masked_fill(outside, 0.0)


def double_sided_weight(ratio: torch.Tensor, eps_low: float, eps_high: float) -> torch.Tensor:
    """GLM-5 direct double-sided IS: f(r) = r if 1-eps_low < r < 1+eps_high else 0 (strict), detached."""
    ratio = ratio.detach()
    return torch.where((ratio > 1 - eps_low) & (ratio < 1 + eps_high), ratio, torch.zeros_like(ratio))


def m2_keep_mask(log_ratio: torch.Tensor, mask: torch.Tensor, threshold: float) -> torch.Tensor:
    """M2PO (arXiv 2510.01161): drop the tokens with the largest (log r)^2 until the mean over the remaining loss tokens
    is <= ``threshold``. Returns a bool keep-mask ``(B, T)`` (False also on non-loss tokens)."""
    valid = mask.bool()
    squared = torch.where(valid, log_ratio.detach().to(torch.float64) ** 2, 0.0).flatten()
    n = int(valid.sum())
    if n == 0:
        return valid
    order = torch.argsort(squared, descending=True)[:n]  # loss tokens first (non-loss ones are 0 and sort last)
    ranked = squared[order]
    removed = torch.arange(n, device=squared.device, dtype=squared.dtype)  # k tokens removed
    remaining_mean = suffix_sums(ranked) / (n - removed)
    ok = remaining_mean <= threshold
    k = int(torch.nonzero(ok)[0]) if bool(ok.any()) else n
    keep = torch.ones_like(squared, dtype=torch.bool)
    keep[order[:k]] = False
    return keep.view_as(mask) & valid


def suffix_sums(values: torch.Tensor) -> torch.Tensor:
    """``out[k] = sum(values[k:])`` of a 1-D tensor, summed from the tail (reverse cumulative sum).

    M2PO needs the sum of the tokens left after removing the k largest. Computing it as ``total - prefix[k]``
    cancels catastrophically when the removed values dwarf the kept ones (float32: ``(1e8 + 0.15) - 1e8 = 0``, so
    tokens whose mean is 0.05 > tau were kept) and is NaN once a value is inf (``inf - inf``); summing the tail
    directly has neither problem (an inf only enters the sums that contain it)."""
    return values.flip(0).cumsum(0).flip(0)


def ppo_clip_active(log_ratio: torch.Tensor, advantages: torch.Tensor, eps_low: float, eps_high: float) -> torch.Tensor:
    """Tokens whose PPO-clip term ``min(r A, clip(r, 1 - eps_low, 1 + eps_high) A)`` still has a gradient (bool,
    broadcast to ``log_ratio``): all but ``A > 0, r > 1 + eps_high`` and ``A < 0, r < 1 - eps_low``, where the clipped
    branch is the minimum and is constant in theta. ``r = exp(log_ratio)`` is compared in log space (no overflow)."""
    log_ratio = log_ratio.detach()
    high = log_ratio > math.log1p(eps_high)
    low = log_ratio < (math.log1p(-eps_low) if eps_low < 1 else -math.inf)
    clipped = ((advantages > 0) & high) | ((advantages < 0) & low)
    return ~clipped.expand_as(log_ratio)


def mismatch_stats(log_rho: torch.Tensor, weight: torch.Tensor, changed: torch.Tensor,
                   mask: torch.Tensor) -> dict[str, figures.Summed | figures.Largest]:
    """Diagnostics of one micro-batch over its loss tokens (weights of shape (B, 1) are broadcast), as figure parts
    the trainer reduces over every rank (:mod:`trl_ext.metrics`; ``reduce_figures`` gives the floats): a rank's own
    means, maxima and ESS are its slice only, and ranks hold different token counts.

    ``logp_diff/{mean,max}``: |log pi_old - log pi_rollout|; ``rho/{mean,std,max}``: the token ratio pi_old/pi_rollout
    (clamped exp, unbiased std); ``weight/{min,mean,max}``: the correction's weight; ``changed_fraction`` and
    ``changed_sequence_fraction``: tokens, and sequences with at least one token, whose weight was masked or truncated;
    ``ess``: effective sample size of the weights as a fraction, ``(sum w)^2 / (n sum w^2)`` (1: uniform, 0: all zero);
    ``mismatch_kl/{k1,k3}``: KL(pi_rollout || pi_old) estimated on the rollout's own samples, k1 = mean(-log rho),
    k3 = mean(rho - 1 - log rho) (>= 0). Every key is always present (a rank without loss tokens adds nothing to the
    sums); a figure with no loss token on any rank is not logged.
    """
    valid = mask.bool()
    lr = torch.where(valid, log_rho.detach(), torch.zeros_like(log_rho))
    rho = ops.safe_ratio(lr)
    w = weight.detach().expand_as(mask)
    w = torch.where(valid, w, torch.zeros_like(w))
    changed_tokens = changed.expand_as(mask) & valid
    rows = valid.any(-1)
    k3 = rho - 1 - lr.clamp(-ops.LOG_RATIO_CLAMP, ops.LOG_RATIO_CLAMP)
    return {
        "logp_diff/mean": figures.masked_mean(lr.abs(), valid),
        "logp_diff/max": figures.masked_max(lr.abs(), valid),
        "rho/mean": figures.masked_mean(rho, valid),
        "rho/std": figures.masked_std(rho, valid),
        "rho/max": figures.masked_max(rho, valid),
        "changed_fraction": figures.mean(changed_tokens.sum(), valid.sum()),
        "changed_sequence_fraction": figures.mean((changed_tokens.any(-1) & rows).sum(), rows.sum()),
        "weight/min": figures.masked_min(w, valid),
        "weight/mean": figures.masked_mean(w, valid),
        "weight/max": figures.masked_max(w, valid),
        "ess": figures.Summed((w.sum(), (w * w).sum(), valid.sum()), _ess),
        "mismatch_kl/k1": figures.masked_mean(-lr, valid),
        "mismatch_kl/k3": figures.masked_mean(k3, valid),
    }


def _ess(total: float, squares: float, count: float) -> float | None:
    """``(sum w)^2 / (n sum w^2)`` from sums over every rank (0 when every weight is 0)."""
    if count <= 0:
        return None
    return total * total / (count * squares) if squares > 0 else 0.0


def rho_from_log(log_rho: torch.Tensor) -> torch.Tensor:
    return ops.safe_ratio(log_rho)
