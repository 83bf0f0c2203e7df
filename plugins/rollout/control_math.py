"""Pure functions of the rollout-control plugins: pass-rate filtering and curriculum order (``pass_rate_filter``),
the partial-rollout stop rule and staleness (``partial_rollout``), environment mixing (``multi_env``), self-play
rewards (``self_play``) and pivot selection (``pivot_rl``)."""

from __future__ import annotations

import math
import warnings
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
    earlier environment): each within one of its exact share."""
    norm = sum(weights)
    exact = [w / norm * total for w in weights]
    counts = [math.floor(x) for x in exact]
    remainders = sorted(range(len(weights)), key=lambda i: (-(exact[i] - counts[i]), i))
    for i in remainders[: total - sum(counts)]:
        counts[i] += 1
    return counts


def batch_mixture_counts(weights: Sequence[float], batch_prompts: int, num_batches: int) -> list[list[int]]:
    """Per-batch environment counts whose running totals follow ``w_e / sum w`` exactly in the long run.

    Each batch gives every environment the floor of its share ``s_e = w_e / sum w * batch_prompts`` and the prompts
    left over to the environments furthest behind their running target ``(b + 1) s_e`` (ties to the earlier one).
    Rounding every batch alike would keep one bias for the whole run (weights [0.7, 0.3] in batches of 2: 1 + 1 every
    time, a 50/50 run); carried over, each batch is within one prompt of its share and each environment's running count
    within one of its target. The first batch is ``mixture_counts(weights, batch_prompts)``.
    """
    norm = sum(weights)
    share = [w / norm * batch_prompts for w in weights]
    given = [0] * len(weights)
    out = []
    for b in range(num_batches):
        counts = [math.floor(s + 1e-9) for s in share]
        # rounded so that equal shortfalls compare equal (float error must not decide a tie)
        behind = [round((b + 1) * s - g - c, 9) for s, g, c in zip(share, given, counts, strict=True)]
        for env in sorted(range(len(share)), key=lambda e: (-behind[e], e))[: batch_prompts - sum(counts)]:
            counts[env] += 1
        given = [g + c for g, c in zip(given, counts, strict=True)]
        out.append(counts)
    return out


def interleave_environments(sizes: Sequence[int], weights: Sequence[float], batch_prompts: int, num_batches: int,
                            seed: int) -> list[tuple[int, int]]:
    """``(environment, row)`` pairs, ``batch_prompts`` per batch for ``num_batches`` batches: batch b holds
    ``batch_mixture_counts(...)[b]`` prompts of each environment (shuffled within the batch); rows of an environment
    are drawn by a seeded permutation, re-shuffled each time the environment is exhausted."""
    rng = np.random.default_rng(seed)
    orders = [list(rng.permutation(n)) for n in sizes]
    cursors = [0] * len(sizes)
    out: list[tuple[int, int]] = []
    for counts in batch_mixture_counts(weights, batch_prompts, num_batches):
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
    return within_band(p_hat, 0.5 - delta, 0.5 + delta)


def within_band(p_hat: float, low: float, high: float) -> bool:
    """``low <= p_hat <= high``, with a 1e-12 margin so that 0.5 + 0.2 keeps a p_hat of 7/10."""
    return low - 1e-12 <= p_hat <= high + 1e-12


def r_zero_code_reward(p_hat: float | None, share: float) -> float:
    """The challenger reward of R-Zero's released code (``caller_penalty.py``): ``min(p_hat, 1 - p_hat) - share`` for a
    well-formed problem, ``-1 - share`` for a malformed one (``p_hat`` None), unclipped. Half the paper's uncertainty
    term, so the repetition share weighs twice as much against it as in the paper's ``max(0, r_unc - share)``."""
    if p_hat is None:
        return -1.0 - share
    return min(p_hat, 1.0 - p_hat) - share


def repetition_penalties(questions: Sequence[str], clustering: str = "exact", threshold: float = 0.5) -> list[float]:
    """R-Zero's batch repetition penalty ``|C_k| / B``: the share of the batch (all ``B`` questions) in each question's
    cluster, so a question unique in the batch pays ``1 / B``. ``clustering``: ``exact`` (identical after whitespace
    normalisation) or ``bleu`` (R-Zero: :func:`bleu_clusters` at ``threshold``)."""
    if not questions:
        return []
    if clustering == "bleu":
        labels = bleu_clusters(questions, threshold)
    elif clustering == "exact":
        labels = [" ".join(q.split()) for q in questions]
    else:
        raise ValueError(f"clustering must be 'exact' or 'bleu', got {clustering!r}")
    counts = Counter(labels)
    return [counts[label] / len(labels) for label in labels]


def bleu_distance_matrix(questions: Sequence[str]) -> list[list[float]]:
    """R-Zero's pairwise distances ``1 - BLEU``: NLTK's sentence BLEU (4-gram, smoothing method 1) on whitespace tokens,
    the earlier question of a pair as the hypothesis and the later as the reference (BLEU is not symmetric; R-Zero
    fills one triangle and mirrors it), 0 on the diagonal. A one-token question has BLEU 0.18 with itself, so short
    formal problems never fall within a 0.5 distance: use ``exact`` clusters for them."""
    from nltk.translate.bleu_score import SmoothingFunction, sentence_bleu

    smoothing = SmoothingFunction().method1
    n = len(questions)
    tokens = [q.split() for q in questions]
    dist = [[0.0] * n for _ in range(n)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # NLTK warns on zero n-gram overlaps, which smoothing handles
        for i in range(n):
            for j in range(i + 1, n):
                dist[i][j] = dist[j][i] = 1.0 - sentence_bleu([tokens[j]], tokens[i], smoothing_function=smoothing)
    return dist


def bleu_clusters(questions: Sequence[str], threshold: float = 0.5) -> list[int]:
    """Cluster labels from average-linkage agglomerative clustering of :func:`bleu_distance_matrix` (scikit-learn, as
    R-Zero): clusters stop merging at a linkage distance of ``threshold`` or more."""
    if len(questions) < 2:
        return [0] * len(questions)
    from sklearn.cluster import AgglomerativeClustering

    clustering = AgglomerativeClustering(n_clusters=None, distance_threshold=threshold, metric="precomputed",
                                         linkage="average")
    return [int(x) for x in clustering.fit_predict(np.array(bleu_distance_matrix(questions)))]


# -- PivotRL (ALGORITHMS.md item 9) ------------------------------------------------------------------------------------


def is_pivot(profile: Sequence[float], max_success: float) -> bool:
    """Keep a turn iff its K profile rewards vary (``var > 0``) and their mean is below ``max_success``."""
    mean = sum(profile) / len(profile)
    variance = sum((r - mean) ** 2 for r in profile) / len(profile)
    return variance > 0 and mean < max_success
