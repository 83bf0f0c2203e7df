"""Embedded data for the distillation recipes: arithmetic with a ``domain`` column for teacher routing."""

from __future__ import annotations

from datasets import Dataset

from trl_ext.embedded.arithmetic import arithmetic_dataset

DOMAIN_OF_OPERATION = {"+": "add", "-": "sub", "*": "mul"}


def domain_arithmetic(split: str = "train", format: str = "prompt", operations: str = "+-", seed: int = 0,
                      max_operand: int = 50, size: int | None = None) -> Dataset:
    """The embedded arithmetic task over several operations, each row labelled ``domain`` = add / sub / mul by its
    operator (for ``multi_teacher_opd`` / ``stage_teachers`` routing)."""
    dataset = arithmetic_dataset(split, format=format, seed=seed, max_operand=max_operand, size=size,
                                 operations=operations)
    domains = [next(DOMAIN_OF_OPERATION[op] for op in operations if op in p.rstrip("=")[1:]) for p in dataset["prompt"]]
    return dataset.add_column("domain", domains)
