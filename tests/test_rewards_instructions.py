"""embedded:instruction_arithmetic, the data of the constraints and checklist_judge recipes: a completion that follows
the row's instruction meets IFEval's checker and both checklist items; the bare answer meets neither constraint and
only the checklist's sum item; SFT rows follow their instruction in about follow_fraction of the rows."""

import pytest

from trl_ext.embedded.tokenizer import EOS_TOKEN
from trl_ext_plugins.rewards.checklist_judge import ChecklistJudge, ChecklistJudgeParams
from trl_ext_plugins.rewards.instructions import instruction_arithmetic

# written out by hand from the instruction texts, independently of INSTRUCTIONS
FOLLOWED = {"end with !": "{}!", "say ok": "{} ok", "add a title": "<<sum>> {}"}


def _followed(data):
    return [FOLLOWED[p.split(":")[0]].format(a) for p, a in zip(data["prompt"], data["answer"], strict=True)]


def test_checklist_items_score_sum_and_instruction():
    data = instruction_arithmetic("test", size=9)
    assert {p.split(":")[0] for p in data["prompt"]} == set(FOLLOWED)
    score = ChecklistJudge(ChecklistJudgeParams()).score
    rows = {"prompts": data["prompt"], "checklist": data["checklist"]}
    assert score(completions=_followed(data), **rows) == [100.0] * 9
    assert score(completions=data["answer"], **rows) == [50.0] * 9  # right sum, instruction ignored
    wrong = [f"1{a}" for a in data["answer"]]  # a wrong sum that contains the right one as a suffix
    assert score(completions=wrong, **rows) == [0.0] * 9
    # listing candidates around the sum, or its negation, is no right sum (only the instruction item is met)
    hedged = [FOLLOWED[p.split(":")[0]].format(f"{int(a) - 1} {a} {int(a) + 1}") for p, a in
              zip(data["prompt"], data["answer"], strict=True)]
    assert score(completions=hedged, **rows) == [50.0] * 9
    assert score(completions=[f"-{a}" for a in data["answer"]], **rows) == [0.0] * 9
    assert score(completions=[f"{a}.5" for a in data["answer"]], **rows) == [0.0] * 9


def test_ifeval_checkers_agree():
    pytest.importorskip("if_verifiable", reason="the constraints extra (if-verifiable) is not installed")
    from trl_ext_plugins.rewards.constraints import constraint_scores

    data = instruction_arithmetic("test", size=9)
    columns = (data["prompt"], data["instruction_id_list"], data["kwargs"])
    assert constraint_scores(_followed(data), *columns) == [1.0] * 9
    assert constraint_scores(data["answer"], *columns) == [0.0] * 9


def test_sft_rows_follow_in_a_fraction_and_are_always_right():
    rows = instruction_arithmetic("train", format="prompt_completion", size=600, follow_fraction=0.5)
    completions = [c.removesuffix(EOS_TOKEN) for c in rows["completion"]]
    followed = _followed(rows)
    bare_or_followed = [c in (f, a) for c, f, a in zip(completions, followed, rows["answer"], strict=True)]
    assert all(bare_or_followed)
    share = sum(c == f for c, f in zip(completions, followed, strict=True)) / len(rows)
    assert 0.4 < share < 0.6  # 600 seeded Bernoulli(0.5) draws
    assert rows["completion"] == instruction_arithmetic("train", format="prompt_completion", size=600)["completion"]
    assert set(instruction_arithmetic("train", size=5).column_names) == {"prompt", "answer", "instruction_id_list",
                                                                          "kwargs", "checklist"}
    with pytest.raises(ValueError, match="follow_fraction"):
        instruction_arithmetic(follow_fraction=1.5)
