"""``math_verify``: mathematical answer equivalence with Hugging Face's math-verify package."""

from __future__ import annotations

import logging
import threading
from typing import Any

from pydantic import Field

from trl_ext import Plugin, PluginParams, hookimpl
from trl_ext.rewards import RewardFunction


class MathVerifyParams(PluginParams):
    weight: float = Field(1.0, description="weight of this reward in the weighted sum of reward functions")
    answer_column: str = Field("answer", description="dataset column holding the gold answer (LaTeX or plain)")
    correct_reward: float = Field(1.0, description="reward when the answer is equivalent (Tulu 3 RLVR uses 10)")
    wrong_reward: float = Field(0.0, description="reward when it is not (DAPO uses -1)")
    parsing_timeout: int = Field(5, description="seconds per parse (main thread only: math-verify uses SIGALRM)")
    verify_timeout: int = Field(5, description="seconds per equivalence check (main thread only)")


def completion_text(completion: Any) -> str:
    """The text of a plain or conversational completion (last assistant message)."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list) and completion:
        return str(completion[-1].get("content", ""))
    return ""


def math_verify_scores(completions: list[Any], answers: list[Any], parsing_timeout: int | None = 5,
                       verify_timeout: int | None = 5) -> list[bool | None]:
    """Per completion: True/False equivalence, or None when the gold answer cannot be parsed.

    Both sides are parsed with LaTeX extraction (``\\boxed{}`` tried first) and plain-expression extraction, so
    ``\\boxed{\\frac{1}{2}}``, ``$0.5$`` and ``1/2`` are equivalent. An empty or unparsable completion is wrong.
    """
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    if threading.current_thread() is not threading.main_thread():  # SIGALRM timeouts only work in the main thread
        parsing_timeout = verify_timeout = None
        logging.getLogger("math_verify").setLevel(logging.ERROR)
    config = [LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig()]
    out: list[bool | None] = []
    for completion, answer in zip(completions, answers, strict=True):
        gold = parse(str(answer), extraction_config=config, parsing_timeout=parsing_timeout)
        if not gold:
            out.append(None)
            continue
        pred = parse(completion_text(completion), extraction_config=config, parsing_timeout=parsing_timeout)
        out.append(bool(pred) and bool(verify(gold, pred, timeout_seconds=verify_timeout)))
    return out


class MathVerify(Plugin):
    """Verifiable math reward by answer equivalence (RLVR: Tulu 3, arXiv 2411.15124; DeepSeek-R1, arXiv 2501.12948).

    Uses the math-verify package (``parse`` + ``verify``, sympy-backed), which normalises LaTeX, ``\\boxed{}``,
    fractions, decimals, percentages and symbolic expressions: ``\\boxed{1/2}`` == ``0.5``. Reward ``correct_reward``
    (default 1.0, the RLVR 1/0 scale; Tulu 3 uses 10, DAPO +-1 via ``wrong_reward=-1``) or ``wrong_reward``.
    Conventions: the gold answer is parsed with the same extractors as the completion; a gold answer math-verify
    cannot parse gives ``None`` for that row (TRL ignores the function there; other rewards still score it); an
    empty/unparsable completion is wrong. Timeouts (SIGALRM) apply only in the main thread, as in TRL's
    ``accuracy_reward``, which this differs from by also accepting plain (non-LaTeX) answers on both sides. Requires
    the ``math`` extra.
    """

    name = "math_verify"
    family = "reward"
    trainers = frozenset({"grpo", "rloo"})
    requires = (("math_verify", "trl-ext[math]"),)
    Params = MathVerifyParams

    @hookimpl
    def trl_ext_reward_functions(self, stage):
        p = self.params

        def math_verify(completions, **kwargs):
            verdicts = math_verify_scores(completions, kwargs[p.answer_column], p.parsing_timeout, p.verify_timeout)
            return [None if v is None else (p.correct_reward if v else p.wrong_reward) for v in verdicts]

        return [RewardFunction(self.name, math_verify, p.weight)]
