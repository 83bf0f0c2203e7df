"""Small pure tensor functions for policy-gradient and preference math.

Conventions (ALGORITHMS.md "cross-cutting conventions"): ratios are computed in log space and clamped to +-20 before
``exp`` so extreme log-probs give no inf/NaN; advantages and importance weights are constants (detached by the
caller or here); masks are float 0/1 tensors of shape (B, T).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

# TRL loss types whose objective is the per-token PPO clip (TRL logs clip_ratio/* for them; m2po's ppo_active needs it)
PPO_CLIP_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")

LOG_RATIO_CLAMP = 20.0


def safe_ratio(log_ratio: torch.Tensor) -> torch.Tensor:
    """exp(log_ratio) with the log-ratio clamped to +-20, so a stale or extreme token cannot overflow."""
    return torch.exp(log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))


def ppo_clip_objective(ratio: torch.Tensor, advantages: torch.Tensor, eps_low: float, eps_high: float,
                       dual_clip: float | None = None, ratio_cap: float | None = None) -> torch.Tensor:
    """Per-token loss -min(r*A, clip(r, 1-eps_low, 1+eps_high)*A) (PPO, arXiv 1707.06347; GRPO/DAPO use it per token).

    ``dual_clip`` c > 1 (dual-clip PPO, Ye et al. 2020, arXiv 1912.09729; verl ``clip_ratio_c`` 3): for A < 0 the loss
    is further capped at -c*A, so a token with a huge ratio and a negative advantage cannot dominate (zero gradient
    beyond the cap). ``None``: plain PPO.

    ``ratio_cap`` delta (INTELLECT-2's two-sided clip, arXiv 2505.07291; TRL's ``delta``): the unclipped term uses
    ``min(r, delta)``, as TRL does. For ``delta >= 1 + eps_high`` this is the same loss as ``dual_clip = delta`` (an
    A > 0 term is clipped at 1 + eps_high before the cap matters); below that it also caps A > 0 tokens at delta."""
    clipped = torch.clamp(ratio, 1 - eps_low, 1 + eps_high)
    unclipped = ratio if ratio_cap is None else torch.clamp(ratio, max=ratio_cap)
    loss = -torch.min(unclipped * advantages, clipped * advantages)
    if dual_clip is not None:
        loss = torch.where(advantages < 0, torch.minimum(loss, -dual_clip * advantages), loss)
    return loss


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


def straight_through_ratio(log_ratio: torch.Tensor) -> torch.Tensor:
    """``exp(x - sg(x)) * sg(safe_ratio(x))``: the value of :func:`safe_ratio` (clamped to e^+-20), with the gradient
    d/dx = that finite value for *any* x. Used where a paper's gradient must survive extreme ratios (CE-GPPO): the
    clamped ratio alone has zero gradient beyond +-20. ``x`` must be finite (mask non-loss positions with ``where``).
    """
    return torch.exp(log_ratio - log_ratio.detach()) * safe_ratio(log_ratio.detach())


def where_mask(values: torch.Tensor, mask: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
    """``values`` on ``mask`` tokens, ``fill`` elsewhere, via ``torch.where`` (never a product: -inf * 0 is NaN); the
    gradient at non-mask positions is exactly zero."""
    return torch.where(mask.bool(), values, torch.as_tensor(fill, dtype=values.dtype, device=values.device))


def ends_with(ids: torch.Tensor, mask: torch.Tensor, tokens) -> torch.Tensor:
    """Bool ``(B,)``: whether each right-padded row's last valid token is one of ``tokens`` (an empty row: False)."""
    count = mask.sum(-1).long()
    last = ids.gather(-1, (count - 1).clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return (count > 0) & torch.isin(last, torch.as_tensor(list(tokens), device=ids.device))


def kl_terms(log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    """Elementwise ``p (log p - log q)`` from log-probabilities (sum them for KL(p || q)): exactly 0, with a zero
    gradient, where ``p = 0``; a ``q = 0`` under ``p > 0`` gives the true value inf.

    The difference is masked with ``torch.where`` *before* it multiplies ``p``: ``where(p > 0, p * (log_p - log_q),
    0)`` has the right value but a NaN gradient where ``log_p = -inf`` (the unused branch's derivative is
    ``log_p - log_q = -inf`` times a zero upstream gradient), and ``0 * -inf`` is NaN in value too. A NaN ``log_p`` is
    not taken for ``p = 0``: it gives NaN (``log_p > -inf`` is false for NaN, and the term was silently 0 while its
    gradient was NaN)."""
    support = log_p != -math.inf
    diff = where_mask(log_p - log_q, support)
    return where_mask(log_p.exp() * diff, support)


# -- KL estimators (ALGORITHMS.md convention 4), d = log pi_theta - log pi_ref per sampled token ------------------------

KL_ESTIMATORS = ("k1", "k2", "k3", "k3+")


def kl_estimate(per_token_logps: torch.Tensor, ref_per_token_logps: torch.Tensor, estimator: str = "k3",
                clamp: float | None = None) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from the sampled token's log-probs (Schulman, "Approximating KL
    divergence", 2020): ``k1 = d``; ``k2 = d^2 / 2``; ``k3 = e^-d - 1 + d`` (TRL's and GRPO's estimator, >= 0);
    ``k3+`` = the k3 value with the k2 gradient, ``k2 + sg(k3 - k2)`` (verl's "low_var_kl+" straight-through form:
    k2's gradient is the unbiased gradient of the KL). k3 clamps d below at -20 (the convention-6 clamp, as verl's
    low_var_kl), so it stays >= 0 and finite for any finite d, exact for d >= -20 and constant (zero gradient) below;
    k2 uses d clamped to [-20, 20] (exact inside, 200 beyond, zero gradient there) and k3+ takes its k2 gradient from
    the same clamped d. Where log pi_ref is -inf on a sampled token (d = +inf) the KL is infinite: k1, k3 and k3+ are
    then inf unless ``clamp`` bounds them (their gradients stay finite: 1, 1 and 0). ``clamp``: optionally clamp the
    estimate to [-clamp, clamp] (verl clamps k3 to +-10); ``None`` = no clamp (TRL). For k3+ the clamp bounds the
    *value* only and the gradient stays k2's (verl's ``kl_penalty``: ``k2 - sg(k2) + sg(clamped k3)``, "regardless
    of the kl value estimation"); clamping the straight-through sum would zero the gradient wherever k3 > clamp
    (d < -2.6 or d > 11 at verl's 10), exactly the tokens furthest from the reference.
    """
    d = per_token_logps - ref_per_token_logps
    # k2 (the estimate, or k3+'s gradient carrier) from d clamped to +-20: where log pi_ref is -inf on a sampled token
    # (d = +inf) an unclamped k2 is inf with gradient inf, k3+'s value inf - inf, and a clamp on the estimate then
    # back-propagates 0 * inf = NaN
    d_k2 = d.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    if estimator == "k1":
        kl = d
    elif estimator == "k2":
        kl = 0.5 * d_k2 * d_k2
    elif estimator in ("k3", "k3+"):
        # Clamp d itself (not only the exponent) on the side where e^-d overflows: clamping just the exponent makes
        # k3 = e^20 - 1 + d for d < -20, which *decreases* as d decreases (gradient +1 instead of 1 - e^-d << 0, so
        # the penalty pushes log pi further below log pi_ref) and reaches -inf at d = -inf. With d clamped the
        # estimate is the constant e^20 - 21 there (zero gradient, verl's low_var_kl clamp); exact for d >= -20.
        d_k3 = d.clamp(min=-LOG_RATIO_CLAMP)
        kl = torch.exp(-d_k3) - 1 + d_k3
        if estimator == "k3+":
            k2 = 0.5 * d_k2 * d_k2
            value = kl if clamp is None else kl.clamp(-clamp, clamp)  # the clamp bounds the value, not the gradient
            return k2 + (value - k2).detach()
    else:
        raise ValueError(f"unknown KL estimator {estimator!r}; choose one of {', '.join(KL_ESTIMATORS)}")
    return kl if clamp is None else kl.clamp(-clamp, clamp)


def kl_k3(per_token_logps: torch.Tensor, ref_per_token_logps: torch.Tensor) -> torch.Tensor:
    """k3 estimator of KL(pi || pi_ref) per sampled token: exp(ref - logp) - (ref - logp) - 1 (>= 0, unbiased)."""
    return kl_estimate(per_token_logps, ref_per_token_logps, "k3")


# -- aggregation: (per_token_loss, mask) -> scalar, before gradient-accumulation scaling ----------------------------


def seq_mean_token_mean(per_token_loss: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean over each sequence's tokens, then over sequences (GRPO paper, GSPO, SAPO; TRL ``grpo``). Every row counts
    in the mean over sequences, also one whose tokens are all masked (it contributes 0), as TRL; rows a group filter
    masked are taken out of that count by the caller (``trl_ext.trainers.grpo.per_kept_row``)."""
    return row_token_means(per_token_loss, mask).mean()


def row_token_sums(per_token_loss: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``(B,)``: each row's loss summed over its valid tokens (0 for a row without any)."""
    return where_mask(per_token_loss, mask).sum(-1)


def row_token_means(per_token_loss: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``(B,)``: each row's loss averaged over its valid tokens (0 for a row without any)."""
    return row_token_sums(per_token_loss, mask) / mask.sum(-1).clamp(min=1.0)


def nonempty_row_mean(row_losses: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of per-row losses over the rows with at least one valid token (verl's ``agg_loss`` seq-mean modes and
    OpenRLHF's loss batch info leave fully masked rows out of the count); 0 when every row is empty."""
    nonempty = mask.sum(-1) > 0
    total = torch.where(nonempty, row_losses, torch.zeros_like(row_losses)).sum()
    return total / nonempty.sum().clamp(min=1)


def seq_mean_token_sum(per_token_loss: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Sum over each sequence's tokens, then mean over sequences (verl ``seq-mean-token-sum``)."""
    return row_token_sums(per_token_loss, mask).mean()


def token_sum(per_token_loss: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Sum over all loss tokens of the micro-batch (verl/NeMo-RL ``token-sum``: no normalisation at all)."""
    return where_mask(per_token_loss, mask).sum()


def token_mean(per_token_loss: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Sum over all tokens / number of tokens in this micro-batch (TRL ``bnpo``)."""
    return where_mask(per_token_loss, mask).sum() / mask.sum().clamp(min=1.0)


def constant_normalized(per_token_loss: torch.Tensor, mask: torch.Tensor, max_length: int) -> torch.Tensor:
    """Sum over tokens / (B * L) with a constant L (Dr. GRPO, arXiv 2503.20783; TRL ``dr_grpo``)."""
    return where_mask(per_token_loss, mask).sum() / (per_token_loss.size(0) * max_length)


def sequence_mean_nll(per_token_nll: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-sequence mean NLL, then mean over sequences (SFT 'per-conversation' normalisation)."""
    return seq_mean_token_mean(per_token_nll, mask)


# -- preference -----------------------------------------------------------------------------------------------------


def dpo_sigmoid_loss(chosen_logratios: torch.Tensor, rejected_logratios: torch.Tensor, beta: float) -> torch.Tensor:
    """DPO (arXiv 2305.18290): -log sigmoid(beta * ((log pi/pi_ref)(y_w) - (log pi/pi_ref)(y_l))), per example."""
    return -F.logsigmoid(beta * (chosen_logratios - rejected_logratios))


# -- the KL-to-reference loss term ------------------------------------------------------------------------------------


class KLTerm:
    """How the GRPO loss pipeline forms its per-token KL-to-reference term ``beta * KL_t`` (added when ``args.beta``
    is non-zero). ``estimator``: one of :data:`KL_ESTIMATORS` (default ``k3``, GRPO arXiv 2402.03300 and TRL);
    ``bias_correction``: the weight on the estimate: ``True``, the importance ratio pi_theta/pi_old (TRL's
    ``use_bias_correction_kl``, on by default in TRL 1.16; it makes the estimate unbiased for samples from pi_old);
    ``False``, none; ``"score"``, NeMo-RL's ``exp(log pi - sg(log pi))``, value 1, so the term's value is the estimate
    and its gradient gains the score-function part ``KL_t * grad log pi`` (on-policy it equals the ratio weight).
    ``clamp``: optional symmetric clamp (verl uses 10 for k3; ``None`` = TRL, no clamp), of the estimate before the
    weight (``clamp_weighted`` false, the default: ``w * clamp(KL)``) or of the weighted value (true: NeMo-RL's and
    slime's ``clamp(w * KL)``, zero gradient where it binds)."""

    __slots__ = ("estimator", "bias_correction", "clamp", "coef", "clamp_weighted")

    def __init__(self, estimator: str = "k3", bias_correction: bool | str = True, clamp: float | None = None,
                 coef: float | None = None, clamp_weighted: bool = False):
        if estimator not in KL_ESTIMATORS:
            raise ValueError(f"unknown KL estimator {estimator!r}; choose one of {', '.join(KL_ESTIMATORS)}")
        if bias_correction not in (True, False, "score"):
            raise ValueError(f"unknown KL bias correction {bias_correction!r}; choose true, false or score")
        self.estimator, self.bias_correction, self.clamp, self.coef = estimator, bias_correction, clamp, coef
        self.clamp_weighted = clamp_weighted

    def __repr__(self) -> str:
        return (f"KLTerm({self.estimator!r}, bias_correction={self.bias_correction}, clamp={self.clamp}, "
                f"coef={self.coef}, clamp_weighted={self.clamp_weighted})")

    def weight(self, beta: float) -> float:
        """The loss coefficient: ``coef`` when set (0 = no loss term, e.g. a KL folded into the reward only, with
        ``args.beta`` non-zero just so TRL computes reference log-probs), else ``args.beta``."""
        return beta if self.coef is None else self.coef

    def is_trl(self) -> bool:
        """True when the term is exactly TRL's (k3, ``args.beta``, no clamp; a true/false bias correction is TRL's own
        field)."""
        return self.estimator == "k3" and self.clamp is None and self.coef is None and self.bias_correction != "score"

    def per_token(self, per_token_logps: torch.Tensor, ref_per_token_logps: torch.Tensor,
                  ratio: torch.Tensor | None = None) -> torch.Tensor:
        """The per-token KL term before ``beta``; ``ratio`` (pi_theta/pi_old, with gradient, as TRL) is the weight
        when ``bias_correction`` is true."""
        if self.bias_correction == "score":
            weight = torch.exp(per_token_logps - per_token_logps.detach())
        else:
            weight = ratio if self.bias_correction and ratio is not None else None
        if weight is None or self.clamp is None or not self.clamp_weighted:
            kl = kl_estimate(per_token_logps, ref_per_token_logps, self.estimator, self.clamp)
            return kl if weight is None else kl * weight
        # clamp(w * KL): the weighted estimate where its value lies inside the clamp, the constant bound elsewhere; a
        # non-finite estimate (log pi_ref = -inf) is zeroed before the product, whose backward would otherwise give
        # 0 * inf = NaN even on the branch ``where`` discards
        kl = kl_estimate(per_token_logps, ref_per_token_logps, self.estimator)
        value = kl.detach() * weight.detach()
        inside = value.abs() <= self.clamp
        safe = torch.where(inside, kl, torch.zeros_like(kl))
        return torch.where(inside, safe * weight, torch.sign(value) * self.clamp)


# -- truncated sampling (top-k / top-p / min-p) -----------------------------------------------------------------------


def truncated_logits(logits: torch.Tensor, temperature: float = 1.0, top_k: int | None = None,
                     top_p: float | None = None, min_p: float | None = None) -> torch.Tensor:
    """The logits of the distribution a sampler with these settings actually draws from: divided by ``temperature``,
    then, in transformers' order, top-k (keep the k largest), top-p (keep the smallest set of most likely tokens whose
    mass reaches p: a token is kept when the mass of the tokens ranked above it is < p) and min-p (keep tokens with
    probability >= min_p * the top probability), each computed on the distribution the previous step left. Removed
    tokens get -inf, so ``log_softmax`` of the result is the renormalised truncated distribution. At least one token
    (the most likely) is always kept. ``top_k`` 0/None, ``top_p`` None/1 and ``min_p`` None/0 switch a step off."""
    x = logits.float() / temperature
    neg_inf = torch.tensor(float("-inf"), dtype=x.dtype, device=x.device)
    if top_k and top_k < x.shape[-1]:
        kth = torch.topk(x, top_k, dim=-1).values[..., -1:]
        x = torch.where(x < kth, neg_inf, x)
    if top_p is not None and top_p < 1.0:
        probs = torch.softmax(x, dim=-1)
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        mass_above = sorted_probs.cumsum(-1) - sorted_probs
        keep_sorted = mass_above < top_p
        keep_sorted[..., 0] = True
        keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
        x = torch.where(keep, x, neg_inf)
    if min_p:
        probs = torch.softmax(x, dim=-1)
        keep = probs >= min_p * probs.amax(-1, keepdim=True)
        x = torch.where(keep, x, neg_inf)
    return x


def truncated_token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, **sampling) -> torch.Tensor:
    """Log-probs of ``tokens`` ``(B, T)`` under the truncated, renormalised sampling distribution of ``logits``
    ``(B, T, V)`` (:func:`truncated_logits`); -inf for a token outside the kept support."""
    return torch.log_softmax(truncated_logits(logits, **sampling), dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
