"""``unit_tests``: reward for model-written code from hidden tests, with verdicts computed outside the sandbox."""

from __future__ import annotations

import os
import warnings
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal

from pydantic import Field

from trl_ext import Plugin, PluginParams, hookimpl
from trl_ext.errors import RecipeError
from trl_ext.rewards import RewardFunction
from trl_ext_plugins.rewards.code_tests import (VERDICTS, StdoutMatch, Test, TestFormatError, parse_tests,
                                                sample_reward, verdict)
from trl_ext_plugins.rewards.sandbox import UNSAFE_WARNING, SandboxLimits, bwrap_problem, run_sample
from trl_ext_plugins.rewards.verify_math import completion_text

PYTHON_LABELS = frozenset({"", "python", "py", "python3", "py3"})  # fence labels of a candidate (lower case)
_ROW_ERRORS_SHOWN = 5


def fenced_blocks(text: str) -> list[tuple[str, str]]:
    """(label, body) of every closed fenced block, fences paired line by line as Markdown pairs them.

    A fence opens on a line that starts (after indentation) with three backticks; its label is the first word after
    them, lower-cased ("" when none). It closes on the next line made only of backticks, or whose code ends with
    them (```` x = 1``` ````). As in CommonMark, the body loses up to as many leading spaces as the opening fence
    is indented (a block inside a list item). Pairing by line matters: searching for backtick runs instead takes
    the closing fence of a ```` ```text ```` example for the opening of a new block, and runs the prose after it.
    """
    blocks, label, body, indent = [], None, [], 0
    for line in text.splitlines(keepends=True):
        stripped = line.strip()
        if label is None:
            if stripped.startswith("```"):
                words = stripped.lstrip("`").split()
                label, body, indent = (words[0].lower() if words else ""), [], len(line) - len(line.lstrip(" "))
            continue
        line = line[min(indent, len(line) - len(line.lstrip(" "))):]
        if stripped.startswith("```") and not stripped.strip("`"):
            blocks.append((label, "".join(body)))
            label = None
        elif stripped.endswith("```"):
            blocks.append((label, "".join(body) + line.rstrip()[:-3]))
            label = None
        else:
            body.append(line)
    return blocks


def extract_code(text: str) -> str:
    """The last closed fenced block labelled Python (``python``, ``py``, ``python3``, ``py3``, any case) or
    unlabelled, or the whole text when there is none (other languages' blocks, e.g. ```` ```text ```` sample output,
    are never the candidate)."""
    blocks = [body for label, body in fenced_blocks(text) if label in PYTHON_LABELS]
    return blocks[-1] if blocks else text


class UnitTestsParams(PluginParams):
    weight: float = Field(1.0, description="weight of this reward in the weighted sum of reward functions")
    tests_column: str = Field("tests", description="dataset column with the hidden tests (assert lines, "
                              "function-call or stdin/stdout tests, or APPS-style inputs/outputs; JSON text allowed); "
                              "rows whose value is empty/None get None (not applicable)")
    scoring: Literal["all_or_nothing", "fraction"] = Field(
        "all_or_nothing", description="all_or_nothing: 1 only when every test passes (RLVR, ALGORITHMS.md item 12); "
        "fraction: the share of tests passed")
    stdout_match: StdoutMatch = Field("lines", description="stdin/stdout comparison: lines (trailing whitespace and "
                                      "trailing blank lines ignored), tokens (whitespace-split), exact")
    backend: Literal["bwrap", "unsafe_subprocess"] = Field(
        "bwrap", description="bwrap (required isolation) or unsafe_subprocess (explicit opt-in, no isolation)")
    max_workers: int = Field(0, ge=0, description="samples scored in parallel; 0 = the machine's CPU count")
    test_wall_seconds: float = Field(4.0, gt=0, description="wall-clock limit per test")
    test_cpu_seconds: int = Field(2, gt=0, description="CPU-seconds limit per test (RLIMIT_CPU)")
    memory_mb: int = Field(512, gt=0, description="memory of the whole sandbox (cgroup; fallback RLIMIT_AS)")
    max_processes: int = Field(64, gt=0, description="processes+threads of the whole sandbox (cgroup pids; fallback "
                               "RLIMIT_NPROC)")
    cpu_cores: float = Field(1.0, gt=0, description="CPU quota of the whole sandbox (cgroup cpu)")
    tmp_mb: int = Field(16, gt=0, description="size of the sandbox's private /tmp (and /dev/shm)")
    max_files: int = Field(1024, gt=0, description="files in the private /tmp (tmpfs inodes)")
    output_kb: int = Field(64, gt=0, description="output read back per test; more is the verdict over_cap")

    def limits(self) -> SandboxLimits:
        return SandboxLimits(test_wall_seconds=self.test_wall_seconds, test_cpu_seconds=self.test_cpu_seconds,
                             memory_bytes=self.memory_mb << 20, max_processes=self.max_processes,
                             cpu_cores=self.cpu_cores, tmp_bytes=self.tmp_mb << 20, max_files=self.max_files,
                             output_bytes=self.output_kb << 10)


@lru_cache(maxsize=4096)
def _cached_tests(value: str) -> tuple[Test, ...]:
    return tuple(parse_tests(value))


def row_tests(value: Any) -> tuple[Test, ...]:
    """Parsed tests of one row (cached for the JSON/assert text most datasets store)."""
    return _cached_tests(value) if isinstance(value, str) else tuple(parse_tests(value))


def run_tests(code: str, tests: tuple[Test, ...], params: UnitTestsParams) -> list[str]:
    """One sandbox for one candidate: its verdict per test."""
    run = run_sample(code, [t.request() for t in tests], params.limits(), backend=params.backend)
    return [verdict(t, reply, params.stdout_match) for t, reply in zip(tests, run.replies)]


def score_candidates(codes: list[str], tests: list[tuple[Test, ...] | None], params: UnitTestsParams,
                     ) -> list[list[str] | None]:
    """Verdicts per test for each candidate, ``max_workers`` sandboxes at a time (None where a row has no tests).

    Identical (code, tests) pairs of one batch run once (a group of samples often repeats a completion); each distinct
    pair still gets a fresh sandbox of its own.
    """
    workers = params.max_workers or os.cpu_count() or 1
    keys = [(code, repr(t)) if t else None for code, t in zip(codes, tests)]  # tests may hold unhashable values
    distinct = {key: i for i, key in reversed(list(enumerate(keys))) if key is not None}

    def one(i: int) -> list[str]:
        return run_tests(codes[i], tests[i], params)

    with ThreadPoolExecutor(max_workers=workers) as pool:
        verdicts = dict(zip(distinct, pool.map(one, distinct.values())))
    return [verdicts[key] if key is not None else None for key in keys]


def verdict_metrics(name: str, all_verdicts: list[list[str] | None]) -> dict[str, float]:
    """Share of each verdict over every test of the batch, and the share of samples passing all their tests."""
    flat = [v for verdicts in all_verdicts if verdicts for v in verdicts]
    scored = [verdicts for verdicts in all_verdicts if verdicts]
    counts = Counter(flat)
    metrics = {f"{name}/tests_{v}": counts[v] / len(flat) if flat else 0.0 for v in VERDICTS}
    metrics[f"{name}/all_tests_passed"] = (sum(all(v == "pass" for v in s) for s in scored) / len(scored)
                                           if scored else 0.0)
    return metrics


class UnitTests(Plugin):
    """Unit-test reward for code generation (RLVR: Tulu 3, arXiv 2411.15124; DeepSeek-R1, arXiv 2501.12948).

    The completion's last fenced Python block (or the whole completion) is the candidate. Its row's hidden tests
    (:mod:`trl_ext_plugins.rewards.code_tests`: function-call tests, ``assert f(x) == y`` lines parsed into them, and
    stdin/stdout tests) run in one sandbox per candidate (:mod:`trl_ext_plugins.rewards.sandbox`: bubblewrap,
    whole-sandbox cgroup limits, private size- and file-capped ``/tmp``, no network, everything killed at the end).
    Inside, a harness runs each test in a fresh child process and returns only the candidate's raw output (a JSON
    return value or stdout); the **trainer** parses it as plain data and compares it with the expected value, which
    never enters the sandbox. Early exits, always-equal objects, exit codes, fake output lines and rewritten files
    therefore earn nothing: a test passes only when the returned data or printed text is right.

    Defaults: ``scoring: all_or_nothing`` (1.0 only if every test passes, ALGORITHMS.md item 12; ``fraction`` gives
    the share passed), ``stdout_match: lines`` (trailing whitespace per line and trailing blank lines ignored),
    ``backend: bwrap`` (required: without a working bubblewrap the recipe is refused at validation unless it sets
    ``backend: unsafe_subprocess``, which warns what it gives up), 4 s wall / 2 CPU-s per test, 512 MiB and 64
    processes per sandbox, a 16 MiB / 1024-file ``/tmp``, 64 KiB of output per test, one worker per CPU. Rows without
    tests score None. Tests that fit neither format are refused at validation (embedded and local datasets) or when
    the dataset is prepared (any source), naming the row.

    Metrics (TRL ``log_metric``): ``unit_tests/tests_<verdict>`` is the share of the batch's tests with each verdict
    (pass, wrong, error, no_result, timeout, over_cap, invalid) and ``unit_tests/all_tests_passed`` the share of
    candidates passing all their tests; the per-test verdicts of every completion go to TRL's completions table
    (``log_extra`` column ``unit_tests_verdicts``).
    """

    name = "unit_tests"
    family = "reward"
    trainers = frozenset({"grpo", "rloo"})
    Params = UnitTestsParams

    @hookimpl
    def trl_ext_validate_stage(self, stage, plugins):
        p = self.params
        errors = []
        if p.backend == "bwrap":
            problem = bwrap_problem()
            if problem is not None:
                errors.append(f"plugins.unit_tests.backend: bwrap is required to run model-written code and {problem}; "
                              f"install it, or set backend: unsafe_subprocess to run without isolation")
        else:
            warnings.warn(UNSAFE_WARNING, stacklevel=2)
        datasets = [("dataset", stage.dataset)]
        if stage.evaluation is not None and _names_unit_tests(stage.evaluation.reward):
            datasets.append(("evaluation.dataset", stage.evaluation.dataset))
        for where, spec in datasets:
            errors += check_dataset_rows(spec, p.tests_column, where)
        return errors

    @hookimpl
    def trl_ext_prepare_dataset(self, dataset, split, stage):
        if self.params.tests_column in dataset.column_names:
            problems = row_problems(dataset[self.params.tests_column])
            if problems:
                spec = stage.eval_dataset if split == "eval" and stage.eval_dataset is not None else stage.dataset
                raise RecipeError([f"unit_tests: {split} dataset {spec.source!r} {m}" for m in problems])
        return None

    @hookimpl
    def trl_ext_reward_functions(self, stage):
        p = self.params

        def unit_tests(completions, log_metric=None, log_extra=None, **kwargs):
            tests = [row_tests(t) or None for t in kwargs[p.tests_column]]
            codes = [extract_code(completion_text(c)) for c in completions]
            all_verdicts = score_candidates(codes, tests, p)
            if log_metric is not None:
                for metric, value in verdict_metrics(self.name, all_verdicts).items():
                    log_metric(metric, value)
            if log_extra is not None:
                log_extra("unit_tests_verdicts", [",".join(v) if v else "" for v in all_verdicts])
            return [None if v is None else sample_reward(v, p.scoring) for v in all_verdicts]

        return [RewardFunction(self.name, unit_tests, p.weight)]


def _names_unit_tests(reward) -> bool:
    return (reward if isinstance(reward, str) else reward.name) == UnitTests.name


def row_problems(values: list[Any]) -> list[str]:
    """``row N: <why>`` for the rows whose tests fit neither format (the first few, then a count)."""
    problems = []
    for row, value in enumerate(values):
        try:
            row_tests(value)
        except TestFormatError as exc:
            problems.append(f"row {row}: {exc}")
    if len(problems) > _ROW_ERRORS_SHOWN:
        problems = problems[:_ROW_ERRORS_SHOWN] + [f"... and {len(problems) - _ROW_ERRORS_SHOWN} more rows"]
    return problems


def check_dataset_rows(spec, column: str, where: str) -> list[str]:
    """Validation-time check of an embedded or local dataset's tests (hub datasets are checked when prepared)."""
    from trl_ext.recipe import EMBEDDED_PREFIX

    source = spec.source
    try:
        if source.startswith(EMBEDDED_PREFIX):
            from trl_ext.catalog import Catalog

            build, _ = Catalog.discover().datasets[source[len(EMBEDDED_PREFIX):]]
            dataset = build(split=spec.split, **spec.params)
        elif Path(source).exists():
            from trl_ext.runner import load_split

            dataset = load_split(spec, None, None, "validate", None)
        else:
            return []
    except Exception:  # unknown names and bad params are reported by the core's own checks
        return []
    if spec.limit is not None:
        dataset = dataset.select(range(min(spec.limit, len(dataset))))
    if column not in dataset.column_names:
        return [f"{where}: {source!r} has no tests column {column!r} (columns: {dataset.column_names})"]
    return [f"{where}: {source!r} {m}" for m in row_problems(dataset[column])]
