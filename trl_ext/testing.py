"""pytest plugin for trl-ext plugin authors (auto-loaded through the ``pytest11`` entry point).

Fixtures:

* ``trl_ext_catalog``: a fresh :class:`~trl_ext.catalog.Catalog` with only the core's built-ins (no entry-point
  autoload), so a test sees exactly the plugins it registers;
* ``register_plugin``: ``register_plugin(PluginClass, catalog=None)`` adds a plugin class to a catalog (default: the
  ``trl_ext_catalog`` fixture) and removes it again when the test ends, even on failure;
* ``tiny_model_dir``: a session-wide folder holding the embedded tiny Qwen2 model and tokenizer (built in code);
* ``tiny_trainer``: ``tiny_trainer(trainer="grpo", plugins=[...], args={...})`` builds a trl-ext trainer with the
  given plugin instances on the tiny model and the embedded arithmetic task, ready for ``.train()``.

Helper: :func:`check_plugin_conformance` asserts a plugin class meets the host's rules (documented, named, schema
instantiable with defaults, hooks all specified, slots declared for selection hooks).
"""

from __future__ import annotations

from typing import Any

import pytest

from trl_ext.catalog import Catalog, check_plugin_class
from trl_ext.plugin import Plugin

_FORMATS = {"sft": "prompt_completion", "grpo": "prompt", "rloo": "prompt", "dpo": "preference",
            "reward": "preference", "kto": "unpaired", "distillation": "prompt"}


def fresh_catalog() -> Catalog:
    """A catalog with the core's built-in models and datasets and no plugins."""
    import trl_ext.builtins

    catalog = Catalog()
    catalog.add_source(trl_ext.builtins, source="builtins", distribution="trl-ext")
    return catalog


def check_plugin_conformance(plugin_cls: type[Plugin]) -> None:
    """Raise AssertionError unless ``plugin_cls`` is a well-formed trl-ext plugin."""
    try:
        check_plugin_class(plugin_cls)
    except TypeError as exc:
        raise AssertionError(str(exc)) from None
    assert plugin_cls.__doc__ and plugin_cls.description(), f"plugin {plugin_cls.name!r} has no docstring"
    assert plugin_cls.family, f"plugin {plugin_cls.name!r} has no family"
    required = [row["name"] for row in plugin_cls.parameter_table() if row["required"]]
    if not required:
        plugin_cls(plugin_cls.Params())  # defaults must form a valid parameter set
    for row in plugin_cls.parameter_table():
        assert row["description"], f"plugin {plugin_cls.name!r}: parameter {row['name']!r} has no description"


@pytest.fixture
def trl_ext_catalog() -> Catalog:
    return fresh_catalog()


@pytest.fixture
def register_plugin(trl_ext_catalog):
    added: list[tuple[Catalog, str]] = []

    def register(plugin_cls: type[Plugin], catalog: Catalog | None = None) -> type[Plugin]:
        target = catalog if catalog is not None else trl_ext_catalog
        target.add_plugin(plugin_cls)
        added.append((target, plugin_cls.name))
        return plugin_cls

    try:
        yield register
    finally:
        for catalog, name in reversed(added):
            if name in catalog.plugins:
                catalog.remove_plugin(name)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    from trl_ext.embedded.models import materialize_model

    return str(materialize_model("tiny-qwen2", tmp_path_factory.mktemp("tiny-model") / "tiny-qwen2", seed=0))


@pytest.fixture
def tiny_trainer(tiny_model_dir, tmp_path):
    def build(trainer: str = "grpo", plugins: list[Plugin] | None = None, args: dict[str, Any] | None = None,
              dataset=None, reward_funcs=None):
        from transformers import AutoTokenizer

        from trl_ext.embedded.arithmetic import arithmetic_dataset
        from trl_ext.host import PluginHost
        from trl_ext.recipe import StageSpec
        from trl_ext.rewards import collect_reward_functions
        from trl_ext.stage import default_args
        from trl_ext.trainers import TRAINER_KINDS, BuildContext

        kind = TRAINER_KINDS[trainer]
        host = PluginHost(plugins or [])
        merged = {**default_args(kind), "max_steps": 2, "logging_steps": 1, "save_strategy": "no", "seed": 0,
                  **_small_defaults(trainer)}
        for impl in reversed(host.pm.hook.trl_ext_configure_args.get_hookimpls()):
            merged.update(impl.function(trainer=trainer, args=dict(args or {})) or {})
        merged.update(args or {})
        stage = StageSpec(trainer=trainer, model=tiny_model_dir, dataset={"source": "embedded:arithmetic"})
        rewards = collect_reward_functions(host, stage) if kind.uses_rewards else []
        if kind.uses_rewards and reward_funcs is None and not rewards:
            from trl_ext.embedded.arithmetic import exact_match_reward

            reward_funcs = [exact_match_reward]
        ctx = BuildContext(
            model=tiny_model_dir, ref_model=None, teacher=tiny_model_dir if trainer == "distillation" else None,
            config=kind.config_cls(output_dir=str(tmp_path / "out"), **merged),
            train_dataset=dataset if dataset is not None else arithmetic_dataset("train", format=_FORMATS[trainer], size=64),
            eval_dataset=None, tokenizer=AutoTokenizer.from_pretrained(tiny_model_dir), peft_config=None,
            callbacks=[], host=host,
            reward_funcs=reward_funcs if reward_funcs is not None else [r.as_trl_callable() for r in rewards],
            reward_weights=[],
        )
        trainer_obj = kind.build(ctx)
        host.hook.trl_ext_trainer_created(trainer=trainer_obj)
        return trainer_obj

    return build


def _small_defaults(trainer: str) -> dict[str, Any]:
    """Small batch and sequence settings so a tiny-model step takes milliseconds."""
    if trainer in ("grpo", "rloo"):
        return {"per_device_train_batch_size": 8, "num_generations": 4, "max_completion_length": 4,
                "gradient_checkpointing": False}
    if trainer == "distillation":
        return {"per_device_train_batch_size": 4, "max_completion_length": 4, "gradient_checkpointing": False}
    return {"per_device_train_batch_size": 8, "max_length": 32}
