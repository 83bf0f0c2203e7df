"""``exact_match``: 1 when the completion's final answer equals the dataset's answer column exactly."""

from __future__ import annotations

from pydantic import Field

from trl_ext import Plugin, PluginParams, hookimpl
from trl_ext.rewards import RewardFunction


class ExactMatchParams(PluginParams):
    weight: float = Field(1.0, description="weight of this reward in the weighted sum of reward functions")
    answer_column: str = Field("answer", description="dataset column holding the gold answer")
    answer_after: str | None = Field(None, min_length=1, description="the answer is the integer leading what follows "
                                     "the last occurrence of this text (\"=\" for a chain of steps such as "
                                     "embedded:arithmetic_chain's, GSM8K's \"####\"); none: the completion's start")


class ExactMatch(Plugin):
    """Exact-match verifiable reward for the embedded arithmetic task (RLVR, Tülu 3, arXiv 2411.15124).

    Reward 1.0 when the completion's leading answer (whitespace and end-of-sequence text stripped) equals the gold
    answer string, else 0.0 (the RLVR 1/0 scale; DAPO's +-1 is a weight/offset choice). ``answer_after`` reads the
    answer after the last occurrence of a marker instead (a completion without the marker is read from its start).
    Works for plain-text and conversational completions. For mathematical equivalence (fractions, LaTeX) use
    ``math_verify`` instead.
    """

    name = "exact_match"
    family = "reward"
    trainers = frozenset({"grpo", "rloo"})
    Params = ExactMatchParams

    @hookimpl
    def trl_ext_reward_functions(self, stage):
        from trl_ext.embedded.arithmetic import exact_match_reward

        column, after = self.params.answer_column, self.params.answer_after

        def exact_match(completions, **kwargs):
            return exact_match_reward(completions, kwargs[column], answer_after=after)

        return [RewardFunction("exact_match", exact_match, self.params.weight)]
