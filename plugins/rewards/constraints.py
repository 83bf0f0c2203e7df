"""``constraints``: IFEval / IFBench instruction-following verifiers from the if-verifiable package."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from trl_ext import Plugin, PluginParams, hookimpl
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


def constraint_scores(completions: list[Any], prompts: list[Any], instruction_ids: list[Any], kwargs: list[Any],
                      benchmark: str = "ifeval", score: str = "partial_strict") -> list[float | None]:
    """One score per completion; rows with no constraints give None."""
    from if_verifiable import evaluate_output_for_sample
    from if_verifiable.types import IFBenchSample, IFEvalSample

    sample_cls = IFEvalSample if benchmark == "ifeval" else IFBenchSample
    out: list[float | None] = []
    for i, (completion, ids) in enumerate(zip(completions, instruction_ids, strict=True)):
        if not ids:
            out.append(None)
            continue
        # Arrow gives every mapping the union of keys, None-filled; checkers want only their own arguments.
        args = [{k: v for k, v in (a or {}).items() if v is not None} for a in kwargs[i]]
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
    """

    name = "constraints"
    aliases = ("ifeval",)
    family = "reward"
    trainers = frozenset({"grpo", "rloo"})
    requires = (("if_verifiable", "trl-ext[constraints]"),)
    Params = ConstraintsParams

    @hookimpl
    def trl_ext_reward_functions(self, stage):
        p = self.params

        def constraints(completions, prompts=None, **kwargs):
            return constraint_scores(completions, prompts, kwargs[p.instructions_column], kwargs[p.kwargs_column],
                                     p.benchmark, p.score)

        return [RewardFunction(self.name, constraints, p.weight)]
