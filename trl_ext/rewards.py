"""Reward functions as plugins hand them to RL trainers (``trl_ext_reward_functions``)."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable


@dataclass(frozen=True)
class RewardFunction:
    """A named reward callable following TRL's contract and its weight in the weighted sum.

    ``fn(prompts=..., completions=..., completion_ids=..., **dataset_columns, trainer_state=..., ...)`` returns one
    float (or ``None`` when it does not apply) per completion.
    """

    name: str
    fn: Callable[..., list[float | None]]
    weight: float = 1.0

    def as_trl_callable(self) -> Callable[..., list[float | None]]:
        """The callable with ``__name__`` set, since TRL names reward columns and metrics after it."""

        @functools.wraps(self.fn)
        def call(*args: Any, **kwargs: Any):
            return self.fn(*args, **kwargs)

        call.__name__ = self.name
        return call


def collect_reward_functions(host, stage) -> list[RewardFunction]:
    """All reward functions the stage's plugins contribute, in recipe order."""
    out: list[RewardFunction] = []
    for contribution in reversed(host.pm.hook.trl_ext_reward_functions.get_hookimpls()):
        out.extend(contribution.function(stage=stage) or [])
    return out


def weighted_reward(functions: list[RewardFunction]) -> Callable[..., list[float]]:
    """One callable summing the weighted rewards (``None`` counts as 0), for held-out evaluation."""

    def score(completions, **kwargs):
        totals = [0.0] * len(completions)
        for function in functions:
            for i, value in enumerate(function.fn(completions=completions, **kwargs)):
                totals[i] += function.weight * (value or 0.0)
        return totals

    return score
