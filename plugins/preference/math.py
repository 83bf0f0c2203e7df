"""Preference losses as small pure functions on per-example tensors (shape ``(B,)``), one per formula.

Every function returns the *per-example* loss; the host averages over the batch. Names of the arguments say which
log-probabilities they expect: ``*_logratios`` are ``log pi_theta - log pi_ref`` of a whole completion (summed over
its tokens unless the caller length-normalises), ``*_mean_logps`` are per-token averages of ``log pi_theta``.
Formulas and test numbers: ALGORITHMS.md items 18-25.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from trl_ext import ops


def ipo_loss(chosen_logratios: torch.Tensor, rejected_logratios: torch.Tensor, tau: float) -> torch.Tensor:
    """IPO (arXiv 2310.12036, Eq. 17): ``(h - 1/(2 tau))**2`` with ``h`` the chosen-minus-rejected log-ratio gap."""
    return (chosen_logratios - rejected_logratios - 1.0 / (2.0 * tau)) ** 2


def apo_zero_loss(chosen_logratios: torch.Tensor, rejected_logratios: torch.Tensor, beta: float) -> torch.Tensor:
    """APO-zero (arXiv 2408.06266, Eq. 7): ``(1 - sigma(beta r_w)) + sigma(beta r_l)``: raise chosen, lower rejected."""
    return (1.0 - torch.sigmoid(beta * chosen_logratios)) + torch.sigmoid(beta * rejected_logratios)


def apo_down_loss(chosen_logratios: torch.Tensor, rejected_logratios: torch.Tensor, beta: float) -> torch.Tensor:
    """APO-down (arXiv 2408.06266, Eq. 8): ``sigma(beta r_w) + (1 - sigma(beta (r_w - r_l)))``."""
    return torch.sigmoid(beta * chosen_logratios) + (1.0 - torch.sigmoid(beta * (chosen_logratios - rejected_logratios)))


def noisy_label_logistic(z: torch.Tensor, label_smoothing: float = 0.0, form: str = "conservative") -> torch.Tensor:
    """The logistic loss ``-log sigma(z)`` of a pairwise margin ``z`` when a share ``eps`` of the preference labels is
    assumed flipped: ``conservative``, ``-(1 - eps) log sigma(z) - eps log sigma(-z)`` (cDPO, Mitchell 2023: the loss
    against soft labels; OpenRLHF's DPOLoss, TRL CPO's simpo); ``robust``, ``[-(1 - eps) log sigma(z) + eps log
    sigma(-z)] / (1 - 2 eps)`` (rDPO, arXiv 2403.00409, TRL's robust: unbiased for the clean-label loss, eps < 0.5).
    eps 0: ``-log sigma(z)`` exactly."""
    loss = -F.logsigmoid(z)
    if not label_smoothing:
        return loss
    flipped = -F.logsigmoid(-z)
    eps = label_smoothing
    if form == "conservative":
        return (1 - eps) * loss + eps * flipped
    return ((1 - eps) * loss - eps * flipped) / (1 - 2 * eps)


def simpo_loss(chosen_mean_logps: torch.Tensor, rejected_mean_logps: torch.Tensor, beta: float,
               gamma: float, label_smoothing: float = 0.0) -> torch.Tensor:
    """SimPO (arXiv 2405.14734): ``-log sigma(z)``, ``z = beta * mean_logp_w - beta * mean_logp_l - gamma``; no
    reference. ``label_smoothing``: :func:`noisy_label_logistic`'s conservative form (TRL CPO's simpo)."""
    return noisy_label_logistic(beta * (chosen_mean_logps - rejected_mean_logps) - gamma, label_smoothing)


LOG_ODDS_MAX_LOGP = -1e-6  # log P is capped here inside log(1 - P): P = 1 exactly would give infinite odds


def log_odds(mean_logps: torch.Tensor) -> torch.Tensor:
    """``log(P / (1 - P))`` for ``P = exp(mean_logps)`` (ORPO's length-normalised odds), stable for ``P`` near 1.

    ``log(1 - P)`` uses ``min(log P, -1e-6)`` (documented clamp), so a log-prob of exactly 0 (P = 1) gives a large
    finite odds (about 13.8 + log P) instead of inf/NaN; below the cap the value is exact."""
    return mean_logps - torch.log(-torch.expm1(mean_logps.clamp(max=LOG_ODDS_MAX_LOGP)))


def orpo_odds_ratio_loss(chosen_mean_logps: torch.Tensor, rejected_mean_logps: torch.Tensor) -> torch.Tensor:
    """ORPO's ``L_OR`` (arXiv 2403.07691, Eq. 7): ``-log sigma(log odds(y_w) - log odds(y_l))``."""
    return -F.logsigmoid(log_odds(chosen_mean_logps) - log_odds(rejected_mean_logps))


def bernoulli_kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> torch.Tensor:
    """``KL(Bern(sigma(p)) || Bern(sigma(q)))`` from logits, computed in log space.

    An outcome of probability 0 under ``p`` (an infinite logit, e.g. a reward gap of inf) contributes exactly 0 with a
    zero gradient; written as ``0 * (-inf - log q)`` it was NaN in value and gradient."""
    log_p, log_not_p = F.logsigmoid(p_logits), F.logsigmoid(-p_logits)
    log_q, log_not_q = F.logsigmoid(q_logits), F.logsigmoid(-q_logits)
    return ops.kl_terms(log_p, log_q) + ops.kl_terms(log_not_p, log_not_q)


def rpo_bwd_kl_loss(policy_gap: torch.Tensor, target_gap: torch.Tensor) -> torch.Tensor:
    """RPO (Nemotron-4, arXiv 2406.11704): ``KL(Bern(sigma(eta dr*)) || Bern(sigma(beta dlogratio)))``.

    ``policy_gap`` = ``beta * (r_w - r_l)`` (implicit rewards), ``target_gap`` = ``eta * (r*(y_w) - r*(y_l))``.
    NeMo-Aligner's ``rpo_bwd_kl``: from the reward model's preference probability to the policy's.
    """
    return bernoulli_kl(target_gap, policy_gap)


def rpo_fwd_kl_loss(policy_gap: torch.Tensor, target_gap: torch.Tensor) -> torch.Tensor:
    """NeMo-Aligner's ``rpo_fwd_kl``: ``KL(Bern(sigma(policy_gap)) || Bern(sigma(target_gap)))``."""
    return bernoulli_kl(policy_gap, target_gap)


def rpo_sq_loss(policy_gap: torch.Tensor, target_gap: torch.Tensor) -> torch.Tensor:
    """NeMo-Aligner's ``rpo_sq``: ``(policy_gap - target_gap)**2``."""
    return (policy_gap - target_gap) ** 2


def quantile_reward(rewards: torch.Tensor, ref_rewards: torch.Tensor) -> torch.Tensor:
    """QRPO's ``r_q = P_{y'~pi_ref}[r(y') <= r(y)]``, estimated from ``n`` reference rewards per row.

    ``rewards``: ``(B,)``; ``ref_rewards``: ``(B, n)``, NaN marks a missing reference reward (rows of unequal ``n``).
    """
    valid = ~torch.isnan(ref_rewards)
    below = (ref_rewards <= rewards.unsqueeze(-1)) & valid
    return below.sum(-1).to(rewards.dtype) / valid.sum(-1).clamp(min=1).to(rewards.dtype)


def qrpo_log_partition(beta: float, exact: bool = True, transform: str = "identity") -> float:
    """``log Z = log E_{u~U(0,1)}[exp(f(u) / beta)]`` for the quantile reward transform ``f``: ``identity``,
    ``log(beta (e^{1/beta} - 1))`` exactly, or ``log beta + 1/beta`` (``exact=False``, the reference implementation's);
    ``log`` (``f = log u``), ``log(beta / (1 + beta))``; ``normal_icdf`` (``f`` = the standard normal quantile),
    ``1 / (2 beta^2)``; ``scaled_normal_icdf`` (``f = s`` times the normal quantile) the same for ``s = 1``, and
    ``s^2 / (2 beta^2)`` in general (the caller multiplies by ``s^2``). The exact identity form is written as
    ``log beta + 1/beta + log(1 - e^{-1/beta})`` so it stays finite for small ``beta``; ``1 - e^{-1/beta}`` is
    ``-expm1(-1/beta)`` so it keeps full precision for large ``beta``.
    """
    if transform == "log":
        return math.log(beta / (1.0 + beta))
    if transform in ("normal_icdf", "scaled_normal_icdf"):  # the scaled form's row scale s multiplies it by s^2
        return 1.0 / (2.0 * beta * beta)
    approx = math.log(beta) + 1.0 / beta
    return approx + math.log(-math.expm1(-1.0 / beta)) if exact else approx


def reference_reward_std(ref_rewards: torch.Tensor) -> torch.Tensor:
    """``(B,)`` sample standard deviation (``n - 1`` in the denominator) of each row's reference rewards, NaN marking
    a missing one; 0 for a row with fewer than 2."""
    valid = ~torch.isnan(ref_rewards)
    n = valid.sum(-1).to(ref_rewards.dtype)
    zero = torch.zeros((), dtype=ref_rewards.dtype, device=ref_rewards.device)
    mean = torch.where(valid, ref_rewards, zero).sum(-1) / n.clamp(min=1)
    squares = torch.where(valid, (ref_rewards - mean.unsqueeze(-1)) ** 2, zero).sum(-1)
    return torch.sqrt(squares / (n - 1).clamp(min=1))


def transformed_quantile_reward(quantile_rewards: torch.Tensor, counts: torch.Tensor, transform: str) -> torch.Tensor:
    """QRPO's reward transforms of ``r_q`` estimated from ``counts`` reference rewards per row: ``identity``; ``log``,
    ``log max(r_q, 1/n)`` (``r_q`` is 0 below every reference reward); ``normal_icdf`` (and ``scaled_normal_icdf``
    before its row scale), the standard normal quantile of ``r_q`` clamped to ``[1/n, (n-1)/n]`` (the reference
    implementation's clamps)."""
    if transform == "identity":
        return quantile_rewards
    lowest = 1.0 / counts.to(quantile_rewards.dtype).clamp(min=1)
    if transform == "log":
        return torch.log(torch.maximum(quantile_rewards, lowest))
    clamped = torch.minimum(torch.maximum(quantile_rewards, lowest), 1.0 - lowest)
    return torch.distributions.Normal(0.0, 1.0).icdf(clamped)


def qrpo_loss(quantile_rewards: torch.Tensor, logratios: torch.Tensor, beta: float, log_partition: float) -> torch.Tensor:
    """QRPO (arXiv 2507.08068): ``(r_q - beta log Z - beta log pi/pi_ref)**2``, pointwise per completion."""
    return (quantile_rewards - beta * log_partition - beta * logratios) ** 2


def kto_loss(logratios: torch.Tensor, desirable: torch.Tensor, kl: torch.Tensor, beta: float,
             desirable_weight: float = 1.0, undesirable_weight: float = 1.0) -> torch.Tensor:
    """KTO (arXiv 2402.01306, Eq. 7) per example: ``lambda_y - v(x, y)`` with ``z_0 = max(0, kl)`` detached.

    Desirable: ``lambda_D (1 - sigma(beta (r - z_0)))``; undesirable: ``lambda_U (1 - sigma(beta (z_0 - r)))``.
    """
    z0 = kl.detach().clamp(min=0)
    chosen = desirable_weight * (1.0 - torch.sigmoid(beta * (logratios - z0)))
    rejected = undesirable_weight * (1.0 - torch.sigmoid(beta * (z0 - logratios)))
    return torch.where(desirable.bool(), chosen, rejected)


def apo_zero_unpaired_loss(logratios: torch.Tensor, desirable: torch.Tensor, beta: float,
                           desirable_weight: float = 1.0, undesirable_weight: float = 1.0) -> torch.Tensor:
    """Unpaired APO-zero (TRL ``KTOConfig(loss_type="apo_zero_unpaired")``): ``1 - sigma(beta r)`` / ``sigma(beta r)``."""
    chosen = desirable_weight * (1.0 - torch.sigmoid(beta * logratios))
    rejected = undesirable_weight * torch.sigmoid(beta * logratios)
    return torch.where(desirable.bool(), chosen, rejected)
