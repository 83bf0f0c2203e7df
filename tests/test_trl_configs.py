"""TRL config files (as `trl grpo --config` takes them) and plain-function rewards, without writing a plugin."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import yaml

from trl_ext.catalog import Catalog
from trl_ext.errors import RecipeError
from trl_ext.recipe import parse_recipe
from trl_ext.runner import resolve_recipe
from trl_ext.trl_config import convert
from trl_ext_plugins.rewards.python_reward import load_reward_function

REWARD_MODULE = textwrap.dedent('''
    def first_char_is_digit(completions, **kwargs):
        return [1.0 if c[:1].isdigit() else 0.0 for c in completions]

    NOT_CALLABLE = 3
''')


def test_grpo_config_maps_field_by_field():
    config = {"model_name_or_path": "Qwen/Qwen2-0.5B", "dataset_name": "trl-lib/tldr", "dataset_config": "default",
              "dataset_train_split": "train[:100]", "reward_funcs": ["accuracy_reward", "my.mod.fn"],
              "use_peft": True, "lora_r": 8, "lora_target_modules": ["q_proj"], "dtype": "bfloat16",
              "output_dir": "out/x", "seed": 3, "learning_rate": 1e-6, "beta": 0.04}
    recipe = convert("grpo", config)
    assert recipe["model"] == "Qwen/Qwen2-0.5B" and recipe["trainer"] == "grpo"
    assert recipe["dataset"] == {"source": "trl-lib/tldr", "split": "train[:100]", "params": {"name": "default"}}
    assert recipe["plugins"] == [{"python_reward": {"functions": ["accuracy_reward", "my.mod.fn"]}}]
    # ModelConfig's LoRA defaults where the file sets nothing, its values where it does.
    assert recipe["peft"] == {"type": "lora", "r": 8, "lora_alpha": 32, "lora_dropout": 0.05,
                              "target_modules": ["q_proj"], "use_rslora": False, "use_dora": False,
                              "task_type": "CAUSAL_LM"}
    assert recipe["args"] == {"learning_rate": 1e-6, "beta": 0.04, "model_init_kwargs": {"dtype": "bfloat16"}}
    assert recipe["output_dir"] == "out/x" and recipe["seed"] == 3
    assert "eval_dataset" not in recipe  # eval_strategy defaults to "no", as in TRL's scripts


def test_one_reward_function_name_is_a_list_of_one_not_of_its_letters():
    recipe = convert("grpo", {"model_name_or_path": "m", "dataset_name": "d", "reward_funcs": "accuracy_reward"})
    assert recipe["plugins"] == [{"python_reward": {"functions": ["accuracy_reward"]}}]


def test_lora_fields_without_use_peft_are_ignored_as_trl_does_and_eval_split_follows_eval_strategy():
    recipe = convert("sft", {"model_name_or_path": "m", "dataset_name": "d", "lora_r": 4, "eval_strategy": "steps",
                             "dataset_test_split": "validation"})
    assert "peft" not in recipe and recipe["eval_dataset"]["split"] == "validation"


@pytest.mark.parametrize("config, message", [
    ({"dataset_name": "d"}, "model_name_or_path: required"),
    ({"model_name_or_path": "m"}, "dataset_name: required"),
    ({"model_name_or_path": "m", "dataset_name": "d", "load_in_4bit": True}, "load_in_4bit: bitsandbytes"),
    ({"model_name_or_path": "m", "dataset_name": "d", "trust_remote_code": True}, "trust_remote_code"),
    ({"model_name_or_path": "m", "dataset_name": "d"}, "reward_funcs: the grpo trainer needs"),
    # Wrong shapes used to crash the conversion (TypeError, exit 1) instead of naming the field.
    ({"model_name_or_path": "m", "dataset_name": "d", "reward_funcs": 5}, "reward_funcs: a list of reward function "
                                                                          "names, got 5"),
    ({"model_name_or_path": "m", "dataset_name": "d", "reward_funcs": ["accuracy_reward"], "dtype": "bfloat16",
      "model_init_kwargs": "x"}, "model_init_kwargs: a mapping of from_pretrained arguments, got 'x'"),
])
def test_what_cannot_be_mapped_is_refused_naming_the_field(config, message):
    with pytest.raises(RecipeError) as info:
        convert("grpo", config, source="cfg.yaml")
    assert message in str(info.value) and "cfg.yaml" in str(info.value)


def test_reward_functions_resolve_from_trl_names_dotted_paths_and_files(tmp_path, monkeypatch):
    from trl.rewards import accuracy_reward

    assert load_reward_function("accuracy_reward") is accuracy_reward
    (tmp_path / "my_rewards.py").write_text(REWARD_MODULE)
    monkeypatch.chdir(tmp_path)  # the working directory is importable, as in TRL's CLI
    assert load_reward_function("my_rewards.first_char_is_digit")(completions=["4", "x"]) == [1.0, 0.0]
    assert load_reward_function(f"{tmp_path / 'my_rewards.py'}:first_char_is_digit")(completions=["1"]) == [1.0]


@pytest.mark.parametrize("spec, message", [
    ("nosuchmodule_xyz.fn", "cannot import module 'nosuchmodule_xyz'"),
    ("my_rewards.missing", "has no attribute 'missing'"),
    ("my_rewards.NOT_CALLABLE", "is not callable"),
    ("plainword", "neither a TRL reward name"),
])
def test_bad_reward_functions_fail_validation_naming_the_plugin_field(tmp_path, monkeypatch, spec, message):
    (tmp_path / "my_rewards.py").write_text(REWARD_MODULE)
    monkeypatch.chdir(tmp_path)
    recipe = parse_recipe({"trainer": "grpo", "model": "embedded:tiny-qwen2",
                           "dataset": {"source": "embedded:arithmetic", "params": {"format": "prompt"}},
                           "plugins": [{"python_reward": {"functions": [spec]}}]})
    with pytest.raises(RecipeError) as info:
        resolve_recipe(recipe, Catalog.discover())
    assert "stages[0].plugins[0].params.functions" in str(info.value) and message in str(info.value)


def test_cli_points_a_trl_config_at_the_trl_flag_and_convert_prints_a_valid_recipe(tmp_path):
    config = tmp_path / "grpo.yaml"
    config.write_text(yaml.safe_dump({"model_name_or_path": "embedded:tiny-qwen2", "dataset_name": "data.jsonl",
                                      "reward_funcs": ["accuracy_reward"], "learning_rate": 1e-5}))
    result = subprocess.run([sys.executable, "-m", "trl_ext.cli", "validate", str(config)], capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 2 and "this is a TRL config file" in result.stderr and "--trl" in result.stderr
    result = subprocess.run([sys.executable, "-m", "trl_ext.cli", "convert", "grpo", str(config)],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    recipe = yaml.safe_load(result.stdout)
    assert recipe["trainer"] == "grpo" and recipe["args"] == {"learning_rate": 1e-5}


# -- TRL config files train unchanged (slow: real training steps) -----------------------------------------------------


@pytest.fixture(scope="module")
def local_model_and_data(tmp_path_factory):
    """A local model folder and local jsonl files, as a user brings them (nothing from a hub)."""
    from trl_ext.embedded.arithmetic import arithmetic_dataset
    from trl_ext.embedded.models import materialize_model

    root = tmp_path_factory.mktemp("trl_configs")
    model = materialize_model("tiny-qwen2", root / "model")
    for fmt in ("prompt", "prompt_completion", "preference"):
        rows = arithmetic_dataset("train", format=fmt).select(range(64)).to_list()
        (root / f"{fmt}.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    (root / "my_rewards.py").write_text(REWARD_MODULE)
    return root, model


@pytest.mark.slow
@pytest.mark.parametrize("command, data, extra", [
    ("sft", "prompt_completion", {"max_length": 32}),
    ("dpo", "preference", {"max_length": 32, "beta": 0.1}),
    ("grpo", "prompt", {"reward_funcs": ["my_rewards.first_char_is_digit"], "num_generations": 4,
                        "per_device_train_batch_size": 4, "max_completion_length": 4}),
])
def test_trl_config_file_trains_unchanged(local_model_and_data, command, data, extra):
    root, model = local_model_and_data
    config = root / f"{command}.yaml"
    config.write_text(yaml.safe_dump({"model_name_or_path": str(model), "dataset_name": str(root / f"{data}.jsonl"),
                                      "output_dir": str(root / f"out_{command}"), "max_steps": 2,
                                      "logging_steps": 1, "learning_rate": 1e-4, "use_peft": True, "lora_r": 4,
                                      "lora_target_modules": ["q_proj", "v_proj"], **extra}))
    result = subprocess.run([sys.executable, "-m", "trl_ext.cli", "train", str(config), "--trl", command],
                            capture_output=True, text=True, timeout=600, cwd=root)
    assert result.returncode == 0, result.stderr[-3000:]
    stage = root / f"out_{command}" / command
    assert (stage / "adapter" / "adapter_config.json").exists()  # LoRA from use_peft/lora_* fields
    rows = [json.loads(line) for line in (stage / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows if "loss" in row] == [1, 2]
    if command == "grpo":  # the plain-function reward was called and logged under its own name
        assert any("rewards/first_char_is_digit/mean" in row for row in rows)
