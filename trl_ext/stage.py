"""Resolve one recipe stage: plugins, merged TRL args, needs, and the TRL config object. Loads no model."""

from __future__ import annotations

import difflib
import importlib.util
import os
import tempfile
from dataclasses import dataclass
from typing import Any

from trl_ext.errors import RecipeError
from trl_ext.host import PluginHost
from trl_ext.plugin import Need, Slot
from trl_ext.recipe import StageSpec, check_args_fields, instantiate_plugins
from trl_ext.trainers import TRAINER_KINDS, TrainerKind

NEED_HINTS = {
    Need.REFERENCE: "set `args.beta` to a non-zero value (GRPO/RLOO) or use a trainer with a reference model",
    Need.SAMPLING_LOGPROBS: "generate with vLLM (`args.use_vllm: true`) or select a plugin that records them",
    Need.TEACHER: "set the stage's `teacher:`",
    Need.VALUE_MODEL: "select a plugin that provides a value model",
    Need.MOE_MODEL: "use a mixture-of-experts model",
    Need.JUDGE: "configure a judge",
    Need.REWARD_MODEL: "configure a reward model",
    Need.OLD_POLICY_LOGPROBS: "use the GRPO trainer",
}


@dataclass
class ResolvedStage:
    spec: StageSpec
    index: int
    kind: TrainerKind
    host: PluginHost
    args: dict[str, Any]  # TRL config kwargs, without output_dir

    def build_config(self, output_dir: str):
        return self.kind.config_cls(output_dir=output_dir, **self.args)


def default_args(kind: TrainerKind) -> dict[str, Any]:
    """Defaults trl-ext sets when the recipe does not: CPU-safe precision, no external loggers."""
    import torch

    defaults: dict[str, Any] = {"report_to": "none"}
    if not torch.cuda.is_available():
        # TRL configs default to bf16=True, which fails to build on a CPU-only machine.
        defaults["bf16"] = False
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            # Without use_cpu, accelerate on a CPU-only machine starts no process group: every rank would train its
            # own copy into the same folder.
            defaults["use_cpu"] = True
    return defaults


def resolve_stage(stage: StageSpec, index: int, catalog, seed: int | None = None,
                  extra_args: dict[str, Any] | None = None) -> ResolvedStage:
    """Validate a stage against the installed plugins and TRL; raise :class:`RecipeError` listing every problem."""
    where = f"stages[{index}]"
    kind = TRAINER_KINDS.get(stage.trainer)
    if kind is None:
        close = difflib.get_close_matches(stage.trainer, list(TRAINER_KINDS), n=3, cutoff=0.5)
        hint = f" Did you mean: {', '.join(close)}?" if close else ""
        raise RecipeError(f"{where}.trainer: unknown trainer {stage.trainer!r}.{hint} Available: {', '.join(TRAINER_KINDS)}")
    errors = check_args_fields(stage.args, kind.config_cls, where)
    if stage.ref_model and not kind.reads_ref_model:
        errors.append(f"{where}.ref_model: the {stage.trainer} trainer takes no separate reference model")
    if stage.teacher and not kind.reads_teacher and not any(Need.TEACHER in p.cls.needs for p in _infos(stage, catalog)):
        errors.append(f"{where}.teacher: neither the {stage.trainer} trainer nor a selected plugin uses a teacher")
    # Continue with the plugins that did resolve, so one run of `trl-ext validate` reports every problem at once.
    plugins, plugin_errors = instantiate_plugins(stage, index, catalog)
    errors += plugin_errors
    if kind.uses_rewards and not plugin_errors and not any("trl_ext_reward_functions" in p.implemented_hooks() for p in plugins):
        errors.append(f"{where}.plugins: the {stage.trainer} trainer needs at least one reward plugin "
                      f"(e.g. exact_match, math_verify)")
    host = PluginHost(plugins)

    args = {**default_args(kind), **({"seed": seed} if seed is not None else {}), **stage.args}
    errors += _merge_plugin_args(host, stage, index, args)

    for j, plugin in enumerate(plugins):
        for module, requirement in plugin.requires:
            if importlib.util.find_spec(module) is None:
                errors.append(f"{where}.plugins[{j}]: plugin {plugin.name!r} needs the Python package {module!r}: "
                              f"pip install '{requirement}'")
    capabilities = kind.capabilities(stage, args) | {n for p in plugins for n in p.provides}
    for j, plugin in enumerate(plugins):
        for need in sorted(plugin.needs - capabilities, key=lambda n: n.value):
            errors.append(
                f"{where}.plugins[{j}]: plugin {plugin.name!r} needs {need.value!r}, which this stage does not provide: "
                f"{NEED_HINTS.get(need, '')}"
            )
    for messages in host.hook.trl_ext_validate_stage(stage=stage, plugins=plugins):
        errors += [f"{where}: {m}" for m in messages or []]
    errors += _check_loss_pipeline_support(host, stage, index, args)
    errors += _check_preference_pipeline_support(host, stage, index, args)
    if extra_args:
        args.update(extra_args)
    if not errors:
        try:
            with tempfile.TemporaryDirectory() as tmp:
                kind.config_cls(output_dir=tmp, **args)
        except (ValueError, TypeError) as exc:
            errors.append(f"{where}.args: {kind.config_cls.__name__} rejected the arguments: {exc}")
    if errors:
        raise RecipeError(errors)
    return ResolvedStage(stage, index, kind, host, args)


def _infos(stage: StageSpec, catalog):
    out = []
    for selection in stage.plugins:
        try:
            out.append(catalog.resolve(selection.name))
        except RecipeError:
            pass
    return out


def _merge_plugin_args(host: PluginHost, stage: StageSpec, index: int, args: dict[str, Any]) -> list[str]:
    """Apply each plugin's ``trl_ext_configure_args`` result; conflicts are errors naming both sides."""
    errors: list[str] = []
    set_by: dict[str, str] = {}
    impls = reversed(host.pm.hook.trl_ext_configure_args.get_hookimpls())  # recipe order
    for impl in impls:
        plugin = impl.plugin
        wanted = impl.function(trainer=stage.trainer, args=dict(stage.args)) or {}
        for key, value in wanted.items():
            if key in stage.args and stage.args[key] != value:
                errors.append(
                    f"stages[{index}].args.{key}: the recipe sets {stage.args[key]!r} but plugin {plugin.name!r} "
                    f"requires {value!r}"
                )
            elif key in set_by and args[key] != value:
                errors.append(
                    f"stages[{index}].plugins: {set_by[key]!r} and {plugin.name!r} set args.{key} to different values "
                    f"({args[key]!r} vs {value!r})"
                )
            else:
                args[key] = value
                set_by[key] = plugin.name
    return errors


# DPOConfig options that change TRL's own preference loss; the plugin path computes summed log-probs and leaves the
# loss to the plugin, so these would be silently ignored there.
_DPO_OPTIONS_NOT_IN_PLUGIN_PATH = {"ld_alpha": None, "f_divergence_type": "reverse_kl", "use_weighting": False,
                                   "label_smoothing": 0.0}


def _check_preference_pipeline_support(host: PluginHost, stage: StageSpec, index: int, args: dict[str, Any]) -> list[str]:
    if stage.trainer != "dpo" or not host.implements("trl_ext_preference_loss"):
        return []
    owner = host.filling(Slot.PREFERENCE_LOSS)
    name = owner.name if owner is not None else "?"
    return [
        f"stages[{index}].args.{key}: TRL's DPO option has no effect with the preference-loss plugin {name!r}; remove it"
        for key, neutral in _DPO_OPTIONS_NOT_IN_PLUGIN_PATH.items()
        if key in args and args[key] != neutral
    ]


def _check_loss_pipeline_support(host: PluginHost, stage: StageSpec, index: int, args: dict[str, Any]) -> list[str]:
    """The trl-ext GRPO loss pipeline re-expresses only some TRL options; refuse the others up front."""
    if stage.trainer != "grpo":
        return []
    from trl_ext.trainers.grpo import DEFAULT_AGGREGATIONS, LOSS_HOOKS, UNSUPPORTED_WITH_LOSS_PLUGINS

    active = [p.name for p in host.plugins if any(h in p.implemented_hooks() for h in LOSS_HOOKS)]
    if not active:
        return []
    errors = []
    for key, neutral in UNSUPPORTED_WITH_LOSS_PLUGINS.items():
        if key in args and args[key] != neutral:
            errors.append(f"stages[{index}].args.{key}: not supported together with loss plugin(s) {active}")
    loss_type = args.get("loss_type", "dapo")
    if loss_type not in DEFAULT_AGGREGATIONS:
        errors.append(
            f"stages[{index}].args.loss_type: {loss_type!r} cannot be combined with loss plugin(s) {active}; "
            f"use one of {sorted(DEFAULT_AGGREGATIONS)}"
        )
    return errors
