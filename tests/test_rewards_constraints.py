"""constraints: IFEval checkers from if-verifiable on hand-made rows (fractions met, binary, None rows)."""

import pytest

pytest.importorskip("if_verifiable", reason="the constraints extra (if-verifiable) is not installed")

from trl_ext.testing import check_plugin_conformance  # noqa: E402
from trl_ext_plugins.rewards.constraints import Constraints, ConstraintsParams  # noqa: E402

IDS = ["change_case:english_lowercase", "length_constraints:number_words", "keywords:existence"]
# Arrow-style kwargs: every mapping carries the union of keys, None where unused
ARGS = [{"relation": None, "num_words": None, "keywords": None},
        {"relation": "less than", "num_words": 10, "keywords": None},
        {"relation": None, "num_words": None, "keywords": ["purr"]}]
RESPONSES = ["cats purr softly at night.",  # all three met
             "Cats Purr softly.",  # not lowercase: 2/3
             "cats are wonderful animals that sleep all day long and night too."]  # only lowercase: 1/3


def _fn(**params):
    (fn,) = Constraints(ConstraintsParams(**params)).trl_ext_reward_functions(stage=None)
    return fn.fn


def test_partial_and_binary_scores():
    rows = dict(prompts=["Write about cats."] * 3, instruction_id_list=[IDS] * 3, kwargs=[ARGS] * 3)
    assert _fn()(completions=RESPONSES, **rows) == pytest.approx([1.0, 2 / 3, 1 / 3])
    assert _fn(score="binary_strict")(completions=RESPONSES, **rows) == [1.0, 0.0, 0.0]


def test_rows_without_constraints_are_none_and_chat_format():
    chat = [[{"role": "assistant", "content": "cats purr."}], [{"role": "assistant", "content": "x"}]]
    got = _fn()(completions=chat, prompts=[[{"role": "user", "content": "p"}]] * 2,
                instruction_id_list=[IDS[2:], []], kwargs=[ARGS[2:], []])
    assert got == [1.0, None]
    check_plugin_conformance(Constraints)
