"""Embedded preference data with reward columns (``embedded:arithmetic_rewards``) for ``rpo`` and ``qrpo`` recipes.

Built offline and deterministically from the embedded arithmetic task. Rewards are a graded closeness score
``exp(-|prediction - answer| / 5)`` (1.0 for the correct answer), so reward gaps differ from pair to pair. The
``ref_rewards`` list holds the scores of ``n_ref`` answers drawn from a fixed noisy "reference answerer" (the true
answer plus a random offset in [-12, 12]); they stand in for the rewards of n reference-policy completions, which this
module does not generate.
"""

from __future__ import annotations

import math
import random

from datasets import Dataset

from trl_ext.embedded.arithmetic import arithmetic_dataset
from trl_ext.embedded.tokenizer import EOS_TOKEN


def closeness_reward(prediction: int, answer: int) -> float:
    return math.exp(-abs(prediction - answer) / 5.0)


def arithmetic_reward_pairs(split: str = "train", size: int | None = None, n_ref: int = 8, seed: int = 0,
                            max_operand: int = 50) -> Dataset:
    """The arithmetic ``preference`` split plus ``chosen_reward``, ``rejected_reward`` and ``ref_rewards``."""
    data = arithmetic_dataset(split, format="preference", seed=seed, size=size, max_operand=max_operand)

    def add(row):
        answer = int(row["answer"])
        rejected = int(row["rejected"].removesuffix(EOS_TOKEN))
        rng = random.Random(f"{seed}:{row['prompt']}")
        refs = [closeness_reward(answer + rng.randint(-12, 12), answer) for _ in range(n_ref)]
        return {"chosen_reward": closeness_reward(answer, answer),
                "rejected_reward": closeness_reward(rejected, answer), "ref_rewards": refs}

    return data.map(add)
