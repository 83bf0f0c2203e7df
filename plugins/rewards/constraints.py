"""``constraints``: IFEval / IFBench instruction-following verifiers from the if-verifiable package."""

from __future__ import annotations

import contextlib
import functools
import json
import random
import re
from typing import Any, Literal

from pydantic import Field

from trl_ext import Plugin, PluginParams, hookimpl
from trl_ext.errors import RecipeError
from trl_ext.rewards import RewardFunction
from trl_ext_plugins.rewards.verify_math import completion_text


class ConstraintsParams(PluginParams):
    weight: float = Field(1.0, description="weight of this reward in the weighted sum of reward functions")
    benchmark: Literal["ifeval", "ifbench"] = Field("ifeval", description="checker registry: IFEval or IFBench ids")
    score: Literal["partial_strict", "partial_loose", "binary_strict", "binary_loose"] = Field(
        "partial_strict", description="fraction of constraints met (partial) or 1 only if all are met (binary); "
        "loose also accepts the response with first/last line or markdown emphasis removed (IFEval's loose mode)")
    instructions_column: str = Field("instruction_id_list", description="dataset column: list of constraint ids")
    kwargs_column: str = Field("kwargs", description="dataset column: one argument mapping per constraint")


@contextlib.contextmanager
def no_nltk_downloads():
    """Turn ``nltk.download`` into a no-op for the block.

    if-verifiable's IFBench module calls ``nltk.download`` at import for every NLTK resource it cannot find: a network
    fetch into ``~/nltk_data``, outside the run (and nothing may download at run time). A checker whose data is missing
    is refused by :func:`checker_problem` instead, naming the resource to install."""
    import nltk

    original = nltk.download
    nltk.download = lambda *args, **kwargs: False
    try:
        yield
    finally:
        nltk.download = original


def checker_registry(benchmark: str) -> dict:
    """The checker classes if-verifiable knows for ``benchmark``, by constraint id."""
    if benchmark == "ifeval":
        from if_verifiable.ifeval.instructions_registry import INSTRUCTION_DICT
    else:
        with no_nltk_downloads():
            from if_verifiable.ifbench.instructions_registry import INSTRUCTION_DICT
    return INSTRUCTION_DICT


def row_arguments(ids: list[str], kwargs: Any) -> list[dict]:
    """One argument mapping per constraint id. Arrow gives every mapping the union of keys, None-filled; checkers want
    only their own arguments (if-verifiable drops the Nones the same way)."""
    mappings = list(kwargs or [])
    if len(mappings) != len(ids):  # if-verifiable would index past the end, or give the extra ids no arguments
        raise ValueError(f"{len(ids)} constraint ids but {len(mappings)} kwargs mappings")
    return [{k: v for k, v in (a or {}).items() if v is not None} for a in mappings]


_PROBE = "A probe sentence for the checker. Another sentence follows here, with a few more words."


@functools.lru_cache(maxsize=4096)
def checker_problem(benchmark: str, instruction_id: str, arguments_json: str) -> str | None:
    """Why this constraint cannot be scored as a deterministic verifier, or None.

    if-verifiable skips an id it does not know and scores the rest (a typo or another benchmark's id passes
    unchecked under binary scores); a checker given fewer arguments than it needs draws the rest at random (IFEval's
    ``build_description``: a random keyword, word count, relation), so the same answer scores differently call to
    call; and sentence checkers need NLTK data that is not installed offline, which fails mid-training. The random draw
    is found by building the checker under several seeds (the global RNG is restored)."""
    registry = checker_registry(benchmark)
    if instruction_id not in registry:
        return f"unknown {benchmark} constraint id {instruction_id!r}"
    arguments = json.loads(arguments_json)
    state = random.getstate()
    built = set()
    try:
        for seed in range(4):
            random.seed(seed)
            checker = registry[instruction_id](instruction_id)
            checker.build_description(**arguments)
            built.add(repr(checker.get_instruction_args()))
        checker.check_following(_PROBE)
    except TypeError as exc:
        return f"{instruction_id}: arguments {sorted(arguments)} not accepted ({exc})"
    except LookupError as exc:  # nltk.data.find names the resource as nltk.download('<name>') in its message
        named = re.search(r"nltk\.download\('([^']+)'\)", str(exc))
        resource = named.group(1) if named else "the data its message names"
        return (f"{instruction_id} needs NLTK data {resource!r}, which is not installed (python -m nltk.downloader "
                f"{resource})")
    finally:
        random.setstate(state)
    if len(built) > 1:
        return (f"{instruction_id} lacks arguments (given: {', '.join(sorted(arguments)) or 'none'}); if-verifiable "
                f"would draw the rest at random, so the reward would be random")
    return None


def problems_of_row(ids: list[str], kwargs: Any, benchmark: str) -> list[str]:
    """What keeps one row's constraints from being scored deterministically (empty when nothing does)."""
    try:
        args = row_arguments(ids, kwargs)
    except ValueError as exc:
        return [str(exc)]
    found = (checker_problem(benchmark, instruction_id, json.dumps(arguments, sort_keys=True, default=str))
             for instruction_id, arguments in zip(ids, args))
    return [problem for problem in found if problem]


def row_problems(instruction_ids: list[Any], kwargs: list[Any], benchmark: str) -> list[str]:
    """One message per problem of every row with constraints (``row i: ...``)."""
    return [f"row {i}: {problem}" for i, ids in enumerate(instruction_ids) if ids
            for problem in problems_of_row(ids, kwargs[i], benchmark)]


def constraint_scores(completions: list[Any], prompts: list[Any], instruction_ids: list[Any], kwargs: list[Any],
                      benchmark: str = "ifeval", score: str = "partial_strict") -> list[float | None]:
    """One score per completion; rows with no constraints give None. A row that cannot be scored deterministically
    (:func:`row_problems`) raises ValueError naming it rather than score over part of its constraints."""
    from if_verifiable import evaluate_output_for_sample
    from if_verifiable.types import IFBenchSample, IFEvalSample

    sample_cls = IFEvalSample if benchmark == "ifeval" else IFBenchSample
    out: list[float | None] = []
    for i, (completion, ids) in enumerate(zip(completions, instruction_ids, strict=True)):
        if not ids:
            out.append(None)
            continue
        problems = problems_of_row(ids, kwargs[i], benchmark)
        if problems:
            raise ValueError(f"constraints: row {i}: {problems[0]}")
        args = row_arguments(ids, kwargs[i])
        prompt = completion_text(prompts[i]) if prompts is not None else ""
        sample = sample_cls(key=i, prompt=prompt, instruction_id_list=list(ids), kwargs=args)
        _, scores = evaluate_output_for_sample(benchmark, sample, completion_text(completion))
        out.append(float(getattr(scores, score)))
    return out


class Constraints(Plugin):
    """Instruction-following constraint reward (RLVR with IF verifiers: Tulu 3, arXiv 2411.15124; IFEval, arXiv
    2311.07911; IFBench, arXiv 2507.02833).

    Uses the maintained ``if-verifiable`` package (the IFEval and IFBench checker registries) instead of hand-written
    checkers. Each dataset row lists constraint ids (``instruction_id_list``, e.g. ``keywords:existence``) and their
    arguments (``kwargs``), exactly IFEval's format. Default score ``partial_strict`` = fraction of the row's
    constraints met in strict mode (Tulu 3 uses all-or-nothing = ``binary_strict``; choose per recipe). Rows without
    constraints give None. Requires the ``constraints`` extra (``pip install trl-ext[constraints]``).

    The verifier must be deterministic and check every constraint it is given, which if-verifiable alone does not
    ensure: it skips ids it does not know and scores the rest, and it draws a checker's missing arguments at random.
    So rows with an unknown id (a typo, or an IFBench id under ``benchmark: ifeval``), with a kwargs list whose length
    differs from the ids', with a checker that still lacks arguments, or with a checker whose NLTK data is not
    installed are refused when the stage prepares its dataset (one line per row, naming it), and the reward raises on
    such a row instead of scoring it.
    """

    name = "constraints"
    aliases = ("ifeval",)
    family = "reward"
    trainers = frozenset({"grpo", "rloo"})
    requires = (("if_verifiable", "trl-ext[constraints]"),)
    Params = ConstraintsParams

    @hookimpl
    def trl_ext_prepare_dataset(self, dataset, split, stage):
        p = self.params
        if p.instructions_column not in dataset.column_names or p.kwargs_column not in dataset.column_names:
            return None
        problems = row_problems(dataset[p.instructions_column], dataset[p.kwargs_column], p.benchmark)
        if problems:
            spec = stage.eval_dataset if split == "eval" and stage.eval_dataset is not None else stage.dataset
            shown = problems[:5] + ([f"... and {len(problems) - 5} more"] if len(problems) > 5 else [])
            raise RecipeError([f"constraints: {split} dataset {spec.source!r} {m}" for m in shown])
        return None

    @hookimpl
    def trl_ext_reward_functions(self, stage):
        p = self.params

        def constraints(completions, prompts=None, **kwargs):
            return constraint_scores(completions, prompts, kwargs[p.instructions_column], kwargs[p.kwargs_column],
                                     p.benchmark, p.score)

        return [RewardFunction(self.name, constraints, p.weight)]
