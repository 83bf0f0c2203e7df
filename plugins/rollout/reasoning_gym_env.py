"""reasoning-gym task families as environments: an embedded dataset builder and the task's own verifier as a reward.

reasoning-gym (``pip install 'trl-ext[reasoning-gym]'``) generates procedural tasks offline and deterministically from
a seed, each family with its own answer checker. The dataset ``embedded:reasoning_gym`` (params ``task``, ``size``,
``seed``, ``config``: the family's own options) has columns ``prompt`` (the question, plus ``prompt_suffix``),
``answer`` and ``rg_entry`` (the entry as JSON, for its checker); ``format: prompt_completion`` adds the answer as
``completion``, for an SFT warm-up on the family's format; ``skip`` leaves out the split's first questions, so an RL
stage can train on questions its SFT warm-up never saw (a warm-up that memorised its rows leaves GRPO on the same rows
nothing that carries to held-out questions). A problem's split is decided by a hash of its question (one
in five goes to ``test``), so held-out problems never appear in training, whatever the sizes and seeds; each split
holds distinct questions, in the order the family generates them from ``seed``. (Splitting by seed, ``seed`` and
``seed + 1``, as earlier versions did, put every test problem of ``basic_arithmetic`` in the train split: the family
draws item ``i`` from ``seed + i``.) The reward plugin ``reasoning_gym`` scores a completion with the family's
``score_answer`` (partial credit where the family gives it); use one per ``multi_env`` environment.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import Field

from trl_ext import Plugin, PluginParams, hookimpl
from trl_ext.embedded.splits import HASH_TEST_SHARE, first_distinct_of_split
from trl_ext.rewards import RewardFunction


def reasoning_gym_dataset(split: str = "train", task: str = "basic_arithmetic", size: int = 256, seed: int = 0,
                          prompt_suffix: str = "\nAnswer: ", config: dict[str, Any] | None = None,
                          format: str = "prompt", skip: int = 0):
    """Rows of a reasoning-gym task family (see the module docstring): the split's questions ``skip`` to
    ``skip + size``."""
    from datasets import Dataset

    try:
        import reasoning_gym
    except ImportError:
        raise ImportError("embedded:reasoning_gym needs the reasoning-gym package: pip install "
                          "'trl-ext[reasoning-gym]'") from None
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    if format not in ("prompt", "prompt_completion"):
        raise ValueError(f"reasoning_gym tasks have format 'prompt' or 'prompt_completion', got {format!r}")
    if size < 1 or skip < 0:
        raise ValueError(f"size must be at least 1 and skip at least 0, got size={size}, skip={skip}")
    def generate(n: int):
        try:
            return reasoning_gym.create_dataset(task, size=n, seed=seed, **(config or {}))
        except AssertionError as exc:  # reasoning-gym checks its task configs with assert: a bad value, not a bug
            raise ValueError(f"reasoning_gym task {task!r}: config {config!r} refused: {exc}") from None

    entries = _split_entries(generate, split, skip + size, task)[skip:]
    rows = [{"prompt": entry["question"] + prompt_suffix, "answer": str(entry["answer"]),
             "rg_entry": json.dumps(entry, default=str)} for entry in entries]
    if format == "prompt_completion":  # TRL's SFT appends the tokenizer's eos to the completion
        rows = [{**row, "completion": row["answer"]} for row in rows]
    return Dataset.from_list(rows)


def _split_entries(generate, split: str, size: int, task: str) -> list[dict]:
    """The first ``size`` distinct questions of ``split`` among the family's entries, generating four times more
    until found; an error once four times more entries bring no new question (the family's space is exhausted)."""
    drawn, found = size * HASH_TEST_SHARE + 64, -1
    while True:
        entries = first_distinct_of_split(generate(drawn), lambda entry: entry["question"], split, size)
        if len(entries) == size:
            return entries
        if len(entries) == found:
            raise ValueError(f"reasoning_gym task {task!r}: only {found} distinct {split} questions among {drawn} "
                             f"generated, {size} asked; lower size or widen the task's config")
        drawn, found = drawn * 4, len(entries)


class ReasoningGymParams(PluginParams):
    weight: float = Field(1.0, description="weight of this reward in the weighted sum of reward functions")
    entry_column: str = Field("rg_entry", description="dataset column holding the reasoning-gym entry (JSON)")
    credit: Literal["family", "full"] = Field(
        "family", description="family: the family's score_answer as it is, partial credit included; full: 1 where "
        "the family gives full credit, else 0 (no credit a wrong answer can earn; see the plugin docstring)")


class ReasoningGymScore(Plugin):
    """The verifier of a reasoning-gym task family as a reward (reasoning-gym, Stojanovski et al. 2025, arXiv
    2505.24760), for environments of ``multi_env`` (ALGORITHMS.md item 49).

    Each row's entry (``rg_entry``, written by ``embedded:reasoning_gym``) names its family
    (``metadata.source_dataset``); the family's ``score_answer(answer, entry)`` scores the completion's first line
    (stripped), in [0, 1]. Rows without an entry get ``None`` (the reward does not apply).

    Convention chosen (``credit``): ``family`` (the default) keeps reasoning-gym's own scores, partial credit included.
    Many families (``basic_arithmetic`` among them) inherit the base scorer, which gives ``len(answer) /
    len(completion)`` to any completion that contains the answer as a substring: for the answer ``151``, the wrong
    ``1512`` earns 0.75 and ``151151`` 0.5, so a policy collects reward for padding or repeating candidates.
    ``credit: full`` scores 1 only where the family gives full credit and 0 otherwise, for tasks where a near-miss
    should earn nothing (configs/reasoning_gym.yaml uses it).
    """

    name = "reasoning_gym"
    family = "reward"
    trainers = frozenset({"grpo", "rloo"})
    requires = (("reasoning_gym", "trl-ext[reasoning-gym]"),)
    Params = ReasoningGymParams

    @hookimpl
    def trl_ext_reward_functions(self, stage):
        column, full_only = self.params.entry_column, self.params.credit == "full"
        # reasoning-gym builds a whole dataset object (word lists and all) for every get_score_answer_fn call: 28 ms
        # for spell_backward, 3.6 s per 128-row batch when called per row, so each family's scorer is built once.
        scorers: dict[str, Any] = {}

        def reasoning_gym(completions, **kwargs):
            from reasoning_gym import get_score_answer_fn

            from trl_ext_plugins.preference.generation import completion_text

            scores: list[float | None] = []
            for completion, raw in zip(completions, kwargs[column], strict=True):
                if not raw:
                    scores.append(None)
                    continue
                entry = json.loads(raw)
                family = entry["metadata"]["source_dataset"]
                if family not in scorers:
                    scorers[family] = get_score_answer_fn(family)
                answer = completion_text(completion).replace("<eos>", "").strip().split("\n")[0].strip()
                score = float(scorers[family](answer=answer, entry=entry))
                scores.append(float(score >= 1.0) if full_only else score)
            return scores

        return [RewardFunction(self.name, reasoning_gym, self.params.weight)]
