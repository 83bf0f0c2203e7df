"""Distillation math as small pure tensor functions (ALGORITHMS.md items 4-7 and 51).

Conventions pinned here (and tested in tests/test_distill_math.py):

* Divergences are per position over the full vocabulary, from *logits* (``(..., V)``), in nats. The generalised JSD
  follows TRL (``trl/kernels/chunked_divergence.py``) and ALGORITHMS.md item 4: ``M = beta p_T + (1 - beta) p_S``,
  ``JSD_beta = beta KL(p_T || M) + (1 - beta) KL(p_S || M)``, with ``beta = 0`` read as the forward KL(p_T || p_S) and
  ``beta = 1`` as the reverse KL(p_S || p_T) (the endpoints of the JSD itself are 0, so TRL special-cases them).
* On-policy distillation advantages are per sampled token, ``A_t = sg[log p_T(y_t) - log p_theta(y_t)]``, exactly 0
  on masked tokens (``torch.where``, never a product with a possibly infinite log-prob).
* BOND: ``log pi_BoN(y) - log pi_ref(y) = log N + (N - 1) log p_le(y)`` (no ties); ``p_le`` is estimated from
  reference/anchor samples as the share with reward ``<=`` ``r(y)`` (ties count as "<=", so ``p_le >= 1/n`` when the
  sample itself is among them and the log is finite).
"""

from __future__ import annotations

import math

import torch

from trl_ext import ops

# The three divergences the `gkd` plugin names, as TRL's `beta` (`DistillationConfig.beta`).
FORWARD_KL_BETA = 0.0
REVERSE_KL_BETA = 1.0


def generalized_jsd(teacher_logits: torch.Tensor, student_logits: torch.Tensor, beta: float,
                    temperature: float = 1.0) -> torch.Tensor:
    """Per-position divergence between teacher and student next-token distributions, ``(...)`` from ``(..., V)``.

    ``beta = 0``: KL(p_T || p_S) (forward); ``beta = 1``: KL(p_S || p_T) (reverse); otherwise TRL's generalised JSD.
    Logits are divided by ``temperature`` first. Materialises the full distributions: a reference for tests, not the
    training path (which is TRL's chunked kernel).
    """
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta must lie in [0, 1], got {beta}")
    # bf16/fp16 computed in float32, float64 kept (the parity fixtures compare float64 inputs)
    dtype = torch.promote_types(torch.promote_types(teacher_logits.dtype, student_logits.dtype), torch.float32)
    log_t = torch.log_softmax(teacher_logits.to(dtype) / temperature, dim=-1)
    log_s = torch.log_softmax(student_logits.to(dtype) / temperature, dim=-1)
    if beta == FORWARD_KL_BETA:
        return kl_from_logprobs(log_t, log_s)
    if beta == REVERSE_KL_BETA:
        return kl_from_logprobs(log_s, log_t)
    log_m = mixture_logprobs(log_t, log_s, beta)
    return beta * kl_from_logprobs(log_t, log_m) + (1.0 - beta) * kl_from_logprobs(log_s, log_m)


def mixture_logprobs(log_t: torch.Tensor, log_s: torch.Tensor, beta: float) -> torch.Tensor:
    """``log(beta p_T + (1 - beta) p_S)`` for 0 < beta < 1; -inf (with zero gradient) where both are -inf.

    ``logaddexp(-inf, -inf)`` is -inf in value but NaN in its backward (``exp(-inf - -inf)``), so a token that both
    models exclude (a vocabulary-padding logit of -inf, a top-k-truncated teacher) would put NaN into the student's
    gradient; such positions are replaced by 0 with ``torch.where`` before the call."""
    support = (log_t > -math.inf) | (log_s > -math.inf)
    zero = torch.zeros((), dtype=log_t.dtype, device=log_t.device)
    mixed = torch.logaddexp(torch.where(support, log_t, zero) + math.log(beta),
                            torch.where(support, log_s, zero) + math.log(1.0 - beta))
    return torch.where(support, mixed, torch.full_like(mixed, -math.inf))


def kl_from_logprobs(log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    """KL(p || q) over the last axis from log-probabilities; terms with p = 0 contribute exactly 0, with a zero gradient
    (:func:`trl_ext.ops.kl_terms`)."""
    return ops.kl_terms(log_p, log_q).sum(-1)


def opd_advantages(teacher_logps: torch.Tensor, student_logps: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-token on-policy distillation advantage ``sg[log p_T - log p_theta]``, ``(B, T)``, 0 where ``mask`` is 0.

    The sampled-token estimate of minus the reverse KL (Thinking Machines' on-policy distillation, discount 0): each
    token's advantage is its own term only.
    """
    gap = (teacher_logps - student_logps).detach()
    return torch.where(mask.bool(), gap, torch.zeros_like(gap))


def combine_advantages(opd: torch.Tensor, task: torch.Tensor | None, alpha: float,
                       coef: float = 1.0) -> torch.Tensor:
    """``coef * A_opd + alpha * A_task`` (MiMo-V2-Flash MOPD, arXiv 2601.02780: Â = A_opd + α Â_ORM).

    ``task`` is per sequence ``(B,)`` (broadcast to every token) or per token ``(B, T)``; ``None`` or ``alpha = 0``
    gives the pure distillation advantage. The result is 0 wherever ``opd`` is masked only if the caller masks it
    (the loss mask does that in the trainer).
    """
    out = coef * opd
    if task is None or alpha == 0.0:
        return out
    task = task.to(opd.dtype)
    return out + alpha * (task.unsqueeze(1) if task.dim() == 1 else task)


def weighted_by_row(advantages: torch.Tensor, row_weights: torch.Tensor) -> torch.Tensor:
    """Scale each row's advantages by its weight (MOPD's per-domain ``w_i``), ``(B, T) * (B,)``."""
    return advantages * row_weights.to(advantages.dtype).unsqueeze(1)


def bon_log_ratio(p_le: torch.Tensor, n: int) -> torch.Tensor:
    """``log pi_BoN(y) - log pi_ref(y) = log N + (N - 1) log p_le(y)`` (BOND, arXiv 2407.14622, no ties)."""
    if n < 1:
        raise ValueError(f"N must be at least 1, got {n}")
    return math.log(n) + (n - 1) * torch.log(p_le)


def empirical_p_le(rewards: torch.Tensor, reference_rewards: torch.Tensor) -> torch.Tensor:
    """Share of ``reference_rewards`` (``(R,)``, or ``(B, R)`` per row) that are ``<=`` each reward, ``(B,)``."""
    ref = reference_rewards if reference_rewards.dim() == 2 else reference_rewards.unsqueeze(0)
    return (ref <= rewards.unsqueeze(1)).to(rewards.dtype).mean(dim=1)


def group_p_le(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """``p_le`` of each sample estimated from its own group (the G samples of one prompt), ``(N,)``.

    Each group's samples serve as the anchor samples of the others; a sample counts itself (ties are "<="), so the
    estimate lies in ``[1/G, 1]`` and its log is finite. An unscorable sample (NaN reward) is no anchor sample and has
    no estimate (NaN): the others' estimates are taken over the scorable samples of their group, as if it had not
    been drawn.
    """
    grouped = rewards.view(-1, group_size)
    scorable = ~torch.isnan(grouped)
    # [group, i, j]: r_j <= r_i; a comparison with NaN is False, so unscorable anchors j never count
    at_most = (grouped.unsqueeze(1) <= grouped.unsqueeze(2)).to(rewards.dtype).sum(dim=2)
    estimate = at_most / scorable.sum(dim=1, keepdim=True).clamp(min=1).to(rewards.dtype)
    return torch.where(scorable, estimate, torch.full_like(estimate, torch.nan)).reshape(-1)


def jeffreys(forward_kl: torch.Tensor, reverse_kl: torch.Tensor, beta: float) -> torch.Tensor:
    """``J_beta = (1 - beta) KL(pi_BoN || pi) + beta KL(pi || pi_BoN)`` (BOND's Jeffreys divergence)."""
    return (1.0 - beta) * forward_kl + beta * reverse_kl


def ema_update(anchor: dict[str, torch.Tensor], current: dict[str, torch.Tensor], rate: float) -> None:
    """In place: ``anchor <- (1 - rate) * anchor + rate * current`` (J-BOND's moving anchor)."""
    with torch.no_grad():
        for name, value in anchor.items():
            value.mul_(1.0 - rate).add_(current[name].detach().to(value.dtype), alpha=rate)
