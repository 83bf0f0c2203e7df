"""Code-test formats and verdicts, computed by the trainer from the sandbox's raw outputs (pure functions).

Two test formats, the ones code-RL datasets use:

* **function call** (MBPP / HumanEval / APPS ``fn_name`` style): a function name, its arguments and the expected return
  value. Written as ``{"fn": "add", "args": [1, 2], "kwargs": {}, "expected": 3}``, as an APPS-style mapping
  ``{"fn_name": "add", "inputs": [[1, 2], ...], "outputs": [3, ...]}``, or as ``assert add(1, 2) == 3`` lines, which are
  parsed with :mod:`ast` (either side of ``==`` may be the call; arguments and the expected value must be literals).
  A ``class Solution`` method of that name is called when there is no module-level function (LeetCode style).
* **stdin/stdout** (APPS / CodeContests / LiveCodeBench style): ``{"stdin": "1 2\\n", "stdout": "3\\n"}`` or an
  APPS-style mapping ``{"inputs": ["1 2\\n", ...], "outputs": ["3\\n", ...]}`` without ``fn_name``.

A ``tests`` value may be a list of such items, one mapping, Python source made only of such ``assert`` lines, or any of
these as a JSON string (Arrow columns cannot mix value types across rows, so datasets usually store JSON text).
Anything else (``assert abs(f(x) - 1.5) < 1e-6``, ``check(candidate)``, a non-literal argument) is refused with
:class:`TestFormatError`, which names the offending test; :mod:`unit_tests` turns it into a validation error naming
the row.

Comparison rules (the trainer's, documented because frameworks differ):

* function call: the candidate's return value crosses the sandbox boundary as ``json.dumps`` text and is read back
  with ``json.loads`` (plain data only: no custom ``__eq__`` survives); the expected value goes through the same JSON
  round trip, then Python ``==`` decides. So tuples equal lists, dict keys compare as strings, ``1 == 1.0`` and
  ``True == 1`` as in the ``assert``. Arguments are sent as Python literals, so tuples, sets and bytes arrive intact.
* stdin/stdout, option ``stdout_match``: ``lines`` (default) ignores trailing whitespace on every line and trailing
  blank lines, everything else must match exactly; ``tokens`` compares whitespace-separated tokens (APPS' lenient
  rule); ``exact`` compares the text byte for byte.

Verdicts: ``pass``; ``wrong`` (an output that differs); ``error`` (exception, non-zero exit, killed, or source that
does not compile); ``no_result`` (the process ended successfully without reporting a value, e.g. ``sys.exit(0)`` or
``os._exit(0)`` before the call returned, or the sandbox died); ``timeout``; ``over_cap`` (output beyond the cap);
``invalid`` (a result that is not JSON). Only ``pass`` passes.
"""

from __future__ import annotations

import ast
import json
from dataclasses import dataclass
from typing import Any, Literal, Union

VERDICTS = ("pass", "wrong", "error", "no_result", "timeout", "over_cap", "invalid")
StdoutMatch = Literal["lines", "tokens", "exact"]


class TestFormatError(ValueError):
    """A test that is neither a function-call nor a stdin/stdout test."""

    __test__ = False  # not a pytest test class


@dataclass(frozen=True)
class CallTest:
    fn: str
    args_literal: str  # repr of the argument tuple, rebuilt with ast.literal_eval inside the sandbox
    kwargs_literal: str
    expected: Any  # JSON-normalised; never sent to the sandbox

    def request(self) -> dict:
        return {"kind": "call", "fn": self.fn, "args_literal": self.args_literal,
                "kwargs_literal": self.kwargs_literal}


@dataclass(frozen=True)
class StdioTest:
    stdin: str
    stdout: str  # never sent to the sandbox

    def request(self) -> dict:
        return {"kind": "stdio", "stdin": self.stdin}


Test = Union[CallTest, StdioTest]


# ---------------------------------------------------------------------------------------------------------------------
# Parsing
# ---------------------------------------------------------------------------------------------------------------------


def parse_tests(value: Any) -> list[Test]:
    """All tests of one dataset row (empty for None / empty values); :class:`TestFormatError` names a bad one."""
    if value is None or (isinstance(value, (str, list, tuple, dict)) and len(value) == 0):
        return []
    if isinstance(value, str):
        text = value.strip()
        if text[:1] in "[{":
            try:
                return parse_tests(json.loads(text))
            except json.JSONDecodeError:
                pass  # a Python list/dict display is handled by the assert parser's error message
        return parse_asserts(value)
    if isinstance(value, dict):
        if "inputs" in value or "outputs" in value:
            return _apps_tests(value)
        return [_one_test(value, 0)]
    if isinstance(value, (list, tuple)):
        tests: list[Test] = []
        for index, item in enumerate(value):
            if isinstance(item, str):
                tests += parse_asserts(item, where=f"test {index}")
            else:
                tests.append(_one_test(item, index))
        return tests
    raise TestFormatError(f"tests must be assert lines, a mapping or a list, got {type(value).__name__}")


def parse_asserts(source: str, where: str = "tests") -> list[CallTest]:
    """``assert f(<literals>) == <literal>`` statements (either operand order) -> call tests."""
    try:
        module = ast.parse(source)
    except SyntaxError as exc:
        raise TestFormatError(f"{where}: not Python ({exc.msg}, line {exc.lineno})") from None
    tests = []
    for statement in module.body:
        text = ast.get_source_segment(source, statement) or ast.dump(statement)
        short = text if len(text) <= 80 else text[:77] + "..."
        test = _assert_to_call(statement)
        if test is None:
            raise TestFormatError(f"{where}: {short!r} is neither `assert f(<literal args>) == <literal>` nor a "
                                  f"stdin/stdout test")
        tests.append(test)
    return tests


def _assert_to_call(statement: ast.stmt) -> CallTest | None:
    if not isinstance(statement, ast.Assert) or not isinstance(statement.test, ast.Compare):
        return None
    compare = statement.test
    if len(compare.ops) != 1 or not isinstance(compare.ops[0], ast.Eq):
        return None
    left, right = compare.left, compare.comparators[0]
    call, expected_node = (left, right) if _is_plain_call(left) else (right, left)
    if not _is_plain_call(call):
        return None
    try:
        args = tuple(ast.literal_eval(a) for a in call.args)
        kwargs = {k.arg: ast.literal_eval(k.value) for k in call.keywords}
        expected = ast.literal_eval(expected_node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return None
    try:
        return _call_test(call.func.id, args, kwargs, expected)
    except TestFormatError:
        return None


def _is_plain_call(node: ast.expr) -> bool:
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
            and not any(isinstance(a, ast.Starred) for a in node.args) and all(k.arg for k in node.keywords))


def _call_test(fn: Any, args: Any, kwargs: Any, expected: Any) -> CallTest:
    if not isinstance(fn, str) or not fn.isidentifier():
        raise TestFormatError(f"function name must be an identifier, got {fn!r}")
    if not isinstance(args, (list, tuple)) or not isinstance(kwargs, dict):
        raise TestFormatError(f"{fn}: args must be a list and kwargs a mapping")
    args_literal, kwargs_literal = repr(tuple(args)), repr(dict(kwargs))
    for literal in (args_literal, kwargs_literal):
        try:
            if ast.literal_eval(literal) is None:  # pragma: no cover - a tuple/dict literal is never None
                raise ValueError
        except (ValueError, SyntaxError):
            raise TestFormatError(f"{fn}: arguments must be Python literals, got {literal[:60]}") from None
    return CallTest(fn, args_literal, kwargs_literal, json_normalise(expected, f"{fn}: expected value"))


def json_normalise(value: Any, what: str = "value") -> Any:
    """``value`` after a JSON round trip (how results are compared); plain data only."""
    try:
        return json.loads(json.dumps(value, allow_nan=False))
    except (TypeError, ValueError):
        raise TestFormatError(f"{what} {str(value)[:60]!r} is not plain JSON data") from None


def _one_test(item: Any, index: int) -> Test:
    where = f"test {index}"
    if not isinstance(item, dict):
        raise TestFormatError(f"{where}: expected a mapping or an assert line, got {type(item).__name__}")
    keys = set(item)
    if keys <= {"stdin", "stdout", "input", "output"} and (keys & {"stdin", "input"}) and (keys & {"stdout", "output"}):
        stdin, stdout = item.get("stdin", item.get("input")), item.get("stdout", item.get("output"))
        if not isinstance(stdin, str) or not isinstance(stdout, str):
            raise TestFormatError(f"{where}: stdin and stdout must be strings")
        return StdioTest(stdin, stdout)
    if "expected" in item and ({"fn", "fn_name", "call"} & keys):
        fn = item.get("fn", item.get("fn_name", item.get("call")))
        try:
            return _call_test(fn, item.get("args", []), item.get("kwargs", {}), item["expected"])
        except TestFormatError as exc:
            raise TestFormatError(f"{where}: {exc}") from None
    raise TestFormatError(f"{where}: keys {sorted(keys)} are neither a function-call test (fn, args, kwargs, "
                          f"expected) nor a stdin/stdout test (stdin, stdout)")


def _apps_tests(value: dict) -> list[Test]:
    inputs, outputs = value.get("inputs"), value.get("outputs")
    if not isinstance(inputs, list) or not isinstance(outputs, list) or len(inputs) != len(outputs):
        raise TestFormatError("APPS-style tests need `inputs` and `outputs` lists of equal length")
    fn = value.get("fn_name")
    tests: list[Test] = []
    for index, (given, wanted) in enumerate(zip(inputs, outputs)):
        if fn:
            args = given if isinstance(given, list) else [given]
            try:
                tests.append(_call_test(fn, args, {}, wanted))
            except TestFormatError as exc:
                raise TestFormatError(f"test {index}: {exc}") from None
        else:
            given = "\n".join(given) if isinstance(given, list) else given
            wanted = "\n".join(wanted) if isinstance(wanted, list) else wanted
            if not isinstance(given, str) or not isinstance(wanted, str):
                raise TestFormatError(f"test {index}: stdin/stdout tests need strings")
            tests.append(StdioTest(given, wanted))
    return tests


# ---------------------------------------------------------------------------------------------------------------------
# Verdicts
# ---------------------------------------------------------------------------------------------------------------------


def normalise_stdout(text: str, rule: StdoutMatch = "lines"):
    """What two program outputs must share to be equal under ``rule`` (see the module docstring)."""
    if rule == "exact":
        return text
    if rule == "tokens":
        return text.split()
    lines = [line.rstrip() for line in text.replace("\r\n", "\n").split("\n")]
    while lines and not lines[-1]:
        lines.pop()
    return lines


def verdict(test: Test, reply: dict | None, stdout_match: StdoutMatch = "lines") -> str:
    """The verdict of one test from the harness's reply (``None``: no reply)."""
    if reply is None:
        return "no_result"
    status = reply["status"]
    if status in ("timeout", "over_cap", "error"):
        return status
    exit_code, output = reply.get("exit"), reply.get("output", "")
    if exit_code is None:  # killed by a signal (memory, its own kill); the harness reports the CPU limit as timeout
        return "error"
    if isinstance(test, StdioTest):
        if exit_code != 0:
            return "error"
        same = normalise_stdout(output, stdout_match) == normalise_stdout(test.stdout, stdout_match)
        return "pass" if same else "wrong"
    if exit_code != 0:
        return "error"
    if output == "":
        return "no_result"
    try:
        value = json.loads(output)
    except (ValueError, RecursionError):
        return "invalid"
    return "pass" if _equal(value, test.expected) else "wrong"


def _equal(value: Any, expected: Any) -> bool:
    try:
        return bool(value == expected)
    except RecursionError:
        return False


def sample_reward(verdicts: list[str], scoring: Literal["all_or_nothing", "fraction"] = "all_or_nothing") -> float:
    """Fraction of tests passed, or 1.0 only when every test passed (0.0 for a row without tests is not used)."""
    passed = sum(v == "pass" for v in verdicts)
    if scoring == "fraction":
        return passed / len(verdicts) if verdicts else 0.0
    return 1.0 if verdicts and passed == len(verdicts) else 0.0
