"""Weight-space merging math: averaging weights, EMA weights, SLERP of task vectors, LITI. Pure tensor functions.

Shared by ``checkpoint_average``, ``warp`` and the reward family's ``warm`` (one copy of the averaging rule). Every
merge is computed in float64 and cast back to the output dtype, so averaging K float32 checkpoints does not lose bits
to K roundings. SLERP has two forms: on vectors (:func:`slerp`, :func:`slerp_many`, :func:`liti`: the paper's
formulas, what the tests check numbers against) and on the task vectors' Gram matrix
(:func:`slerp_fold_coefficients`: what the streamed merge uses, shown equal to the vector form in the tests).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch


class ArchitectureMismatchError(ValueError):
    """Models (or checkpoints) to be merged do not share tensor names or shapes."""


class ZeroTaskVectorError(ValueError):
    """A task vector of one tensor is exactly zero, so its angle (and SLERP) is undefined."""


class NonFiniteWeightsError(ValueError):
    """A tensor to be merged holds NaN or Inf, so every merge of it (average, angle, SLERP) is undefined."""


class MalformedWeightsError(ValueError):
    """A model folder's weight files cannot be read as safetensors weights (bad index, unreadable or lying shard,
    an unsupported dtype)."""


# ----------------------------------------------------------------------------------------------------------------
# Weights of an average
# ----------------------------------------------------------------------------------------------------------------


def normalized_weights(count: int, weights: Sequence[float] | None = None) -> list[float]:
    """``w_k / sum(w)``; uniform ``1/K`` when ``weights`` is None. Weights must be finite, >= 0, with a positive sum."""
    if count == 0:
        raise ValueError("nothing to average")
    w = [1.0] * count if weights is None else [float(x) for x in weights]
    if len(w) != count:
        raise ValueError(f"{len(w)} weights for {count} models")
    if not all(math.isfinite(x) and x >= 0 for x in w) or sum(w) <= 0:
        raise ValueError(f"weights must be finite, non-negative and not all zero, got {w}")
    total = sum(w)
    return [x / total for x in w]


def ema_weights(count: int, decay: float) -> list[float]:
    """Closed-form weights of an EMA over ``count`` ordered checkpoints (oldest first).

    ``e_1 = theta_1``, ``e_k = decay * e_{k-1} + (1 - decay) * theta_k``, so ``w_1 = decay^(K-1)`` and
    ``w_k = (1 - decay) * decay^(K-k)`` for k >= 2; they sum to 1. decay 0 keeps the newest only; decay 1 the oldest.
    """
    if count == 0:
        raise ValueError("nothing to average")
    if not 0.0 <= decay <= 1.0:
        raise ValueError(f"EMA decay must be in [0, 1], got {decay}")
    return [decay ** (count - 1)] + [(1.0 - decay) * decay ** (count - k) for k in range(2, count + 1)]


# ----------------------------------------------------------------------------------------------------------------
# Per-tensor merges
# ----------------------------------------------------------------------------------------------------------------


def weighted_average(tensors: Sequence[torch.Tensor], weights: Sequence[float],
                     out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``sum_k w_k theta_k`` accumulated in float64 (``weights`` already normalised), cast to ``out_dtype``."""
    acc = torch.zeros(tensors[0].shape, dtype=torch.float64)
    for w, t in zip(weights, tensors, strict=True):
        acc.add_(t.detach().to("cpu", torch.float64), alpha=w)
    return acc.to(out_dtype or tensors[0].dtype)


def coefficients_from_cos(cos: float, t: float, colinear_threshold: float = 0.9995) -> tuple[float, float, bool]:
    """SLERP's ``(sin((1-t) W) / sin W, sin(t W) / sin W)`` for ``cos W``, or ``(1-t, t)`` when ``|cos W|`` exceeds the
    threshold (see :func:`slerp_coefficients`); the flag says whether the linear fallback was used."""
    if not math.isfinite(cos):
        raise NonFiniteWeightsError(f"the cosine between two task vectors is {cos} (NaN or Inf in the weights)")
    if abs(cos) > colinear_threshold:
        return 1.0 - t, t, True
    omega = math.acos(cos)
    sin_omega = math.sin(omega)
    return math.sin((1.0 - t) * omega) / sin_omega, math.sin(t * omega) / sin_omega, False


def slerp_coefficients(delta_1: torch.Tensor, delta_2: torch.Tensor, t: float,
                       colinear_threshold: float = 0.9995) -> tuple[float, float, bool]:
    """Coefficients ``(c_1, c_2)`` of ``slerp(delta_1, delta_2; t) = c_1 delta_1 + c_2 delta_2`` and whether the linear
    fallback was used.

    ``Omega = arccos(<d1, d2> / (|d1| |d2|))``; ``c_1 = sin((1-t) Omega) / sin Omega``, ``c_2 = sin(t Omega) / sin Omega``.
    When ``|cos Omega| > colinear_threshold`` (mergekit's 0.9995) the vectors are (anti-)parallel: sin Omega ~ 0 makes
    the ratio ill-conditioned, so the linear interpolation ``(1-t, t)`` is returned. For parallel vectors that *is*
    the limit of SLERP as Omega -> 0. For anti-parallel vectors SLERP is undefined (every great circle joins them);
    the linear fallback then cancels the two task vectors in proportion (t = 0.5, equal norms: zero), i.e. the merge
    keeps what the runs agree on, which for opposite updates is nothing. A zero vector has no direction and raises
    :class:`ZeroTaskVectorError` (the caller names the tensor).
    """
    d1, d2 = delta_1.detach().to(torch.float64).flatten(), delta_2.detach().to(torch.float64).flatten()
    n1, n2 = torch.linalg.vector_norm(d1), torch.linalg.vector_norm(d2)
    if n1 == 0 or n2 == 0:
        raise ZeroTaskVectorError("a task vector is exactly zero; its angle is undefined")
    cos = float(torch.clamp(torch.dot(d1, d2) / (n1 * n2), -1.0, 1.0))
    return coefficients_from_cos(cos, t, colinear_threshold)


def slerp(delta_1: torch.Tensor, delta_2: torch.Tensor, t: float, colinear_threshold: float = 0.9995) -> torch.Tensor:
    """Spherical interpolation of two task vectors (float64; see :func:`slerp_coefficients`)."""
    c1, c2, _ = slerp_coefficients(delta_1, delta_2, t, colinear_threshold)
    return c1 * delta_1.to(torch.float64) + c2 * delta_2.to(torch.float64)


def slerp_many(deltas: Sequence[torch.Tensor], t: float | None = None,
               colinear_threshold: float = 0.9995) -> tuple[torch.Tensor, int]:
    """SLERP of M >= 1 task vectors by iterated pairwise SLERP; returns the merged vector (float64) and the number of
    pairwise steps that used the linear fallback.

    ``acc = d_1``; ``acc = slerp(acc, d_m; t_m)`` for m = 2..M with ``t_m = 1/m``, the step at which a running
    *linear* average gives every run equal weight. On the sphere this is close to, not exactly, uniform: three
    orthogonal unit task vectors get coefficients (0.612, 0.612, 0.5), norm 1. ``t`` overrides ``t_2`` and is only
    meaningful for M = 2 (WARP's lambda).
    For M > 2 the result depends on the order of the runs (SLERP is not associative); the runs are folded in the
    order given, and a running merge that cancelled to zero (anti-parallel runs) folds the next run in linearly
    (:func:`running_merge_cancelled`). M = 1 returns d_1.
    """
    if not deltas:
        raise ValueError("nothing to interpolate")
    if t is not None and len(deltas) != 2:
        raise ValueError(f"an explicit SLERP t applies to exactly 2 task vectors, got {len(deltas)}")
    acc, fallbacks = deltas[0].to(torch.float64), 0
    scale = float(torch.linalg.vector_norm(acc))  # sum_k |a_k| |d_k| of acc = sum_k a_k d_k: the size of its parts
    if scale == 0 and len(deltas) > 1:
        raise ZeroTaskVectorError("task vector 1 is exactly zero; its angle is undefined")
    for m, delta in enumerate(deltas[1:], start=2):
        t_m = t if t is not None else 1.0 / m
        delta = delta.to(torch.float64)
        norm_m = float(torch.linalg.vector_norm(delta))
        if norm_m == 0:
            raise ZeroTaskVectorError(f"task vector {m} is exactly zero; its angle is undefined")
        if running_merge_cancelled(float(torch.linalg.vector_norm(acc)), scale):
            c1, c2, linear = 1.0 - t_m, t_m, True
        else:
            c1, c2, linear = slerp_coefficients(acc, delta, t_m, colinear_threshold)
        acc = c1 * acc + c2 * delta
        scale = abs(c1) * scale + abs(c2) * norm_m
        fallbacks += linear
    return acc, fallbacks


def running_merge_cancelled(norm_acc: float, scale: float) -> bool:
    """The running merge of M > 2 folds is zero (or rounding away from it) although its task vectors are not.

    The linear fallback cancels anti-parallel task vectors (equal norms, t = 0.5: exactly zero), and a zero running
    merge has no direction, so the next fold cannot be spherical: it is linear too, ``(1 - t) acc + t d_m``, counted
    as a fallback. "Zero" is relative to the size of the parts it was built from (``scale = sum_k |a_k| |d_k|``), at
    1e-7, above float64 rounding of ``a^T G a`` (the Gram path) and the same in the vector path.
    """
    return norm_acc <= 1e-7 * scale


def slerp_fold_coefficients(gram: torch.Tensor, t: float | None = None,
                            colinear_threshold: float = 0.9995) -> tuple[list[float], int]:
    """:func:`slerp_many` from the Gram matrix ``G[i, j] = <d_i, d_j>`` of the M task vectors alone.

    Every fold keeps the running vector a linear combination ``acc = sum_m a_m d_m``, so ``|acc|^2 = a^T G a`` and
    ``<acc, d_m> = (G a)_m``: the merged task vector's coefficients ``a`` follow without holding any vector in memory.
    This is how the streamed merge computes SLERP (one pass for G, one for the output). Returns ``a`` and the number
    of folds that used the linear fallback (a running merge that cancelled to zero folds linearly, see
    :func:`running_merge_cancelled`); raises :class:`ZeroTaskVectorError` when a task vector is zero.
    """
    g = gram.to(torch.float64)
    if not bool(torch.isfinite(g).all()):
        raise NonFiniteWeightsError("the task vectors' Gram matrix is not finite (NaN or Inf in the weights)")
    m_total = g.shape[0]
    if t is not None and m_total != 2:
        raise ValueError(f"an explicit SLERP t applies to exactly 2 task vectors, got {m_total}")
    a = torch.zeros(m_total, dtype=torch.float64)
    a[0] = 1.0
    fallbacks = 0
    norms = torch.sqrt(torch.clamp(torch.diagonal(g), min=0.0))
    for k in range(m_total):
        if norms[k] == 0:
            raise ZeroTaskVectorError(f"task vector {k + 1} is exactly zero; its angle is undefined")
    for m in range(1, m_total):
        t_m = t if t is not None else 1.0 / (m + 1)
        norm_acc = math.sqrt(max(float(a @ g @ a), 0.0))
        if running_merge_cancelled(norm_acc, float(a.abs() @ norms)):
            c1, c2, linear = 1.0 - t_m, t_m, True
        else:
            cos = max(-1.0, min(1.0, float((g @ a)[m]) / (norm_acc * float(norms[m]))))
            c1, c2, linear = coefficients_from_cos(cos, t_m, colinear_threshold)
        a = c1 * a
        a[m] += c2
        fallbacks += linear
    return a.tolist(), fallbacks


def liti(theta_init: torch.Tensor, theta_merged: torch.Tensor, eta: float) -> torch.Tensor:
    """WARP's linear interpolation towards the initialisation: ``(1 - eta) theta_init + eta theta_merged`` (float64)."""
    return (1.0 - eta) * theta_init.to(torch.float64) + eta * theta_merged.to(torch.float64)


# ----------------------------------------------------------------------------------------------------------------
# Whole models
# ----------------------------------------------------------------------------------------------------------------


def check_same_tensors(shapes: Sequence[Mapping[str, tuple]], names: Sequence[str], who: str) -> None:
    """Refuse models whose tensor names or shapes differ; the message names the tensor and both models.

    ``shapes[i]`` maps tensor name -> shape for the model called ``names[i]``; ``who`` prefixes the message.
    """
    first, first_name = shapes[0], names[0]
    for current, name in zip(shapes[1:], names[1:]):
        if current.keys() != first.keys():
            only_here = sorted(current.keys() - first.keys())
            only_first = sorted(first.keys() - current.keys())
            detail = (f"tensor {only_here[0]!r} is in {name!r} but not in {first_name!r}" if only_here
                      else f"tensor {only_first[0]!r} is in {first_name!r} but not in {name!r}")
            raise ArchitectureMismatchError(
                f"{who}: {name!r} and {first_name!r} have different parameters ({detail}; "
                f"{len(only_here) + len(only_first)} differ); merged models must share an architecture")
        for key, shape in current.items():
            if tuple(shape) != tuple(first[key]):
                raise ArchitectureMismatchError(
                    f"{who}: parameter {key!r} has shape {list(shape)} in {name!r} but {list(first[key])} in "
                    f"{first_name!r}; merged models must share an architecture")


@torch.no_grad()
def average_state_dicts(state_dicts: Sequence[Mapping[str, torch.Tensor]],
                        weights: Sequence[float] | None = None, base: int = 0) -> dict[str, torch.Tensor]:
    """In-memory ``phi = sum_i w_i phi_i / sum_i w_i`` per tensor (uniform by default), float64, cast back.

    Non-floating tensors (integer and bool buffers: counters, ids) are copied from ``state_dicts[base]``, not
    averaged: an average of step counters or token ids is not a counter or an id. The streaming path
    (:mod:`trl_ext_plugins.merge.streaming`) applies the same rule tensor by tensor from files.
    """
    w = normalized_weights(len(state_dicts), weights)
    names = [f"model {i}" for i in range(len(state_dicts))]
    check_same_tensors([{k: tuple(v.shape) for k, v in sd.items()} for sd in state_dicts], names, "average")
    out = {}
    for key, reference in state_dicts[base].items():
        if not reference.is_floating_point():
            out[key] = reference.clone()
            continue
        tensors = [sd[key] for sd in state_dicts]
        for name, t in zip(names, tensors):
            if not t.is_floating_point():
                raise ArchitectureMismatchError(f"average: {key!r} is {t.dtype} in {name!r} but {reference.dtype} "
                                                f"in {names[base]!r}")
            if not bool(torch.isfinite(t).all()):
                raise NonFiniteWeightsError(f"average: {key!r} holds NaN or Inf in {name!r}")
        out[key] = weighted_average(tensors, w, reference.dtype)
    return out
