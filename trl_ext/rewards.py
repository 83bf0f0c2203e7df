"""Reward functions as plugins hand them to RL trainers (``trl_ext_reward_functions``)."""

from __future__ import annotations

import asyncio
import functools
import inspect
import math
from dataclasses import dataclass
from typing import Any, Callable


def is_async_reward(fn: Callable[..., Any]) -> bool:
    """Whether calling ``fn`` returns a coroutine: TRL's own test (``trl.trainer.utils.is_async_callable``), which
    also sees the ``async`` of a callable instance's ``__call__``."""
    from trl.trainer.utils import is_async_callable

    return is_async_callable(fn)


@dataclass(frozen=True)
class RewardFunction:
    """A named reward callable following TRL's contract and its weight in the weighted sum.

    ``fn(prompts=..., completions=..., completion_ids=..., **dataset_columns, trainer_state=..., ...)`` returns one
    float (or ``None`` when it does not apply) per completion; ``fn`` may be ``async`` (TRL awaits those
    concurrently).
    """

    name: str
    fn: Callable[..., list[float | None]]
    weight: float = 1.0

    def as_trl_callable(self) -> Callable[..., list[float | None]]:
        """The callable with ``__name__`` set, since TRL names reward columns and metrics after it.

        An async ``fn`` gets an async wrapper: TRL decides from the callable it is handed whether to await it, and a
        plain wrapper would hide the ``async`` (TRL would iterate the coroutine and fail)."""
        if is_async_reward(self.fn):

            @functools.wraps(self.fn)
            async def call(*args: Any, **kwargs: Any):
                return await self.fn(*args, **kwargs)
        else:

            @functools.wraps(self.fn)
            def call(*args: Any, **kwargs: Any):
                return self.fn(*args, **kwargs)

        call.__name__ = self.name
        return call


def collect_reward_functions(host, stage) -> list[RewardFunction]:
    """All reward functions the stage's plugins contribute, in recipe order; their names must differ.

    TRL keys each reward's column, its ``rewards/<name>/mean|std`` metrics and the completions table by name, and
    plugins (length_shaping's ``correctness_reward``) find a column by name: two functions of one name (two
    ``python_reward`` files that both define ``reward``) would be logged as one and the lookup would take the first.
    """
    out: list[RewardFunction] = []
    owners: dict[str, str] = {}
    for contribution in reversed(host.pm.hook.trl_ext_reward_functions.get_hookimpls()):
        plugin = getattr(contribution.plugin, "name", contribution.plugin_name)
        for function in contribution.function(stage=stage) or []:
            if function.name in owners:
                raise ValueError(f"two reward functions are named {function.name!r} (from plugins "
                                 f"{owners[function.name]!r} and {plugin!r}); reward columns and metrics are keyed "
                                 "by name: rename one function")
            owners[function.name] = plugin
            out.append(function)
    return out


def await_rewards(result: Any) -> Any:
    """The value of an async reward function's coroutine (a fresh event loop; plain values pass through), for
    callers that invoke reward functions themselves rather than through TRL."""
    return asyncio.run(result) if inspect.isawaitable(result) else result


def weighted_reward(functions: list[RewardFunction]) -> Callable[..., list[float]]:
    """One callable summing the weighted rewards, for held-out evaluation, by TRL's GRPO convention: ``None`` and
    NaN contribute 0 (TRL turns ``None`` into NaN and takes a ``nansum``), an ``async`` function is awaited, and a
    function returning other than one value per completion is an error (TRL raises too)."""

    def score(completions, **kwargs):
        totals = [0.0] * len(completions)
        for function in functions:
            values = list(await_rewards(function.fn(completions=completions, **kwargs)))
            if len(values) != len(completions):
                raise ValueError(f"reward function {function.name!r} returned {len(values)} rewards for "
                                 f"{len(completions)} completions (one per completion expected)")
            for i, value in enumerate(values):
                if value is not None and not math.isnan(value):
                    totals[i] += function.weight * value
        return totals

    return score
