"""Code-test formats, trainer-side verdicts and reward arithmetic (no sandbox needed), and validation of rows."""

import json

import pytest

from trl_ext_plugins.rewards.code_tests import (CallTest, StdioTest, TestFormatError, normalise_stdout, parse_tests,
                                                sample_reward, verdict)
from trl_ext_plugins.rewards.unit_tests import UnitTests, UnitTestsParams, extract_code, row_problems, verdict_metrics


def _ok(output, exit=0):
    return {"status": "exited", "exit": exit, "signal": None, "output": output}


def test_assert_lines_parse_into_call_tests():
    (t1, t2, t3) = parse_tests("assert add(1, 2) == 3\nassert [1, (2, 3)] == pairs(k=(2, 3))\nassert f(-1) == -2.5")
    assert t1 == CallTest("add", "(1, 2)", "{}", 3)
    assert t2.fn == "pairs" and t2.kwargs_literal == "{'k': (2, 3)}" and t2.expected == [1, [2, 3]]  # JSON-normalised
    assert t3.args_literal == "(-1,)" and t3.expected == -2.5
    assert t1.request() == {"kind": "call", "fn": "add", "args_literal": "(1, 2)", "kwargs_literal": "{}"}
    assert "expected" not in json.dumps(t1.request())  # expected values never go to the sandbox


def test_dict_apps_and_json_forms():
    as_dict = parse_tests([{"fn": "g", "args": [[1, 2]], "expected": {"a": 1}}])
    assert as_dict == [CallTest("g", "([1, 2],)", "{}", {"a": 1})]
    apps = parse_tests({"fn_name": "h", "inputs": [[1, 2], [3, 4]], "outputs": [3, 7]})
    assert apps[1] == CallTest("h", "(3, 4)", "{}", 7)
    assert parse_tests(json.dumps({"inputs": ["1 2\n"], "outputs": ["3\n"]})) == [StdioTest("1 2\n", "3\n")]
    assert parse_tests([{"input": "5", "output": "6"}]) == [StdioTest("5", "6")]
    assert parse_tests(None) == [] and parse_tests("") == [] and parse_tests("[]") == []
    assert StdioTest("5", "6").request() == {"kind": "stdio", "stdin": "5"}


@pytest.mark.parametrize("bad, why", [
    ("assert abs(f(1) - 0.5) < 1e-6", "neither"),
    ("check(candidate)", "neither"),
    ("assert f(x) == 1", "neither"),  # a non-literal argument
    ("assert f(1)", "neither"),
    ("assert f(1) != 2", "neither"),
    ("assert f(1) == {1, 2}", "neither"),  # a set is not JSON data
    ("def f(:", "not Python"),
    ([{"stdin": "1"}], "neither a function-call test"),
    ({"inputs": [1], "outputs": []}, "equal length"),
])
def test_unsupported_tests_are_refused_naming_the_test(bad, why):
    with pytest.raises(TestFormatError, match=why):
        parse_tests(bad)


def test_stdout_rules():
    assert normalise_stdout("1 2  \n3\n\n\n") == normalise_stdout("1 2\n3") == ["1 2", "3"]
    assert normalise_stdout(" 1\n") != normalise_stdout("1\n")  # leading spaces matter under `lines`
    assert normalise_stdout("1\n2 3", "tokens") == normalise_stdout("1 2\n3", "tokens")
    assert normalise_stdout("3\n", "exact") != normalise_stdout("3", "exact")


def test_verdicts_from_raw_replies():
    call = CallTest("f", "(1,)", "{}", [1, 2])
    assert verdict(call, _ok("[1, 2]")) == "pass"
    assert verdict(call, _ok("[1, 3]")) == "wrong"
    assert verdict(call, _ok('{"status": "pass"}')) == "wrong"
    assert verdict(call, _ok("not json")) == "invalid"
    assert verdict(call, _ok("")) == "no_result"  # exited 0 without reporting a value (sys.exit(0), os._exit(0))
    assert verdict(call, _ok("", exit=1)) == "error"
    assert verdict(call, {"status": "exited", "exit": None, "signal": 9, "output": ""}) == "error"
    assert verdict(call, {"status": "timeout", "exit": None, "signal": None, "output": "[1, 2]"}) == "timeout"
    assert verdict(call, {"status": "over_cap", "exit": None, "signal": None, "output": "[1, 2]"}) == "over_cap"
    assert verdict(call, None) == "no_result"
    assert verdict(CallTest("f", "()", "{}", 1), _ok("true")) == "pass"  # Python ==, as the assert would judge
    io = StdioTest("1\n", "2\n3\n")
    assert verdict(io, _ok("2  \n3")) == "pass"
    assert verdict(io, _ok("2\n3\n", exit=1)) == "error"
    assert verdict(io, _ok("23")) == "wrong"
    assert verdict(io, _ok("2 3"), "tokens") == "pass"


def test_reward_arithmetic_and_metrics():
    assert sample_reward(["pass", "wrong", "pass", "timeout"], "fraction") == 0.5
    assert sample_reward(["pass", "wrong", "pass", "timeout"]) == 0.0
    assert sample_reward(["pass", "pass"]) == 1.0
    metrics = verdict_metrics("unit_tests", [["pass", "wrong"], None, ["pass", "pass"]])
    assert metrics["unit_tests/tests_pass"] == 0.75 and metrics["unit_tests/tests_wrong"] == 0.25
    assert metrics["unit_tests/tests_timeout"] == 0.0 and metrics["unit_tests/all_tests_passed"] == 0.5


def test_extract_code():
    assert extract_code("text\n```python\nx = 1\n```\nmore\n```python\ny = 2\n```") == "y = 2\n"
    assert extract_code("z = 3") == "z = 3"


SOLUTION = "def f(x):\n    return x * x + 1\n"


@pytest.mark.parametrize("completion", [
    # an example block in another language before the code: its closing fence is not an opening one
    f"Input:\n```text\n2\n```\nSolution:\n```python\n{SOLUTION}```\n",
    f"Run it with:\n```bash\npython sol.py\n```\nwhere sol.py is\n```python3\n{SOLUTION}```",
    f"```console\n$ python sol.py\n5\n```\nthen\n```Python\n{SOLUTION}```",
    # a block inside a list item: the fence's indentation is not the code's
    "1. The function:\n   ```python\n" + "".join("   " + line for line in SOLUTION.splitlines(True)) + "   ```\n",
])
def test_extract_code_pairs_fences_by_line(completion):
    assert extract_code(completion) == SOLUTION
    assert extract_code(f"```py\n{SOLUTION.rstrip()}```") == SOLUTION.rstrip()  # closing fence right after the code


def test_rows_that_fit_neither_format_are_named():
    rows = [json.dumps(["assert f(1) == 2"]), "assert g(1) > 2", None, [{"stdin": "1", "stdout": "1"}]]
    problems = row_problems(rows)
    assert len(problems) == 1 and problems[0].startswith("row 1: ") and "assert g(1) > 2" in problems[0]


def test_validation_names_the_bad_row_of_a_local_dataset(tmp_path, monkeypatch):
    from trl_ext.recipe import StageSpec
    from trl_ext_plugins.rewards import unit_tests

    monkeypatch.setattr(unit_tests, "bwrap_problem", lambda python=None: None)
    data = tmp_path / "code.jsonl"
    rows = [{"prompt": "p", "tests": json.dumps(["assert f(1) == 2"])},
            {"prompt": "q", "tests": json.dumps(["assert sorted(f(1)) == [1]"])}]
    data.write_text("\n".join(json.dumps(r) for r in rows))
    plugin = UnitTests(UnitTestsParams())
    stage = StageSpec(trainer="grpo", model="m", dataset={"source": str(data)})
    (error,) = plugin.trl_ext_validate_stage(stage=stage, plugins=[plugin])
    assert error.startswith("dataset: ") and "row 1:" in error and "sorted(f(1))" in error


def test_embedded_code_task_rows_are_valid_and_solvable_by_their_references():
    from trl_ext.embedded.code_tasks import code_tasks_dataset, reference_solution

    train, test = code_tasks_dataset("train"), code_tasks_dataset("test")
    assert len(test) == 60 and len(train) == 2 * 9 * 20 - 60
    assert not set(train["prompt"]) & set(test["prompt"])
    assert row_problems(train["tests"]) == [] and row_problems(test["tests"]) == []
    sft = code_tasks_dataset("train", format="prompt_completion", size=3)
    assert sft[0]["completion"].endswith("<eos>")
    call = [r for r in train if r["prompt"].startswith("call")][0]
    a_b = call["prompt"].split("x*")[1].rstrip(":\n").split("+")
    assert reference_solution("call", int(a_b[0]), int(a_b[1])) in code_tasks_dataset(
        "train", format="prompt_completion")[train["prompt"].index(call["prompt"])]["completion"]
    assert all(isinstance(t, (CallTest, StdioTest)) for row in train["tests"] for t in parse_tests(row))


def test_imperfect_demonstrations_change_completions_never_tests():
    from trl_ext.embedded.code_tasks import code_tasks_dataset

    clean = code_tasks_dataset("train", format="prompt_completion", size=50)
    buggy = code_tasks_dataset("train", format="prompt_completion", size=50, buggy_fraction=1.0)
    assert clean["tests"] == buggy["tests"] and clean["prompt"] == buggy["prompt"]
    for prompt, good, bad in zip(clean["prompt"], clean["completion"], buggy["completion"]):
        a, b = prompt.split("x*")[1].rstrip(":\n").split("+")
        assert f"*{a}+{b}\n" in good or f"*{a}+{b})" in good
        assert f"*{a}+{b}+1" in bad
    some = code_tasks_dataset("train", format="prompt_completion", buggy_fraction=0.6)["completion"]
    share = sum("+1\n" in c or "+1)" in c for c in some) / len(some)
    assert 0.5 < share < 0.75  # about 60% (plus the rows whose b is 1)
    with pytest.raises(ValueError, match="buggy_fraction"):
        code_tasks_dataset(buggy_fraction=1.5)


def test_prepare_dataset_refuses_bad_rows_from_any_source():
    from datasets import Dataset

    from trl_ext.errors import RecipeError
    from trl_ext.recipe import StageSpec

    rows = Dataset.from_list([{"prompt": "p", "tests": "assert f(1) == 2"}, {"prompt": "q", "tests": "assert f(1) < 2"}])
    stage = StageSpec(trainer="grpo", model="m", dataset={"source": "some-org/hub-code"})
    with pytest.raises(RecipeError, match="'some-org/hub-code' row 1: tests: 'assert f.1. < 2' is neither"):
        UnitTests(UnitTestsParams()).trl_ext_prepare_dataset(dataset=rows, split="train", stage=stage)
    assert UnitTests(UnitTestsParams()).trl_ext_prepare_dataset(dataset=rows.select([0]), split="train",
                                                                stage=stage) is None
