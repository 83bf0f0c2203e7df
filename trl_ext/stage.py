"""Resolve one recipe stage: plugins, merged TRL args, needs, and the TRL config object. Loads no model."""

from __future__ import annotations

import csv
import difflib
import importlib.util
import inspect
import json
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trl_ext.catalog import validating_with
from trl_ext.errors import RecipeError
from trl_ext.host import PluginHost
from trl_ext.plugin import Need
from trl_ext.recipe import (EMBEDDED_PREFIX, SERVED_PREFIX, STAGE_PREFIX, StageSpec, check_args_fields, did_you_mean,
                            instantiate_plugins)
from trl_ext.trainers import TRAINER_KINDS, TrainerKind

# TRL arguments that need an optional package: the config class or the trainer fails without it, after the model
# loaded (or with a packaging traceback); validation names the extra instead.
ARG_PACKAGES = {"deepspeed": ("deepspeed", "DeepSpeed", "trl-ext[deepspeed]"),
                "use_vllm": ("vllm", "vLLM", "trl-ext[vllm]")}

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
    arg_errors = check_args_fields(stage.args, kind.config_cls, where)
    errors = list(arg_errors)
    if stage.dataset is None and kind.reads_dataset:
        errors.append(f"{where}.dataset: the {stage.trainer} trainer trains on a dataset; give one (e.g. "
                      "`dataset: embedded:arithmetic`, a local file or a hub id)")
    if stage.dataset is not None and not kind.reads_dataset:
        errors.append(f"{where}.dataset: the {stage.trainer} trainer reads no dataset; remove it")
    if stage.ref_model and not kind.reads_ref_model:
        errors.append(f"{where}.ref_model: the {stage.trainer} trainer takes no separate reference model")
    if stage.teacher and not kind.reads_teacher and not any(Need.TEACHER in p.cls.needs for p in _infos(stage, catalog)):
        errors.append(f"{where}.teacher: neither the {stage.trainer} trainer nor a selected plugin uses a teacher")
    if stage.teacher and stage.teacher.startswith(SERVED_PREFIX) and kind.reads_teacher:
        errors.append(f"{where}.teacher: the {stage.trainer} trainer reads the teacher's whole distribution, but a "
                      f"served teacher ({SERVED_PREFIX}<url>) only scores sampled tokens; use a local teacher, or the "
                      "opd_reward plugin on the grpo trainer")
    # Continue with the plugins that did resolve, so one run of `trl-ext validate` reports every problem at once.
    plugins, plugin_errors = instantiate_plugins(stage, index, catalog)
    errors += plugin_errors
    if kind.uses_rewards and not plugin_errors and not any("trl_ext_reward_functions" in p.implemented_hooks() for p in plugins):
        errors.append(f"{where}.plugins: the {stage.trainer} trainer needs at least one reward plugin "
                      f"(e.g. exact_match, math_verify)")
    host = PluginHost(plugins)

    args = {**default_args(kind), **({"seed": seed} if seed is not None else {}), **stage.args}
    failures: list[BaseException] = []  # what plugin hooks raised; the first is the cause --debug shows
    errors += _merge_plugin_args(host, stage, index, args, catalog, failures)

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
    # Plugins' own checks read the stage's args as typed values (int(args["num_generations"]) ...): with an arg of
    # the wrong type they would fail on it rather than report, so they run once the args are right.
    for impl in reversed(host.pm.hook.trl_ext_validate_stage.get_hookimpls()) if not arg_errors else []:
        try:
            with validating_with(catalog):
                messages = impl.function(stage=stage, plugins=plugins)
        except Exception as exc:
            failures.append(exc)
            errors.append(plugin_hook_failure(impl.plugin, "trl_ext_validate_stage", exc, catalog, where))
            continue
        errors += [f"{where}: {m}" for m in messages or []]
    errors += kind.check(host, stage, args, where)
    errors += trl_arg_errors(stage, kind, args, where)
    errors += model_ref_errors(stage, where, missing_relative=False)  # those are the runner's (preflight) to judge
    errors += peft_errors(stage, where)
    errors += evaluation_errors(stage, index, catalog)
    errors += dataset_errors(stage, kind, host, catalog, where)
    if extra_args:
        args.update(extra_args)
    errors += [f"{where}.args.{key}: needs {name}: pip install '{extra}'"
               for key, (module, name, extra) in ARG_PACKAGES.items()
               if args.get(key) and importlib.util.find_spec(module) is None]
    if not errors:
        try:
            with tempfile.TemporaryDirectory() as tmp:
                kind.config_cls(output_dir=tmp, **args)
        except (ValueError, TypeError) as exc:
            errors.append(f"{where}.args: {kind.config_cls.__name__} rejected the arguments: {exc}")
    if errors:
        raise RecipeError(errors) from (failures[0] if failures else None)
    return ResolvedStage(stage, index, kind, host, args)


# The largest integer (in size) a TRL argument takes, unless recipe.ARG_RANGES bounds it (seed: 2**32 - 1): sizes,
# steps and counts end in C integers (itertools.islice, torch, the dataloader), where a larger value fails mid-training.
MAX_ARG_INT = 2**31 - 1
# Dict-valued config fields that transformers also reads as a file path (a DeepSpeed / FSDP / accelerator JSON file).
_PATH_OR_DICT_ARGS = {"deepspeed", "fsdp_config", "accelerator_config"}
_TEMPLATE_SUFFIXES = (".jinja", ".j2")  # TRL reads a chat_template_path file only with these suffixes


def trl_arg_errors(stage: StageSpec, kind: TrainerKind, args: dict[str, Any], where: str) -> list[str]:
    """TRL arguments whose bad values the config classes accept and that fail only once training starts, after the
    model loaded (or reach the network, which a run never does). ``args`` are the merged, type-checked arguments."""
    from trl_ext.recipe import ARG_RANGES

    errors = []
    for key, value in args.items():
        if key in ARG_RANGES and ARG_RANGES[key][2] is not None:
            continue  # its own bound is checked with the recipe
        numbers = value if isinstance(value, (list, tuple)) else [value]
        if any(isinstance(n, int) and not isinstance(n, bool) and abs(n) > MAX_ARG_INT for n in numbers):
            errors.append(f"{where}.args.{key}: does not fit a 32-bit integer (at most {MAX_ARG_INT} in size)")
    # transformers parses a JSON text ("{...}") of these fields into a dict but leaves any other string, which the
    # trainer then unpacks as keyword arguments (`dict("bogus")`: a ValueError naming no field).
    for key in getattr(kind.config_cls, "_VALID_DICT_FIELDS", []):
        value = args.get(key)
        if isinstance(value, str) and key not in _PATH_OR_DICT_ARGS and not value.startswith("{"):
            errors.append(f"{where}.args.{key}: a mapping of keyword arguments (got {value!r})")
    num_proc = args.get("dataset_num_proc")
    if isinstance(num_proc, int) and not isinstance(num_proc, bool) and num_proc < 1:  # datasets.map raises below 0
        errors.append(f"{where}.args.dataset_num_proc: must be >= 1, or null for one process (got {num_proc!r})")
    strategy = getattr(args.get("eval_strategy"), "value", args.get("eval_strategy"))
    if kind.reads_dataset and strategy not in (None, "no") and stage.eval_dataset is None:
        # transformers' Trainer refuses it when it is built, after the model loaded.
        errors.append(f"{where}.args.eval_strategy: {strategy!r} evaluates on the stage's eval_dataset, and it has "
                      "none: give `eval_dataset:` or set eval_strategy to 'no'")
    if args.get("push_to_hub"):
        errors.append(f"{where}.args.push_to_hub: trl-ext does not upload: a run works offline and writes only to its "
                      "output directory; upload the stage folder yourself afterwards (e.g. `hf upload`)")
    template = args.get("chat_template_path")
    if isinstance(template, str):
        errors += _chat_template_errors(template, f"{where}.args.chat_template_path")
    return errors


def _chat_template_errors(value: str, field: str) -> list[str]:
    """TRL reads ``chat_template_path`` as a Jinja file (.jinja/.j2) if that file exists, else as a tokenizer to load
    (a folder or a hub id): a missing path or any other file goes to the hub and fails after the model loaded. It
    checks the path as given (no ``~`` expansion), so this does too."""
    path = Path(value)
    if path.is_file():
        if not value.endswith(_TEMPLATE_SUFFIXES):
            return [f"{field}: {value!r} is a file but not a Jinja template (.jinja or .j2); give a template file, a "
                    "tokenizer folder or a hub id"]
        return []
    if path.is_dir():
        if not (path / "tokenizer_config.json").is_file():
            return [f"{field}: {value!r} is a folder without tokenizer_config.json, not a tokenizer folder"]
        return []
    explicit = value.startswith(("/", "./", "../", "~")) or value.endswith(_TEMPLATE_SUFFIXES)
    if explicit or not _HUB_ID.fullmatch(value):
        return [f"{field}: no such file or folder {value!r} (a Jinja template file, tokenizer folder or hub id)"]
    return []  # a hub id, like a model's


def plugin_hook_failure(plugin, hook: str, exc: BaseException, catalog, where: str) -> str:
    """One line for a plugin hook that raised while a stage was checked: the plugin, its distribution, the hook and
    the error (a bug in that plugin, or a value it did not expect; ``--debug`` shows the traceback)."""
    info = catalog.plugins.get(plugin.name)
    origin = f" (distribution {info.distribution})" if info is not None else ""
    text = str(exc).strip()
    return (f"{where}.plugins: plugin {plugin.name!r}{origin} failed in {hook}: {type(exc).__name__}: "
            f"{text.splitlines()[0] if text else ''}")


def _infos(stage: StageSpec, catalog):
    out = []
    for selection in stage.plugins:
        try:
            out.append(catalog.resolve(selection.name))
        except RecipeError:
            pass
    return out


def _merge_plugin_args(host: PluginHost, stage: StageSpec, index: int, args: dict[str, Any], catalog=None,
                       failures: list[BaseException] | None = None) -> list[str]:
    """Apply each plugin's ``trl_ext_configure_args`` result; conflicts are errors naming both sides, and a hook that
    raises is an error naming its plugin (the exception goes to ``failures``)."""
    errors: list[str] = []
    set_by: dict[str, str] = {}
    impls = reversed(host.pm.hook.trl_ext_configure_args.get_hookimpls())  # recipe order
    for impl in impls:
        plugin = impl.plugin
        try:
            wanted = impl.function(trainer=stage.trainer, args=dict(stage.args)) or {}
        except Exception as exc:
            if failures is None:
                raise
            failures.append(exc)
            errors.append(plugin_hook_failure(plugin, "trl_ext_configure_args", exc, catalog, f"stages[{index}]"))
            continue
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


# ---------------------------------------------------------------------------------------------------------------------
# Checks of what would otherwise fail only after the model loads
# ---------------------------------------------------------------------------------------------------------------------

# A hub id is `name` or `owner/name`; anything else that does not exist locally cannot be loaded.
_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?")


def model_ref_errors(stage: StageSpec, where: str, missing_relative: bool = True) -> list[str]:
    """``model``/``ref_model``/``teacher`` given as local paths must be model folders (hub ids are left to the hub).

    ``missing_relative=False`` leaves out relative paths such as ``runs/quickstart/sft`` and ``run:`` references that
    do not exist *yet* (the output of another run); explicit local paths (absolute, ``./``, ``../``, ``~``) are always
    checked."""
    errors = []
    for field_name in ("model", "ref_model", "teacher"):
        ref = getattr(stage, field_name)
        if ref and ref.startswith(SERVED_PREFIX) and field_name != "teacher":
            errors.append(f"{where}.{field_name}: {ref!r}: only a teacher can be served ({SERVED_PREFIX}<url>); the "
                          f"{field_name} must be a model folder, hub id, stage:<name> or embedded:<name>")
            continue
        if not ref or ref.startswith((STAGE_PREFIX, EMBEDDED_PREFIX, SERVED_PREFIX)):
            continue
        path = Path(ref).expanduser()
        # Another run's stage (a resolved ``run:`` reference) may not exist *yet*, like a bare relative path.
        explicit = ref not in stage._run_refs and (ref.startswith(("/", "./", "../", "~", ".\\", "..\\")) or "\\" in ref)
        if path.is_dir():
            if not (path / "config.json").is_file():
                errors.append(f"{where}.{field_name}: {ref!r} is a folder without config.json, not a model folder")
        elif path.is_file() and path.suffix == ".gguf":
            continue  # a GGUF checkpoint, converted once into a model folder when the stage runs
        elif path.exists():
            errors.append(f"{where}.{field_name}: {ref!r} is a file; give the model's folder (or a .gguf file)")
        elif explicit or (missing_relative and not _HUB_ID.fullmatch(ref)):
            written = f"for {stage._run_refs[ref]!r}" if ref in stage._run_refs else "and not a hub id"
            errors.append(f"{where}.{field_name}: no such model folder {ref!r} ({written})")
    return errors


def build_peft_config(spec):
    """The PEFT config object for a stage's ``peft:`` section (None without one); RecipeError naming the fault."""
    if spec is None:
        return None
    from peft.mapping import PEFT_TYPE_TO_CONFIG_MAPPING

    fields = spec.model_dump(exclude={"type", "save_merged"})
    if not isinstance(getattr(spec, "save_merged", False), bool):
        raise RecipeError(f"peft.save_merged: true or false (got {spec.save_merged!r})")
    config_cls = PEFT_TYPE_TO_CONFIG_MAPPING.get(spec.type.upper())
    if config_cls is None:
        raise RecipeError(f"peft.type: unknown PEFT method {spec.type!r}; known: "
                          f"{sorted(k.lower() for k in PEFT_TYPE_TO_CONFIG_MAPPING)}")
    fields.setdefault("task_type", "CAUSAL_LM")
    # PEFT configs do not type-check their fields either: a bad `r` fails only in get_peft_model, after the model
    # loaded.
    from trl_ext.recipe import check_args_fields

    problems = [m.removeprefix("peft.args.") for m in check_args_fields(fields, config_cls, "peft")]
    problems += [f"{key}: must be >= 1 (got {fields[key]!r})" for key in ("r", "lora_alpha")
                 if isinstance(fields.get(key), int) and fields[key] < 1]
    # A dropout probability (lora_dropout, and the other methods' *_dropout) outside [0, 1) fails in torch's Dropout
    # when get_peft_model builds the adapter, after the model loaded.
    problems += [f"{key}: must be in [0, 1) (got {value!r})" for key, value in fields.items()
                 if key.endswith("dropout") and isinstance(value, (int, float)) and not isinstance(value, bool)
                 and not 0 <= value < 1]
    if problems:
        raise RecipeError([f"peft.{m}" for m in problems])
    try:
        return config_cls(**fields)
    except (TypeError, ValueError) as exc:
        raise RecipeError(f"peft: {config_cls.__name__} rejected the fields: {' '.join(str(exc).split())}") from None


def peft_errors(stage: StageSpec, where: str) -> list[str]:
    try:
        build_peft_config(stage.peft)
    except RecipeError as exc:
        return [f"{where}.{m}" for m in exc.messages]
    return []


def evaluation_reward_plugins(stage: StageSpec, index: int, catalog) -> list:
    """The reward plugin instance(s) of a stage's ``evaluation.reward``; RecipeError naming ``evaluation.reward``."""
    from trl_ext.recipe import PluginSelection

    ev = stage.evaluation
    selection = ev.reward if isinstance(ev.reward, PluginSelection) else PluginSelection(name=ev.reward)
    # Reward plugins are written for the RL trainers; the probe stage lets them instantiate whatever this stage trains.
    probe = StageSpec(name=stage.name, trainer="grpo", model=stage.model, dataset=ev.dataset, plugins=[selection])
    plugins, errors = instantiate_plugins(probe, index, catalog)
    errors = [e.replace(".plugins[0]", ".evaluation.reward").replace(".plugins:", ".evaluation.reward:") for e in errors]
    if not errors and not any("trl_ext_reward_functions" in p.implemented_hooks() for p in plugins):
        errors.append(f"stages[{index}].evaluation.reward: plugin {selection.name!r} is not a reward plugin")
    if errors:
        raise RecipeError(errors)
    return plugins


def evaluation_errors(stage: StageSpec, index: int, catalog) -> list[str]:
    if stage.evaluation is None:
        return []
    try:
        evaluation_reward_plugins(stage, index, catalog)
    except RecipeError as exc:
        return exc.messages
    return []


def dataset_errors(stage: StageSpec, kind: TrainerKind, host: PluginHost, catalog, where: str) -> list[str]:
    """Embedded builders' parameters, and the columns of local dataset files the trainer reads."""
    errors = []
    specs = {"dataset": stage.dataset, "eval_dataset": stage.eval_dataset,
             "evaluation.dataset": stage.evaluation.dataset if stage.evaluation else None}
    for field_name, spec in specs.items():
        if spec is None:
            continue
        if spec.source.startswith(EMBEDDED_PREFIX):
            builder = catalog.datasets.get(spec.source[len(EMBEDDED_PREFIX):], (None,))[0]
            problems = _builder_param_errors(builder, spec.params, f"{where}.{field_name}.params")
            errors += problems or _builder_value_errors(builder, spec, f"{where}.{field_name}.params")
            continue
        path = Path(spec.source).expanduser()
        local_problems = local_source_errors(spec, f"{where}.{field_name}")
        if local_problems:
            errors += local_problems
            continue
        # Plugins that prepare the dataset may build the trainer's columns; the evaluation split only needs prompts.
        if field_name == "evaluation.dataset" or not kind.columns or host.implements("trl_ext_prepare_dataset"):
            continue
        try:
            columns = local_dataset_columns(path)
        except (OSError, ValueError) as exc:
            errors.append(f"{where}.{field_name}.source: cannot read {spec.source!r}: {exc}")
            continue
        if columns is not None and not any(need <= columns for need in kind.columns):
            wanted = " or ".join(sorted("+".join(sorted(c)) for c in kind.columns))
            errors.append(f"{where}.{field_name}.source: {spec.source!r} has columns {sorted(columns)}; the "
                          f"{stage.trainer} trainer reads {wanted}{_column_hint(columns, kind.columns)}")
    return errors


def local_source_errors(spec, field: str) -> list[str]:
    """Problems of a dataset ``spec`` that is not embedded: a local path that does not exist, a source that is neither
    a local path nor a hub id, a folder that is not a saved dataset, a split or params a local file ignores, a file
    whose rows datasets cannot read. Messages start with ``field`` (``stages[0].dataset``, ``mixture parts[1]``)."""
    path = Path(spec.source).expanduser()
    looks_local = spec.source.startswith((".", "/", "~")) or path.suffix.lower() in LOCAL_DATA_SUFFIXES
    if looks_local and not path.exists():
        return [f"{field}.source: no such file or folder {spec.source!r}"]
    if not path.exists():
        if _HUB_ID.fullmatch(spec.source):
            return []  # a hub dataset, checked when it is loaded
        # datasets.load_dataset reads it as a hub id and fails only after the model loaded ("s3://...", "a b")
        return [f"{field}.source: {spec.source!r} is neither a local file or folder nor a hub id (name or owner/name)"]
    if path.is_dir() and not any((path / name).is_file() for name in ("dataset_dict.json", "dataset_info.json")):
        # datasets would guess a dataset from the folder's files by its own naming rules (splits from file names,
        # the most common suffix), fail on any bad file only after the model loaded, and cache it under
        # ~/.cache/huggingface (outside the run): only the documented local forms are read.
        return [f"{field}.source: {spec.source!r} is a folder but not a saved dataset (no dataset_dict.json or "
                "dataset_info.json); give one .jsonl/.json/.csv/.parquet file, or a folder written by save_to_disk"]
    return local_split_errors(path, spec, field) or local_rows_errors(path, spec, field)


def _column_hint(columns: set[str], wanted: tuple[frozenset[str], ...]) -> str:
    """`` Did you mean: 'promt' for 'prompt'?`` for the wanted column set closest to what the file has."""
    closest = min(wanted, key=lambda need: (len(need - columns), -len(need & columns)))
    pairs = [(found[0], missing) for missing in sorted(closest - columns)
             if (found := difflib.get_close_matches(missing, sorted(columns), n=1, cutoff=0.6))]
    return f". Did you mean: {', '.join(f'{a!r} for {b!r}' for a, b in pairs)}?" if pairs else ""


def local_split_errors(path: Path, spec, where: str) -> list[str]:
    """A local file is one split (``train`` in datasets' terms) and takes no builder ``params``; a saved DatasetDict
    folder has the splits it lists. Anything else would be ignored by the loader, so it is refused."""
    if path.is_dir() and (path / "dataset_dict.json").is_file():
        splits = json.loads((path / "dataset_dict.json").read_text()).get("splits", [])
        if spec.split not in splits:
            return [f"{where}.split: {spec.split!r} is not a split of the saved dataset {spec.source!r} "
                    f"(splits: {', '.join(splits)})"]
    elif path.is_file() or (path / "dataset_info.json").is_file():
        errors = []
        if spec.split != "train":
            errors.append(f"{where}.split: {spec.source!r} is a single split (named 'train'); {spec.split!r} would "
                          "be ignored: give each split its own file, or save a DatasetDict folder")
        if spec.params:
            errors.append(f"{where}.params: a local dataset takes no params (got {', '.join(spec.params)}); params "
                          "go to embedded builders and hub datasets")
        return errors
    return []


def _builder_param_errors(builder, params: dict[str, Any], where: str) -> list[str]:
    if builder is None or not params:
        return []
    try:
        signature = inspect.signature(builder)
    except (TypeError, ValueError):
        return []
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in signature.parameters.values()):
        return []
    accepted = [name for name in signature.parameters if name != "split"]
    return [f"{where}.{key}: not a parameter of this embedded dataset.{did_you_mean(key, accepted)} (accepted: "
            f"{', '.join(accepted)})" for key in params if key not in accepted]


def _builder_value_errors(builder, spec, where: str) -> list[str]:
    """Build an embedded dataset whose recipe gives params, so a value the builder refuses (a size beyond the split,
    an option that does not fit the format) is reported now, before any model loads. Embedded builders are synthetic
    and fast; the runner builds the split again when it trains."""
    if builder is None or not spec.params:
        return []
    try:
        built = builder(split=spec.split, **spec.params)
    except (ValueError, TypeError) as exc:
        return [f"{where}: {exc}"]
    if hasattr(built, "__len__") and len(built) == 0:  # the trainer would fail on it only after the model loaded
        return [f"{where}: the {spec.split!r} split these params build holds no rows"]
    return []


LOCAL_DATA_SUFFIXES = (".jsonl", ".json", ".csv", ".parquet")


def local_rows_errors(path: Path, spec, where: str) -> list[str]:
    """A local JSON-lines file has at least one row and every row is a JSON object; a JSON file is one valid document
    (a list of objects, or an object as datasets reads it), else JSON lines; a CSV file parses as datasets parses it
    and has a row; a Parquet file has a readable footer and a row. datasets would fail on a torn or non-object line,
    a malformed CSV row, or an empty file, only while the stage starts, after the model was materialized."""
    suffix = path.suffix.lower()
    if not path.is_file():
        return []
    if path.suffix not in LOCAL_DATA_SUFFIXES:  # the runner (case-sensitive) refuses it only when the stage starts
        return [f"{where}.source: {spec.source!r}: unsupported file type {path.suffix or '(none)'} (use .json, "
                ".jsonl, .csv or .parquet)"]
    if suffix == ".csv":
        return _csv_rows_errors(path, spec, where)
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            rows = pq.read_metadata(path).num_rows
        except (OSError, ValueError) as exc:  # pyarrow's ArrowInvalid is a ValueError
            return [f"{where}.source: cannot read {spec.source!r} as Parquet: {exc}"]
        return [] if rows else [f"{where}.source: {spec.source!r} holds no rows"]
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        return [f"{where}.source: cannot read {spec.source!r}: {exc}"]
    if suffix == ".json":
        try:
            document = json.loads(text)
        except json.JSONDecodeError:
            document = None  # JSON lines under a .json name, as datasets also accepts
        if isinstance(document, dict):
            return []
        if isinstance(document, list):
            bad = next((i for i, row in enumerate(document) if not isinstance(row, dict)), None)
            if bad is not None:
                return [f"{where}.source: {spec.source!r} item {bad}: not a JSON object"]
            return [] if document else [f"{where}.source: {spec.source!r} holds no rows"]
    rows = 0
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            return [f"{where}.source: {spec.source!r} line {number}: not valid JSON ({exc.msg})"]
        if not isinstance(row, dict):
            return [f"{where}.source: {spec.source!r} line {number}: not a JSON object"]
        rows += 1
    return [] if rows else [f"{where}.source: {spec.source!r} holds no rows"]


def _csv_rows_errors(path: Path, spec, where: str) -> list[str]:
    """Parse a CSV file with the pandas options datasets' csv builder uses, in its chunks, so a row datasets cannot
    read (an unterminated quote, too many fields) or a file with a header only is found here."""
    import pandas as pd
    from datasets.packaged_modules.csv.csv import CsvConfig

    rows = 0
    try:
        for chunk in pd.read_csv(path, iterator=True, **CsvConfig().pd_read_csv_kwargs):
            rows += len(chunk)
    except pd.errors.EmptyDataError:
        pass  # no header either: no rows
    except (ValueError, UnicodeDecodeError, OSError) as exc:  # pandas' ParserError is a ValueError
        text = " ".join(str(exc).split())
        return [f"{where}.source: {spec.source!r}: not valid CSV ({text})"]
    return [] if rows else [f"{where}.source: {spec.source!r} holds no rows"]


def load_local_file(path: str | Path):
    """A local .jsonl/.json/.csv/.parquet file as a datasets.Dataset held in memory, read outside a run (validation).

    datasets writes its Arrow cache to ~/.cache/huggingface/datasets unless told otherwise, and a validation has no
    output directory to put it in: the cache goes to a temporary folder, removed once the rows are in memory."""
    import datasets

    builder = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}.get(Path(path).suffix)
    if builder is None:
        raise ValueError(f"{str(path)!r}: unsupported file type {Path(path).suffix or '(none)'} (use .json, .jsonl, "
                         ".csv or .parquet)")
    with tempfile.TemporaryDirectory(prefix="trl-ext-datasets-") as tmp:
        return datasets.load_dataset(builder, data_files=str(path), split="train", cache_dir=tmp, keep_in_memory=True)


def local_dataset_columns(path: Path) -> set[str] | None:
    """Column names of a local dataset file or saved dataset, read without loading it (None: not a local dataset)."""
    if path.is_dir():
        info = path / "dataset_info.json"
        if not info.is_file():
            return None
        return set(json.loads(info.read_text()).get("features", {}))
    if not path.is_file():
        return None
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".json"):
        with path.open(encoding="utf-8") as handle:
            first = handle.readline().strip()
            if first.startswith("{"):
                try:
                    return set(json.loads(first))
                except json.JSONDecodeError:
                    pass
        data = json.loads(path.read_text(encoding="utf-8"))  # a JSON array (or one object) rather than JSON lines
        row = data[0] if isinstance(data, list) and data else data
        return set(row) if isinstance(row, dict) else None
    if suffix == ".csv":
        with path.open(encoding="utf-8", newline="") as handle:
            return set(next(csv.reader(handle), []))
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        return set(pq.read_schema(path).names)
    raise ValueError(f"unsupported file type {suffix or '(none)'} (use json, jsonl, csv or parquet)")
