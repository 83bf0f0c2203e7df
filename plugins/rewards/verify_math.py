"""``math_verify``: mathematical answer equivalence with Hugging Face's math-verify package."""

from __future__ import annotations

import logging
import re
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


# An escaped dollar (MATH's currency, "\\$18.90") is text, not a math delimiter.
_DELIMITED = re.compile(r"(?<!\\)\$|\\\(|\\\[|\\boxed|\\fbox")


def parse_gold(answer: str, config: list, parsing_timeout: int | None = 5) -> list:
    """The gold answer parsed as math-verify reads it.

    Datasets (MATH, DAPO-Math, verl's ``ground_truth``) store the gold answer as bare LaTeX without ``$...$``
    (``2\\sqrt{3}``, ``2^{10}``, ``(1, 2)``, ``\\pi``). Parsed as is, LaTeX extraction finds no anchor and the
    plain-expression extractor reads a prefix (``2`` of ``2\\sqrt{3}``) or nothing, so correct answers score wrong,
    wrong ones right, or the row is dropped. An undelimited gold that is not prose is therefore read as
    ``\\boxed{gold}`` first (verl's ``math_verify.compute_score`` does the same); the plain parse is the fallback.
    """
    from math_verify import LatexExtractionConfig, parse

    text = answer.strip()
    # Two words of letters ("not a number", "Answer is forty two") are prose, not LaTeX; single letters are variables.
    prose = sum(word.isalpha() and len(word) > 1 for word in text.split()) >= 2
    if text and not prose and not _DELIMITED.search(text):
        gold = parse("\\boxed{" + text + "}", extraction_config=[LatexExtractionConfig()],
                     parsing_timeout=parsing_timeout)
        if len(gold) >= 2:  # a sympy value was read (a lone string: LaTeX it could not interpret)
            return gold
    return parse(answer, extraction_config=config, parsing_timeout=parsing_timeout)


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
        if missing_answer(answer):  # str(None) is "None", a product of symbols that \boxed{None} would match
            out.append(None)
            continue
        gold = parse_gold(str(answer), config, parsing_timeout)
        if not gold:
            out.append(None)
            continue
        pred = parse(completion_text(completion), extraction_config=config, parsing_timeout=parsing_timeout)
        out.append(bool(pred) and bool(verify(gold, pred, timeout_seconds=verify_timeout)))
    return out


def missing_answer(answer: Any) -> bool:
    """A dataset cell that holds no gold answer: None, NaN (pandas' missing value) or blank text."""
    if answer is None:
        return True
    if isinstance(answer, float):
        return answer != answer
    return isinstance(answer, str) and not answer.strip()


class MathVerify(Plugin):
    """Verifiable math reward by answer equivalence (RLVR: Tulu 3, arXiv 2411.15124; DeepSeek-R1, arXiv 2501.12948).

    Uses the math-verify package (``parse`` + ``verify``, sympy-backed), which normalises LaTeX, ``\\boxed{}``,
    fractions, decimals, percentages and symbolic expressions: ``\\boxed{1/2}`` == ``0.5``. Reward ``correct_reward``
    (default 1.0, the RLVR 1/0 scale; Tulu 3 uses 10, DAPO +-1 via ``wrong_reward=-1``) or ``wrong_reward``.
    Conventions: the gold answer is parsed with the same extractors as the completion, except that a gold answer
    without math delimiters that is not prose (bare LaTeX as MATH, DAPO-Math and verl datasets store it: ``2\sqrt{3}``,
    ``2^{10}``) is read as ``\boxed{gold}`` first, as verl's math_verify scorer does; a gold answer math-verify
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
