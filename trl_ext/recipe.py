"""Recipe schema and validation. Everything here runs before any model is loaded.

A recipe is YAML: either one stage (``trainer``, ``model``, ``dataset``, ``args``, ``plugins`` at the top level) or a
list of named ``stages``. Each error message starts with the exact field path, e.g. ``stages[1].args.learnin_rate``.

Model references (``model``, ``ref_model``, ``teacher``): ``stage:<name>`` is the output folder of an earlier stage,
``run:<recipe>/<stage>`` a stage of another recipe's run (:func:`resolve_run_refs`), ``embedded:<name>`` a model
built in code (see ``trl-ext plugins list``), ``vllm:<url>`` (``teacher`` only) a teacher behind a vLLM server, which
scores sampled tokens for the plugins that need no more (``opd_reward``, ``multi_teacher_opd``), anything else a local
path or hub id.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import math
import os
import re
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (AfterValidator, BaseModel, ConfigDict, Field, PrivateAttr, TypeAdapter, ValidationError,
                      field_validator, model_serializer, model_validator)

from trl_ext.errors import RecipeError, UnknownPluginError, validation_message

STAGE_PREFIX = "stage:"
RUN_PREFIX = "run:"
EMBEDDED_PREFIX = "embedded:"
SERVED_PREFIX = "vllm:"
# Fields trl-ext manages itself; setting them in `args` would fight the runner.
MANAGED_ARGS = {"output_dir": "use the top-level `output_dir` or `trl-ext train --output-dir`"}

# Bounds on the recipe file itself, so a hostile or broken file fails at load with one line (never after a model has
# loaded, never by exhausting memory): a YAML alias bomb is a few hundred bytes that expand to billions of nodes.
MAX_RECIPE_BYTES = 1 << 20
MAX_YAML_NODES = 200_000  # nodes after alias expansion
MAX_YAML_CHARS = 8 * MAX_RECIPE_BYTES  # scalar characters after alias expansion (a long string aliased many times)
MAX_INT_DIGITS = 4000  # below Python's int-parsing limit (4300 digits), which raised a bare ValueError
MAX_YAML_DEPTH = 64
# Names that become folder names under the output directory: no separator, no `..`, nothing hidden (`_embedded` and
# dot-files belong to the runner), no dots (no clash with run.json or curves.png), at most 64 characters.
SAFE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")


# Linux's NAME_MAX and PATH_MAX, in bytes: longer names make os.stat raise instead of answering "no such file".
MAX_NAME_BYTES = 255
MAX_PATH_BYTES = 4096


def path_text_problem(value: str) -> str | None:
    """Why the OS refuses ``value`` as a path whatever is on disk (None when it does not): a NUL character, an unknown
    ``~user``, a name over 255 bytes, text with no file-system encoding. ``Path.exists()`` and friends raise on these
    (OSError, ValueError, RuntimeError) rather than answer, so they are refused before any path is looked at."""
    if "\x00" in value:
        return "contains a NUL character"
    try:
        encoded = os.fsencode(str(Path(value).expanduser()))
    except RuntimeError:
        return f"starts with {value.split('/')[0]!r}, which names no user of this machine"
    except UnicodeError:
        return "cannot be encoded as a file name"
    if len(encoded) > MAX_PATH_BYTES or any(len(part) > MAX_NAME_BYTES for part in encoded.split(b"/")):
        return f"is too long (a path takes at most {MAX_NAME_BYTES} bytes a name, {MAX_PATH_BYTES} in all)"
    return None


def check_path_text(value: str) -> str:
    """Validator for fields that may be a local path (model references, dataset sources, output_dir)."""
    if not value.strip():
        # Blank is no name: `model: ""` passed validation and failed in from_pretrained, `output_dir: ""` was
        # silently replaced by the default.
        raise ValueError("is empty; give a name or a path")
    problem = path_text_problem(value)
    if problem:
        raise ValueError(f"{value[:80]!r}{'...' if len(value) > 80 else ''} {problem}")
    return value


PathText = Annotated[str, AfterValidator(check_path_text)]


def check_safe_name(value: str) -> str:
    """Validator for names used as path components (stage names)."""
    if not isinstance(value, str) or not SAFE_NAME.fullmatch(value):
        raise ValueError(f"{value!r} is not a safe name: use 1-64 letters, digits, '_' or '-', starting with a letter "
                         f"or digit (it becomes a folder under the output directory)")
    return value


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")

    @field_validator("*", mode="before")
    @classmethod
    def _no_booleans_as_numbers(cls, value: Any, info) -> Any:
        # pydantic's lax mode reads `true` as 1 for int/float fields (`seed: true`, `limit: yes`).
        numeric = cls.model_fields[info.field_name].annotation in (int, float, int | None, float | None)
        if numeric and isinstance(value, bool):
            raise ValueError(f"expected a number, got {value!r}")
        return value


class PluginSelection(_Strict):
    name: str
    params: dict[str, Any] = Field(default_factory=dict)


class DatasetSpec(_Strict):
    """Where a split comes from: ``embedded:<name>``, a local file/folder (json, jsonl, csv, parquet, saved dataset)
    or a hub id, and which split; ``params`` go to an embedded builder, ``limit`` keeps the first rows."""

    source: PathText
    split: str = "train"
    params: dict[str, Any] = Field(default_factory=dict)
    limit: int | None = Field(default=None, gt=0)


class PeftSpec(BaseModel):
    """A PEFT method and its fields, passed to TRL's ``peft_config`` (``type: lora`` with ``r``, ``lora_alpha`` ...).

    One field is trl-ext's own: ``save_merged`` (true/false). The stage always saves its adapter under
    ``<stage>/adapter/``; a merged copy (base + adapter, a plain model at the top of the stage folder) is saved when
    ``save_merged: true``, or, when the field is absent, only if a later stage of the recipe loads this one
    (``stage:<name>``). It is read as an extra field so that recipes without it keep their fingerprints."""

    model_config = ConfigDict(extra="allow")
    type: str = "lora"


class EvaluationSpec(_Strict):
    """Held-out evaluation before and after a stage: greedy decodes scored by a reward plugin.

    ``dataset`` takes the same string shorthand as a stage's ``dataset``; for an evaluation it means the ``test``
    split of an embedded or hub dataset (a held-out evaluation on the training split would measure memorisation), and
    the whole file for a local file. ``mean_at_k: k`` also samples k completions per prompt at ``temperature`` and
    reports their mean accuracy (``sampled_accuracy``, the mean@k or sampled pass@1 of RL papers), which greedy
    decoding, always the likeliest answer, can hide: a policy made more consistent moves it and not greedy's."""

    dataset: DatasetSpec
    reward: str | PluginSelection
    max_new_tokens: int = Field(default=8, gt=0)
    batch_size: int = Field(default=64, gt=0)
    limit: int | None = Field(default=None, gt=0)
    mean_at_k: int | None = Field(default=None, gt=0, description="also score this many sampled completions per "
                                                                   "prompt (sampled_accuracy)")
    temperature: float = Field(default=1.0, gt=0, description="sampling temperature of mean_at_k")

    @model_validator(mode="after")
    def _temperature_needs_samples(self):
        if "temperature" in self.model_fields_set and self.mean_at_k is None:
            raise ValueError("temperature is the sampling temperature of mean_at_k; set mean_at_k (samples per prompt)")
        return self

    @model_serializer(mode="wrap")
    def _leave_out_unused_sampling(self, handler):
        # The stage fingerprint hashes this dump: sampling fields left out while unused keep the fingerprints of runs
        # finished before they existed, so those runs are still found complete.
        data = handler(self)
        if self.mean_at_k is None:
            data.pop("mean_at_k", None)
            data.pop("temperature", None)
        return data

    @field_validator("dataset", mode="before")
    @classmethod
    def _dataset_shorthand(cls, value: Any) -> Any:
        if not isinstance(value, str):
            return value
        local = path_text_problem(value) is None and Path(value).exists()  # DatasetSpec names an unusable path
        return {"source": value} if local else {"source": value, "split": "test"}


class StageSpec(_Strict):
    name: str = "main"
    trainer: str
    model: PathText
    ref_model: PathText | None = None
    teacher: PathText | None = None
    # Required by every trainer that reads data (checked with the trainer kind, trl_ext/stage.py); a merge stage has none.
    dataset: DatasetSpec | None = None
    eval_dataset: DatasetSpec | None = None
    args: dict[str, Any] = Field(default_factory=dict)
    plugins: list[PluginSelection] = Field(default_factory=list)
    peft: PeftSpec | None = None
    evaluation: EvaluationSpec | None = None
    # Folder -> the ``run:`` reference it was resolved from (resolve_run_refs): fingerprints use the reference, so a
    # finished stage stays valid when both runs move together or the command runs from another directory.
    _run_refs: dict[str, str] = PrivateAttr(default_factory=dict)

    def as_written(self) -> dict[str, Any]:
        """The spec as JSON with each resolved ``run:`` reference written back as the recipe wrote it."""
        return _replace_strings(self.model_dump(mode="json"), self._run_refs)

    @field_validator("name")
    @classmethod
    def _safe_name(cls, value: str) -> str:
        return check_safe_name(value)

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
                # `{dapo: null}` (or `dapo:` alone) takes the defaults; `{dapo: 0}` is not "no parameters" and is refused.
                normalized.append({"name": name, "params": {} if params is None else params})
            else:
                normalized.append(item)
        return normalized


class DistributedSpec(_Strict):
    """Several processes from one ``trl-ext train`` (trl_ext/launch.py): torchrun is started by the CLI and the backend
    becomes TRL arguments of every stage (a stage's own ``args`` win)."""

    num_processes: int = Field(default=1, ge=1, description="processes per machine")
    backend: Literal["ddp", "zero2", "zero3", "fsdp2"] = "ddp"
    num_machines: int = Field(default=1, ge=1)
    machine_rank: int = Field(default=0, ge=0, description="this machine's rank (or `trl-ext train --machine-rank`)")
    main_process_ip: str = "127.0.0.1"
    main_process_port: int | None = Field(default=None, ge=1, le=65535, description="default: a free port (1 machine)")

    @model_validator(mode="after")
    def _multi_node_needs_a_port(self) -> "DistributedSpec":
        if self.num_machines > 1 and self.main_process_port is None:
            raise ValueError("main_process_port is required when num_machines > 1")
        if self.machine_rank >= self.num_machines:
            raise ValueError(f"machine_rank {self.machine_rank} is not below num_machines {self.num_machines}")
        return self


class Recipe(_Strict):
    output_dir: PathText | None = None
    seed: int | None = Field(default=None, ge=0, le=2**32 - 1)  # numpy's seed range (transformers.set_seed)
    distributed: DistributedSpec | None = None
    # Training checkpoints (weights plus optimizer state, several times the model) are deleted once their stage is
    # complete: the stage folder holds the final model and later stages read only that. True keeps them (for
    # inspection, or to average them in a later run by path).
    keep_checkpoints: bool = False
    # The file the recipe was read from (None when built in code): where to look for the recipes that build another
    # run's outputs it uses, to name them when those outputs are missing.
    _source_file: Path | None = PrivateAttr(default=None)
    # Stage folder -> the ``run:`` reference it was found for (resolve_run_refs), to name what builds a missing one.
    _run_refs_found: dict[str, RunRef] = PrivateAttr(default_factory=dict)
    stages: list[StageSpec] = Field(min_length=1)

    @model_validator(mode="before")
    @classmethod
    def _single_stage_shorthand(cls, data: Any) -> Any:
        if isinstance(data, dict) and "stages" not in data and "trainer" in data:
            top = {k: data[k] for k in ("output_dir", "seed", "distributed", "keep_checkpoints") if k in data}
            stage = {k: v for k, v in data.items() if k not in top}
            return {**top, "stages": [stage]}
        return data

    def stage(self, name: str) -> StageSpec:
        return next(s for s in self.stages if s.name == name)

    def fingerprint(self, upto: int | None = None) -> str:
        """Hash of the resolved stages (all, or the first ``upto``); a finished stage is reused only on a match."""
        stages = self.stages if upto is None else self.stages[:upto]
        blob = json.dumps([s.as_written() for s in stages], sort_keys=True, default=str)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


# ------------------------------------------------------------------------------------------------------------------
# References to another recipe's run
# ------------------------------------------------------------------------------------------------------------------


def default_output_dir(recipe_file: str | Path) -> Path:
    """Where ``trl-ext train RECIPE`` writes when neither the recipe nor ``--output-dir`` says: ``runs/<file stem>``."""
    return Path("runs") / Path(recipe_file).stem


@dataclasses.dataclass(frozen=True)
class RunRef:
    """Where ``run:<recipe>/<stage>`` was looked for: ``producer`` is the recipe file that builds it."""

    ref: str
    producer: Path
    stage: str
    folder: Path  # the stage folder used (the first place looked in when none exists yet)
    looked_in: tuple[Path, ...]

    def missing_hint(self) -> str:
        places = ", ".join(str(p) for p in self.looked_in)
        return (f"it is stage {self.stage!r} of {self.producer}, not built yet (looked in {places}); build it first "
                f"with `trl-ext train {self.producer}`")


def _replace_strings(value: Any, mapping: dict[str, str]) -> Any:
    if isinstance(value, str):
        return mapping.get(value, value)
    if isinstance(value, dict):
        return {k: _replace_strings(v, mapping) for k, v in value.items()}
    if isinstance(value, list):
        return [_replace_strings(v, mapping) for v in value]
    return value


def _run_ref_leaves(value: Any) -> list[str]:
    return [leaf for _path, leaf in string_leaves(value) if leaf.startswith(RUN_PREFIX)]


def locate_run_ref(ref: str, recipe_dir: Path, cwd: Path) -> RunRef:
    """``run:<recipe>/<stage>``: stage ``<stage>`` of the recipe file ``<recipe>`` (``.yaml`` implied), a path taken
    relative to the referencing recipe's folder, never the working directory.

    That recipe's ``output_dir`` (default ``runs/<its file stem>``, as ``trl-ext train`` uses) is, when relative,
    wherever its ``trl-ext train`` ran: the working directory, the producing recipe's folder or one of that folder's
    parents (``configs/quickstart.yaml`` run from the repository root writes ``<root>/runs/quickstart``). The first
    of those holding the finished stage (its ``stage.json``) wins, then the first where the stage folder exists.
    RecipeError naming the reference when the recipe file or the stage does not exist."""
    body = ref[len(RUN_PREFIX):]
    recipe_part, _, stage = body.rpartition("/")
    if not recipe_part or not stage:
        raise RecipeError(f"{ref!r}: write run:<recipe file>/<stage name>, e.g. run:quickstart/sft")
    producer = (recipe_dir / recipe_part).expanduser()
    if producer.suffix not in (".yaml", ".yml"):
        producer = next((c for c in (producer.with_name(producer.name + ".yaml"),
                                     producer.with_name(producer.name + ".yml")) if c.is_file()),
                        producer.with_name(producer.name + ".yaml"))
    try:
        other = parse_recipe(load_raw(producer))
    except RecipeError as exc:
        raise RecipeError(f"{ref!r}: cannot read the recipe that builds it: {exc.messages[0]}") from None
    names = [s.name for s in other.stages]
    if stage not in names:
        raise RecipeError(f"{ref!r}: {producer} has no stage {stage!r} (its stages: {names})")
    out = Path(other.output_dir or default_output_dir(producer)).expanduser()
    if out.is_absolute():
        bases = [out]
    else:
        home = producer.resolve().parent
        bases = list(dict.fromkeys(b / out for b in (cwd, home, *home.parents)))
    folders = [b / stage for b in bases]
    found = (next((f for f in folders if (f / "stage.json").is_file()), None)
             or next((f for f in folders if f.is_dir()), folders[0]))
    return RunRef(ref, producer, stage, found, tuple(folders))


def resolve_run_refs(recipe: Recipe, recipe_file: Path | None, cwd: Path | None = None) -> Recipe:
    """Replace every ``run:`` reference (stage ``model``/``ref_model``/``teacher`` and plugin parameters) by the
    folder :func:`locate_run_ref` finds, in place; the recipe keeps them in ``_run_refs_found`` to name a missing
    one's producer, and each stage keeps the written form for its fingerprint. RecipeError lists every bad one."""
    cwd = (cwd or Path.cwd()).resolve()
    recipe_dir = recipe_file.resolve().parent if recipe_file is not None else cwd
    errors, found = [], {}
    for index, stage in enumerate(recipe.stages):
        refs = [getattr(stage, f) for f in ("model", "ref_model", "teacher")]
        refs += [leaf for p in stage.plugins for leaf in _run_ref_leaves(p.params)]
        mapping = {}
        for ref in dict.fromkeys(r for r in refs if r and r.startswith(RUN_PREFIX)):
            try:
                located = found.get(ref) or locate_run_ref(ref, recipe_dir, cwd)
            except RecipeError as exc:
                errors += [f"stages[{index}]: {m}" for m in exc.messages]
                continue
            found[ref] = located
            mapping[ref] = str(located.folder)
        if mapping:
            for field_name in ("model", "ref_model", "teacher"):
                setattr(stage, field_name, mapping.get(getattr(stage, field_name), getattr(stage, field_name)))
            for selection in stage.plugins:
                selection.params = _replace_strings(selection.params, mapping)
            stage._run_refs = {folder: ref for ref, folder in mapping.items()}
    if errors:
        raise RecipeError(errors)
    recipe._run_refs_found = {str(r.folder): r for r in found.values()}
    return recipe


# ------------------------------------------------------------------------------------------------------------------
# Loading and overrides
# ------------------------------------------------------------------------------------------------------------------


def load_raw(path: str | Path) -> dict[str, Any]:
    """Read a recipe file: UTF-8 YAML holding a mapping, within the size, alias-expansion and nesting bounds."""
    path = Path(path)
    problem = path_text_problem(str(path))
    if problem:
        raise RecipeError(f"{str(path)[:80]!r}: the recipe path {problem}")
    if path.is_dir():
        raise RecipeError(f"{path}: is a directory, not a recipe file")
    if not path.is_file():
        raise RecipeError(f"{path}: no such recipe file")
    try:
        with path.open("rb") as handle:
            raw = handle.read(MAX_RECIPE_BYTES + 1)
    except OSError as exc:  # no read permission, an I/O error
        raise RecipeError(f"{path}: cannot read the recipe file: {exc.strerror or exc}") from None
    if len(raw) > MAX_RECIPE_BYTES:
        raise RecipeError(f"{path}: larger than {MAX_RECIPE_BYTES} bytes; a recipe this large is not a recipe")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise RecipeError(f"{path}: not UTF-8 text (invalid byte at offset {exc.start})") from None
    if not text.strip():
        raise RecipeError(f"{path}: the file is empty")
    data = safe_yaml(text, str(path))
    if data is None:
        raise RecipeError(f"{path}: holds no YAML content (only comments?)")
    if not isinstance(data, dict):
        raise RecipeError(f"{path}: a recipe must be a YAML mapping, got {type(data).__name__}")
    return data


def safe_yaml(text: str, where: str) -> Any:
    """``yaml.safe_load`` with the alias expansion and nesting depth bounded before anything is constructed.

    PyYAML composes aliases as shared nodes, so composing is linear in the text; the expanded size is then counted on
    the node graph (memoised per node) and a bomb is refused before construction could expand it.
    """
    try:
        loader = yaml.SafeLoader(text)  # its reader already refuses control characters (NUL, BEL ...)
    except yaml.YAMLError as exc:
        raise RecipeError(f"{where}: not valid YAML: {' '.join(str(exc).split())}") from None
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _check_node_graph(node, where)
        return loader.construct_document(node)
    except yaml.YAMLError as exc:
        raise RecipeError(f"{where}: not valid YAML: {' '.join(str(exc).split())}") from None
    except RecursionError:
        # PyYAML composes recursively: thousands of nested brackets overflow the stack before the depth check runs.
        raise RecipeError(f"{where}: YAML nested deeper than {MAX_YAML_DEPTH} levels") from None
    except ValueError as exc:  # a value PyYAML's constructors cannot build (after the checks above: rare)
        raise RecipeError(f"{where}: cannot read a value: {' '.join(str(exc).split())}") from None
    finally:
        loader.dispose()


def _check_node_graph(root: yaml.Node, where: str) -> None:
    sizes: dict[int, tuple[int, int, int]] = {}  # id(node) -> (expanded node count, depth, expanded characters)
    active: set[int] = set()

    def visit(node: yaml.Node) -> tuple[int, int, int]:
        key = id(node)
        if key in sizes:
            return sizes[key]
        if key in active:
            raise RecipeError(f"{where}: a YAML alias refers to itself (recursive structure)")
        if len(active) >= MAX_YAML_DEPTH:
            raise RecipeError(f"{where}: YAML nested deeper than {MAX_YAML_DEPTH} levels")
        active.add(key)
        count, depth = 1, 0
        if isinstance(node, yaml.SequenceNode):
            children = node.value
        elif isinstance(node, yaml.MappingNode):
            children = [item for pair in node.value for item in pair]
            # YAML keeps the last of two equal keys silently (`max_steps: 2` ... `max_steps: 3`): refuse them.
            first_line: dict[tuple[str, str], int] = {}
            for key_node, _value in node.value:
                if isinstance(key_node, yaml.ScalarNode) and key_node.tag != "tag:yaml.org,2002:merge":
                    name = (key_node.tag, key_node.value)
                    if name in first_line:
                        raise RecipeError(f"{where}: line {key_node.start_mark.line + 1}: duplicate key "
                                          f"{key_node.value!r} (first at line {first_line[name]})")
                    first_line[name] = key_node.start_mark.line + 1
        else:
            children = []
        chars = len(node.value) if isinstance(node, yaml.ScalarNode) else 0
        if (isinstance(node, yaml.ScalarNode) and node.tag == "tag:yaml.org,2002:int"
                and len(node.value) > MAX_INT_DIGITS):
            raise RecipeError(f"{where}: line {node.start_mark.line + 1}: an integer of {len(node.value)} digits; "
                              f"no recipe number needs more than {MAX_INT_DIGITS}")
        for child in children:
            child_count, child_depth, child_chars = visit(child)
            count, depth, chars = count + child_count, max(depth, child_depth + 1), chars + child_chars
            if count > MAX_YAML_NODES:
                raise RecipeError(f"{where}: YAML expands to more than {MAX_YAML_NODES} values (alias bomb?)")
            if chars > MAX_YAML_CHARS:
                raise RecipeError(f"{where}: YAML expands to more than {MAX_YAML_CHARS} characters of text (alias "
                                  f"bomb?)")
        active.discard(key)
        sizes[key] = (count, depth, chars)
        return count, depth, chars

    visit(root)


def nonfinite_numbers(value: Any, path: str = "") -> list[str]:
    """Paths of NaN/inf numbers anywhere in ``value`` (also NaN/inf spelled as strings, which numeric fields accept)."""
    if isinstance(value, float) and not math.isfinite(value):
        return [path or "<recipe>"]
    if isinstance(value, str) and value.strip().lower().lstrip("+-.") in ("nan", "inf", "infinity"):
        return [path or "<recipe>"]
    if isinstance(value, dict):
        return [p for k, v in value.items() for p in nonfinite_numbers(v, f"{path}.{k}" if path else str(k))]
    if isinstance(value, (list, tuple)):
        return [p for i, v in enumerate(value) for p in nonfinite_numbers(v, f"{path}[{i}]")]
    return []


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``--set PATH=VALUE`` overrides (VALUE parsed as YAML). Path parts are keys, list indices, or stage names.

    A key that does not exist is created; the schema then refuses it like a misspelt key in the file."""
    for item in overrides:
        path, sep, raw_value = item.partition("=")
        parts = path.replace("[", ".").replace("]", "").split(".")
        if not sep or not path.strip() or any(not p.strip() for p in parts):
            raise RecipeError(f"--set {item!r}: expected PATH=VALUE with a dotted PATH such as stages.sft.args.max_steps")
        value = _parse_scalar(raw_value, path)
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


def _parse_scalar(raw: str, path: str) -> Any:
    """YAML-parse a --set value; PyYAML (YAML 1.1) reads 1e-3 as a string, so numeric strings become floats."""
    value = safe_yaml(raw, f"--set {path}") if raw.strip() else ""
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
    nonfinite = nonfinite_numbers(data)
    if nonfinite:
        raise RecipeError([f"{p}: NaN and infinity are not accepted; give a finite number" for p in nonfinite])
    try:
        return Recipe.model_validate(data)
    except ValidationError as exc:
        raise RecipeError([f"{_format_loc(err['loc'])}: {validation_message(err)}" for err in exc.errors()]) from None


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
    """Problems between stages and with installed names (stage references, duplicate names, embedded models and
    datasets), as field-path-prefixed messages (empty when valid). Each stage's own checks are
    :func:`trl_ext.stage.resolve_stage`'s; ``trl_ext.runner.resolve_recipe`` runs both. Loads no model."""
    errors: list[str] = []
    names = [s.name for s in recipe.stages]
    folded = [n.casefold() for n in names]  # stage folders must differ on case-insensitive file systems too
    for index, stage in enumerate(recipe.stages):
        where = f"stages[{index}]"
        if folded.count(stage.name.casefold()) > 1:
            errors.append(f"{where}.name: stage name {stage.name!r} is used more than once")
        for field_name in ("model", "ref_model", "teacher"):
            ref = getattr(stage, field_name)
            if ref and ref.startswith(STAGE_PREFIX):
                target = ref[len(STAGE_PREFIX):]
                if target not in names[:index]:
                    errors.append(f"{where}.{field_name}: {ref!r} does not name an earlier stage (earlier: {names[:index]})")
            elif ref and ref.startswith(EMBEDDED_PREFIX) and ref[len(EMBEDDED_PREFIX):] not in catalog.models:
                errors.append(_unknown(f"{where}.{field_name}", "embedded model", ref[len(EMBEDDED_PREFIX):], catalog.models))
        errors.extend(_plugin_stage_ref_errors(stage, index, names, catalog))
        datasets = {"dataset": stage.dataset, "eval_dataset": stage.eval_dataset,
                    "evaluation.dataset": stage.evaluation.dataset if stage.evaluation else None}
        for field_name, spec in datasets.items():
            if spec and spec.source.startswith(EMBEDDED_PREFIX) and spec.source[len(EMBEDDED_PREFIX):] not in catalog.datasets:
                errors.append(_unknown(f"{where}.{field_name}.source", "embedded dataset", spec.source[len(EMBEDDED_PREFIX):], catalog.datasets))
    return errors


def _plugin_stage_ref_errors(stage: StageSpec, index: int, names: list[str], catalog) -> list[str]:
    """``stage:<name>`` values in a plugin's validated parameters (teachers, pair models ...) must name earlier stages,
    since a stage only starts after the stages before it have finished."""
    plugins, _ = instantiate_plugins(stage, index, catalog)
    positions = {}
    for j, selection in enumerate(stage.plugins):
        try:
            positions.setdefault(catalog.resolve(selection.name).cls.name, j)
        except UnknownPluginError:
            continue
    errors = []
    for plugin in plugins:
        for path, ref in string_leaves(plugin.params.model_dump(mode="json")):
            if ref.startswith(STAGE_PREFIX) and ref[len(STAGE_PREFIX):] not in names[:index]:
                errors.append(f"stages[{index}].plugins[{positions.get(plugin.name, '?')}].params.{path}: {ref!r} does "
                              f"not name an earlier stage (earlier: {names[:index]}; plugin {plugin.name!r})")
    return errors


def string_leaves(value: Any, path: str = "") -> list[tuple[str, str]]:
    if isinstance(value, str):
        return [(path, value)]
    if isinstance(value, dict):
        return [leaf for k, v in value.items() for leaf in string_leaves(v, f"{path}.{k}" if path else str(k))]
    if isinstance(value, list):
        return [leaf for i, v in enumerate(value) for leaf in string_leaves(v, f"{path}[{i}]")]
    return []


def did_you_mean(name: str, known, cutoff: float = 0.6) -> str:
    """`` Did you mean: a, b?`` for the close spellings of ``name`` among ``known`` (empty when none is close)."""
    close = difflib.get_close_matches(name, list(known), n=3, cutoff=cutoff)
    return f" Did you mean: {', '.join(close)}?" if close else ""


def _unknown(where: str, kind: str, name: str, table: dict) -> str:
    return f"{where}: unknown {kind} {name!r}.{did_you_mean(name, table)} Available: {', '.join(sorted(table))}"


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
                # A boolean is not a number (lax mode reads `max_steps: true` as 1).
                args[key] = TypeAdapter(hints[key]).validate_python(value, strict=True if isinstance(value, bool)
                                                                    else None)
            except ValidationError as exc:
                errors.append(f"{where}.args.{key}: {validation_message(exc.errors()[0])} (got {value!r})")
                continue
            except Exception:  # an annotation pydantic cannot model: leave the check to the config class
                pass
        if key in fields:
            problem = arg_range_problem(key, args[key])
            if problem:
                errors.append(f"{where}.args.{key}: {problem} (got {args[key]!r})")
    if "report_to" in args and not any(e.startswith(f"{where}.args.report_to:") for e in errors):  # typed first
        errors += [f"{where}.args.report_to: {problem}" for problem in report_to_problems(args["report_to"])]
    return errors


# The Python package each tracking backend of transformers needs, for the install hint.
REPORT_TO_PACKAGES = {"azure_ml": "azureml-core", "comet_ml": "comet-ml", "flyte": "flytekit"}


def report_to_problems(value: Any) -> list[str]:
    """Tracking backends transformers does not know or cannot import here (it would fail when the trainer is built,
    after the model loaded). ``all`` and ``none`` are transformers' own words and always accepted."""
    from transformers.integrations.integration_utils import (INTEGRATION_TO_CALLBACK,
                                                             get_available_reporting_integrations)

    names = [value] if isinstance(value, str) else list(value or [])
    problems = []
    for name in names:
        if name in ("all", "none"):
            continue
        if name not in INTEGRATION_TO_CALLBACK:
            problems.append(f"unknown tracking backend {name!r}.{did_you_mean(str(name), INTEGRATION_TO_CALLBACK)} "
                            f"Known: {', '.join(sorted(INTEGRATION_TO_CALLBACK))}")
        elif name not in get_available_reporting_integrations():
            problems.append(f"tracking backend {name!r} is not installed here: pip install "
                            f"{REPORT_TO_PACKAGES.get(name, name)}")
    return problems


# Ranges of the TRL/transformers arguments whose bad values TRL accepts and only fails on (or silently misuses) while
# training: (lower, lower inclusive, upper, upper inclusive); None = unbounded. `max_steps` also takes TRL's -1
# ("train by epochs"). Every other float is still checked for NaN/inf.
ARG_RANGES: dict[str, tuple[float | None, bool, float | None, bool]] = {
    "learning_rate": (0, False, None, False),
    "num_train_epochs": (0, False, None, False),
    "max_steps": (1, True, None, False),
    "per_device_train_batch_size": (1, True, None, False),
    "per_device_eval_batch_size": (1, True, None, False),
    "gradient_accumulation_steps": (1, True, None, False),
    "logging_steps": (0, False, None, False),
    "save_steps": (0, False, None, False),
    "eval_steps": (0, False, None, False),
    "save_total_limit": (1, True, None, False),
    "warmup_steps": (0, True, None, False),
    "warmup_ratio": (0, True, 1, True),
    "weight_decay": (0, True, None, False),
    "max_grad_norm": (0, True, None, False),
    "adam_beta1": (0, True, 1, False),
    "adam_beta2": (0, True, 1, False),
    "adam_epsilon": (0, False, None, False),
    "num_generations": (1, True, None, False),
    "generation_batch_size": (1, True, None, False),
    "steps_per_generation": (1, True, None, False),
    "num_iterations": (1, True, None, False),
    "max_length": (1, True, None, False),
    "max_prompt_length": (1, True, None, False),
    "max_completion_length": (1, True, None, False),
    "temperature": (0, False, None, False),
    "top_p": (0, False, 1, True),
    "min_p": (0, True, 1, True),
    "top_k": (0, True, None, False),
    "repetition_penalty": (0, False, None, False),
    "epsilon": (0, True, None, False),
    "epsilon_high": (0, True, None, False),
    "label_smoothing": (0, True, 0.5, True),
    "dataloader_num_workers": (0, True, None, False),
    "seed": (0, True, 2**32 - 1, True),
    "data_seed": (0, True, 2**32 - 1, True),
}


def arg_range_problem(key: str, value: Any) -> str | None:
    """Why ``value`` is out of range for the TRL argument ``key`` (None when it is fine or not a number)."""
    numbers = value if isinstance(value, (list, tuple)) else [value]
    numbers = [v for v in numbers if isinstance(v, (int, float)) and not isinstance(v, bool)]
    if any(not math.isfinite(v) for v in numbers):
        return "NaN and infinity are not accepted; give a finite number"
    if key not in ARG_RANGES or not numbers or (key == "max_steps" and value == -1):
        return None
    lo, lo_incl, hi, hi_incl = ARG_RANGES[key]
    for v in numbers:
        if lo is not None and (v < lo or (v == lo and not lo_incl)):
            return f"must be {'>=' if lo_incl else '>'} {lo}" + (" (or -1: train by epochs)" if key == "max_steps" else "")
        if hi is not None and (v > hi or (v == hi and not hi_incl)):
            return f"must be {'<=' if hi_incl else '<'} {hi}"
    return None


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
                message = validation_message(err)
                if err["type"] == "extra_forbidden" and len(err["loc"]) == 1:
                    fields = list(cls.Params.model_fields)
                    message = (f"not a parameter of this plugin.{did_you_mean(str(err['loc'][0]), fields)} "
                               f"({'accepted: ' + ', '.join(fields) if fields else 'it takes none'})")
                errors.append(f"{where}.params{'.' + loc if loc != '<recipe>' else ''}: {message} (plugin {cls.name!r})")
            continue
        # Only what the recipe set: a plugin may default a bound to infinity on purpose.
        nonfinite = nonfinite_numbers(params.model_dump(exclude_unset=True))
        if nonfinite:
            errors.extend(f"{where}.params.{p}: NaN and infinity are not accepted (plugin {cls.name!r})" for p in nonfinite)
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
