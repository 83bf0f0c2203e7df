"""Embedded datasets of the rollout-control plugins (registered by the family's entry point)."""

from __future__ import annotations

import random
import re

from datasets import Dataset

from trl_ext.embedded.arithmetic import arithmetic_dataset
from trl_ext.embedded.splits import first_problems, seeded_split
from trl_ext.embedded.tokenizer import EOS_TOKEN

_PROBLEM = re.compile(r"^(-?\d+[-+*])(\d+=)$")


def arithmetic_proposals(split: str = "train", format: str = "prompt", seed: int = 0, max_operand: int = 50,
                         size: int | None = None, operations: str = "+") -> Dataset:
    """Problem-proposal prompts for ``self_play``'s proposer on the embedded arithmetic task: the prompt is a first
    operand and operation (``"12+"``); ``prompt_completion`` adds the rest of a real problem (``"34=<eos>"``) to warm a
    proposer with SFT. Rows follow the arithmetic task's split, seed and operand range."""
    if format not in ("prompt", "prompt_completion"):
        raise ValueError(f"format must be 'prompt' or 'prompt_completion', got {format!r}")
    rows = []
    for problem in arithmetic_dataset(split, format="prompt", seed=seed, max_operand=max_operand, size=size,
                                      operations=operations)["prompt"]:
        head, rest = _PROBLEM.match(problem).groups()
        rows.append({"prompt": head, **({"completion": rest + EOS_TOKEN} if format == "prompt_completion" else {})})
    return Dataset.from_list(rows)


# 500 held-out problems (of 8000 at the default range): a held-out score resolved to about 2 points.
_CHAIN_TEST_SIZE = 500
_SUM = re.compile(r"^\s*\d+(?:\s*\+\s*\d+)+\s*=\s*$")
_MAX_SUM_DIGITS = 100  # a verifier never parses huge generated numbers (int() refuses over 4300 digits)


def _chain_problems(split: str, seed: int, max_operand: int) -> list[tuple[int, int, int]]:
    if max_operand < 2:
        raise ValueError(f"max_operand must be at least 2, got {max_operand}")
    problems = [(a, b, c) for a in range(max_operand) for b in range(max_operand) for c in range(max_operand)]
    return seeded_split(problems, split, seed, test_size=min(_CHAIN_TEST_SIZE, len(problems) // 5))


def chain_of_steps(a: int, b: int, c: int, seed: int = 0) -> str:
    """The worked solution of ``a+b+c=``: two additions in an order drawn per problem (seeded by the problem, so
    independent of row order), e.g. ``"12+5=17,17+7=24"``; the answer follows the last ``=``."""
    operands = [a, b, c]
    first, second = random.Random(f"{seed}:chain:{a}+{b}+{c}").sample(range(3), 2)
    last = operands[3 - first - second]
    partial = operands[first] + operands[second]
    return f"{operands[first]}+{operands[second]}={partial},{partial}+{last}={partial + last}"


def arithmetic_chain(split: str = "train", format: str = "prompt_completion", seed: int = 0, max_operand: int = 20,
                     size: int | None = None) -> Dataset:
    """Three-operand sums solved by a chain of two steps (``"12+7+5="`` -> ``"12+5=17,17+7=24"``): the embedded task
    where sampled answers come from a chain of steps. The pair added first varies from problem to problem, so a model
    warmed up on it spreads its samples over several paths to one answer, and the majority of sampled answers can
    beat the greedy one (self-consistency; ``self_play``'s majority labels rest on it). All ordered triples with
    operands below ``max_operand``, 500 held out. ``prompt_completion`` (SFT: the chain, then ``<eos>``) or
    ``prompt`` (GRPO and held-out evaluation); both carry ``answer``. Score with ``exact_match`` and
    ``answer_after: "="``."""
    if format not in ("prompt", "prompt_completion"):
        raise ValueError(f"format must be 'prompt' or 'prompt_completion', got {format!r}")
    problems = first_problems(_chain_problems(split, seed, max_operand), size, split)
    rows = []
    for a, b, c in problems:
        row = {"prompt": f"{a}+{b}+{c}=", "answer": str(a + b + c)}
        if format == "prompt_completion":
            row["completion"] = chain_of_steps(a, b, c, seed) + EOS_TOKEN
        rows.append(row)
    return Dataset.from_list(rows)


def arithmetic_chain_proposals(split: str = "train", format: str = "prompt", seed: int = 0, max_operand: int = 20,
                               size: int | None = None) -> Dataset:
    """Problem-proposal prompts for a ``self_play`` proposer on :func:`arithmetic_chain`: the first two operands
    (``"12+7+"``); ``prompt_completion`` adds the last one of a real problem (``"5=<eos>"``) for an SFT warm-up."""
    if format not in ("prompt", "prompt_completion"):
        raise ValueError(f"format must be 'prompt' or 'prompt_completion', got {format!r}")
    rows = []
    for problem in arithmetic_chain(split, "prompt", seed, max_operand, size)["prompt"]:
        head, last = problem.rsplit("+", 1)
        completion = {"completion": last + EOS_TOKEN} if format == "prompt_completion" else {}
        rows.append({"prompt": head + "+", **completion})
    return Dataset.from_list(rows)


def solve_sum(problem: str) -> str | None:
    """The sum a problem ``"a+b+...="`` asks for (two operands or more, spaces allowed), or ``None`` when the text is
    not such a problem: the ``arithmetic_chain`` verifier of ``self_play``. Parsed, never evaluated."""
    if not _SUM.match(problem):
        return None
    operands = re.findall(r"\d+", problem)
    if max(len(x) for x in operands) > _MAX_SUM_DIGITS:
        return None
    return str(sum(int(x) for x in operands))


def dataset_mixture(split: str = "train", parts: list[dict] | None = None, seed: int = 0) -> Dataset:
    """Rows of several datasets in one, in a seeded shuffle: an SFT warm-up on every environment of a ``multi_env`` run
    (one SFT stage reads one dataset; training on the environments one after another forgets the first).

    Each part is a dataset as a recipe writes one (``source``, ``split``, ``params``, ``limit``); a part without
    ``split`` takes the mixture's, so ``split: test`` of the mixture is every part's held-out split. Its ``limit``
    sets how many of its rows the mixture takes. Columns are the union of the parts' columns; a row lacks (``None``)
    those its part does not have, as in ``multi_env``'s mixture."""
    from datasets.exceptions import DatasetGenerationError
    from pydantic import ValidationError

    from trl_ext.errors import validation_message
    from trl_ext.recipe import EMBEDDED_PREFIX, DatasetSpec, did_you_mean
    from trl_ext.stage import local_source_errors
    from trl_ext_plugins.rollout.multi_env import _load, current_catalog

    if not parts or not isinstance(parts, list):
        raise ValueError(f"mixture: give its datasets as a list, parts: [{{source: ..., params: ...}}, ...]; "
                         f"got {parts!r}")
    catalog, loaded = current_catalog(), []
    for index, part in enumerate(parts):
        if not isinstance(part, dict):
            raise ValueError(f"mixture parts[{index}]: a dataset mapping (source, split, params, limit), got {part!r}")
        try:
            spec = DatasetSpec(**{"split": split, **part})
        except ValidationError as exc:
            problems = "; ".join(f"parts[{index}].{'.'.join(map(str, e['loc']))}: {validation_message(e)}"
                                 for e in exc.errors())
            raise ValueError(f"mixture {problems}") from None
        name = spec.source.removeprefix(EMBEDDED_PREFIX)
        if spec.source.startswith(EMBEDDED_PREFIX) and name not in catalog.datasets:
            raise ValueError(f"mixture parts[{index}].source: no embedded dataset {name!r}."
                             f"{did_you_mean(name, sorted(catalog.datasets))}")
        if not spec.source.startswith(EMBEDDED_PREFIX):
            # The checks of a stage's own local dataset (a torn line, a malformed CSV row, no rows, a plain folder),
            # naming the part and the file's line, rather than datasets' DatasetGenerationError naming neither.
            problems = local_source_errors(spec, f"mixture parts[{index}]")
            if problems:
                raise ValueError("; ".join(problems))
        try:
            data = _load(spec, catalog, None)
        except (ValueError, TypeError, KeyError, OSError) as exc:  # OSError: a missing file, a hub id offline
            raise ValueError(f"mixture parts[{index}] ({spec.source}): {exc}") from None
        except DatasetGenerationError as exc:  # a file datasets cannot read: its cause says why
            raise ValueError(f"mixture parts[{index}] ({spec.source}): {exc.__cause__ or exc}") from None
        if len(data) == 0:
            raise ValueError(f"mixture parts[{index}] ({spec.source}): no rows in split {spec.split!r}")
        loaded.append(data)
    columns = list(dict.fromkeys(c for data in loaded for c in data.column_names))
    rows = [{c: row.get(c) for c in columns} for data in loaded for row in data]
    random.Random(seed).shuffle(rows)
    try:
        return Dataset.from_list(rows)
    except (TypeError, ValueError) as exc:  # pyarrow's ArrowInvalid is a ValueError
        raise ValueError(f"mixture: the parts' columns do not share types ({exc})") from None


def _calc_tool(*args, **kwargs) -> Dataset:
    from trl_ext_plugins.rollout.tool_task import calc_tool_trajectories

    return calc_tool_trajectories(*args, **kwargs)


def _calc_tool_prompts(*args, **kwargs) -> Dataset:
    from trl_ext_plugins.rollout.tool_envs import calc_tool_prompts

    return calc_tool_prompts(*args, **kwargs)


def _reasoning_gym(*args, **kwargs) -> Dataset:
    from trl_ext_plugins.rollout.reasoning_gym_env import reasoning_gym_dataset

    return reasoning_gym_dataset(*args, **kwargs)


DATASETS = {"arithmetic_proposals": arithmetic_proposals, "arithmetic_chain": arithmetic_chain,
            "arithmetic_chain_proposals": arithmetic_chain_proposals, "calc_tool": _calc_tool,
            "calc_tool_prompts": _calc_tool_prompts, "reasoning_gym": _reasoning_gym, "mixture": dataset_mixture}
