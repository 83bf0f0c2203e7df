"""Inputs that `trl-ext validate` accepted but `trl-ext train` failed on only after the model was built (exit 1, a
library message naming no field, a started.json left behind): each is now one line naming the field, exit 2, before
any model loads and before anything is written."""

import json

import pytest

from trl_ext.cli import main

BASE = {"trainer": "sft", "model": "embedded:tiny-qwen2", "plugins": ["sft"],
        "dataset": {"source": "embedded:arithmetic", "params": {"format": "prompt_completion"}},
        "args": {"max_steps": 1, "per_device_train_batch_size": 2, "max_length": 32}}


pytestmark = pytest.mark.usefixtures("no_model_loads")  # validation must never load a model (conftest.py)


@pytest.fixture
def hf_cache(tmp_path, monkeypatch):
    """datasets' default cache folder (~/.cache/huggingface/datasets), moved where the test can see it."""
    import datasets.config

    cache = tmp_path / "home_cache" / "datasets"
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(cache))
    return cache


def validate(tmp_path, capsys, recipe, *extra):
    path = tmp_path / "recipe.yaml"
    path.write_text(json.dumps(recipe))
    code = main(["validate", str(path), *extra])
    return code, capsys.readouterr().err


def assert_refused(code, err, *fragments):
    assert code == 2, err
    assert "Traceback" not in err and "DatasetGenerationError" not in err, err
    for fragment in fragments:
        assert fragment in err, err


def with_args(**args):
    return {**BASE, "args": {**BASE["args"], **args}}


DATA = {"bad.csv": 'prompt,completion\n1+1=,2\n"unterminated,4\n3+3=,6,extra\n',
        "extra_field.csv": "prompt,completion\n1+1=,2\n3+3=,6,extra\n",
        "header_only.csv": "prompt,completion\n",
        "empty.csv": "",
        "notes.txt": "prompt,completion\n1+1=,2\n",
        "good.csv": "prompt,completion\n1+1=,2\n"}


@pytest.mark.parametrize("name, fragment", [
    ("bad.csv", "bad.csv': not valid CSV (Error tokenizing data. C error: EOF inside string"),
    ("extra_field.csv", "extra_field.csv': not valid CSV (Error tokenizing data. C error: Expected 2 fields in line 3"),
    ("header_only.csv", "header_only.csv' holds no rows"),
    ("empty.csv", "empty.csv' holds no rows"),
    ("notes.txt", "notes.txt': unsupported file type .txt"),
    ("folder", "is a folder but not a saved dataset"),
])
def test_a_local_dataset_datasets_cannot_read_is_refused_naming_file_and_field(tmp_path, capsys, name, fragment):
    """Checked as .jsonl files already were, also when a plugin prepares the dataset (no column check then)."""
    for file_name, text in DATA.items():
        (tmp_path / file_name).write_text(text)
    (tmp_path / "folder").mkdir()
    (tmp_path / "folder" / "train.jsonl").write_text('{"prompt": "1+1=", "completion": "2"}\n')
    code, err = validate(tmp_path, capsys, {**BASE, "dataset": str(tmp_path / name)})
    assert_refused(code, err, f"stages[0].dataset.source: '{tmp_path / name}", fragment)
    code, err = validate(tmp_path, capsys, {**BASE, "dataset": str(tmp_path / "good.csv")})
    assert code == 0, err


def test_a_refused_csv_stops_train_before_anything_is_written(tmp_path, capsys):
    (tmp_path / "bad.csv").write_text(DATA["bad.csv"])
    path = tmp_path / "recipe.yaml"
    path.write_text(json.dumps({**BASE, "eval_dataset": str(tmp_path / "bad.csv")}))
    code = main(["train", str(path), "--output-dir", str(tmp_path / "out")])
    assert_refused(code, capsys.readouterr().err, "stages[0].eval_dataset.source: ", "not valid CSV")
    assert not (tmp_path / "out").exists()  # no started.json to block a rerun of the fixed recipe


def test_parquet_files_without_rows_or_footer_are_refused(tmp_path, capsys):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"prompt": pa.array([], pa.string()), "completion": pa.array([], pa.string())}),
                   tmp_path / "empty.parquet")
    pq.write_table(pa.table({"prompt": ["1+1="], "completion": ["2"]}), tmp_path / "good.parquet")
    (tmp_path / "fake.parquet").write_text("not parquet")
    code, err = validate(tmp_path, capsys, {**BASE, "dataset": str(tmp_path / "empty.parquet")})
    assert_refused(code, err, "stages[0].dataset.source: ", "empty.parquet' holds no rows")
    code, err = validate(tmp_path, capsys, {**BASE, "dataset": str(tmp_path / "fake.parquet")})
    assert_refused(code, err, "stages[0].dataset.source: cannot read ", "fake.parquet' as Parquet")
    code, err = validate(tmp_path, capsys, {**BASE, "dataset": str(tmp_path / "good.parquet")})
    assert code == 0, err


@pytest.mark.parametrize("strategy", ["steps", "epoch"])
def test_evaluating_without_an_eval_dataset_is_refused(tmp_path, capsys, strategy):
    code, err = validate(tmp_path, capsys, with_args(eval_strategy=strategy))
    assert_refused(code, err, f"stages[0].args.eval_strategy: '{strategy}' evaluates on the stage's eval_dataset")
    with_eval = {**with_args(eval_strategy=strategy, eval_steps=1), "eval_dataset": {**BASE["dataset"], "split": "test"}}
    code, err = validate(tmp_path, capsys, with_eval)
    assert code == 0, err
    code, err = validate(tmp_path, capsys, with_args(eval_strategy="no"))
    assert code == 0, err


@pytest.mark.parametrize("dropout, ok", [(5.0, False), (1.0, False), (-0.1, False), (0.0, True), (0.1, True)])
def test_peft_dropout_outside_0_1_is_refused(tmp_path, capsys, dropout, ok):
    code, err = validate(tmp_path, capsys, {**BASE, "peft": {"type": "lora", "lora_dropout": dropout}})
    if ok:
        assert code == 0, err
    else:
        assert_refused(code, err, f"stages[0].peft.lora_dropout: must be in [0, 1) (got {dropout})")


@pytest.mark.parametrize("args, fragment", [
    ({"model_init_kwargs": "bogus"}, "stages[0].args.model_init_kwargs: a mapping of keyword arguments (got 'bogus')"),
    ({"dataset_kwargs": "x"}, "stages[0].args.dataset_kwargs: a mapping"),
    ({"dataset_num_proc": -3}, "stages[0].args.dataset_num_proc: must be >= 1, or null for one process (got -3)"),
    ({"dataset_num_proc": 0}, "stages[0].args.dataset_num_proc: must be >= 1"),
    ({"per_device_train_batch_size": 10**30}, "stages[0].args.per_device_train_batch_size: does not fit a 32-bit "
                                              "integer (at most 2147483647 in size)"),
    ({"gradient_accumulation_steps": 2**31}, "stages[0].args.gradient_accumulation_steps: does not fit a 32-bit"),
    ({"push_to_hub": True}, "stages[0].args.push_to_hub: trl-ext does not upload"),
    ({"chat_template_path": "/nonexistent"}, "stages[0].args.chat_template_path: no such file or folder "
                                             "'/nonexistent'"),
    ({"chat_template_path": "templates/missing.jinja"}, "stages[0].args.chat_template_path: no such file or folder"),
])
def test_trl_args_that_fail_after_the_model_loads_are_refused(tmp_path, capsys, args, fragment):
    code, err = validate(tmp_path, capsys, with_args(**args))
    assert_refused(code, err, fragment)


def test_chat_template_path_must_be_a_template_file_tokenizer_folder_or_hub_id(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "chat.jinja").write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    (tmp_path / "chat.txt").write_text("{{ messages }}")
    (tmp_path / "empty_folder").mkdir()
    for value in ("chat.jinja", str(tmp_path / "chat.jinja"), "Qwen/Qwen3-0.6B"):
        code, err = validate(tmp_path, capsys, with_args(chat_template_path=value))
        assert code == 0, err
    code, err = validate(tmp_path, capsys, with_args(chat_template_path="chat.txt"))
    assert_refused(code, err, "stages[0].args.chat_template_path: 'chat.txt' is a file but not a Jinja template")
    code, err = validate(tmp_path, capsys, with_args(chat_template_path="empty_folder"))
    assert_refused(code, err, "stages[0].args.chat_template_path: 'empty_folder' is a folder without "
                              "tokenizer_config.json")


@pytest.mark.parametrize("args", [{"model_init_kwargs": {"dtype": "float32"}},
                                  {"model_init_kwargs": '{"dtype": "float32"}'},  # transformers parses JSON text
                                  {"dataset_num_proc": 2}, {"dataset_num_proc": None},
                                  {"push_to_hub": False}, {"per_device_train_batch_size": 4}])
def test_good_trl_args_still_validate(tmp_path, capsys, args):
    code, err = validate(tmp_path, capsys, with_args(**args))
    assert code == 0, err


def test_seed_keeps_its_own_wider_bound(tmp_path, capsys):
    code, err = validate(tmp_path, capsys, {**BASE, "seed": 2**32 - 1})
    assert code == 0, err


def _mixture(path):
    return {"source": "embedded:mixture", "params": {"parts": [{"source": "embedded:arithmetic", "limit": 4,
                                                                "params": {"format": "prompt_completion"}},
                                                               {"source": str(path)}]}}


@pytest.mark.parametrize("name, text, fragment", [
    ("torn.jsonl", '{"prompt": "1+1=", "completion": "2"}\n{"prompt": "2+2=", "compl',
     "torn.jsonl' line 2: not valid JSON"),
    ("bad.csv", DATA["bad.csv"], "bad.csv': not valid CSV"),
    ("header_only.csv", DATA["header_only.csv"], "header_only.csv' holds no rows"),
])
def test_a_mixture_part_with_a_bad_local_file_names_the_part_and_the_file(tmp_path, capsys, hf_cache, name, text,
                                                                        fragment):
    (tmp_path / name).write_text(text)
    code, err = validate(tmp_path, capsys, {**BASE, "dataset": _mixture(tmp_path / name)})
    assert_refused(code, err, f"stages[0].dataset.params: mixture parts[1].source: '{tmp_path / name}", fragment)


def test_a_mixture_with_a_local_file_writes_no_cache_outside_the_run(tmp_path, capsys, hf_cache):
    """Validation (also the first step of train) built the mixture through datasets with its default cache folder,
    ~/.cache/huggingface/datasets."""
    (tmp_path / "good.jsonl").write_text('{"prompt": "1+1=", "completion": "2"}\n{"prompt": "2+2=", "completion": "4"}\n')
    code, err = validate(tmp_path, capsys, {**BASE, "dataset": _mixture(tmp_path / "good.jsonl")})
    assert code == 0, err
    assert not hf_cache.exists(), list(hf_cache.rglob("*"))

    from trl_ext_plugins.rollout.datasets import dataset_mixture

    mixed = dataset_mixture(parts=_mixture(tmp_path / "good.jsonl")["params"]["parts"])
    assert len(mixed) == 6 and {"1+1=", "2+2="} <= set(mixed["prompt"])
    assert not hf_cache.exists()
