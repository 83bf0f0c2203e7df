"""End to end (slow): configs/unit_tests.yaml SFT-warms the tiny model on the embedded code task, then GRPO with the
sandboxed unit_tests reward raises the held-out pass rate; per-test verdict shares are in the logged metrics."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from trl_ext_plugins.rewards.sandbox import bwrap_problem

RECIPE = Path(__file__).resolve().parents[1] / "configs" / "unit_tests.yaml"


@pytest.mark.slow
@pytest.mark.skipif(bwrap_problem() is not None, reason="the unit_tests reward refuses to run without bubblewrap "
                                                        "(.ci/run installs it and stops if it is missing, so CI runs this)")
def test_unit_tests_recipe_raises_held_out_pass_rate(tmp_path):
    # One BLAS/OpenMP thread: on a shared 2-core machine spinning OpenMP workers slowed training 20-fold.
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, "-m", "trl_ext.cli", "train", str(RECIPE), "--output-dir", str(tmp_path)],
                         env=env, capture_output=True, text=True, timeout=3000)
    assert run.returncode == 0, run.stderr[-3000:]
    grpo = json.loads((tmp_path / "grpo" / "eval.json").read_text())
    before, after = grpo["before"]["accuracy"], grpo["after"]["accuracy"]
    assert after > before, (before, after)
    rows = [json.loads(line) for line in (tmp_path / "grpo" / "metrics.jsonl").read_text().splitlines()]
    logged = {k for row in rows for k in row}
    assert {"unit_tests/tests_pass", "unit_tests/tests_wrong", "unit_tests/tests_timeout",
            "unit_tests/all_tests_passed"} <= logged
