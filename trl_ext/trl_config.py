"""TRL CLI config files (``trl grpo --config x.yaml``) as one-stage trl-ext recipes.

A TRL config mixes three argument classes: the script's (``dataset_name``, ``dataset_config``, splits, GRPO's
``reward_funcs``), ``ModelConfig`` (``model_name_or_path``, ``use_peft``, ``lora_*``, ``dtype``, ...) and the trainer's
config (``learning_rate``, ``beta``, ...). :func:`convert` maps them field by field; what it does not map is refused
naming the field, never dropped silently (except what TRL itself ignores: ``lora_*`` without ``use_peft``).

========================================= ================================================================
TRL field                                  recipe
========================================= ================================================================
model_name_or_path                         ``model``
dataset_name / dataset_config              ``dataset.source`` / ``dataset.params.name`` (local files work too)
dataset_train_split                        ``dataset.split`` (default ``train``)
dataset_test_split                         ``eval_dataset.split``, when ``eval_strategy`` is not ``no``
reward_funcs (GRPO, RLOO)                  plugin ``python_reward`` with ``functions`` (TRL names or import paths)
use_peft + lora_r, lora_alpha, ...         ``peft: {type: lora, r, lora_alpha, lora_dropout, target_modules, ...}``
dtype, attn_implementation, model_revision ``args.model_init_kwargs`` (``dtype``, ``attn_implementation``, ``revision``)
output_dir                                 top-level ``output_dir``
every other field                          ``args`` (checked against the trainer's TRL config class)
========================================= ================================================================
"""

from __future__ import annotations

from typing import Any

from trl_ext.errors import RecipeError

TRL_COMMANDS = ("sft", "grpo", "rloo", "dpo", "kto", "reward")
_REWARD_TRAINERS = ("grpo", "rloo")
# ModelConfig's LoRA fields -> peft.LoraConfig fields (defaults are ModelConfig's, so a bare `use_peft: true` matches
# what `trl sft --use_peft` trains).
_LORA_FIELDS = {"lora_r": ("r", 16), "lora_alpha": ("lora_alpha", 32), "lora_dropout": ("lora_dropout", 0.05),
                "lora_target_modules": ("target_modules", None), "lora_modules_to_save": ("modules_to_save", None),
                "lora_target_parameters": ("target_parameters", None), "use_rslora": ("use_rslora", False),
                "use_dora": ("use_dora", False), "lora_task_type": ("task_type", "CAUSAL_LM")}
_MODEL_INIT_FIELDS = {"dtype": "dtype", "attn_implementation": "attn_implementation", "model_revision": "revision"}
_REFUSED = {
    "load_in_4bit": "bitsandbytes quantisation is not supported by trl-ext recipes",
    "load_in_8bit": "bitsandbytes quantisation is not supported by trl-ext recipes",
    "datasets": "dataset mixtures are not supported; use dataset_name (one dataset)",
    "dataset_streaming": "streaming datasets are not supported",
    "reward_model_name_or_path": "use the reward_model plugin in a trl-ext recipe for a reward model",
    "trust_remote_code": "remote code is not loaded by trl-ext",
}
_IGNORED_WHEN_FALSE = {"load_in_4bit", "load_in_8bit", "dataset_streaming", "trust_remote_code", "use_bnb_nested_quant",
                       "ignore_bias_buffers"}


def convert(command: str, config: dict[str, Any], source: str = "<config>") -> dict[str, Any]:
    """The recipe (a plain mapping, ready for :func:`trl_ext.recipe.parse_recipe`) equivalent to ``trl COMMAND``."""
    if command not in TRL_COMMANDS:
        raise RecipeError(f"--trl {command!r}: not a TRL command trl-ext runs; use one of {', '.join(TRL_COMMANDS)}")
    config = dict(config)
    errors = []
    for key, why in _REFUSED.items():
        if key in config and not (key in _IGNORED_WHEN_FALSE and not config[key]):
            errors.append(f"{source}: {key}: {why}")
        config.pop(key, None)
    for key in _IGNORED_WHEN_FALSE:
        config.pop(key, None)
    for key in ("bnb_4bit_quant_type", "bnb_4bit_quant_storage"):
        config.pop(key, None)  # only meaningful with load_in_4bit, refused above
    model = config.pop("model_name_or_path", None)
    if not model:
        errors.append(f"{source}: model_name_or_path: required")
    dataset_name = config.pop("dataset_name", None)
    if not dataset_name:
        errors.append(f"{source}: dataset_name: required")
    if errors:
        raise RecipeError(errors)

    dataset: dict[str, Any] = {"source": dataset_name, "split": config.pop("dataset_train_split", "train")}
    dataset_config = config.pop("dataset_config", None)
    if dataset_config is not None:
        dataset["params"] = {"name": dataset_config}
    test_split = config.pop("dataset_test_split", "test")
    stage: dict[str, Any] = {"name": command, "trainer": command, "model": model, "dataset": dataset}
    if config.get("eval_strategy", "no") != "no":
        stage["eval_dataset"] = {**dataset, "split": test_split}

    use_peft = config.pop("use_peft", False)
    lora = {target: config.pop(key, default) for key, (target, default) in _LORA_FIELDS.items()}
    if use_peft:
        stage["peft"] = {"type": "lora", **{k: v for k, v in lora.items() if v is not None}}

    init_kwargs = {target: config.pop(key) for key, target in _MODEL_INIT_FIELDS.items() if key in config}
    if init_kwargs:
        given = config.get("model_init_kwargs") or {}
        if not isinstance(given, dict):
            raise RecipeError(f"{source}: model_init_kwargs: a mapping of from_pretrained arguments, got {given!r}")
        config["model_init_kwargs"] = {**given, **init_kwargs}

    reward_funcs = config.pop("reward_funcs", None)
    if isinstance(reward_funcs, str):
        reward_funcs = [reward_funcs]  # one name, as `trl grpo --reward_funcs NAME` gives
    if reward_funcs is not None and not isinstance(reward_funcs, list):
        raise RecipeError(f"{source}: reward_funcs: a list of reward function names, got {reward_funcs!r}")
    if command in _REWARD_TRAINERS:
        if not reward_funcs:
            raise RecipeError(f"{source}: reward_funcs: the {command} trainer needs at least one reward function "
                              f"(TRL names such as accuracy_reward, or import paths module.function)")
        stage["plugins"] = [{"python_reward": {"functions": list(reward_funcs)}}]
    elif reward_funcs:
        raise RecipeError(f"{source}: reward_funcs: the {command} trainer takes no reward functions")

    recipe: dict[str, Any] = {}
    output_dir = config.pop("output_dir", None)
    if output_dir is not None:
        recipe["output_dir"] = output_dir
    if "seed" in config:
        recipe["seed"] = config.pop("seed")
    stage["args"] = config
    recipe.update(stage)
    return recipe


def looks_like_trl_config(data: dict[str, Any]) -> bool:
    """A YAML mapping with TRL's model field and no recipe structure (to point users at ``--trl``)."""
    return "model_name_or_path" in data and "stages" not in data and "trainer" not in data
