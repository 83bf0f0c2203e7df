"""Pure reward formulas of the reward family (ALGORITHMS.md items 10, 11, 14, 15, 17).

Everything here is a small function of tensors or numbers with no trainer state, so tests can pin each formula to
the numbers in ALGORITHMS.md. Length arguments are completion token counts.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

# ----------------------------------------------------------------------------------------------------------------
# Item 17: length-based shaping
# ----------------------------------------------------------------------------------------------------------------


def kimi_length_reward(lengths: torch.Tensor, correct: torch.Tensor, group_size: int) -> torch.Tensor:
    """Kimi k1.5 group length reward (arXiv 2501.12599).

    Per group of ``group_size`` consecutive rows: lambda_i = 0.5 - (len_i - min_len) / (max_len - min_len); the reward is
    lambda_i for correct samples and min(0, lambda_i) for wrong ones. A group whose samples all have one length gets 0
    (the formula is 0/0 there; Kimi's text does not say, 0 leaves the task reward unchanged).
    """
    lengths = lengths.to(torch.float64).view(-1, group_size)
    correct = correct.to(torch.bool).view(-1, group_size)
    low = lengths.min(dim=1, keepdim=True).values
    span = lengths.max(dim=1, keepdim=True).values - low
    lam = torch.where(span > 0, 0.5 - (lengths - low) / span.clamp(min=1e-12), torch.zeros_like(lengths))
    return torch.where(correct, lam, lam.clamp(max=0.0)).view(-1)


def cosine_length_reward(
    lengths: torch.Tensor,
    correct: torch.Tensor,
    max_length: int,
    correct_range: tuple[float, float] = (2.0, 1.0),
    wrong_range: tuple[float, float] = (-10.0, 0.0),
    exceed_reward: float = -10.0,
    beyond: str = "exceed",
    truncated: torch.Tensor | None = None,
) -> torch.Tensor:
    """Cosine length reward (Yeo et al., arXiv 2502.03373): R(L) = r_L + (r_0 - r_L)(1 + cos(pi L / L_max)) / 2.

    ``(r_0, r_L)`` is ``correct_range`` for correct samples (short correct answers earn more) and ``wrong_range`` for
    wrong ones (longer thinking is penalised less). This *is* the task reward (it replaces the 1/0 correctness), not a
    bonus on top of it. ``beyond`` says what L > L_max gets: ``exceed`` (the paper: ``exceed_reward``), ``clamp``
    (L clamped to L_max, so r_L: continuous at L_max), ``extend`` (the formula continued, cos is periodic: open-r1's
    ``get_cosine_scaled_reward`` neither clamps nor penalises), ``truncated`` (``exceed_reward`` also for every row
    flagged in ``truncated``, a completion the generation budget cut: the paper's released code gives it to a
    generation within 16 tokens of its budget, so with L_max equal to the budget a cut completion is not scored r_L).
    """
    if beyond not in COSINE_BEYOND:
        raise ValueError(f"unknown cosine beyond-max rule {beyond!r}; choose one of {', '.join(COSINE_BEYOND)}")
    lengths = lengths.to(torch.float64)
    correct = correct.to(torch.bool)
    r0 = torch.where(correct, correct_range[0], wrong_range[0]).to(torch.float64)
    rl = torch.where(correct, correct_range[1], wrong_range[1]).to(torch.float64)
    progress = lengths.clamp(max=max_length) if beyond == "clamp" else lengths
    value = rl + 0.5 * (r0 - rl) * (1.0 + torch.cos(math.pi * progress / max_length))
    if beyond not in ("exceed", "truncated"):
        return value
    over = lengths > max_length
    if beyond == "truncated":
        if truncated is None:
            raise ValueError("cosine beyond-max rule 'truncated' needs the truncated flags")
        over = over | truncated.to(device=over.device, dtype=torch.bool)
    return torch.where(over, torch.full_like(value, exceed_reward), value)


COSINE_BEYOND = ("exceed", "clamp", "extend", "truncated")


def dapo_overlong_penalty(lengths: torch.Tensor, max_length: int, cache_length: int, cap: bool = True,
                          factor: float = 1.0) -> torch.Tensor:
    """DAPO soft overlong punishment (arXiv 2503.14476), added to the +-1 correctness reward.

    0 if |y| <= L_max - L_cache; ``factor * ((L_max - L_cache) - |y|) / L_cache`` beyond that; ``cap`` (the paper):
    ``-factor`` beyond L_max; ``cap=False`` (verl's ``DAPORewardManager``, ``min(-exceed / L_cache * factor, 0)``):
    the linear penalty continues below ``-factor``. ``factor``: verl ``overlong_buffer.penalty_factor`` (paper 1).
    """
    lengths = lengths.to(torch.float64)
    expected = max_length - cache_length
    inside = factor * (expected - lengths) / cache_length
    out = torch.where(lengths <= expected, torch.zeros_like(lengths), inside)
    if not cap:
        return out
    return torch.where(lengths > max_length, torch.full_like(lengths, -factor), out)


def stop_penalties(lengths: torch.Tensor, stopped: torch.Tensor, max_length: int | None, truncation: float,
                   no_stop: float) -> torch.Tensor:
    """Fixed penalties for completions that did not end on their own: ``truncation`` when the completion used the
    whole budget (``length >= max_length``, the generation limit cut it) and ``no_stop`` when its last token is not
    an end-of-sequence token (TRL's ``mask_truncated_completions`` test, which also covers stop strings and tool-call
    limits); a completion cut at the limit gets both. Values are added to the reward (pass negative numbers)."""
    lengths = lengths.to(torch.float64)
    out = torch.zeros_like(lengths)
    if truncation and max_length is not None:
        out = out + torch.where(lengths >= max_length, truncation, 0.0)
    if no_stop:
        out = out + torch.where(stopped.to(torch.bool), 0.0, no_stop)
    return out


def budget_reward(lengths: torch.Tensor, task_reward: torch.Tensor, b0: torch.Tensor, tau: float) -> torch.Tensor:
    """Hard budget: -1 if |y| > tau * b0 (b0 a per-problem reference length), else the task reward."""
    lengths = lengths.to(torch.float64)
    over = lengths > tau * b0.to(torch.float64)
    return torch.where(over, torch.full_like(lengths, -1.0), task_reward.to(torch.float64))


def l1_exact_reward(lengths: torch.Tensor, correct: torch.Tensor, target: torch.Tensor, alpha: float) -> torch.Tensor:
    """L1-Exact (LCPO, arXiv 2503.04697): r = 1[correct] - alpha * |n_gold - n_y|."""
    lengths = lengths.to(torch.float64)
    return correct.to(torch.float64) - alpha * (target.to(torch.float64) - lengths).abs()


def l1_max_reward(
    lengths: torch.Tensor, correct: torch.Tensor, target: torch.Tensor, alpha: float, delta: float
) -> torch.Tensor:
    """L1-Max (LCPO, arXiv 2503.04697): r = 1[correct] * clip(alpha * (n_gold - n_y) + delta, 0, 1)."""
    lengths = lengths.to(torch.float64)
    return correct.to(torch.float64) * (alpha * (target.to(torch.float64) - lengths) + delta).clamp(0.0, 1.0)


# ----------------------------------------------------------------------------------------------------------------
# Item 10: Bradley-Terry; item 11: ORM / PRM
# ----------------------------------------------------------------------------------------------------------------


def bradley_terry_loss(chosen: torch.Tensor, rejected: torch.Tensor, margin: torch.Tensor | float = 0.0) -> torch.Tensor:
    """Per-pair BT loss -log sigmoid(r_w - r_l - m) (margin m: Llama 2; 0 for InstructGPT)."""
    return -torch.nn.functional.logsigmoid(chosen - rejected - margin)


def math_shepherd_labels(num_correct: int, num_completions: int) -> tuple[float, float]:
    """Math-Shepherd step labels (arXiv 2312.08935) from N completer rollouts: (hard, soft).

    Hard y^HE = 1 if any rollout from the step reaches the gold answer; soft y^SE = #correct / N.
    """
    if num_completions <= 0 or not 0 <= num_correct <= num_completions:
        raise ValueError(f"need 0 <= correct ({num_correct}) <= completions ({num_completions}), completions > 0")
    return float(num_correct > 0), num_correct / num_completions


def aggregate_step_scores(scores: torch.Tensor, how: str = "product", dim: int = -1) -> torch.Tensor:
    """Solution score from per-step correctness probabilities (Lightman, arXiv 2305.20050): product or min."""
    return STEP_AGGREGATIONS[how](scores, dim)


STEP_AGGREGATIONS = {
    "product": lambda s, d: s.prod(dim=d),
    "min": lambda s, d: s.min(dim=d).values,
    "last": lambda s, d: s.select(d, -1),
}

# ----------------------------------------------------------------------------------------------------------------
# Item 14: checklist; item 15: Copeland win-rate
# ----------------------------------------------------------------------------------------------------------------


def checklist_score(weights: Sequence[float], scores: Sequence[float]) -> float:
    """RLCF checklist reward (arXiv 2507.18624): R = sum_j w_j s_j / sum_j w_j (item scores s_j in [0, 100])."""
    if len(weights) != len(scores) or not weights:
        raise ValueError("checklist needs one score per item and at least one item")
    total = float(sum(weights))
    if total <= 0:
        raise ValueError("checklist weights must sum to a positive number")
    return sum(w * s for w, s in zip(weights, scores)) / total


def copeland_win_rates(preference: torch.Tensor) -> torch.Tensor:
    """Copeland win rate of each of G samples from a (G, G) matrix P[i, j] = P(i beats j) (diagonal ignored).

    A pairwise win counts 1, a tie (P = 0.5) counts 1/2, a loss 0; the rate is the mean over the G - 1 opponents
    (SERL, arXiv 2511.07922). With verdicts A>B, A>C, B>C the rates are [1.0, 0.5, 0.0].
    """
    g = preference.shape[0]
    if g < 2:
        return torch.full((g,), 0.5, dtype=torch.float64)
    p = preference.to(torch.float64)
    wins = torch.where(p > 0.5, 1.0, torch.where(p < 0.5, 0.0, 0.5)).to(torch.float64)
    wins.fill_diagonal_(0.0)
    return wins.sum(dim=1) / (g - 1)


def judge_step_label(score: float | None, low: float, high: float, soft: bool, threshold: float,
                     fallback: float) -> float:
    """Step label from a judge's verdict score on ``[low, high]`` (LLM-as-judge step labels, Qwen PRM lessons,
    arXiv 2501.07301).

    soft: the normalised score (s - low) / (high - low); hard: 1.0 if s >= ``threshold`` (on the judge's scale) else
    0.0; an unparsable verdict (``score is None``) gets ``fallback``.
    """
    if score is None:
        return float(fallback)
    if soft:
        return (score - low) / (high - low)
    return float(score >= threshold)
