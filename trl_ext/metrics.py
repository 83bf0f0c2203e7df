"""Logged figures that cover every rank: a plugin hands the host the *parts* of a figure, the host reduces them.

TRL logs rank 0's metric buffers, so a figure a plugin computes from its own rank's tensors (``x.mean().item()``)
reports one rank's slice. A plugin that cannot reach the accelerator (loss and preference hooks) puts a
:class:`Summed` or :class:`Largest` into ``metrics`` instead of a float; :func:`reduce_figures` (called by the
trainers' ``_log_plugin_metrics`` on every rank) sums or maxes the parts over all ranks in two collectives and logs
``finish(*sums)``. On one process the figure is the same number a plain ``.item()`` gave.

Every rank must put the same keys into one ``metrics`` dict (the collectives run in key order): a plugin emits its
figures unconditionally and lets an empty rank contribute zero sums (or ``-inf`` to a maximum); a figure whose
global parts are empty (``finish`` returns ``None``) is not logged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch


@dataclass(frozen=True)
class Summed:
    """A figure computed from sums over every rank's data: ``finish(*globally summed parts)`` (``None``: skip)."""

    parts: tuple[Any, ...]
    finish: Callable[..., float | None]


@dataclass(frozen=True)
class Largest:
    """The maximum over every rank of ``value`` (``-inf`` on a rank without data), times ``sign`` (-1: a minimum
    given as the maximum of the negated values)."""

    value: Any
    sign: float = 1.0


def _ratio(total: float, count: float) -> float | None:
    return total / count if count > 0 else None


def mean(total, count) -> Summed:
    """``sum / count`` over every rank (a token mean: weighted by each rank's count, not the mean of rank means)."""
    return Summed((total, count), _ratio)


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> Summed:
    """The mean of ``values`` where ``mask`` (bool) is true, over every rank."""
    return mean(torch.where(mask, values, torch.zeros_like(values)).sum(), mask.sum())


def _unbiased_std(total: float, squares: float, count: float) -> float | None:
    if count <= 0:
        return None
    if count == 1:
        return 0.0
    return math.sqrt(max(squares - total * total / count, 0.0) / (count - 1))


def masked_std(values: torch.Tensor, mask: torch.Tensor) -> Summed:
    """The unbiased standard deviation of ``values`` where ``mask`` is true, over every rank (sums in float64)."""
    v = torch.where(mask, values, torch.zeros_like(values)).double()
    return Summed((v.sum(), (v * v).sum(), mask.sum()), _unbiased_std)


def masked_max(values: torch.Tensor, mask: torch.Tensor) -> Largest:
    """The maximum of ``values`` where ``mask`` is true, over every rank."""
    return Largest(torch.where(mask, values, torch.full_like(values, -math.inf)).max())


def masked_min(values: torch.Tensor, mask: torch.Tensor) -> Largest:
    """The minimum of ``values`` where ``mask`` is true, over every rank."""
    return Largest(torch.where(mask, -values, torch.full_like(values, -math.inf)).max(), sign=-1.0)


def _floats(values: list, device) -> torch.Tensor:
    return torch.stack([torch.as_tensor(v, dtype=torch.float64, device=device).detach().reshape(()) for v in values])


def reduce_figures(metrics: dict[str, Any], accelerator=None) -> dict[str, float]:
    """Plain floats for logging: floats and 0-d tensors pass through; :class:`Summed` parts are summed and
    :class:`Largest` values maxed over every rank (``accelerator`` ``None`` or one process: this rank's alone).

    Must be called on every rank with the same keys; it makes one reduce and one gather at most, in sorted key order.
    """
    keys = sorted(metrics)
    summed = [k for k in keys if isinstance(metrics[k], Summed)]
    largest = [k for k in keys if isinstance(metrics[k], Largest)]
    out = {k: float(v) for k, v in metrics.items() if not isinstance(v, (Summed, Largest))}
    device = next((t.device for k in summed + largest
                   for t in (metrics[k].parts if k in summed else (metrics[k].value,))
                   if isinstance(t, torch.Tensor)), None)
    several = accelerator is not None and accelerator.num_processes > 1
    if several:  # collectives need tensors on the accelerator's device (NCCL refuses CPU tensors)
        device = getattr(accelerator, "device", device)
    if summed:
        parts = _floats([p for k in summed for p in metrics[k].parts], device)
        if several:
            parts = accelerator.reduce(parts, reduction="sum")
        values, i = parts.tolist(), 0
        for k in summed:
            n = len(metrics[k].parts)
            figure = metrics[k].finish(*values[i:i + n])
            i += n
            if figure is not None:
                out[k] = float(figure)
    if largest:
        peaks = _floats([metrics[k].value for k in largest], device)
        if several:
            peaks = accelerator.gather(peaks.unsqueeze(0)).reshape(-1, len(largest)).amax(0)
        for k, peak in zip(largest, peaks.tolist()):
            if peak != -math.inf:  # no rank had data
                out[k] = metrics[k].sign * peak
    return out
