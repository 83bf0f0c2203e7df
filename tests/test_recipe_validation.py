"""Every class of bad input is refused by `trl-ext validate` (and by `train`, which validates first) with a line naming
the file, field or plugin at fault, exit code 2, no traceback, and no model loaded; runtime failures exit 1.
Also the run-directory guards that need no training: the lock, unfinished stages of another recipe, incomplete
checkpoints and torn metrics lines."""

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

from trl_ext.catalog import Catalog
from trl_ext.cli import main
from trl_ext.errors import OutputDirError
from trl_ext.hookspecs import hookimpl

BASE = {"trainer": "sft", "model": "embedded:tiny-qwen2", "dataset": "embedded:arithmetic", "args": {"max_steps": 1}}


pytestmark = pytest.mark.usefixtures("no_model_loads")  # validation must never load a model (conftest.py)


def write(tmp_path, data, name="recipe.yaml"):
    path = tmp_path / name
    if isinstance(data, bytes):
        path.write_bytes(data)
    else:
        path.write_text(data if isinstance(data, str) else json.dumps(data))
    return str(path)


def cli(capsys, *argv):
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def assert_refused(code, err, *fragments):
    assert code == 2, err
    assert "Traceback" not in err
    assert "Value error, " not in err, err  # a validator's own message comes without pydantic's prefix
    for fragment in fragments:
        assert fragment in err, err


def stages(*names):
    return {"stages": [{**BASE, "name": n} for n in names]}


def test_output_dir_refused_when_the_os_denies_writing(tmp_path, capsys, monkeypatch):
    # Runs as root too (CI): the OS's answer for the nearest existing folder is replaced by a denial.
    real_access = os.access
    locked = tmp_path / "locked"
    locked.mkdir()
    monkeypatch.setattr(os, "access", lambda path, mode: False if Path(path) == locked else real_access(path, mode))
    code, _, err = cli(capsys, "validate", write(tmp_path, BASE), "--output-dir", str(locked / "out"))
    assert_refused(code, err, "output_dir:", "is not writable", str(locked))


LONG = "a" * 300  # over the 255 bytes a file name may have: os.stat raises ENAMETOOLONG rather than "no such file"


@pytest.mark.parametrize("patch, fragment", [
    ({"output_dir": LONG}, "output_dir: 'aaaa"),
    ({"output_dir": "runs/a\x00b"}, "output_dir: 'runs/a\\x00b' contains a NUL character"),
    ({"output_dir": "~no_such_user_here/run"}, "output_dir: '~no_such_user_here/run' starts with '~no_such_user_here', "
                                               "which names no user"),
    ({"model": "./" + LONG}, "stages[0].model: './aaaa"),
    ({"model": "~no_such_user_here/m"}, "stages[0].model: '~no_such_user_here/m' starts with"),
    ({"dataset": "./" + LONG + ".jsonl"}, "stages[0].dataset.source: './aaaa"),
    ({"evaluation": {"dataset": LONG, "reward": "exact_match"}}, "stages[0].evaluation.dataset.source: 'aaaa"),
    ({"model": "run:" + LONG + "/sft"}, "stages[0].model: 'run:aaaa"),
], ids=["output-dir-long", "output-dir-nul", "output-dir-unknown-user", "model-long", "model-unknown-user",
        "dataset-long", "evaluation-dataset-long", "run-ref-long"])
def test_paths_the_os_refuses_are_named_not_crashed_on(tmp_path, capsys, patch, fragment):
    code, _, err = cli(capsys, "validate", write(tmp_path, {**BASE, **patch}))
    assert_refused(code, err, fragment)
    assert len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("params", [0, "", False, []])
def test_plugin_shorthand_with_params_that_are_not_a_mapping(tmp_path, capsys, params):
    # `{sft: 0}` used to be read as `{sft: {}}`: whatever was meant, it was dropped silently.
    code, _, err = cli(capsys, "validate", write(tmp_path, {**BASE, "plugins": [{"sft": params}]}))
    assert_refused(code, err, "stages[0].plugins[0].params: Input should be a valid dictionary")


@pytest.mark.parametrize("patch, where", [
    ({"model": ""}, "stages[0].model"), ({"model": "  "}, "stages[0].model"),
    ({"dataset": ""}, "stages[0].dataset.source"),
    ({"evaluation": {"dataset": " ", "reward": "exact_match"}}, "stages[0].evaluation.dataset.source"),
    ({"output_dir": ""}, "output_dir"),
])
def test_blank_names_are_refused(tmp_path, capsys, patch, where):
    code, _, err = cli(capsys, "validate", write(tmp_path, {**BASE, **patch}))
    assert_refused(code, err, f"{where}: is empty; give a name or a path")


def test_output_dir_option_and_recipe_path_the_os_refuses(tmp_path, capsys):
    code, _, err = cli(capsys, "validate", write(tmp_path, BASE), "--output-dir", "runs/a\x00b")
    assert_refused(code, err, "output_dir: 'runs/a\\x00b' contains a NUL character")
    code, _, err = cli(capsys, "validate", str(tmp_path / (LONG + ".yaml")))
    assert_refused(code, err, "the recipe path is too long")


def test_unreadable_recipe_file(tmp_path, capsys, monkeypatch):
    # Runs as root too: the file system's answer is replaced by a denial.
    path = write(tmp_path, BASE)
    real_open = Path.open

    def denied(self, *args, **kwargs):
        if self == Path(path):
            raise PermissionError(13, "Permission denied", str(self))
        return real_open(self, *args, **kwargs)

    monkeypatch.setattr(Path, "open", denied)
    code, _, err = cli(capsys, "validate", path)
    assert_refused(code, err, f"{path}: cannot read the recipe file: Permission denied")


# --------------------------------------------------------------------------------------------------------------------
# Names that become paths
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["../escape", "a/b", "/abs/path", "", "..", ".hidden", "_embedded", "run.json",
                                  "a\\b", "x" * 65])
def test_unsafe_stage_names_are_refused(tmp_path, capsys, name):
    code, _, err = cli(capsys, "validate", write(tmp_path, stages(name)))
    assert_refused(code, err, "stages[0].name", "not a safe name")


def test_duplicate_stage_names_even_by_case(tmp_path, capsys):
    code, _, err = cli(capsys, "validate", write(tmp_path, stages("sft", "SFT")))
    assert_refused(code, err, "stages[1].name: stage name 'SFT' is used more than once")


# --------------------------------------------------------------------------------------------------------------------
# The recipe file itself
# --------------------------------------------------------------------------------------------------------------------

BOMB = """\
trainer: sft
model: embedded:tiny-qwen2
dataset:
  source: embedded:arithmetic
  params:
    a: &a [x, x, x, x, x, x, x, x, x, x]
    b: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a, *a]
    c: &c [*b, *b, *b, *b, *b, *b, *b, *b, *b, *b]
    d: &d [*c, *c, *c, *c, *c, *c, *c, *c, *c, *c]
    e: &e [*d, *d, *d, *d, *d, *d, *d, *d, *d, *d]
    f: &f [*e, *e, *e, *e, *e, *e, *e, *e, *e, *e]
    g: &g [*f, *f, *f, *f, *f, *f, *f, *f, *f, *f]
    h: &h [*g, *g, *g, *g, *g, *g, *g, *g, *g, *g]
"""


@pytest.mark.parametrize(
    "content, fragment",
    [
        (BOMB, "YAML expands to more than"),
        ("trainer: " + "[" * 100 + "]" * 100 + "\n", "YAML nested deeper than"),
        ("a: &a [*a]\n", "refers to itself"),
        (b"trainer: sft\nmodel: \xff\xfe\n", "not UTF-8 text"),
        ("", "the file is empty"),
        ("# only a comment\n", "holds no YAML content"),
        ("- a\n- list\n", "must be a YAML mapping, got list"),
        ("stages: [unclosed\n", "not valid YAML"),
        ("trainer: sft\n" + "# padding\n" * 120_000, "larger than"),
        ("[" * 5000 + "]" * 5000, "YAML nested deeper than"),
        ("trainer: sft\x00\n", "not valid YAML: unacceptable character #x0000"),
        ("trainer: sft\x07\n", "not valid YAML: unacceptable character #x0007"),
    ],
    ids=["alias-bomb", "deep-nesting", "recursive-alias", "not-utf8", "empty", "comments-only", "list", "bad-yaml",
         "too-large", "nesting-beyond-the-stack", "nul-byte", "control-character"],
)
def test_broken_recipe_files(tmp_path, capsys, content, fragment):
    path = write(tmp_path, content)
    code, _, err = cli(capsys, "validate", path)
    assert_refused(code, err, path, fragment)


def test_a_directory_is_not_a_recipe(tmp_path, capsys):
    code, _, err = cli(capsys, "validate", str(tmp_path))
    assert_refused(code, err, "is a directory")


# --------------------------------------------------------------------------------------------------------------------
# Numbers
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args, fragment",
    [
        ({"learning_rate": 0}, "args.learning_rate: must be > 0"),
        ({"learning_rate": -1e-4}, "args.learning_rate: must be > 0"),
        ({"learning_rate": ".nan"}, "args.learning_rate: NaN and infinity"),
        ({"max_steps": 0}, "args.max_steps: must be >= 1"),
        ({"per_device_train_batch_size": 0}, "args.per_device_train_batch_size: must be >= 1"),
        ({"gradient_accumulation_steps": -2}, "args.gradient_accumulation_steps: must be >= 1"),
        ({"adam_beta1": 1.5}, "args.adam_beta1: must be < 1"),
        ({"warmup_steps": -1}, "args.warmup_steps: must be >= 0"),
        ({"max_grad_norm": "inf"}, "args.max_grad_norm: NaN and infinity"),
        ({"num_train_epochs": 0}, "args.num_train_epochs: must be > 0"),
    ],
)
def test_numeric_ranges(tmp_path, capsys, args, fragment):
    code, _, err = cli(capsys, "validate", write(tmp_path, {**BASE, "args": args}))
    assert_refused(code, err, fragment)


def test_yaml_nan_and_inf_anywhere_are_refused(tmp_path, capsys):
    text = ("trainer: grpo\nmodel: embedded:tiny-qwen2\ndataset: embedded:arithmetic\n"
            "plugins: [grpo, {exact_match: {weight: .inf}}]\nargs: {beta: .nan}\n")
    code, _, err = cli(capsys, "validate", write(tmp_path, text))
    assert_refused(code, err, "plugins[1].exact_match.weight: NaN and infinity", "args.beta: NaN and infinity")


def test_numbers_yaml_reads_as_strings_are_accepted(tmp_path, capsys):
    # YAML 1.1 reads 1e-3 (no dot) as a string; TRL's own parser takes it as a number, so do we.
    text = "trainer: sft\nmodel: embedded:tiny-qwen2\ndataset: embedded:arithmetic\nargs: {learning_rate: 1e-3}\n"
    code, out, err = cli(capsys, "validate", write(tmp_path, text))
    assert code == 0, err and "valid" in out


def test_plugin_parameter_ranges_come_from_the_plugin(tmp_path, capsys):
    data = {**BASE, "trainer": "grpo", "plugins": ["grpo", {"exact_match": {"weight": "1e3"}}]}
    code, _, err = cli(capsys, "validate", write(tmp_path, data))
    assert code == 0, err


# --------------------------------------------------------------------------------------------------------------------
# Command-line overrides
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "override, fragment",
    [
        ("no-equals-sign", "--set 'no-equals-sign': expected PATH=VALUE"),
        ("=3", "expected PATH=VALUE"),
        ("args..max_steps=3", "expected PATH=VALUE"),
        ("args.max_stepz=3", "args.max_stepz: not a field of SFTConfig"),
        ("bogus=1", "Extra inputs are not permitted"),
        ("args.max_steps=-5", "args.max_steps: must be >= 1"),
        ("args.learning_rate=nan", "NaN and infinity"),
        ("args.max_steps=[unclosed", "--set args.max_steps: not valid YAML"),
        ("trainer.x=1", "--set trainer.x: trainer is not a mapping or list"),
    ],
)
def test_bad_set_overrides(tmp_path, capsys, override, fragment):
    code, _, err = cli(capsys, "validate", write(tmp_path, BASE), "--set", override)
    assert_refused(code, err, fragment)


@pytest.mark.parametrize("value", ["0", "-3", "two"])
def test_bad_max_steps(tmp_path, capsys, value):
    with pytest.raises(SystemExit) as exc:
        main(["train", write(tmp_path, BASE), "--max-steps", value, "--output-dir", str(tmp_path / "out")])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: trl-ext train: argument --max-steps: ")
    assert len(err.strip().splitlines()) == 1, err  # argparse's usage block used to come first
    assert not (tmp_path / "out").exists()


# --------------------------------------------------------------------------------------------------------------------
# What used to fail only after the model loaded
# --------------------------------------------------------------------------------------------------------------------

EVAL = {"dataset": {"source": "embedded:arithmetic", "params": {"format": "prompt"}}, "reward": "exact_match"}


def _local_dataset(tmp_path, rows, name="data.jsonl"):
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.mark.parametrize(
    "patch, fragment",
    [
        ({"evaluation": {**EVAL, "reward": "exact_matc"}}, "stages[0].evaluation.reward: unknown plugin 'exact_matc'"),
        ({"evaluation": {**EVAL, "reward": "grpo"}}, "stages[0].evaluation.reward: plugin 'grpo' is not a reward plugin"),
        ({"evaluation": {**EVAL, "dataset": {"source": "embedded:arithmetix"}}},
         "stages[0].evaluation.dataset.source: unknown embedded dataset 'arithmetix'"),
        ({"dataset": {"source": "embedded:arithmetic", "params": {"fromat": "prompt"}}},
         "stages[0].dataset.params.fromat: not a parameter of this embedded dataset"),
        ({"dataset": {"source": "embedded:arithmetic", "params": {"format": "prompt", "tail_fraction": 0.1}}},
         "stages[0].dataset.params: tail_fraction shapes completions: it needs format 'prompt_completion'"),
        ({"dataset": {"source": "embedded:arithmetic", "params": {"format": "prompt", "size": 99999}}},
         "stages[0].dataset.params: size=99999 exceeds the 2300 problems of the train split"),
        ({"evaluation": {**EVAL, "dataset": {"source": "embedded:arithmetic", "split": "test",
                                             "params": {"operations": "x"}}}},
         "stages[0].evaluation.dataset.params: operations must be made of"),
        ({"dataset": {"source": "embedded:arithmetic", "params": {"max_operand": 0}}},
         "stages[0].dataset.params: the 'train' split these params build holds no rows"),
        ({"dataset": {"source": "embedded:arithmetic", "params": {"size": 0}}},
         "stages[0].dataset.params: the 'train' split these params build holds no rows"),
        # a negative size kept problems[:-5]: every row but the last five, silently
        ({"dataset": {"source": "embedded:arithmetic", "params": {"size": -5}}},
         "stages[0].dataset.params: size must not be negative (got -5)"),
        # "++" listed each problem twice: 30 of the 40 held-out problems of max_operand 10 were also in train.
        ({"dataset": {"source": "embedded:arithmetic", "params": {"operations": "++", "max_operand": 10}}},
         "stages[0].dataset.params: operations must name each operation once, got '++'"),
        ({"peft": {"type": "lorax"}}, "stages[0].peft.type: unknown PEFT method 'lorax'"),
        ({"peft": {"type": "lora", "rr": 8}}, "stages[0].peft.rr: not a field of LoraConfig"),
        ({"peft": {"type": "lora", "r": "abc"}}, "stages[0].peft.r: Input should be a valid integer"),
        ({"peft": {"type": "lora", "r": -4}}, "stages[0].peft.r: must be >= 1 (got -4)"),
        ({"seed": -1}, "seed: Input should be greater than or equal to 0"),  # numpy's seed range, checked by
        ({"seed": 10 ** 26}, "seed: Input should be less than or equal to 4294967295"),  # transformers.set_seed
        ({"seed": True}, "seed: expected a number, got True"),  # YAML `true` is not 1
        ({"args": {"max_steps": True}}, "stages[0].args.max_steps: Input should be a valid integer (got True)"),
        ({"dataset": "data/nope.jsonl"}, "stages[0].dataset.source: no such file or folder 'data/nope.jsonl'"),
        ({"dataset": "s3://bucket/train"}, "stages[0].dataset.source: 's3://bucket/train' is neither a local file or "
                                           "folder nor a hub id"),
        ({"model": "./no/such/model"}, "stages[0].model: no such model folder './no/such/model'"),
        ({"model": "/no/such/model"}, "stages[0].model: no such model folder"),
        ({"model": "runs/never/made"}, "stages[0].model: no such model folder 'runs/never/made'"),
    ],
)
def test_faults_that_used_to_need_a_loaded_model(tmp_path, capsys, patch, fragment):
    code, _, err = cli(capsys, "train", write(tmp_path, {**BASE, **patch}), "--output-dir", str(tmp_path / "out"))
    assert_refused(code, err, fragment)
    assert not (tmp_path / "out").exists()  # train validated first and wrote nothing


@pytest.mark.parametrize("dataset, fragment", [
    ({"source": "embedded:arithmetic", "params": {"max_operand": 10 ** 9}},
     "stages[0].dataset.params: max_operand=1000000000 and 1 operation(s) enumerate 1e+18 problems; at most 1,000,000"),
    ({"source": "embedded:code_tasks", "params": {"max_a": 10 ** 30}},
     "stages[0].dataset.params: max_a=1000000000000000000000000000000 and max_b=19 enumerate 4e+31 problems"),
])
def test_embedded_sizes_that_would_exhaust_memory_are_refused(tmp_path, capsys, dataset, fragment):
    # Validation builds the split: unbounded, `max_operand: 1e9` listed 1e18 problems until the kernel killed it.
    import time

    started = time.monotonic()
    code, _, err = cli(capsys, "validate", write(tmp_path, {**BASE, "dataset": dataset}))
    assert_refused(code, err, fragment)
    assert time.monotonic() - started < 5


def test_local_data_files_are_read_whole_before_anything_loads(tmp_path, capsys):
    """A torn JSON line, rows that are not objects and a file without rows failed only while the stage started,
    after run.json and the embedded model were written; a pretty-printed JSON object of columns is valid."""
    files = {"torn.jsonl": '{"prompt": "1+1=", "completion": "2"}\n{"prompt": "2+2=", "compl',
             "list.json": "[1, 2]", "empty.jsonl": "\n",
             "columns.json": '{\n  "prompt": ["1+1="],\n  "completion": ["2"]\n}\n'}
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    for name, fragment in (("torn.jsonl", "torn.jsonl' line 2: not valid JSON"),
                           ("list.json", "list.json' item 0: not a JSON object"),
                           ("empty.jsonl", "empty.jsonl' holds no rows")):
        code, _, err = cli(capsys, "train", write(tmp_path, {**BASE, "dataset": str(tmp_path / name)}),
                           "--output-dir", str(tmp_path / "out"))
        assert_refused(code, err, f"stages[0].dataset.source: '{tmp_path / name}", fragment)
        assert not (tmp_path / "out").exists()
    code, _, err = cli(capsys, "validate", write(tmp_path, {**BASE, "dataset": str(tmp_path / "columns.json")}))
    assert code == 0, err


def test_duplicate_keys_and_a_shared_output_dir_are_refused(tmp_path, capsys):
    path = tmp_path / "dup.yaml"
    path.write_text("seed: 1\ntrainer: sft\nargs: {max_steps: 2, max_steps: 3}\n")
    code, _, err = cli(capsys, "validate", str(path))
    assert_refused(code, err, f"{path}: line 3: duplicate key 'max_steps' (first at line 3)")
    code, _, err = cli(capsys, "validate", write(tmp_path, BASE), "--output-dir", "/")
    assert_refused(code, err, "output_dir: '/' is the file system root")


def test_each_problem_is_one_line(tmp_path, capsys):
    code, _, err = cli(capsys, "validate", write(tmp_path, {**BASE, "seed": -1}))
    assert code == 2 and err.splitlines() == ["error: invalid recipe: seed: Input should be greater than or equal "
                                              "to 0"]
    code, _, err = cli(capsys, "validate", write(tmp_path, {**BASE, "seed": -1, "output_dir": 5}))
    assert code == 2 and len(err.splitlines()) == 2 and all(line.startswith("error: invalid recipe: ")
                                                            for line in err.splitlines())


def test_a_model_path_that_is_a_file_or_not_a_model_folder(tmp_path, capsys):
    (tmp_path / "weights.bin").write_text("x")
    (tmp_path / "empty").mkdir()
    data = {"stages": [{**BASE, "name": "a", "model": str(tmp_path / "weights.bin")},
                       {**BASE, "name": "b", "model": str(tmp_path / "empty")}]}
    code, _, err = cli(capsys, "validate", write(tmp_path, data))
    assert_refused(code, err, "stages[0].model:", "is a file", "stages[1].model:", "without config.json")


def test_relative_model_path_of_another_run_is_a_warning_in_validate_and_an_error_in_train(tmp_path, capsys):
    path = write(tmp_path, {**BASE, "model": "runs/not/yet"})
    code, out, err = cli(capsys, "validate", path, "--output-dir", str(tmp_path / "out"))
    assert code == 0 and "warning: stages[0].model: no such model folder 'runs/not/yet'" in err
    code, _, err = cli(capsys, "train", path, "--output-dir", str(tmp_path / "out"))
    assert_refused(code, err, "stages[0].model: no such model folder 'runs/not/yet'")


@pytest.mark.parametrize(
    "trainer, rows, fragment",
    [
        ("sft", [{"question": "1+1", "answer": "2"}], "the sft trainer reads completion+prompt or messages or text"),
        ("dpo", [{"prompt": "1+1", "chosen": "2"}], "the dpo trainer reads chosen+rejected"),
        ("grpo", [{"question": "1+1"}], "the grpo trainer reads prompt"),
    ],
)
def test_missing_columns_of_a_local_dataset(tmp_path, capsys, trainer, rows, fragment):
    plugins = ["grpo", "exact_match"] if trainer == "grpo" else []
    data = {**BASE, "trainer": trainer, "plugins": plugins, "dataset": _local_dataset(tmp_path, rows)}
    code, _, err = cli(capsys, "validate", write(tmp_path, data))
    assert_refused(code, err, "stages[0].dataset.source:", fragment)


def test_deepspeed_or_vllm_args_without_the_package_name_the_extra(tmp_path, capsys, monkeypatch):
    # Absent here whatever is installed: the check looks the module names up through this table.
    monkeypatch.setattr("trl_ext.stage.ARG_PACKAGES", {
        "deepspeed": ("trl_ext_absent_deepspeed", "DeepSpeed", "trl-ext[deepspeed]"),
        "use_vllm": ("trl_ext_absent_vllm", "vLLM", "trl-ext[vllm]")})
    data = {**BASE, "trainer": "grpo", "plugins": ["grpo", "exact_match"],
            "args": {"max_steps": 1, "use_vllm": True, "deepspeed": {"zero_optimization": {"stage": 2}}}}
    code, _, err = cli(capsys, "validate", write(tmp_path, data))
    assert_refused(code, err, "stages[0].args.deepspeed: needs DeepSpeed: pip install 'trl-ext[deepspeed]'",
                   "stages[0].args.use_vllm: needs vLLM: pip install 'trl-ext[vllm]'")


def test_misspelled_local_columns_get_a_did_you_mean(tmp_path, capsys):
    data = {**BASE, "dataset": _local_dataset(tmp_path, [{"promt": "1+1=", "completion": "2"}])}
    code, _, err = cli(capsys, "validate", write(tmp_path, data))
    assert_refused(code, err, "stages[0].dataset.source:", "Did you mean: 'promt' for 'prompt'?")


def test_local_dataset_with_the_right_columns_validates(tmp_path, capsys):
    csv_path = tmp_path / "data.csv"
    csv_path.write_text("prompt,completion\n1+1,2\n")
    code, out, err = cli(capsys, "validate", write(tmp_path, {**BASE, "dataset": str(csv_path)}))
    assert code == 0, err


@pytest.mark.parametrize(
    "patch, fragments",
    [
        ({"dataset": {"source": "embedded:arithmetic", "params": {"formatt": "prompt"}}},
         ["stages[0].dataset.params.formatt: not a parameter of this embedded dataset. Did you mean: format?"]),
        ({"trainer": "grpo", "plugins": ["grpo", {"exact_match": {"wieght": 2}}]},
         ["stages[0].plugins[1].params.wieght: not a parameter of this plugin. Did you mean: weight?",
          "(plugin 'exact_match')"]),
        ({"args": {"max_steps": 1, "report_to": "tensorbord"}},
         ["stages[0].args.report_to: unknown tracking backend 'tensorbord'. Did you mean: tensorboard?"]),
        ({"args": {"max_steps": 1, "report_to": ["none", "clearml"]}},
         ["stages[0].args.report_to: tracking backend 'clearml' is not installed here: pip install clearml"]),
        # A number is refused by its type alone (it used to reach the backend check: "TypeError", exit 1).
        ({"args": {"max_steps": 1, "report_to": 5}}, ["stages[0].args.report_to: ", "(got 5)"]),
    ],
)
def test_misspellings_and_missing_backends_get_a_hint(tmp_path, capsys, patch, fragments):
    code, _, err = cli(capsys, "validate", write(tmp_path, {**BASE, **patch}))
    assert_refused(code, err, *fragments)


def test_report_to_installed_backend_or_none_validates(tmp_path, capsys):
    from transformers.integrations.integration_utils import get_available_reporting_integrations

    for value in ["none", "all", ["none"], *get_available_reporting_integrations()]:
        code, _, err = cli(capsys, "validate", write(tmp_path, {**BASE, "args": {"max_steps": 1, "report_to": value}}))
        assert code == 0, (value, err)


def test_split_and_params_on_a_local_file_are_refused_not_ignored(tmp_path, capsys):
    rows = [{"prompt": "1+1=", "completion": "2"}]
    data = {**BASE, "dataset": {"source": _local_dataset(tmp_path, rows), "split": "validation", "params": {"x": 1}}}
    code, _, err = cli(capsys, "validate", write(tmp_path, data))
    assert_refused(code, err, "stages[0].dataset.split: ", "is a single split (named 'train'); 'validation' would be "
                   "ignored", "stages[0].dataset.params: a local dataset takes no params (got x)")
    data["dataset"] = {"source": data["dataset"]["source"], "split": "train"}
    code, _, err = cli(capsys, "validate", write(tmp_path, data))
    assert code == 0, err


def test_split_of_a_saved_dataset_dict_is_used(tmp_path, capsys):
    import datasets

    from trl_ext.catalog import Catalog
    from trl_ext.recipe import StageSpec
    from trl_ext.runner import load_split

    folder = tmp_path / "saved"
    datasets.DatasetDict({
        "train": datasets.Dataset.from_list([{"prompt": "a", "completion": "1"}] * 3),
        "test": datasets.Dataset.from_list([{"prompt": "b", "completion": "2"}]),
    }).save_to_disk(str(folder))
    code, _, err = cli(capsys, "validate", write(tmp_path, {**BASE, "dataset": {"source": str(folder), "split": "dev"}}))
    assert_refused(code, err, "stages[0].dataset.split: 'dev' is not a split of the saved dataset", "splits: train, test")
    stage = StageSpec(**{**BASE, "dataset": {"source": str(folder), "split": "test"}})
    assert load_split(stage.dataset, Catalog.discover(), stage, "train", None)["prompt"] == ["b"]


def test_evaluation_dataset_takes_the_string_shorthand(tmp_path, capsys):
    from trl_ext.recipe import StageSpec

    local = _local_dataset(tmp_path, [{"prompt": "1+1="}])
    data = {**BASE, "evaluation": {"dataset": "embedded:arithmetic", "reward": "exact_match"}}
    code, _, err = cli(capsys, "validate", write(tmp_path, data))
    assert code == 0, err
    held_out = StageSpec(**data).evaluation.dataset
    assert (held_out.source, held_out.split) == ("embedded:arithmetic", "test")  # held out, never the training split
    file_spec = StageSpec(**{**BASE, "evaluation": {"dataset": local, "reward": "exact_match"}}).evaluation.dataset
    assert (file_spec.source, file_spec.split) == (local, "train")  # a file is its one split



def test_sampled_evaluation_fields_are_checked_and_unused_ones_keep_old_fingerprints(tmp_path, capsys):
    from trl_ext.recipe import parse_recipe

    evaluation = {"dataset": "embedded:arithmetic", "reward": "exact_match", "max_new_tokens": 6}
    stage = {"name": "rl", "trainer": "grpo", "model": "embedded:tiny-qwen2", "plugins": ["grpo", "exact_match"],
             "dataset": {"source": "embedded:arithmetic", "params": {"format": "prompt"}}}
    recipe = {"seed": 0, "stages": [{**stage, "evaluation": evaluation}]}
    # The fingerprint the release before mean_at_k (08a85c6) gave this recipe: a run it finished is still complete.
    assert parse_recipe(recipe).fingerprint() == "d061598a796e6f61"
    assert "mean_at_k" not in parse_recipe(recipe).stages[0].as_written()["evaluation"]
    sampled = {"seed": 0, "stages": [{**stage, "evaluation": {**evaluation, "mean_at_k": 4}}]}
    assert parse_recipe(sampled).stages[0].as_written()["evaluation"]["mean_at_k"] == 4
    assert parse_recipe(sampled).fingerprint() != parse_recipe(recipe).fingerprint()

    for fields, expected in (({"mean_at_k": 0}, "stages[0].evaluation.mean_at_k: Input should be greater than 0"),
                             ({"mean_at_k": 2, "temperature": 0}, "stages[0].evaluation.temperature: Input should be "
                                                                  "greater than 0"),
                             ({"temperature": 0.7}, "stages[0].evaluation: temperature is the sampling "
                                                    "temperature of mean_at_k; set mean_at_k")):
        code, _, err = cli(capsys, "validate", write(tmp_path, {**BASE, "evaluation": {**evaluation, **fields}}))
        assert_refused(code, err, expected)


def test_output_dir_that_is_a_file(tmp_path, capsys):
    (tmp_path / "out").write_text("not a folder")
    code, _, err = cli(capsys, "train", write(tmp_path, BASE), "--output-dir", str(tmp_path / "out"))
    assert_refused(code, err, "output_dir:", "exists and is not a folder")
    code, _, err = cli(capsys, "validate", write(tmp_path, BASE), "--output-dir", str(tmp_path / "out" / "sub"))
    assert_refused(code, err, "output_dir:", "is not a folder")


def test_output_dir_that_is_a_broken_symlink(tmp_path, capsys):
    """validate said valid; train then failed with "cannot create 'out': File exists"."""
    (tmp_path / "out").symlink_to(tmp_path / "gone")
    for command in ("validate", "train"):
        code, _, err = cli(capsys, command, write(tmp_path, BASE), "--output-dir", str(tmp_path / "out"))
        assert_refused(code, err, "output_dir:", "is a broken symbolic link", str(tmp_path / "gone"))
    assert not (tmp_path / "gone").exists()


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes through permission bits, so there is no unwritable folder; "
                    "test_output_dir_refused_when_the_os_denies_writing covers the check as root")
def test_output_dir_not_writable(tmp_path, capsys):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        code, _, err = cli(capsys, "validate", write(tmp_path, BASE), "--output-dir", str(locked / "out"))
        assert_refused(code, err, "output_dir:", "is not writable")
    finally:
        locked.chmod(0o700)


# --------------------------------------------------------------------------------------------------------------------
# Messages and exit codes
# --------------------------------------------------------------------------------------------------------------------


def test_debug_shows_the_traceback_and_runtime_failures_exit_1(tmp_path, capsys, monkeypatch):
    path = write(tmp_path, {**BASE, "plugins": ["nope"]})
    code, _, err = cli(capsys, "--debug", "validate", path)
    assert code == 2 and "Traceback" in err and "unknown plugin 'nope'" in err

    def broken(*args, **kwargs):
        raise RuntimeError("disk on fire\nsecond line")

    monkeypatch.setattr("trl_ext.runner.run_recipe", broken)
    code, _, err = cli(capsys, "train", write(tmp_path, BASE), "--output-dir", str(tmp_path / "out"))
    assert code == 1 and "error: RuntimeError: disk on fire" in err and "second line" not in err
    assert "Traceback" not in err
    code, _, err = cli(capsys, "train", write(tmp_path, BASE), "--output-dir", str(tmp_path / "out"), "--debug")
    assert code == 1 and "Traceback" in err


# --------------------------------------------------------------------------------------------------------------------
# Third-party plugins
# --------------------------------------------------------------------------------------------------------------------


class FakeEntryPoint:
    """What importlib.metadata gives the catalog: a name, a distribution, and load()."""

    def __init__(self, name, load, dist="trl-ext-broken"):
        self.name, self._load = name, load
        self.dist = types.SimpleNamespace(name=dist, version="9.9")

    def load(self):
        return self._load()


def _exits():
    raise SystemExit(3)


def _interrupts_generator():
    raise GeneratorExit()


class HalfRegisters:
    """Registers a model, then dies in its next registration hook: nothing it registered may stay."""

    @staticmethod
    @hookimpl
    def trl_ext_register_models(register):
        register("half-model", lambda directory, seed=0: directory)

    @staticmethod
    @hookimpl
    def trl_ext_register_datasets(register):
        raise SystemExit("plugin called sys.exit()")


@pytest.mark.parametrize("load, error", [(_exits, "SystemExit: 3"), (_interrupts_generator, "GeneratorExit"),
                                         (lambda: HalfRegisters, "SystemExit: plugin called sys.exit()")])
def test_an_entry_point_raising_anything_is_recorded_and_the_rest_loads(load, error):
    catalog = Catalog.discover()
    before = set(catalog.plugins)
    catalog.load_entry_point(FakeEntryPoint("broken", load))
    assert set(catalog.plugins) == before and "half-model" not in catalog.models
    (failure,) = [f for f in catalog.failures if f.source == "broken"]
    assert failure.distribution == "trl-ext-broken" and error in failure.error


def test_a_broken_entry_point_is_reported_by_the_cli_which_goes_on(tmp_path, capsys, monkeypatch):
    original = Catalog.load_entry_point
    entry_points = [FakeEntryPoint("broken", _exits)]

    def discover(cls, autoload=None, block=frozenset()):
        catalog = original_discover(autoload, block=block)
        for ep in entry_points:
            if ep.name not in block:
                original(catalog, ep)
        return catalog

    original_discover = Catalog.discover
    monkeypatch.setattr(Catalog, "discover", classmethod(discover))
    code, out, err = cli(capsys, "validate", write(tmp_path, BASE))
    assert code == 0, err
    assert "warning: plugin entry point 'broken' of distribution 'trl-ext-broken' failed to load" in err
    assert "SystemExit: 3" in err and "-p no:broken" in err
    code, out, err = cli(capsys, "-p", "no:broken", "validate", write(tmp_path, BASE))
    assert code == 0 and "broken" not in err


def test_disable_a_plugin_family_by_name_and_allow_list(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("TRL_EXT_DISABLE_PLUGIN_AUTOLOAD", raising=False)
    data = {**BASE, "trainer": "grpo", "plugins": ["grpo", "exact_match"]}
    code, _, err = cli(capsys, "validate", write(tmp_path, data), "-p", "no:rewards")
    assert_refused(code, err, "unknown plugin 'exact_match'")
    monkeypatch.setenv("TRL_EXT_PLUGINS", "losses")
    code, _, err = cli(capsys, "validate", write(tmp_path, data))
    assert_refused(code, err, "unknown plugin 'exact_match'")
    monkeypatch.setenv("TRL_EXT_PLUGINS", "losses,rewards")
    code, _, err = cli(capsys, "validate", write(tmp_path, data))
    assert code == 0, err


# --------------------------------------------------------------------------------------------------------------------
# One run per output directory; unfinished stages; incomplete checkpoints; torn lines
# --------------------------------------------------------------------------------------------------------------------


def test_second_run_is_refused_naming_the_holder_and_a_stale_lock_is_taken_over(tmp_path, capsys):
    import socket

    from trl_ext.runner import LOCK_FILE, RunLock, _process_start

    out = tmp_path / "out"
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        out.mkdir()
        (out / LOCK_FILE).write_text(json.dumps({"pid": holder.pid, "host": socket.gethostname(),
                                                 "process_start": _process_start(holder.pid), "started": "earlier"}))
        code, _, err = cli(capsys, "train", write(tmp_path, BASE), "--output-dir", str(out))
        assert_refused(code, err, f"in use by another trl-ext run (pid {holder.pid} on host {socket.gethostname()}")
    finally:
        holder.kill()
        holder.wait()
    messages = []
    lock = RunLock(out, messages.append).acquire()  # the holder is dead now
    assert any("taking over a stale lock" in m and str(holder.pid) in m for m in messages)
    assert json.loads((out / LOCK_FILE).read_text())["pid"] == os.getpid()
    with pytest.raises(OutputDirError, match=f"pid {os.getpid()}"):
        RunLock(out).acquire()  # held by a live process (this one)
    lock.release()
    assert not (out / LOCK_FILE).exists()


def test_unfinished_stage_of_another_recipe_is_refused_or_restarted(tmp_path, capsys):
    from trl_ext.runner import check_output_dir

    out = tmp_path / "out"
    (out / "main" / "checkpoints" / "checkpoint-2").mkdir(parents=True)
    (out / "main" / "started.json").write_text(json.dumps({"fingerprint": "another-recipe"}))
    code, _, err = cli(capsys, "train", write(tmp_path, BASE), "--output-dir", str(out))
    assert_refused(code, err, "holds an unfinished stage 'main' of a different recipe", "--restart-unfinished")
    assert (out / "main" / "checkpoints" / "checkpoint-2").is_dir()  # untouched
    messages = []
    check_output_dir(out, {"main": "this-recipe"}, restart_unfinished=True, echo=messages.append)
    assert not (out / "main").exists() and "removing the unfinished stage" in messages[0]
    (out / "main").mkdir()
    (out / "main" / "started.json").write_text(json.dumps({"fingerprint": "this-recipe"}))
    check_output_dir(out, {"main": "this-recipe"})  # the same recipe continues


def test_only_complete_checkpoints_are_resumed_from(tmp_path):
    from trl_ext.callbacks import CHECKPOINT_COMPLETE
    from trl_ext.runner import latest_checkpoint

    for step in (2, 4, 6):
        (tmp_path / f"checkpoint-{step}").mkdir()
    (tmp_path / "checkpoint-2" / CHECKPOINT_COMPLETE).write_text("{}")
    (tmp_path / "checkpoint-4" / CHECKPOINT_COMPLETE).write_text("{}")
    messages = []
    assert latest_checkpoint(tmp_path, messages.append, remove_incomplete=True) == str(tmp_path / "checkpoint-4")
    assert "skipping incomplete checkpoint" in messages[0] and not (tmp_path / "checkpoint-6").exists()
    assert latest_checkpoint(tmp_path / "none", messages.append) is None


def test_metrics_file_with_a_torn_line_is_repaired_on_resume(tmp_path):
    from transformers import TrainerControl, TrainerState

    from trl_ext.callbacks import MetricsJsonlCallback

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 1.0}\n{"step": 2, "loss": 0.5}\n{"step": 3, "lo')
    callback = MetricsJsonlCallback(path, resume_step=2)
    state = TrainerState()
    callback.on_train_begin(None, state, TrainerControl())
    assert [json.loads(line) for line in path.read_text().splitlines()] == [{"step": 1, "loss": 1.0},
                                                                          {"step": 2, "loss": 0.5}]
    state.global_step = 3
    callback.on_log(None, state, TrainerControl(), logs={"loss": 0.25})
    assert json.loads(path.read_text().splitlines()[-1]) == {"step": 3, "loss": 0.25}


def _with_entry_points(monkeypatch, *entry_points):
    """Make the CLI's catalog also load these (fake) third-party entry points."""
    original_discover, original_load = Catalog.discover, Catalog.load_entry_point

    def discover(cls, autoload=None, block=frozenset()):
        catalog = original_discover(autoload, block=block)
        for ep in entry_points:
            original_load(catalog, ep)
        return catalog

    monkeypatch.setattr(Catalog, "discover", classmethod(discover))


def _raising_plugins():
    from trl_ext.plugin import Plugin

    class RaisesInCheck(Plugin):
        name = "raises_in_check"

        @hookimpl
        def trl_ext_validate_stage(self, stage, plugins):
            raise KeyError("oops")

    class RaisesInConfigure(Plugin):
        name = "raises_in_configure"

        @hookimpl
        def trl_ext_configure_args(self, trainer, args):
            raise ValueError("cannot configure\nsecond line")

    return RaisesInCheck, RaisesInConfigure


def test_a_plugin_hook_raising_during_validation_is_one_line_naming_it(tmp_path, capsys, monkeypatch):
    check, configure = _raising_plugins()
    _with_entry_points(monkeypatch, FakeEntryPoint("check", lambda: check), FakeEntryPoint("conf", lambda: configure))
    data = {**BASE, "plugins": ["raises_in_check", "raises_in_configure"]}
    code, _, err = cli(capsys, "validate", write(tmp_path, data))
    assert_refused(code, err, "stages[0].plugins: plugin 'raises_in_check' (distribution trl-ext-broken) failed in "
                              "trl_ext_validate_stage: KeyError: 'oops'",
                   "stages[0].plugins: plugin 'raises_in_configure' (distribution trl-ext-broken) failed in "
                   "trl_ext_configure_args: ValueError: cannot configure")
    assert "second line" not in err and len(err.strip().splitlines()) == 2, err


def test_plugin_checks_wait_for_typed_args(tmp_path, capsys):
    # rloo's check reads int(args["num_generations"]): it used to run on the mistyped value and crash (ValueError,
    # exit 1) instead of the type error being reported.
    data = {**BASE, "trainer": "grpo", "plugins": ["rloo", "exact_match"], "args": {"num_generations": "xyzzy"}}
    code, _, err = cli(capsys, "validate", write(tmp_path, data))
    assert_refused(code, err, "stages[0].args.num_generations: Input should be a valid integer")
    assert "ValueError" not in err


def _nonconforming_plugins():
    """Plugin classes that loaded fine and failed (or misbehaved) only when a recipe selected them."""
    from pydantic import BaseModel

    from trl_ext.plugin import Plugin

    class DictParams(Plugin):
        name = "dict_params"
        Params = dict  # validation crashed: "AttributeError: type object 'dict' has no attribute 'model_validate'"

    class LaxParams(Plugin):
        name = "lax_params"

        class Params(BaseModel):  # extra keys allowed: a misspelt parameter was silently ignored
            target: int = 1

    class WrongArgument(Plugin):
        name = "wrong_argument"

        @hookimpl
        def trl_ext_validate_stage(self, stage, plugins, bogus):  # pluggy refused it only when a stage was built
            return []

    class LettersAsTrainers(Plugin):
        name = "letters_as_trainers"
        trainers = "grpo"  # read as {'g', 'r', 'p', 'o'}: "works with trainer(s) ['g', 'o', 'p', 'r']"

    class NeedAsText(Plugin):
        name = "need_as_text"
        needs = frozenset({"teacher"})  # crashed: "'str' object has no attribute 'value'"

    class NotAPlugin:
        pass

    return {"dict_params": (DictParams, "Params must be a trl_ext.PluginParams subclass"),
            "lax_params": (LaxParams, "its Params class must refuse unknown keys"),
            "wrong_argument": (WrongArgument, "Argument(s) {'bogus'} are declared in the hookimpl but can not be found "
                                              "in the hookspec"),
            "letters_as_trainers": (LettersAsTrainers, "trainers must be a collection of str, got 'grpo'"),
            "need_as_text": (NeedAsText, "needs holds 'teacher', not a Need"),
            "not_a_plugin": (NotAPlugin, "is neither a trl_ext.Plugin subclass nor a module with registration hooks")}


@pytest.mark.parametrize("name", list(_nonconforming_plugins()))
def test_a_nonconforming_plugin_class_fails_to_load_naming_it(tmp_path, capsys, monkeypatch, name):
    cls, message = _nonconforming_plugins()[name]
    catalog = Catalog.discover()
    catalog.load_entry_point(FakeEntryPoint(name, lambda: cls))
    (failure,) = [f for f in catalog.failures if f.source == name]
    assert failure.distribution == "trl-ext-broken" and message in failure.error, failure.error
    assert name not in catalog.plugins

    _with_entry_points(monkeypatch, FakeEntryPoint(name, lambda: cls))
    code, _, err = cli(capsys, "validate", write(tmp_path, {**BASE, "plugins": [{name: {"taget": 2}}]}))
    assert_refused(code, err, f"stages[0].plugins[0]: plugin {name!r} is installed but failed to load", message)
    assert f"plugin entry point {name!r} of distribution 'trl-ext-broken' failed to load" in err
