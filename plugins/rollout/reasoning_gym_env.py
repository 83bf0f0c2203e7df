"""reasoning-gym task families as environments: an embedded dataset builder and the task's own verifier as a reward.

reasoning-gym (``pip install 'trl-ext[reasoning-gym]'``) generates procedural tasks offline and deterministically from
a seed, each family with its own answer checker. The dataset ``embedded:reasoning_gym`` (params ``task``, ``size``,
``seed``, ``config``: the family's own options) has columns ``prompt`` (the question, plus ``prompt_suffix``),
``answer`` and ``rg_entry`` (the entry as JSON, for its checker); the train and test splits use different seeds
(``seed`` and ``seed + 1``). The reward plugin ``reasoning_gym`` scores a completion with the family's
``score_answer`` (partial credit where the family gives it); use one per ``multi_env`` environment.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import Field

from trl_ext import Plugin, PluginParams, hookimpl
from trl_ext.rewards import RewardFunction


def reasoning_gym_dataset(split: str = "train", task: str = "basic_arithmetic", size: int = 256, seed: int = 0,
                          prompt_suffix: str = "\nAnswer: ", config: dict[str, Any] | None = None, format: str = "prompt"):
    """Rows of a reasoning-gym task family (see the module docstring)."""
    from datasets import Dataset

    try:
        import reasoning_gym
    except ImportError:
        raise ImportError("embedded:reasoning_gym needs the reasoning-gym package: pip install "
                          "'trl-ext[reasoning-gym]'") from None
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    if format != "prompt":
        raise ValueError(f"reasoning_gym tasks have format 'prompt' only, got {format!r}")
    data = reasoning_gym.create_dataset(task, size=size, seed=seed + (split == "test"), **(config or {}))
    return Dataset.from_list([{"prompt": entry["question"] + prompt_suffix, "answer": str(entry["answer"]),
                               "rg_entry": json.dumps(entry, default=str)} for entry in data])


class ReasoningGymParams(PluginParams):
    weight: float = Field(1.0, description="weight of this reward in the weighted sum of reward functions")
    entry_column: str = Field("rg_entry", description="dataset column holding the reasoning-gym entry (JSON)")


class ReasoningGymScore(Plugin):
    """The verifier of a reasoning-gym task family as a reward (reasoning-gym, Stojanovski et al. 2025, arXiv
    2505.24760), for environments of ``multi_env`` (ALGORITHMS.md item 49).

    Each row's entry (``rg_entry``, written by ``embedded:reasoning_gym``) names its family
    (``metadata.source_dataset``); the family's ``score_answer(answer, entry)`` scores the completion's first line
    (stripped), in [0, 1]. Rows without an entry get ``None`` (the reward does not apply).
    """

    name = "reasoning_gym"
    family = "reward"
    trainers = frozenset({"grpo", "rloo"})
    requires = (("reasoning_gym", "trl-ext[reasoning-gym]"),)
    Params = ReasoningGymParams

    @hookimpl
    def trl_ext_reward_functions(self, stage):
        column = self.params.entry_column

        def reasoning_gym(completions, **kwargs):
            from reasoning_gym import get_score_answer_fn

            from trl_ext_plugins.preference.generation import completion_text

            scores: list[float | None] = []
            for completion, raw in zip(completions, kwargs[column], strict=True):
                if not raw:
                    scores.append(None)
                    continue
                entry = json.loads(raw)
                answer = completion_text(completion).replace("<eos>", "").strip().split("\n")[0].strip()
                score = get_score_answer_fn(entry["metadata"]["source_dataset"])
                scores.append(float(score(answer=answer, entry=entry)))
            return scores

        return [RewardFunction(self.name, reasoning_gym, self.params.weight)]
