"""Pure functions of the rollout-control plugins: pass-rate filtering and curriculum order (``pass_rate_filter``),
the partial-rollout stop rule and staleness (``partial_rollout``), environment mixing (``multi_env``), self-play
rewards (``self_play``) and pivot selection (``pivot_rl``)."""

from __future__ import annotations

import math
from collections import Counter
from typing import Literal, Sequence

import numpy as np

CurriculumOrder = Literal["easy_to_hard", "hard_to_easy", "none"]


# -- pass-rate filtering (ALGORITHMS.md item 46) -----------------------------------------------------------------------


def pass_rates(successes: Sequence[Sequence[bool]]) -> list[float]:
    """``p_hat(x) = (1/k) sum_j 1[correct(y_j)]`` for each prompt's ``k`` sampled completions."""
    return [sum(bool(s) for s in row) / len(row) if len(row) else 0.0 for row in successes]


def within_bounds(rate: float, lower: float, upper: float, inclusive: bool) -> bool:
    """``lower < p < upper`` (exclusive, the default) or ``lower <= p <= upper``."""
    return lower <= rate <= upper if inclusive else lower < rate < upper


def select_and_order(rates: Sequence[float], lower: float, upper: float, inclusive: bool = False,
                     order: CurriculumOrder = "easy_to_hard") -> list[int]:
    """Indices of the prompts kept by the bounds, in curriculum order.

    ``easy_to_hard`` sorts by pass rate descending (Nemotron 3 Super / Kimi k1.5 curriculum), ``hard_to_easy``
    ascending, ``none`` keeps dataset order. Ties keep dataset order (a stable sort), so the order is reproducible.
    """
    kept = [i for i, p in enumerate(rates) if within_bounds(p, lower, upper, inclusive)]
    if order == "easy_to_hard":
        return sorted(kept, key=lambda i: -rates[i])
    if order == "hard_to_easy":
        return sorted(kept, key=lambda i: rates[i])
    return kept


def zero_variance_fraction(successes: Sequence[Sequence[float]]) -> float:
    """Share of groups whose rewards all agree (no GRPO signal)."""
    if not successes:
        return 0.0
    return sum(len(set(row)) <= 1 for row in successes) / len(successes)


# -- partial rollouts (ALGORITHMS.md item 44) --------------------------------------------------------------------------


def finish_target(num_trajectories: int, fraction: float) -> int:
    """``ceil(lambda * N)``: generation stops once this many of the batch's ``N`` trajectories have finished."""
    return max(1, math.ceil(fraction * num_trajectories - 1e-9))


def versions_per_trajectory(versions: Sequence[Sequence[int]]) -> list[int]:
    """Number of distinct policy versions that produced each trajectory's tokens (1 = fully on-policy)."""
    return [len(set(v)) for v in versions]


def stale_token_mask(versions: Sequence[int], current: int) -> list[bool]:
    """True for tokens sampled by a policy older than ``current`` (the segment ``mask_offpolicy`` removes)."""
    return [v < current for v in versions]


# -- multi-environment mixing (ALGORITHMS.md item 49) ------------------------------------------------------------------


def mixture_counts(weights: Sequence[float], total: int) -> list[int]:
    """Integer counts proportional to ``weights`` summing to ``total`` (largest-remainder rounding, ties to the
    earlier environment), so every batch holds each environment in its expected proportion."""
    norm = sum(weights)
    exact = [w / norm * total for w in weights]
    counts = [math.floor(x) for x in exact]
    remainders = sorted(range(len(weights)), key=lambda i: (-(exact[i] - counts[i]), i))
    for i in remainders[: total - sum(counts)]:
        counts[i] += 1
    return counts


def interleave_environments(sizes: Sequence[int], weights: Sequence[float], batch_prompts: int, num_batches: int,
                            seed: int) -> list[tuple[int, int]]:
    """``(environment, row)`` pairs, ``batch_prompts`` per batch for ``num_batches`` batches: each batch holds
    ``mixture_counts(weights, batch_prompts)`` prompts of each environment (shuffled within the batch); rows of an
    environment are drawn by a seeded permutation, re-shuffled each time the environment is exhausted."""
    rng = np.random.default_rng(seed)
    counts = mixture_counts(weights, batch_prompts)
    orders = [list(rng.permutation(n)) for n in sizes]
    cursors = [0] * len(sizes)
    out: list[tuple[int, int]] = []
    for _ in range(num_batches):
        batch = []
        for env, count in enumerate(counts):
            for _ in range(count):
                if cursors[env] == sizes[env]:
                    orders[env], cursors[env] = list(rng.permutation(sizes[env])), 0
                batch.append((env, int(orders[env][cursors[env]])))
                cursors[env] += 1
        out += [batch[i] for i in rng.permutation(len(batch))]
    return out


# -- self-play (ALGORITHMS.md item 50) ---------------------------------------------------------------------------------


def majority_vote(answers: Sequence[str]) -> tuple[str | None, float]:
    """The most frequent answer (ties: the one seen first) and ``p_hat``, the fraction of answers agreeing with it.
    Empty answers (unparseable) count in the denominator but never win."""
    valid = [a for a in answers if a]
    if not valid:
        return None, 0.0
    counts = Counter(valid)
    best = max(counts.values())
    label = next(a for a in valid if counts[a] == best)
    return label, best / len(answers)


def verified_solve_rate(answers: Sequence[str], label: str | None) -> tuple[str | None, float]:
    """The verified label and the solve rate, the fraction of answers equal to it (Absolute Zero's ``r_solve``);
    ``(None, 0.0)`` when the verifier gave no label (not a valid problem)."""
    if label is None or not answers:
        return None, 0.0
    return label, sum(a == label for a in answers) / len(answers)


def uncertainty_reward(p_hat: float) -> float:
    """R-Zero's challenger reward ``r_unc = 1 - 2 |p_hat - 1/2|`` (1 at 50% solver agreement, 0 at 0 or 1)."""
    return 1.0 - 2.0 * abs(p_hat - 0.5)


def learnability_reward(mean_solve_rate: float) -> float:
    """Absolute Zero's proposer reward: ``1 - r_solve`` when ``0 < r_solve < 1``, else 0."""
    return 1.0 - mean_solve_rate if 0.0 < mean_solve_rate < 1.0 else 0.0


def in_informative_band(p_hat: float, delta: float) -> bool:
    """R-Zero's solver filter ``|p_hat - 1/2| <= delta``."""
    return abs(p_hat - 0.5) <= delta + 1e-12


def repetition_penalties(questions: Sequence[str]) -> list[float]:
    """Batch repetition penalty: ``|cluster| / batch`` for each question, clustering exact duplicates (after
    whitespace normalisation); a question unique in the batch pays ``1 / batch``. R-Zero clusters by BLEU distance;
    exact-match clusters are the special case for short formal problems."""
    keys = [" ".join(q.split()) for q in questions]
    counts = Counter(keys)
    return [counts[k] / len(keys) for k in keys]


# -- PivotRL (ALGORITHMS.md item 9) ------------------------------------------------------------------------------------


def is_pivot(profile: Sequence[float], max_success: float) -> bool:
    """Keep a turn iff its K profile rewards vary (``var > 0``) and their mean is below ``max_success``."""
    mean = sum(profile) / len(profile)
    variance = sum((r - mean) ** 2 for r in profile) / len(profile)
    return variance > 0 and mean < max_success
