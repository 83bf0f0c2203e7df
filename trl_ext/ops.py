"""Small pure tensor functions for policy-gradient and preference math.

Conventions (ALGORITHMS.md "cross-cutting conventions"): ratios are computed in log space and clamped to +-20 before
``exp`` so extreme log-probs give no inf/NaN; advantages and importance weights are constants (detached by the
caller or here); masks are float 0/1 tensors of shape (B, T).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

LOG_RATIO_CLAMP = 20.0


def safe_ratio(log_ratio: torch.Tensor) -> torch.Tensor:
    """exp(log_ratio) with the log-ratio clamped to +-20, so a stale or extreme token cannot overflow."""
    return torch.exp(log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))


def ppo_clip_objective(ratio: torch.Tensor, advantages: torch.Tensor, eps_low: float, eps_high: float) -> torch.Tensor:
    """Per-token loss -min(r*A, clip(r, 1-eps_low, 1+eps_high)*A) (PPO, arXiv 1707.06347; GRPO/DAPO use it per token)."""
    clipped = torch.clamp(ratio, 1 - eps_low, 1 + eps_high)
    return -torch.min(ratio * advantages, clipped * advantages)


def cispo_objective(ratio: torch.Tensor, per_token_logps: torch.Tensor, advantages: torch.Tensor, eps_high: float,
                    eps_low: float | None = None) -> torch.Tensor:
    """CISPO (arXiv 2506.13585): -sg(clip(r, lo, hi)) * A * log pi. TRL's form: only the upper bound ``eps_high`` is an
    absolute cap on r (``torch.clamp(r, max=eps_high)``); ``eps_low`` (absolute lower bound) is optional."""
    weight = torch.clamp(ratio, min=eps_low, max=eps_high).detach()
    return -weight * advantages * per_token_logps


def sapo_objective(ratio: torch.Tensor, advantages: torch.Tensor, tau_pos: float, tau_neg: float) -> torch.Tensor:
    """SAPO (arXiv 2511.20347): -f(r)*A with the soft gate f(r) = sigmoid(tau*(r-1)) * 4/tau, tau by the sign of A."""
    tau = torch.where(advantages > 0, torch.as_tensor(tau_pos), torch.as_tensor(tau_neg)).to(ratio.dtype)
    return -torch.sigmoid(tau * (ratio - 1)) * 4 / tau * advantages


def kl_k3(per_token_logps: torch.Tensor, ref_per_token_logps: torch.Tensor) -> torch.Tensor:
    """k3 estimator of KL(pi || pi_ref) per sampled token: exp(ref - logp) - (ref - logp) - 1 (>= 0, unbiased)."""
    delta = ref_per_token_logps - per_token_logps
    return torch.exp(delta) - delta - 1


# -- aggregation: (per_token_loss, mask) -> scalar, before gradient-accumulation scaling ----------------------------


def seq_mean_token_mean(per_token_loss: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean over each sequence's tokens, then over sequences (GRPO paper, GSPO, SAPO; TRL ``grpo``)."""
    return ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()


def token_mean(per_token_loss: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Sum over all tokens / number of tokens in this micro-batch (TRL ``bnpo``)."""
    return (per_token_loss * mask).sum() / mask.sum().clamp(min=1.0)


def constant_normalized(per_token_loss: torch.Tensor, mask: torch.Tensor, max_length: int) -> torch.Tensor:
    """Sum over tokens / (B * L) with a constant L (Dr. GRPO, arXiv 2503.20783; TRL ``dr_grpo``)."""
    return (per_token_loss * mask).sum() / (per_token_loss.size(0) * max_length)


def sequence_mean_nll(per_token_nll: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-sequence mean NLL, then mean over sequences (SFT 'per-conversation' normalisation)."""
    return seq_mean_token_mean(per_token_nll, mask)


# -- preference -----------------------------------------------------------------------------------------------------


def dpo_sigmoid_loss(chosen_logratios: torch.Tensor, rejected_logratios: torch.Tensor, beta: float) -> torch.Tensor:
    """DPO (arXiv 2305.18290): -log sigmoid(beta * ((log pi/pi_ref)(y_w) - (log pi/pi_ref)(y_l))), per example."""
    return -F.logsigmoid(beta * (chosen_logratios - rejected_logratios))
