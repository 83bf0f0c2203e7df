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


def _stage():
    from trl_ext.recipe import StageSpec

    return StageSpec(trainer="grpo", model="m", dataset={"source": "embedded:instruction_arithmetic"})


def test_rows_that_cannot_be_scored_deterministically_are_refused_naming_the_row():
    """if-verifiable skips an unknown id and scores the rest (a typo passed binary_strict with the constraint
    unchecked), and draws a checker's missing arguments at random (the same answer scored 1 or 0 call to call): the
    dataset is refused when the stage prepares it, and the reward refuses such a row instead of scoring it."""
    from datasets import Dataset

    from trl_ext.errors import RecipeError
    from trl_ext_plugins.rewards.constraints import row_problems

    typo = ["keywords:existence", "length_constraints:number_word"]
    rows = {"instruction_id_list": [IDS, typo, ["length_constraints:number_words"], IDS[:1]],
            "kwargs": [ARGS, ARGS[2:] + [{}], [{"relation": None, "num_words": None}], [ARGS[0], ARGS[1]]]}
    problems = row_problems(rows["instruction_id_list"], rows["kwargs"], "ifeval")
    assert problems == [
        "row 1: unknown ifeval constraint id 'length_constraints:number_word'",
        "row 2: length_constraints:number_words lacks arguments (given: none); if-verifiable would draw the rest at "
        "random, so the reward would be random",
        "row 3: 1 constraint ids but 2 kwargs mappings"]
    assert row_problems([["count:word_count_range"]], [[{}]], "ifeval") == [
        "row 0: unknown ifeval constraint id 'count:word_count_range'"]  # an IFBench id under ifeval
    with pytest.raises(ValueError, match="row 1: unknown ifeval constraint id"):
        _fn(score="binary_strict")(completions=["cats purr."] * 2, prompts=None,
                                   instruction_id_list=rows["instruction_id_list"][:2], kwargs=rows["kwargs"][:2])
    plugin = Constraints(ConstraintsParams())
    with pytest.raises(RecipeError) as err:
        plugin.trl_ext_prepare_dataset(dataset=Dataset.from_dict({"prompt": ["p"] * 4, **rows}), split="train",
                                       stage=_stage())
    assert err.value.messages[0] == ("constraints: train dataset 'embedded:instruction_arithmetic' row 1: unknown "
                                     "ifeval constraint id 'length_constraints:number_word'")
    assert len(err.value.messages) == 3


def test_a_checker_needing_missing_nltk_data_is_named_before_training(monkeypatch):
    from trl_ext_plugins.rewards import constraints

    class NeedsPunkt:
        def __init__(self, instruction_id):
            pass

        def build_description(self, **kwargs):
            return ""

        def get_instruction_args(self):
            return {}

        def check_following(self, value):
            raise LookupError("Resource punkt_tab not found.\n  >>> import nltk\n  >>> nltk.download('punkt_tab')")

    monkeypatch.setattr(constraints, "checker_registry", lambda benchmark: {"sentences": NeedsPunkt})
    constraints.checker_problem.cache_clear()
    try:
        assert constraints.row_problems([["sentences"]], [[{}]], "ifeval") == [
            "row 0: sentences needs NLTK data 'punkt_tab', which is not installed (python -m nltk.downloader "
            "punkt_tab)"]
    finally:
        constraints.checker_problem.cache_clear()


def test_loading_the_ifbench_checkers_downloads_nothing(monkeypatch):
    """if-verifiable's IFBench module fetches missing NLTK data into ~/nltk_data at import: nothing may download at
    run time or write outside the run, so the import runs with nltk.download disabled."""
    import sys

    import nltk

    from trl_ext_plugins.rewards.constraints import checker_registry

    downloads = []
    monkeypatch.setattr(nltk, "download", lambda name, *args, **kwargs: downloads.append(name))
    monkeypatch.setattr(nltk.data, "find", lambda path, *args, **kwargs: (_ for _ in ()).throw(LookupError(path)))
    for name in [m for m in sys.modules if m.startswith("if_verifiable.ifbench")]:
        monkeypatch.delitem(sys.modules, name)  # import afresh: the download runs at module import
    registry = checker_registry("ifbench")
    assert len(registry) > 50 and downloads == []
    assert nltk.download is not None and nltk.download("x") is None and downloads == ["x"]  # the spy is back

def test_the_embedded_instruction_task_passes_the_check():
    from trl_ext.catalog import Catalog
    from trl_ext.runner import load_split

    stage = _stage()
    data = load_split(stage.dataset, Catalog.discover(), stage, "train", None)
    assert Constraints(ConstraintsParams()).trl_ext_prepare_dataset(dataset=data, split="train", stage=stage) is None
