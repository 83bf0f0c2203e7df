"""What a user meets first: another recipe's output that is missing names the recipe and command that build it,
GGUF files are accepted as models, and library deprecation notices stay out of the console."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from trl_ext.cli import main
from trl_ext.recipe import parse_recipe
from trl_ext.stage import model_ref_errors

CONFIGS = Path(__file__).parent.parent / "configs"


def test_missing_output_of_another_recipe_names_it_and_the_command(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # no runs/quickstart here
    recipe = CONFIGS / "grpo.yaml"
    assert main(["validate", str(recipe)]) == 0  # validate warns: it may exist by the time training starts
    err = capsys.readouterr().err
    assert (f"warning: stages[0].model: no such model folder 'runs/quickstart/sft' (and not a hub id): it is stage "
            f"'sft' of {CONFIGS / 'quickstart.yaml'}; build it first with `trl-ext train {CONFIGS / 'quickstart.yaml'}`"
            in err)
    assert main(["train", str(recipe), "--max-steps", "1"]) == 2  # train refuses before any model loads
    err = capsys.readouterr().err
    assert "build it first with `trl-ext train" in err and "Traceback" not in err
    assert not (tmp_path / "runs" / "grpo").exists() or not any((tmp_path / "runs" / "grpo").iterdir())


def test_gguf_files_are_models_other_files_are_not(tmp_path):
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    (tmp_path / "weights.bin").write_bytes(b"x")
    base = {"trainer": "sft", "dataset": "embedded:arithmetic"}
    assert model_ref_errors(parse_recipe({**base, "model": str(tmp_path / "m.gguf")}).stages[0], "stages[0]") == []
    errors = model_ref_errors(parse_recipe({**base, "model": str(tmp_path / "weights.bin")}).stages[0], "stages[0]")
    assert errors and "is a file; give the model's folder (or a .gguf file)" in errors[0]


def test_library_deprecation_notices_are_not_printed_unless_debugging():
    quiet = subprocess.run([sys.executable, "-m", "trl_ext.cli", "validate", str(CONFIGS / "quickstart.yaml")],
                           capture_output=True, text=True, timeout=300)
    assert quiet.returncode == 0, quiet.stderr
    assert "FutureWarning" not in quiet.stderr and "DeprecationWarning" not in quiet.stderr


def test_models_and_datasets_commands_list_the_embedded_names(capsys):
    import json

    assert main(["models", "--json"]) == 0
    models = {row["name"]: row for row in json.loads(capsys.readouterr().out)}
    assert models["tiny-qwen2"]["use_as"] == "embedded:tiny-qwen2" and "tiny-qwen3-moe" in models
    assert main(["datasets"]) == 0
    out = capsys.readouterr().out
    assert "embedded:arithmetic" in out and out.splitlines()[0].split() == ["name", "use", "as", "registered", "by"]
