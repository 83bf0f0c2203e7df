"""Embedded instruction-following task for the ``constraints`` and ``checklist_judge`` recipes: two-operand arithmetic
with one formatting instruction per prompt (``say ok: 12+7=`` -> ``19 ok``), checkable both by IFEval's checkers and by
checklist verifier programs, so both rewards train offline on the tiny model built in code.
"""

from __future__ import annotations

import random

from datasets import Dataset

from trl_ext.embedded.arithmetic import arithmetic_dataset
from trl_ext.embedded.tokenizer import EOS_TOKEN

# instruction text -> (a completion that follows it, IFEval checker id, its arguments, checklist verifier program).
# Every IFEval argument mapping carries the same keys (None where unused): Arrow stores the union anyway.
INSTRUCTIONS = {
    "end with !": (lambda answer: f"{answer}!", "startend:end_checker", {"end_phrase": "!", "keywords": None},
                   "ends_with:!"),
    "say ok": (lambda answer: f"{answer} ok", "keywords:existence", {"end_phrase": None, "keywords": ["ok"]},
               "icontains:ok"),
    "add a title": (lambda answer: f"<<sum>> {answer}", "detectable_format:title",
                    {"end_phrase": None, "keywords": None}, "regex:<<[^\\n]+>>"),
}
FORMATS = ("prompt_completion", "prompt")


def sum_verifier(answer: str) -> str:
    """Checklist verifier of "the sum is right": the answer is the completion's *only* number. Merely containing it
    would pay a completion that lists several candidates ("18 19 20 ok") as much as the right one."""
    return f"regex:^[^0-9]*(?<![0-9-]){answer}[^0-9]*$"


def instruction_arithmetic(split: str = "train", format: str = "prompt", size: int | None = None, seed: int = 0,
                           max_operand: int = 50, follow_fraction: float = 0.5) -> Dataset:
    """The embedded arithmetic split with an instruction before each problem (cycling through ``INSTRUCTIONS``).

    ``format="prompt"`` (RL and evaluation): ``prompt``, ``answer``, ``instruction_id_list`` and ``kwargs`` (IFEval's
    columns, one constraint per row) and ``checklist`` (two verifier items, weight 1 each: the sum is right, the
    instruction is followed). ``format="prompt_completion"`` (SFT): ``prompt``, ``completion``, ``answer``; the
    completion always has the right sum and follows the instruction in a ``follow_fraction`` of the rows (chosen per
    problem, seeded), otherwise it is the bare answer, so an SFT model follows instructions only part of the time and
    an RL stage has something to learn.
    """
    if format not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {format!r}")
    if not 0.0 <= follow_fraction <= 1.0:
        raise ValueError(f"follow_fraction must be in [0, 1], got {follow_fraction}")
    base = arithmetic_dataset(split, format="prompt", seed=seed, max_operand=max_operand, size=size)
    texts = list(INSTRUCTIONS)
    rows = []
    for index, (problem, answer) in enumerate(zip(base["prompt"], base["answer"], strict=True)):
        instruction = texts[index % len(texts)]
        follow, checker, arguments, verifier = INSTRUCTIONS[instruction]
        row = {"prompt": f"{instruction}: {problem}", "answer": answer}
        if format == "prompt_completion":
            # seeded by the problem text, so the choice does not depend on row order or Python's hash seed
            follows = random.Random(f"{seed}:{problem}").random() < follow_fraction
            row["completion"] = (follow(answer) if follows else answer) + EOS_TOKEN
        else:
            row["instruction_id_list"] = [checker]
            row["kwargs"] = [arguments]
            row["checklist"] = [
                {"item": "the sum is right", "weight": 1.0, "verifier": sum_verifier(answer)},
                {"item": f"it follows the instruction: {instruction}", "weight": 1.0, "verifier": verifier},
            ]
        rows.append(row)
    return Dataset.from_list(rows)
