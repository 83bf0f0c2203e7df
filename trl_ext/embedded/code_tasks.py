"""Embedded code task: write a tiny Python function or program for a linear formula (``x*4+7``).

Every problem is a pair (a, b) with 1 <= a <= max_a and 0 <= b <= max_b, in one of two styles that exercise the two
test formats of the ``unit_tests`` reward:

* ``call``: prompt ``"call x*4+7:"``, reference ``"def f(x):\\n return x*4+7\\n"``; hidden tests are
  ``assert f(x) == y`` lines (function-call tests) for x in ``TEST_INPUTS``;
* ``stdio``: prompt ``"stdio x*4+7:"``, reference ``"print(int(input())*4+7)\\n"``; hidden tests are stdin/stdout
  pairs for the same inputs.

The task is deliberately simple (the formula is in the prompt) so that the embedded character-level model can learn
it on two CPU cores in minutes; what the model must get right is the program around the formula and the copy of it.
Everything uses only characters of the embedded tokenizer's alphabet. A seeded shuffle puts ``test_size`` problems in
the test split and the rest in train, so held-out problems never appear in training; every call with the same
arguments returns the same rows. ``tests`` is JSON text (Arrow columns cannot mix value types across rows).
"""

import json
import random

from datasets import Dataset

from trl_ext.embedded.splits import check_problem_count, first_problems, seeded_split
from trl_ext.embedded.tokenizer import EOS_TOKEN

FORMATS = ("prompt_completion", "prompt")
STYLES = ("call", "stdio")
TEST_INPUTS = (0, 1, 5)


def _problems(split: str, seed: int, max_a: int, max_b: int, test_size: int) -> list[tuple[str, int, int]]:
    check_problem_count(len(STYLES) * max(max_a, 0) * max(max_b + 1, 0), f"max_a={max_a} and max_b={max_b}")
    problems = [(style, a, b) for style in STYLES for a in range(1, max_a + 1) for b in range(max_b + 1)]
    if not 0 < test_size < len(problems):
        raise ValueError(f"test_size must be between 1 and {len(problems) - 1}, got {test_size}")
    return seeded_split(problems, split, seed, test_size)


def reference_solution(style: str, a: int, b: int, off_by_one: bool = False) -> str:
    """The correct program, or (``off_by_one``) the same program with the classic ``+1`` bug."""
    expression = f"{a}+{b}+1" if off_by_one else f"{a}+{b}"
    if style == "call":
        return f"def f(x):\n return x*{expression}\n"
    return f"print(int(input())*{expression})\n"


def hidden_tests(style: str, a: int, b: int) -> str:
    """JSON text of the row's tests: assert lines (function-call) or stdin/stdout pairs."""
    if style == "call":
        return json.dumps([f"assert f({x}) == {a * x + b}" for x in TEST_INPUTS])
    return json.dumps([{"stdin": f"{x}\n", "stdout": f"{a * x + b}\n"} for x in TEST_INPUTS])


def code_tasks_dataset(split: str = "train", format: str = "prompt", seed: int = 0, max_a: int = 9, max_b: int = 19,
                       test_size: int = 60, size: int | None = None, buggy_fraction: float = 0.0) -> Dataset:
    """The `split` of the code task in a TRL dataset `format`.

    - "prompt_completion": prompt, completion (reference program + eos), tests; for SFTTrainer.
    - "prompt": prompt, tests; for GRPOTrainer / RLOOTrainer with the ``unit_tests`` reward.
    `size` keeps the first `size` problems of the (shuffled) split. `buggy_fraction` of the "prompt_completion" rows
    (chosen by a seeded draw) show the off-by-one program instead of the correct one: imperfect demonstrations, as
    scraped code is, which the unit-test reward can correct and imitation cannot. The tests are always the correct
    program's.
    """
    if not 0.0 <= buggy_fraction <= 1.0:
        raise ValueError(f"buggy_fraction must be in [0, 1], got {buggy_fraction}")
    buggy = random.Random(f"{seed}:buggy")
    if format not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {format!r}")
    problems = first_problems(_problems(split, seed, max_a, max_b, test_size), size, split)
    rows = []
    for style, a, b in problems:
        row = {"prompt": f"{style} x*{a}+{b}:\n", "tests": hidden_tests(style, a, b)}
        if format == "prompt_completion":
            row["completion"] = reference_solution(style, a, b, buggy.random() < buggy_fraction) + EOS_TOKEN
        rows.append(row)
    return Dataset.from_list(rows)
