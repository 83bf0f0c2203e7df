"""How every embedded task splits its problems: an enumerated task by one seeded shuffle (the test split first), a task
drawn from a generator by a hash of each problem's text; the first ``size`` problems of a split on request. Held-out
problems never appear in training, and the same arguments give the same rows."""

import hashlib
import random
from collections.abc import Callable, Iterable
from typing import TypeVar

T = TypeVar("T")

# One problem in HASH_TEST_SHARE is held out by hash_split.
HASH_TEST_SHARE = 5
# Enumerated tasks list every problem in memory, and validation builds a split before training builds it again: the
# bound makes a typo (max_operand: 50000 is 2.5e9 problems) an error rather than a process that exhausts memory.
MAX_ENUMERATED_PROBLEMS = 1_000_000


def check_problem_count(count: int, sizes: str) -> None:
    """ValueError when an enumerated task would hold more than MAX_ENUMERATED_PROBLEMS problems (``sizes`` names the
    parameters that set ``count``)."""
    if count > MAX_ENUMERATED_PROBLEMS:
        raise ValueError(f"{sizes} enumerate {count:.3g} problems; at most {MAX_ENUMERATED_PROBLEMS:,} are built")


def seeded_split(problems: list, split: str, seed: int, test_size: int) -> list:
    """``problems`` shuffled with ``seed``: the first ``test_size`` form the ``test`` split, the rest ``train``."""
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    problems = list(problems)
    random.Random(seed).shuffle(problems)
    return problems[:test_size] if split == "test" else problems[test_size:]


def first_problems(problems: list, size: int | None, split: str) -> list:
    """The first ``size`` problems of a split (all of them for ``None``); a split holding fewer is an error that says
    how many it holds."""
    if size is None:
        return problems
    if size < 0:  # problems[:-5] would silently drop the last five instead
        raise ValueError(f"size must not be negative (got {size})")
    if size > len(problems):
        raise ValueError(f"size={size} exceeds the {len(problems)} problems of the {split} split")
    return problems[:size]


def hash_split(problem: str) -> str:
    """``"test"`` for one problem text in ``HASH_TEST_SHARE``, ``"train"`` for the rest: a fixed hash of the text, for
    tasks drawn from a generator rather than enumerated (a held-out problem is never drawn for training, whatever the
    seeds and sizes)."""
    return "test" if hashlib.sha256(problem.encode("utf-8")).digest()[0] % HASH_TEST_SHARE == 0 else "train"


def first_distinct_of_split(candidates: Iterable[T], text: Callable[[T], str], split: str, size: int) -> list[T]:
    """The first ``size`` candidates of ``split`` (by :func:`hash_split` of their ``text``), each text once; fewer when
    the candidates run out (the caller says what that means for its task)."""
    chosen, seen = [], set()
    for candidate in candidates:
        if len(chosen) == size:
            break
        key = text(candidate)
        if key not in seen:
            seen.add(key)
            if hash_split(key) == split:
                chosen.append(candidate)
    return chosen
