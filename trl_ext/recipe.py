"""Recipe schema and validation. Everything here runs before any model is loaded.

A recipe is YAML: either one stage (``trainer``, ``model``, ``dataset``, ``args``, ``plugins`` at the top level) or a
list of named ``stages``. Each error message starts with the exact field path, e.g. ``stages[1].args.learnin_rate``.

Model references (``model``, ``ref_model``, ``teacher``): ``stage:<name>`` is the output folder of an earlier stage,
``embedded:<name>`` a model built in code (see ``trl-ext plugins list``), anything else a local path or hub id.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, field_validator, model_validator

from trl_ext.errors import RecipeError, UnknownPluginError

STAGE_PREFIX = "stage:"
EMBEDDED_PREFIX = "embedded:"
# Fields trl-ext manages itself; setting them in `args` would fight the runner.
MANAGED_ARGS = {"output_dir": "use the top-level `output_dir` or `trl-ext train --output-dir`"}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class PluginSelection(_Strict):
    name: str
    params: dict[str, Any] = Field(default_factory=dict)


class DatasetSpec(_Strict):
    """Where a split comes from: ``embedded:<name>``, a local file/folder (json, jsonl, csv, parquet, saved dataset)
    or a hub id, and which split; ``params`` go to an embedded builder, ``limit`` keeps the first rows."""

    source: str
    split: str = "train"
    params: dict[str, Any] = Field(default_factory=dict)
    limit: int | None = Field(default=None, gt=0)


class PeftSpec(BaseModel):
    """A PEFT method and its fields, passed to TRL's ``peft_config`` (``type: lora`` with ``r``, ``lora_alpha`` ...)."""

    model_config = ConfigDict(extra="allow")
    type: str = "lora"


class EvaluationSpec(_Strict):
    """Held-out evaluation before and after a stage: greedy decodes scored by a reward plugin."""

    dataset: DatasetSpec
    reward: str | PluginSelection
    max_new_tokens: int = Field(default=8, gt=0)
    batch_size: int = Field(default=64, gt=0)
    limit: int | None = Field(default=None, gt=0)


class StageSpec(_Strict):
    name: str = "main"
    trainer: str
    model: str
    ref_model: str | None = None
    teacher: str | None = None
    dataset: DatasetSpec
    eval_dataset: DatasetSpec | None = None
    args: dict[str, Any] = Field(default_factory=dict)
    plugins: list[PluginSelection] = Field(default_factory=list)
    peft: PeftSpec | None = None
    evaluation: EvaluationSpec | None = None

    @field_validator("dataset", "eval_dataset", mode="before")
    @classmethod
    def _dataset_shorthand(cls, value: Any) -> Any:
        return {"source": value} if isinstance(value, str) else value

    @field_validator("plugins", mode="before")
    @classmethod
    def _plugin_shorthands(cls, value: Any) -> Any:
        """Accept ``[grpo, {dapo: {...}}, {name: tis, params: {...}}]`` and a ``{name: params}`` mapping."""
        if isinstance(value, dict):
            value = [{k: v} for k, v in value.items()]
        if not isinstance(value, list):
            return value
        normalized = []
        for item in value:
            if isinstance(item, str):
                normalized.append({"name": item})
            elif isinstance(item, dict) and "name" not in item and len(item) == 1:
                (name, params), = item.items()
                normalized.append({"name": name, "params": params or {}})
            else:
                normalized.append(item)
        return normalized


class Recipe(_Strict):
    output_dir: str | None = None
    seed: int | None = None
    stages: list[StageSpec] = Field(min_length=1)

    @model_validator(mode="before")
    @classmethod
    def _single_stage_shorthand(cls, data: Any) -> Any:
        if isinstance(data, dict) and "stages" not in data and "trainer" in data:
            top = {k: data[k] for k in ("output_dir", "seed") if k in data}
            stage = {k: v for k, v in data.items() if k not in top}
            return {**top, "stages": [stage]}
        return data

    def stage(self, name: str) -> StageSpec:
        return next(s for s in self.stages if s.name == name)

    def fingerprint(self, upto: int | None = None) -> str:
        """Hash of the resolved stages (all, or the first ``upto``); a finished stage is reused only on a match."""
        stages = self.stages if upto is None else self.stages[:upto]
        blob = json.dumps([s.model_dump(mode="json") for s in stages], sort_keys=True, default=str)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


# ------------------------------------------------------------------------------------------------------------------
# Loading and overrides
# ------------------------------------------------------------------------------------------------------------------


def load_raw(path: str | Path) -> dict[str, Any]:
    """Read a recipe file; it must be YAML holding a mapping."""
    path = Path(path)
    if not path.is_file():
        raise RecipeError(f"{path}: no such recipe file")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise RecipeError(f"{path}: not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise RecipeError(f"{path}: a recipe must be a YAML mapping, got {type(data).__name__}")
    return data


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``--set PATH=VALUE`` overrides (VALUE parsed as YAML). Path parts are keys, list indices, or stage names."""
    for item in overrides:
        if "=" not in item:
            raise RecipeError(f"--set {item!r}: expected PATH=VALUE")
        path, raw_value = item.split("=", 1)
        value = _parse_scalar(raw_value)
        parts = [p for p in path.replace("[", ".").replace("]", "").split(".") if p]
        node: Any = data
        for depth, part in enumerate(parts):
            last = depth == len(parts) - 1
            if isinstance(node, list):
                index = _list_index(node, part, path)
                if last:
                    node[index] = value
                else:
                    node = node[index]
            elif isinstance(node, dict):
                if last:
                    node[part] = value
                else:
                    node = node.setdefault(part, {})
            else:
                raise RecipeError(f"--set {path}: {'.'.join(parts[:depth])} is not a mapping or list")
    return data


def _parse_scalar(raw: str) -> Any:
    """YAML-parse a --set value; PyYAML (YAML 1.1) reads 1e-3 as a string, so numeric strings become floats."""
    value = yaml.safe_load(raw)
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    return value


def _list_index(node: list, part: str, path: str) -> int:
    if part.isdigit() and int(part) < len(node):
        return int(part)
    for index, item in enumerate(node):
        if isinstance(item, dict) and item.get("name") == part:
            return index
    raise RecipeError(f"--set {path}: no list item {part!r}")


def parse_recipe(data: dict[str, Any]) -> Recipe:
    """Schema validation with field paths in every message."""
    try:
        return Recipe.model_validate(data)
    except ValidationError as exc:
        raise RecipeError([f"{_format_loc(err['loc'])}: {err['msg']}" for err in exc.errors()]) from None


def _format_loc(loc: tuple) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out or "<recipe>"


# ------------------------------------------------------------------------------------------------------------------
# Semantic validation (plugins, args, needs, stage references)
# ------------------------------------------------------------------------------------------------------------------


def validate_recipe(recipe: Recipe, catalog) -> list[str]:
    """Every problem in the recipe, as field-path-prefixed messages (empty when valid). Loads no model."""
    from trl_ext.stage import resolve_stage  # local: stage imports trainers, which import TRL

    errors: list[str] = []
    names = [s.name for s in recipe.stages]
    for index, stage in enumerate(recipe.stages):
        where = f"stages[{index}]"
        if names.count(stage.name) > 1:
            errors.append(f"{where}.name: stage name {stage.name!r} is used more than once")
        for field_name in ("model", "ref_model", "teacher"):
            ref = getattr(stage, field_name)
            if ref and ref.startswith(STAGE_PREFIX):
                target = ref[len(STAGE_PREFIX):]
                if target not in names[:index]:
                    errors.append(f"{where}.{field_name}: {ref!r} does not name an earlier stage (earlier: {names[:index]})")
            elif ref and ref.startswith(EMBEDDED_PREFIX) and ref[len(EMBEDDED_PREFIX):] not in catalog.models:
                errors.append(_unknown(f"{where}.{field_name}", "embedded model", ref[len(EMBEDDED_PREFIX):], catalog.models))
        for field_name in ("dataset", "eval_dataset"):
            spec = getattr(stage, field_name)
            if spec and spec.source.startswith(EMBEDDED_PREFIX) and spec.source[len(EMBEDDED_PREFIX):] not in catalog.datasets:
                errors.append(_unknown(f"{where}.{field_name}.source", "embedded dataset", spec.source[len(EMBEDDED_PREFIX):], catalog.datasets))
        try:
            resolve_stage(stage, index, catalog)
        except RecipeError as exc:
            errors.extend(exc.messages)
    return errors


def _unknown(where: str, kind: str, name: str, table: dict) -> str:
    close = difflib.get_close_matches(name, list(table), n=3, cutoff=0.6)
    hint = f" Did you mean: {', '.join(close)}?" if close else ""
    return f"{where}: unknown {kind} {name!r}.{hint} Available: {', '.join(sorted(table))}"


def check_args_fields(args: dict[str, Any], config_cls: type, where: str) -> list[str]:
    """Every key of ``args`` must be a field of the TRL config class (did-you-mean on typos)."""
    fields = {f.name for f in dataclasses.fields(config_cls)}
    hints = _type_hints(config_cls)
    errors = []
    for key, value in args.items():
        if key in MANAGED_ARGS:
            errors.append(f"{where}.args.{key}: managed by trl-ext; {MANAGED_ARGS[key]}")
        elif key not in fields:
            close = difflib.get_close_matches(key, sorted(fields), n=3, cutoff=0.7)
            hint = f" Did you mean: {', '.join(close)}?" if close else ""
            errors.append(f"{where}.args.{key}: not a field of {config_cls.__name__}.{hint}")
        elif key in hints:
            # HF/TRL configs do not type-check their fields; a string learning rate would only fail mid-training.
            try:
                args[key] = TypeAdapter(hints[key]).validate_python(value)
            except ValidationError as exc:
                errors.append(f"{where}.args.{key}: {exc.errors()[0]['msg']} (got {value!r})")
            except Exception:  # an annotation pydantic cannot model: leave the check to the config class
                pass
    return errors


def _type_hints(config_cls: type) -> dict[str, Any]:
    import typing

    try:
        return typing.get_type_hints(config_cls)
    except Exception:
        return {}


def instantiate_plugins(stage: StageSpec, index: int, catalog) -> tuple[list, list[str]]:
    """Resolve names, validate parameters, check trainer support and exclusive slots."""
    from pydantic import ValidationError as _VE

    plugins, errors = [], []
    for j, selection in enumerate(stage.plugins):
        where = f"stages[{index}].plugins[{j}]"
        try:
            info = catalog.resolve(selection.name, where=where)
        except UnknownPluginError as exc:
            errors.extend(exc.messages)
            continue
        cls = info.cls
        if cls.trainers and stage.trainer not in cls.trainers:
            errors.append(
                f"{where}: plugin {cls.name!r} works with trainer(s) {sorted(cls.trainers)}, not {stage.trainer!r}"
            )
            continue
        try:
            params = cls.Params.model_validate(selection.params)
        except _VE as exc:
            for err in exc.errors():
                loc = _format_loc(err["loc"])
                errors.append(f"{where}.params{'.' + loc if loc != '<recipe>' else ''}: {err['msg']} (plugin {cls.name!r})")
            continue
        plugins.append(cls(params))
    seen = {}
    for plugin in plugins:
        if plugin.name in seen:
            errors.append(f"stages[{index}].plugins: plugin {plugin.name!r} is selected twice")
        seen[plugin.name] = plugin
    slot_holders: dict = {}
    for plugin in plugins:
        for slot in plugin.slots:
            if slot in slot_holders:
                errors.append(
                    f"stages[{index}].plugins: {slot_holders[slot].name!r} and {plugin.name!r} both fill the exclusive "
                    f"slot {slot.value!r}; select one of them"
                )
            else:
                slot_holders[slot] = plugin
    return plugins, errors
