"""Embedded verifiable task: two-operand integer arithmetic ("12+34=" -> "46").

Problems are all ordered pairs (a, b) with 0 <= a, b < max_operand for each operation. A seeded
shuffle puts a fixed number of problems in the test split and the rest in train, so held-out
problems never appear in training and every call with the same arguments returns the same rows.
The answer is plain text ending with the eos token, which the embedded tokenizer encodes as one token.
"""

import math
import random
import re
from collections.abc import Callable

from datasets import Dataset

from trl_ext.embedded.splits import check_problem_count, first_problems, seeded_split
from trl_ext.embedded.tokenizer import EOS_TOKEN, SPECIAL_TOKENS

FORMATS = ("prompt_completion", "prompt", "preference", "unpaired")
_OPERATIONS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
# 200 held-out problems for the default 50 x 50 additions (2300 train), at most a fifth of the problems.
_MAX_TEST_SIZE = 200


def _problems(split: str, seed: int, max_operand: int, operations: str) -> list[tuple[int, str, int]]:
    unknown = set(operations) - set(_OPERATIONS)
    if unknown or not operations:
        raise ValueError(f"operations must be made of {''.join(_OPERATIONS)!r}, got {operations!r}")
    if len(set(operations)) != len(operations):
        # Each repeat lists every problem again, and the shuffle then puts copies of held-out problems in train.
        raise ValueError(f"operations must name each operation once, got {operations!r}")
    check_problem_count(len(operations) * max(max_operand, 0) ** 2, f"max_operand={max_operand} and {len(operations)} "
                        "operation(s)")
    problems = [(a, op, b) for op in operations for a in range(max_operand) for b in range(max_operand)]
    return seeded_split(problems, split, seed, test_size=min(_MAX_TEST_SIZE, len(problems) // 5))


def _wrong_answer(a: int, op: str, b: int, answer: int, seed: int) -> int:
    """A deterministic plausible mistake: a small offset, a tens error, or the digits reversed."""
    # Seeding with the problem text makes the mistake independent of row order and of Python's hash seed.
    rng = random.Random(f"{seed}:{a}{op}{b}")
    candidates = [answer + 1, answer - 1, answer + 2, answer - 2, answer + 10, answer - 10]
    digits = str(abs(answer))
    if len(digits) > 1 and digits[::-1] != digits:
        candidates.append(int(digits[::-1]) * (1 if answer >= 0 else -1))
    # A negative answer to a problem whose true answer is not negative would be too easy to reject.
    candidates = [c for c in candidates if c != answer and (c >= 0 or answer < 0)]
    return rng.choice(candidates)


def _tail_length(a: int, op: str, b: int, seed: int, fraction: float, longest: int) -> int:
    """0, or with probability `fraction` a length log-uniform in [1, `longest`]: most tails short, a few long."""
    rng = random.Random(f"{seed}:tail:{a}{op}{b}")  # per problem, independent of row order
    if rng.random() >= fraction:
        return 0
    return min(longest, int(math.exp(rng.uniform(0.0, math.log(longest + 1)))))


def arithmetic_dataset(
    split: str = "train",
    format: str = "prompt_completion",
    seed: int = 0,
    max_operand: int = 50,
    size: int | None = None,
    operations: str = "+",
    tail_fraction: float = 0.0,
    tail_max: int = 48,
) -> Dataset:
    """Return the `split` ("train" or "test") of the arithmetic task in a TRL dataset `format`.

    Formats (all plain text, not conversational; every one has the gold `answer` for reward functions):
    - "prompt_completion": prompt, completion (answer + eos), answer; for SFTTrainer.
    - "prompt": prompt, answer; for GRPOTrainer and RLOOTrainer.
    - "preference": prompt, chosen (answer + eos), rejected (a wrong answer + eos), answer; for
      DPOTrainer and RewardTrainer.
    - "unpaired": prompt, completion, label (True for a correct completion), answer; for KTOTrainer.
      Rows alternate correct and wrong completions so the labels are balanced.
    The completions already end with eos, so the trainers, which append eos only when it is missing,
    do not add a second one.
    `size` keeps the first `size` problems of the (shuffled) split. `operations` is a string of "+-*".
    `tail_fraction` (prompt_completion only) gives that share of problems a verbose tail after the answer: "46" then
    L dots then eos, L log-uniform in [1, `tail_max`] and fixed per problem. The reward ignores text after the leading
    integer, so a model warmed up on it samples a long-tailed length distribution that RL does not penalise (the
    setting of partial rollouts: benchmarks/partial_rollout.py --long-tail).
    """
    if not 0.0 <= tail_fraction <= 1.0:
        raise ValueError(f"tail_fraction must lie in [0, 1], got {tail_fraction}")
    if tail_max < 1:
        raise ValueError(f"tail_max must be at least 1, got {tail_max}")
    if tail_fraction and format != "prompt_completion":
        raise ValueError(f"tail_fraction shapes completions: it needs format 'prompt_completion', got {format!r}")
    if format not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {format!r}")
    problems = first_problems(_problems(split, seed, max_operand, operations), size, split)

    rows = []
    for index, (a, op, b) in enumerate(problems):
        answer = _OPERATIONS[op](a, b)
        row = {"prompt": f"{a}{op}{b}=", "answer": str(answer)}
        if format == "prompt_completion":
            row["completion"] = f"{answer}{'.' * _tail_length(a, op, b, seed, tail_fraction, tail_max)}{EOS_TOKEN}"
        elif format == "preference":
            row["chosen"] = f"{answer}{EOS_TOKEN}"
            row["rejected"] = f"{_wrong_answer(a, op, b, answer, seed)}{EOS_TOKEN}"
        elif format == "unpaired":
            label = index % 2 == 0
            shown = answer if label else _wrong_answer(a, op, b, answer, seed)
            row["completion"] = f"{shown}{EOS_TOKEN}"
            row["label"] = label
        rows.append(row)
    return Dataset.from_list(rows)


_MAX_SOLVED_DIGITS = 1000
_PROBLEM = re.compile(r"^\s*(-?\d+)\s*([-+*])\s*(\d+)\s*=\s*$")


def solve(problem: str) -> str | None:
    """The answer to a problem in this task's format (``"12+34="`` -> ``"46"``, spaces allowed, ``"07"`` read as 7),
    or ``None`` when the text is not such a problem. A verifier for generated problems: the text is parsed, never
    evaluated."""
    match = _PROBLEM.match(problem)
    if match is None:
        return None
    a, op, b = match.groups()
    if max(len(a), len(b)) > _MAX_SOLVED_DIGITS:  # int() refuses texts over 4300 digits; no problem of the task is near
        return None
    return str(_OPERATIONS[op](int(a), int(b)))


# The leading number with its decimal fraction, if any: "46.5" is not the integer 46 (a wrong answer must not match
# its integer part); a dot without digits after it ("46." or the embedded task's "46...." tails) ends the number.
_LEADING_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
_SPECIAL_TEXT = re.compile("|".join(re.escape(token) for token in SPECIAL_TOKENS))


def _completion_text(completion) -> str:
    # TRL passes conversational completions as a list of messages; the answer is the last message.
    if isinstance(completion, list):
        return completion[-1]["content"] if completion else ""
    return completion


def exact_match_reward(completions: list, answer: list[str], answer_after: str | None = None,
                       **kwargs) -> list[float | None]:
    """1.0 where the integer at the start of the completion equals the gold answer, else 0.0; None (TRL: the function
    does not apply) where the row has no gold answer (None, NaN or blank).

    Special-token text (e.g. "<eos>") and surrounding whitespace are ignored; anything after the
    leading integer is ignored too, so "46<eos>", " 46", "46." and "46 =" all match "46" but "460" and
    "46.5" (a decimal, not the integer 46) do not.
    With `answer_after` (e.g. "=" for a chain of steps "12+5=17,17+7=24", GSM8K's "####"), the answer is
    the integer at the start of what follows the last occurrence of that text (the whole completion when
    it has none). Takes TRL's reward-function arguments: `answer` is the dataset column, other columns
    arrive in kwargs.
    """
    rewards = []
    for completion, gold in zip(completions, answer, strict=True):
        if gold is None or gold != gold or not str(gold).strip():  # no gold answer (None, NaN, blank): unscored
            rewards.append(None)
            continue
        text = _SPECIAL_TEXT.sub("", _completion_text(completion))
        if answer_after:
            text = text.rsplit(answer_after, 1)[-1]
        match = _LEADING_NUMBER.match(text.strip())
        rewards.append(1.0 if match is not None and match.group() == str(gold).strip() else 0.0)
    return rewards


EMBEDDED_DATASETS: dict[str, Callable[..., Dataset]] = {"arithmetic": arithmetic_dataset}
