"""``length_bonus``: an example third-party trl-ext plugin (its own distribution, found via the entry point)."""

from __future__ import annotations

from pydantic import Field

from trl_ext import Plugin, PluginParams, hookimpl
from trl_ext.rewards import RewardFunction


def length_bonus(lengths: list[int], target: int, scale: float) -> list[float]:
    """1 at the target length, falling linearly by ``1/scale`` per character away from it, floored at 0."""
    return [max(0.0, 1.0 - abs(n - target) / scale) for n in lengths]


class LengthBonusParams(PluginParams):
    target: int = Field(2, gt=0, description="target completion length in characters")
    scale: float = Field(4.0, gt=0, description="characters away from the target at which the bonus reaches 0")
    weight: float = Field(0.1, description="weight of this reward in the weighted sum")


class LengthBonus(Plugin):
    """Reward completions whose length is close to a target (a toy shaping reward; no paper).

    Defaults: target 2 characters, scale 4, weight 0.1. Completions are measured in characters of the decoded text.
    """

    name = "length_bonus"
    family = "reward"
    trainers = frozenset({"grpo", "rloo"})
    Params = LengthBonusParams

    @hookimpl
    def trl_ext_reward_functions(self, stage):
        target, scale = self.params.target, self.params.scale

        def reward(completions, **kwargs):
            texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
            return length_bonus([len(t) for t in texts], target, scale)

        return [RewardFunction("length_bonus", reward, self.params.weight)]
