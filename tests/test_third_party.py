"""A third-party plugin distribution installs, is discovered through the entry point, is selectable with parameters,
and bad parameters are rejected; a broken installed plugin is reported without breaking other runs."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).parent.parent / "examples" / "trl-ext-length-bonus"
CLI = [sys.executable, "-m", "trl_ext.cli"]


def cli(*args, env=None, cwd=None):
    return subprocess.run([*CLI, *args], capture_output=True, text=True, env=env, cwd=cwd, timeout=300)


@pytest.fixture(scope="module")
def installed_example():
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", str(EXAMPLE)]
    subprocess.run(pip, check=True, capture_output=True, timeout=300)
    try:
        yield
    finally:
        subprocess.run([sys.executable, "-m", "pip", "uninstall", "-q", "-y", "trl-ext-length-bonus"],
                       capture_output=True, timeout=300)


def recipe(tmp_path, params):
    path = tmp_path / "recipe.yaml"
    path.write_text(json.dumps({
        "trainer": "grpo", "model": "embedded:tiny-qwen2", "dataset": "embedded:arithmetic",
        "plugins": ["exact_match", {"length_bonus": params}], "args": {"max_steps": 1},
    }))
    return str(path)


def test_listed_selected_and_validated(installed_example, tmp_path):
    listed = cli("plugins", "list", "--json")
    assert listed.returncode == 0, listed.stderr
    rows = {row["name"]: row for row in json.loads(listed.stdout)}
    assert rows["length_bonus"]["distribution"] == "trl-ext-length-bonus"
    assert rows["length_bonus"]["version"] == "0.2.0" and rows["length_bonus"]["status"] == "loaded"

    ok = cli("validate", recipe(tmp_path, {"target": 3, "weight": 0.5}))
    assert ok.returncode == 0, ok.stderr
    bad = cli("validate", recipe(tmp_path, {"target": -1}))
    assert bad.returncode == 2
    assert "stages[0].plugins[1].params.target" in bad.stderr and "greater than 0" in bad.stderr

    own_tests = subprocess.run([sys.executable, "-m", "pytest", "-q", str(EXAMPLE / "tests")],
                               capture_output=True, text=True, timeout=300)
    assert own_tests.returncode == 0, own_tests.stdout[-2000:]

    blocked = cli("plugins", "list", "--json", env={**os.environ, "TRL_EXT_PLUGINS_BLOCK": "length_bonus"})
    assert "length_bonus" not in {row["name"] for row in json.loads(blocked.stdout)}
    allowed = cli("plugins", "list", "--json", env={**os.environ, "TRL_EXT_PLUGINS": "length_bonus"})
    assert {row["name"] for row in json.loads(allowed.stdout)} == {"length_bonus"}


def test_broken_plugin_is_reported_and_does_not_break_other_runs(tmp_path):
    site = tmp_path / "site"
    dist = site / "trl_ext_broken-1.0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: trl-ext-broken\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(
        "[trl_ext]\nbroken = trl_ext_broken_mod:Broken\nnospec = trl_ext_nospec_mod\n")
    (site / "trl_ext_broken_mod.py").write_text("import a_module_that_does_not_exist\n")
    (site / "trl_ext_nospec_mod.py").write_text(textwrap.dedent("""
        from trl_ext import hookimpl

        @hookimpl
        def trl_ext_no_such_hook(register):
            pass
    """))
    env = {**os.environ, "PYTHONPATH": str(site)}
    listed = cli("plugins", "list", "--json", env=env)
    assert listed.returncode == 0, listed.stderr
    rows = {row["name"]: row for row in json.loads(listed.stdout)}
    assert "ModuleNotFoundError" in rows["broken"]["status"]
    assert "no matching spec: trl_ext_no_such_hook" in rows["nospec"]["status"]
    assert rows["sft"]["status"] == "loaded"

    good = tmp_path / "good.yaml"
    good.write_text(json.dumps({"trainer": "sft", "model": "embedded:tiny-qwen2", "dataset": "embedded:arithmetic"}))
    assert cli("validate", str(good), env=env).returncode == 0
    bad = tmp_path / "bad.yaml"
    bad.write_text(json.dumps({"trainer": "sft", "model": "embedded:tiny-qwen2", "dataset": "embedded:arithmetic",
                               "plugins": ["broken"]}))
    result = cli("validate", str(bad), env=env)
    assert result.returncode == 2 and "installed but failed to load" in result.stderr
    assert "a_module_that_does_not_exist" in result.stderr
