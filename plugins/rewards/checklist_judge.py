"""``checklist_judge``: RLCF per-prompt weighted checklist, item scores from a judge or from verifier programs."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

from pydantic import Field

from trl_ext import hookimpl
from trl_ext.rewards import RewardFunction
from trl_ext_plugins.rewards import formulas, judging
from trl_ext_plugins.rewards.llm_judge import JudgeBackendParams, JudgeReward, backend_errors

ITEM_MAX = 100.0


def _words(text: str) -> int:
    return len(text.split())


# name -> check(completion, argument) -> passes. A spec is "<name>:<argument>" (the argument may contain ':').
VERIFIERS: dict[str, Callable[[str, str], bool]] = {
    "contains": lambda text, arg: arg in text,
    "not_contains": lambda text, arg: arg not in text,
    "icontains": lambda text, arg: arg.lower() in text.lower(),
    "regex": lambda text, arg: re.search(arg, text) is not None,
    "max_words": lambda text, arg: _words(text) <= int(arg),
    "min_words": lambda text, arg: _words(text) >= int(arg),
    "max_chars": lambda text, arg: len(text) <= int(arg),
    "starts_with": lambda text, arg: text.lstrip().startswith(arg),
    "ends_with": lambda text, arg: text.rstrip().endswith(arg),
}


def parse_verifier(spec: str) -> tuple[Callable[[str, str], bool], str]:
    """``"max_words:50"`` -> (check, "50"); a ValueError names the known verifiers or the bad argument."""
    name, sep, arg = spec.partition(":")
    if not sep or name not in VERIFIERS:
        raise ValueError(f"checklist_judge: unknown verifier {spec!r}; use <name>:<argument> with name one of "
                         f"{sorted(VERIFIERS)}")
    check = VERIFIERS[name]
    try:  # reject bad arguments up front (e.g. max_words:x, an invalid regex)
        check("", arg)
    except (ValueError, re.error) as exc:
        raise ValueError(f"checklist_judge: bad argument in verifier {spec!r}: {exc}") from None
    return check, arg


def run_verifier(spec: str, completion: str) -> float:
    """100.0 if the completion passes the verifier program, else 0.0."""
    check, arg = parse_verifier(spec)
    return ITEM_MAX if check(completion, arg) else 0.0


def normalise_checklist(value: Any) -> list[dict[str, Any]] | None:
    """A row's checklist as ``[{"item", "weight", "verifier"}]`` (JSON string or list of dicts/strings); ``None`` or
    an empty list when the row has none. A bare string item gets weight 1 and no verifier."""
    if value is None:
        return None
    if isinstance(value, str):
        value = json.loads(value) if value.strip() else []
    out = []
    for entry in value:
        if isinstance(entry, str):
            entry = {"item": entry}
        weight = entry.get("weight")
        out.append({"item": str(entry.get("item") or ""), "weight": 1.0 if weight is None else float(weight),
                    "verifier": entry.get("verifier") or None})
    return out


class ChecklistJudgeParams(JudgeBackendParams):
    checklist_column: str = Field("checklist", description="dataset column with each prompt's checklist: a list of "
                                  "{item, weight, verifier (optional)} (or its JSON string)")
    samples: int = Field(1, gt=0, description="judge samples per item, averaged (RLCF ~25; use temperature > 0 so "
                         "they differ)")
    template: str | None = Field(None, description="item prompt (str.format): {prompt} {item} {completion} {low} "
                                 "{high} {instruction}; None: the built-in template")
    fallback: float = Field(0.0, ge=0, le=100, description="item score (0-100) when none of an item's judge samples "
                            "parses; counted in the `checklist_judge/unparsable` metrics")


class ChecklistJudge(JudgeReward):
    """Checklist reward, RLCF (Viswanathan et al., arXiv 2507.18624): R(x, y) = sum_j w_j s_j / sum_j w_j.

    Each row carries its checklist ``[{item, weight, verifier}]`` in ``checklist_column`` (the paper's teacher-made
    "candidate-based" checklists, WildChecklists; generating them is a data step, not part of this reward). Item
    scores s_j in [0, 100]: an item with a ``verifier`` program is scored by code (100 pass / 0 fail), which
    *replaces* the judge for that item (the judge is not asked; the paper combines both, we chose the deterministic
    override ALGORITHMS.md allows); other items are scored by the judge (``llm_judge``'s backends and parser, on a
    0-100 scale) averaged over ``samples`` judge samples (paper ~25; default 1, greedy). An item none of whose
    samples parse scores ``fallback`` (0), counted in ``checklist_judge/unparsable*`` metrics. Without a judge
    (``path`` and ``endpoint`` unset) every item must carry a verifier.

    Verifier programs (``<name>:<argument>``): ``contains``, ``not_contains``, ``icontains``, ``regex`` (re.search),
    ``max_words``, ``min_words``, ``max_chars``, ``starts_with``, ``ends_with``; specs are checked when the dataset is
    prepared. Weights default to 1 for items without one. Conventions: the reward is on the paper's 0-100 scale (set
    ``weight`` to rescale; GRPO's group normalisation is scale-free); a row without a checklist gets ``None`` (the
    reward does not apply; other reward functions still score it). The paper trains with offline DPO on pairs with
    large score gaps; here the score is a reward for any RL stage (GRPO/RLOO).
    """

    name = "checklist_judge"
    Params = ChecklistJudgeParams

    @hookimpl
    def trl_ext_validate_stage(self, stage, plugins):
        p = self.params
        if p.path is None and p.endpoint is None:  # verifier-only checklists need no judge
            return None
        return backend_errors(self.name, p)

    @hookimpl
    def trl_ext_prepare_dataset(self, dataset, split, stage):
        column = self.params.checklist_column
        if column not in dataset.column_names:
            raise ValueError(f"checklist_judge: checklist_column {column!r} is not a column of the {split} dataset "
                             f"(columns: {dataset.column_names})")
        for row, value in enumerate(dataset[column]):
            for entry in normalise_checklist(value) or []:
                if entry["verifier"] is not None:
                    parse_verifier(entry["verifier"])
                if not 0 <= entry["weight"] < float("inf"):  # also refuses NaN and inf
                    raise ValueError(f"checklist_judge: row {row} has a negative or non-finite item weight")
        return None

    def score(self, prompts, completions, log_metric=None, **kwargs) -> list[float | None]:
        p = self.params
        column = p.checklist_column
        if column not in kwargs:
            raise ValueError(f"checklist_judge: the batch has no {column!r} column")
        self.stats.start()
        checklists = [normalise_checklist(v) for v in kwargs[column]]
        answers = [judging.as_text(c) for c in completions]
        template = p.template or judging.CHECKLIST_TEMPLATE
        instruction = judging.POINTWISE_INSTRUCTION[p.reasoning]
        item_scores: list[list[float | None]] = []
        jobs, texts = [], []
        verified = 0
        for row, (checklist, prompt, answer) in enumerate(zip(checklists, prompts, answers, strict=True)):
            item_scores.append([None] * len(checklist or []))
            for j, entry in enumerate(checklist or []):
                if entry["verifier"] is not None:
                    item_scores[row][j] = run_verifier(entry["verifier"], answer)
                    verified += 1
                else:
                    jobs.append((row, j))
                    texts.append(template.format(prompt=judging.as_text(prompt), item=entry["item"],
                                                 completion=answer, low=0, high=100, instruction=instruction))
        if texts:
            if self.backend is None:
                raise ValueError("checklist_judge: items need a judge (set params.path or params.endpoint + model)")
            judged = judging.judge_scores(self.backend, texts, 0.0, ITEM_MAX, self.stats, samples=p.samples)
            for (row, j), value in zip(jobs, judged, strict=True):
                item_scores[row][j] = p.fallback if value is None else value
        rewards: list[float | None] = []
        for checklist, scores in zip(checklists, item_scores, strict=True):
            if not checklist or sum(e["weight"] for e in checklist) <= 0:
                rewards.append(None)
            else:
                rewards.append(formulas.checklist_score([e["weight"] for e in checklist], scores))
        self.stats.log(log_metric, {f"{self.name}/verified_items": float(verified)})
        return rewards

    @hookimpl
    def trl_ext_reward_functions(self, stage):
        return [RewardFunction(self.name, self.score, self.params.weight)]

    @hookimpl
    def trl_ext_trainer_created(self, trainer):
        if self.backend is not None:
            self.backend.bind(trainer)
