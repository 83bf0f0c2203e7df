"""What a user meets first: another recipe's output (``run:<recipe>/<stage>``) is found wherever the command runs,
and when missing names the recipe and command that build it; GGUF files are accepted as models, and library
deprecation notices stay out of the console."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

from trl_ext.catalog import Catalog
from trl_ext.cli import _load_recipe, main
from trl_ext.recipe import parse_recipe, resolve_run_refs
from trl_ext.runner import preflight, stage_fingerprints
from trl_ext.stage import model_ref_errors

CONFIGS = Path(__file__).parent.parent / "configs"


def test_missing_output_of_another_recipe_names_it_and_the_command(tmp_path, monkeypatch, capsys):
    # The two recipes are copied out of the checkout: the lookup also searches the recipe's parent folders, where a
    # user who ran the README's main job has runs/quickstart (the test then found it and failed).
    configs = tmp_path / "project" / "configs"
    configs.mkdir(parents=True)
    for name in ("grpo.yaml", "quickstart.yaml"):
        shutil.copy(CONFIGS / name, configs / name)
    monkeypatch.chdir(tmp_path)  # no runs/quickstart here, nor beside the copied configs/
    recipe = configs / "grpo.yaml"
    assert main(["validate", str(recipe)]) == 0  # validate warns: it may exist by the time training starts
    err = capsys.readouterr().err
    producer = (configs / "quickstart.yaml").resolve()
    assert (f"warning: stages[0].model: no such model folder '{tmp_path / 'runs/quickstart/sft'}' (for "
            f"'run:quickstart/sft'): it is stage 'sft' of {producer}, not built yet (looked in "
            f"{tmp_path / 'runs/quickstart/sft'}, {producer.parent / 'runs/quickstart/sft'}" in err)
    assert f"build it first with `trl-ext train {producer}`; it must exist when training starts" in err
    assert main(["train", str(recipe), "--max-steps", "1"]) == 2  # train refuses before any model loads
    err = capsys.readouterr().err
    assert "build it first with `trl-ext train" in err and "Traceback" not in err
    assert not (tmp_path / "runs" / "grpo").exists() or not any((tmp_path / "runs" / "grpo").iterdir())


def test_a_plain_relative_path_to_another_run_still_names_the_recipe_beside_it(tmp_path, monkeypatch, capsys):
    """The older spelling (a path relative to the working directory) keeps working and keeps its hint."""
    project = _project(tmp_path / "project", built=False)
    (project / "configs" / "next.yaml").write_text(yaml.safe_dump(_consumer("runs/base/sft")))
    monkeypatch.chdir(project)
    assert main(["validate", "configs/next.yaml"]) == 0
    err = capsys.readouterr().err
    assert ("no such model folder 'runs/base/sft' (and not a hub id): it is stage 'sft' of configs/base.yaml; build it "
            "first with `trl-ext train configs/base.yaml` from this directory") in err


def _consumer(model: str) -> dict:
    return {"output_dir": "runs/next", "trainer": "sft", "name": "more", "model": model,
            "dataset": {"source": "embedded:arithmetic", "limit": 8}, "args": {"max_steps": 1}}


def _project(root: Path, built: bool = True) -> Path:
    """A checkout-like folder: configs/base.yaml (stage ``sft`` into runs/base) and, when ``built``, its finished
    stage folder at <root>/runs/base/sft as `trl-ext train configs/base.yaml` run from <root> leaves it."""
    (root / "configs").mkdir(parents=True)
    (root / "configs" / "base.yaml").write_text(yaml.safe_dump(
        {"output_dir": "runs/base", "stages": [{"name": "sft", "trainer": "sft", "model": "embedded:tiny-qwen2",
                                                "dataset": "embedded:arithmetic"}]}))
    if built:
        from trl_ext.embedded.models import materialize_model

        stage_dir = root / "runs" / "base" / "sft"
        materialize_model("tiny-qwen2", stage_dir)
        (stage_dir / "stage.json").write_text(json.dumps({"fingerprint": "x"}))
    return root


def test_run_reference_resolves_against_the_recipe_not_the_working_directory(tmp_path, monkeypatch, capsys):
    project = _project(tmp_path / "project")
    (project / "configs" / "next.yaml").write_text(yaml.safe_dump(_consumer("run:base/sft")))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    catalog = Catalog.discover()
    prints = {}
    for cwd in (project, project / "configs", elsewhere):
        monkeypatch.chdir(cwd)
        recipe = _load_recipe(str(project / "configs" / "next.yaml"), [])
        resolved = preflight(recipe, catalog)  # a missing folder would be an error here (no warn callback)
        assert resolved[0].spec.model == str((project / "runs" / "base" / "sft").resolve()), cwd
        prints[cwd] = stage_fingerprints(resolved)
    assert len(set(map(json.dumps, prints.values()))) == 1  # the fingerprint holds the reference as written
    # The two runs moved together: the finished stage downstream is still the same stage.
    moved = shutil.move(str(project), str(tmp_path / "moved"))
    monkeypatch.chdir(elsewhere)
    recipe = _load_recipe(str(Path(moved) / "configs" / "next.yaml"), [])
    resolved = preflight(recipe, catalog)
    assert resolved[0].spec.model.startswith(str(Path(moved).resolve()))
    assert stage_fingerprints(resolved) == prints[elsewhere]
    # And it trains from there, on the other run's model.
    assert main(["train", str(Path(moved) / "configs" / "next.yaml"), "--output-dir", str(elsewhere / "out")]) == 0
    assert (elsewhere / "out" / "more" / "stage.json").is_file()
    run = json.loads((elsewhere / "out" / "run.json").read_text())
    assert run["recipe"]["stages"][0]["model"] == resolved[0].spec.model  # run.json records the folder used


def test_run_reference_to_the_working_directory_wins_over_the_recipes_folder(tmp_path, monkeypatch):
    """The producer run here writes <cwd>/runs/base: that is the run this command means, when both exist."""
    project = _project(tmp_path / "project")
    (project / "configs" / "next.yaml").write_text(yaml.safe_dump(_consumer("run:base/sft")))
    here = _project(tmp_path / "here", built=True)
    monkeypatch.chdir(here)
    recipe = resolve_run_refs(_load_recipe(str(project / "configs" / "next.yaml"), []), project / "configs/next.yaml")
    assert recipe.stages[0].model == str(here.resolve() / "runs" / "base" / "sft")


def test_bad_run_references_are_one_line_each(tmp_path, capsys):
    project = _project(tmp_path / "project", built=False)
    cases = {"run:nosuch/sft": f"'run:nosuch/sft': cannot read the recipe that builds it: "
                               f"{(project / 'configs' / 'nosuch.yaml').resolve()}: no such recipe file",
             "run:base/rl": f"'run:base/rl': {(project / 'configs' / 'base.yaml').resolve()} has no stage 'rl' (its "
                            f"stages: ['sft'])",
             "run:sft": "'run:sft': write run:<recipe file>/<stage name>, e.g. run:quickstart/sft"}
    for ref, fragment in cases.items():
        path = project / "configs" / "next.yaml"
        path.write_text(yaml.safe_dump(_consumer(ref)))
        assert main(["validate", str(path)]) == 2
        err = capsys.readouterr().err
        assert f"stages[0]: {fragment}" in err and "Traceback" not in err, err


def test_run_references_in_plugin_parameters_are_resolved_too(tmp_path):
    project = _project(tmp_path / "project")
    data = _consumer("embedded:tiny-qwen2")
    data["plugins"] = [{"name": "some_teacher_plugin", "params": {"teachers": [{"path": "run:base/sft"}]}}]
    recipe = resolve_run_refs(parse_recipe(data), project / "configs" / "next.yaml")
    folder = str((project / "runs" / "base" / "sft").resolve())
    assert recipe.stages[0].plugins[0].params == {"teachers": [{"path": folder}]}
    assert recipe.stages[0].as_written()["plugins"][0]["params"] == {"teachers": [{"path": "run:base/sft"}]}


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


def test_compile_caches_go_under_the_run_unless_the_environment_says_otherwise(tmp_path, monkeypatch):
    """torch.compile's graph and kernel cache was $TMPDIR/torchinductor_<user> (and Triton's ~/.triton), outside the
    run; torch reads the variable each time it compiles, so setting it when the run starts is enough."""
    import os

    from torch._inductor.runtime.cache_dir_utils import cache_dir

    from trl_ext.runner import keep_caches_in_run

    for name in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):
        monkeypatch.delenv(name, raising=False)
    keep_caches_in_run(tmp_path / "run")
    assert Path(cache_dir()) == (tmp_path / "run").resolve() / "_cache" / "torchinductor"
    assert os.environ["TRITON_CACHE_DIR"] == str((tmp_path / "run").resolve() / "_cache" / "triton")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    keep_caches_in_run(tmp_path / "run")
    assert Path(cache_dir()) == tmp_path / "mine"
