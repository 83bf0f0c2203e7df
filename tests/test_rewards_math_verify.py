"""math_verify: a table of equivalent / non-equivalent answers; unparsable gold gives None for that row only."""

import pytest

from trl_ext.rewards import RewardFunction
from trl_ext.testing import check_plugin_conformance
from trl_ext_plugins.rewards.verify_math import MathVerify, MathVerifyParams

CASES = [  # (completion, gold, expected reward)
    (r"so \boxed{\frac{1}{2}}", "0.5", 1.0),
    (r"The answer is $0.5$", r"\frac{1}{2}", 1.0),
    ("The answer is 0.5", "1/2", 1.0),
    ("42", "42", 1.0),
    (r"\boxed{\dfrac{1}{3}}", r"$\frac13$", 1.0),
    (r"\boxed{x^2+2x+1}", "$(x+1)^2$", 1.0),
    (r"\(\frac{3}{4}\)", "0.75", 1.0),
    (r"first 3, finally \boxed{5}", "5", 1.0),  # boxed wins over earlier numbers
    (r"\boxed{\sqrt{4}}", "2", 1.0),
    (r"\boxed{50\%}", "0.5", 1.0),
    (r"\boxed{3}", "4", 0.0),
    (r"\boxed{\frac{1}{3}}", "0.33", 0.0),
    ("", "5", 0.0),
    ("no number here", "5", 0.0),
    (r"\boxed{2}", "not a number", None),
    # Gold answers as MATH / DAPO / verl datasets store them: bare LaTeX, no $...$. Read as written they parsed to a
    # prefix (2 of 2\sqrt{3}, so \boxed{2} scored right) or to nothing (the row went unscored).
    (r"\boxed{2\sqrt{3}}", r"2\sqrt{3}", 1.0),
    (r"\boxed{2}", r"2\sqrt{3}", 0.0),
    (r"\boxed{1024}", r"2^{10}", 1.0),
    (r"\boxed{2}", r"2^{10}", 0.0),
    (r"\boxed{(1, 2)}", "(1, 2)", 1.0),
    (r"\boxed{2}", "(1, 2)", 0.0),
    (r"\boxed{\pi}", r"\pi", 1.0),
    (r"\boxed{\dfrac{3}{4}}", r"\dfrac{3}{4}", 1.0),
    (r"\boxed{\frac{1+\sqrt{5}}{2}}", r"\frac{1+\sqrt{5}}{2}", 1.0),
    (r"\boxed{x+y}", "x + y", 1.0),
    (r"\boxed{xy}", "x + y", 0.0),
    ("42", "Answer is forty two.", None),  # prose, not LaTeX: still unparsable
]


def _reward(**params) -> RewardFunction:
    (fn,) = MathVerify(MathVerifyParams(**params)).trl_ext_reward_functions(stage=None)
    return fn


def test_table_of_cases():
    fn = _reward()
    got = fn.fn(completions=[c for c, _, _ in CASES], answer=[g for _, g, _ in CASES])
    assert got == [e for _, _, e in CASES]


def test_conversational_completions_and_scale():
    fn = _reward(correct_reward=10.0, wrong_reward=-1.0, answer_column="solution", weight=0.5)
    completions = [[{"role": "assistant", "content": r"\boxed{1/2}"}], [{"role": "assistant", "content": "7"}]]
    assert fn.fn(completions=completions, solution=["0.5", "8"]) == [10.0, -1.0]
    assert fn.name == "math_verify" and fn.weight == 0.5


def test_none_rows_leave_other_rewards_scored():
    """A gold answer math-verify cannot parse gives None: the weighted evaluation sum still uses other rewards."""
    from trl_ext.rewards import weighted_reward

    other = RewardFunction("format", lambda completions, **kw: [0.25] * len(completions), 2.0)
    total = weighted_reward([_reward(), other])(completions=["1", "1"], answer=["1", "?!"])
    assert total == [1.0 + 0.5, 0.5]


def test_conformance():
    check_plugin_conformance(MathVerify)
