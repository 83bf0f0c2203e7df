"""Run a validated recipe: stages in order, each an ordinary TRL training run into its own folder.

Output directory layout::

    DIR/run.json                 resolved recipe, active plugins with versions, status, per-stage summary
    DIR/<stage>/                 the stage's final model (an ordinary Hugging Face model folder)
    DIR/<stage>/metrics.jsonl    one JSON object per logged step (TRL's log keys plus "step")
    DIR/<stage>/eval.json        held-out evaluation before and after the stage (when the stage has `evaluation`)
    DIR/<stage>/stage.json       written last: marks the stage complete, with the fingerprint it was run with
    DIR/<stage>/started.json     written first: the fingerprint an unfinished stage was started with
    DIR/<stage>/checkpoints/     TRL/HF checkpoints; an interrupted stage resumes from the newest complete one
    DIR/<stage>/tensorboard/     TensorBoard event files (args.report_to: tensorboard); see trl_ext/tracking.py
    DIR/_embedded/<name>/        embedded models materialized for this run
    DIR/curves.png               loss and reward curves of all stages
    DIR/.trl-ext.lock            PID and host of the run using DIR (one run per output directory)

Crash safety (a run killed at any instant, rerun with the same command, ends as if never interrupted): every JSON
file is written atomically (temp file + rename); a checkpoint counts only once its completion marker is written
(trl_ext/callbacks.py), newer incomplete ones are removed with a message; the last step is always checkpointed and
the final model is written to a temporary folder and moved into place, so an interrupted final save resumes at the
last step and trains nothing again; metrics.jsonl is repaired on resume (torn last line, rows after the checkpoint);
an unfinished stage continues only under the recipe fingerprint it was started with.
"""

from __future__ import annotations

import gc
import hashlib
import json
import os
import shutil
import socket
import sys
import time
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from trl_ext.errors import OutputDirError, RecipeError
from trl_ext.faults import crash_point
from trl_ext.files import write_json_atomic
from trl_ext.recipe import (EMBEDDED_PREFIX, STAGE_PREFIX, Recipe, StageSpec, default_output_dir, resolve_run_refs,
                            string_leaves, validate_recipe)
from trl_ext.stage import ResolvedStage, build_peft_config, evaluation_reward_plugins, resolve_stage  # noqa: F401

COMPLETE_MARKER = "stage.json"
STARTED_MARKER = "started.json"
LOCK_FILE = ".trl-ext.lock"
FINAL_TMP = ".final-save"


def resolve_recipe(recipe: Recipe, catalog, max_steps: int | None = None) -> list[ResolvedStage]:
    """Resolve every stage (all errors of all stages reported together). Loads no model."""
    backend_errors = check_distributed(recipe)
    if backend_errors:  # the stages' configs cannot even be built without the backend
        raise RecipeError(backend_errors)
    if max_steps is not None and max_steps < 1:
        raise RecipeError(f"--max-steps: must be >= 1 (got {max_steps})")
    resolved, errors = [], []
    recipe = with_backend_args(recipe)
    for index, stage in enumerate(recipe.stages):
        try:
            resolved.append(resolve_stage(stage, index, catalog, seed=recipe.seed, extra_args=_cap(stage, max_steps)))
        except RecipeError as exc:
            errors.extend(exc.messages)
    errors.extend(m for m in validate_recipe(recipe, catalog) if m not in errors)
    if errors:
        raise RecipeError(errors)
    return resolved


def preflight(recipe: Recipe, catalog, output_dir: str | Path | None = None, max_steps: int | None = None,
              warn: Callable[[str], None] | None = None) -> list[ResolvedStage]:
    """Everything `trl-ext validate` checks and `trl-ext train` checks first: the recipe, every stage, and the output
    directory. Raises :class:`RecipeError` listing every problem; loads no model and writes nothing.

    A relative model path that does not exist yet (``runs/quickstart/sft``, another run's output) is an error when
    training starts; with ``warn`` (``trl-ext validate``) it is reported there instead, as it may exist by then."""
    from trl_ext.stage import model_ref_errors

    resolve_run_refs(recipe, recipe._source_file)  # run:<recipe>/<stage> -> that run's stage folder
    errors: list[str] = []
    resolved: list[ResolvedStage] = []
    try:
        resolved = resolve_recipe(recipe, catalog, max_steps=max_steps)
    except RecipeError as exc:
        errors += exc.messages
    missing = [m + prerequisite_hint(m, recipe)
               for i, stage in enumerate(recipe.stages) for m in model_ref_errors(stage, f"stages[{i}]")
               if m not in errors]
    if warn is None:
        errors += missing
    for message in missing if warn is not None else []:
        warn(f"{message}; it must exist when training starts")
    if output_dir is not None:
        errors += output_dir_errors(Path(output_dir))
    if errors:
        raise RecipeError(errors)
    return resolved


def prerequisite_hint(message: str, recipe: Recipe) -> str:
    """For a missing model folder that another recipe builds, the command that builds it: the producer of a ``run:``
    reference, or for a plain relative path (``runs/quickstart/sft``) a recipe beside this one whose ``output_dir``
    and stage name make that path."""
    import re

    found = re.search(r"no such model folder '([^']+)'", message)
    if found is None:
        return ""
    if found.group(1) in recipe._run_refs_found:
        return ": " + recipe._run_refs_found[found.group(1)].missing_hint()
    recipe_file = recipe._source_file
    if recipe_file is None:
        return ""
    wanted = Path(found.group(1))
    from trl_ext.recipe import load_raw

    for candidate in sorted(recipe_file.parent.glob("*.yaml")):
        try:
            data = load_raw(candidate)  # bounded, UTF-8, a mapping; RecipeError otherwise
        except Exception:  # noqa: BLE001 - only a hint: an unrelated file beside the recipe must not fail validation
            continue
        stages = data.get("stages") or ([{"name": data.get("name", "main")}] if "trainer" in data else [])
        if not isinstance(stages, list) or not isinstance(data.get("output_dir") or "", str):
            continue
        out = Path(data.get("output_dir") or default_output_dir(candidate))
        for stage in stages:
            if isinstance(stage, dict) and out / str(stage.get("name", "main")) == wanted:
                return (f": it is stage {stage.get('name', 'main')!r} of {candidate}; build it first with "
                        f"`trl-ext train {candidate}` from this directory")
    return ""


def output_dir_errors(output_dir: Path) -> list[str]:
    """The output directory must be a folder (or creatable as one) this process can write."""
    from trl_ext.recipe import path_text_problem

    problem = path_text_problem(str(output_dir))
    if problem:
        return [f"output_dir: {str(output_dir)[:80]!r} {problem}"]
    if output_dir.exists() and not output_dir.is_dir():
        return [f"output_dir: {str(output_dir)!r} exists and is not a folder"]
    if output_dir.is_symlink() and not output_dir.exists():  # validation passed it; creating it then failed
        return [f"output_dir: {str(output_dir)!r} is a broken symbolic link (to {os.readlink(output_dir)!r}); remove "
                "it or create its target folder"]
    resolved = output_dir.expanduser().resolve()
    shared = {Path(resolved.anchor): "the file system root", Path.home().resolve(): "the home folder"}.get(resolved)
    if shared:
        return [f"output_dir: {str(output_dir)!r} is {shared}; give a folder of its own (the run writes run.json, a "
                "lock and one folder per stage into it)"]
    existing = output_dir
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        return [f"output_dir: {str(output_dir)!r} cannot be created: {str(existing)!r} is not a folder"]
    if not os.access(existing, os.W_OK | os.X_OK):
        return [f"output_dir: {str(output_dir)!r} is not writable (no write permission on {str(existing)!r})"]
    return []


def check_distributed(recipe: Recipe) -> list[str]:
    """The ``distributed`` section's needs that the schema cannot see (installed backends, this machine's devices)."""
    import importlib.util

    import torch

    spec = recipe.distributed
    if spec is not None and spec.backend in ("zero2", "zero3") and importlib.util.find_spec("deepspeed") is None:
        return [f"distributed.backend: {spec.backend!r} needs DeepSpeed: pip install 'trl-ext[deepspeed]'"]
    if spec is not None and spec.backend == "fsdp2" and not torch.cuda.is_available():
        # accelerate turns FSDP on only for GPU-type process groups: with CPU (gloo) ranks it keeps MULTI_CPU, and
        # Trainer wraps the model in DDP, so the run would train unsharded while the recipe says fsdp2.
        return ["distributed.backend: 'fsdp2' needs CUDA: without it accelerate does not enable FSDP and the CPU ranks "
                "would silently train unsharded with DDP; use backend 'ddp' (or 'zero2'/'zero3') on CPU"]
    return []


def with_backend_args(recipe: Recipe) -> Recipe:
    """The recipe with the ``distributed`` backend's TRL arguments under every stage's own ``args``."""
    if recipe.distributed is None:
        return recipe
    import torch

    from trl_ext.launch import backend_args

    base = backend_args(recipe.distributed.backend, cuda=torch.cuda.is_available())
    stages = [s.model_copy(update={"args": {**base, **s.args}}) for s in recipe.stages]
    return recipe.model_copy(update={"stages": stages})


def _cap(stage: StageSpec, max_steps: int | None) -> dict[str, Any] | None:
    if max_steps is None:
        return None
    current = stage.args.get("max_steps", -1)
    return {"max_steps": max_steps if current is None or current <= 0 else min(current, max_steps)}


def stage_fingerprints(resolved: list[ResolvedStage]) -> dict[str, str]:
    """A stage's fingerprint covers its spec, its resolved args and every earlier stage (its inputs may change)."""
    out, chain = {}, ""
    for rs in resolved:
        blob = json.dumps([rs.spec.as_written(), rs.args], sort_keys=True, default=str)
        chain = hashlib.sha256((chain + blob).encode()).hexdigest()[:16]
        out[rs.spec.name] = chain
    return out


def check_output_dir(output_dir: Path, fingerprints: dict[str, str], restart_unfinished: bool = False,
                     echo: Callable[[str], None] = print) -> None:
    """Refuse a directory holding another recipe's stages, finished or not (before any model loads).

    A finished stage is reused only when its fingerprint matches. An unfinished one (``started.json`` without
    ``stage.json``) is continued only under the fingerprint it was started with; with ``restart_unfinished`` it is
    removed and started over instead, with a message.
    """
    if not output_dir.is_dir():
        return
    for name in fingerprints:  # a stage folder that is a symlink would put the stage's files outside the directory
        if (output_dir / name).is_symlink():
            raise OutputDirError(f"{output_dir / name}: the folder of stage {name!r} is a symlink; trl-ext writes only "
                                 f"inside the output directory (remove the link)")
    for stage_dir in sorted(p for p in output_dir.iterdir() if p.is_dir() and not p.name.startswith((".", "_"))):
        name = stage_dir.name
        finished = _read_json(stage_dir / COMPLETE_MARKER)
        if finished is not None:
            if fingerprints.get(name) != finished.get("fingerprint"):
                raise OutputDirError(
                    f"{output_dir}: holds a finished stage {name!r} of a different recipe (or different settings); "
                    f"use another --output-dir or remove {stage_dir}"
                )
            continue
        started = _read_json(stage_dir / STARTED_MARKER)
        if started is None and (name not in fingerprints or all(p.name.startswith(".") for p in stage_dir.iterdir())):
            continue  # not a trl-ext stage folder, or one killed before its first file (temporary files are hidden)
        if started is not None and started.get("fingerprint") == fingerprints.get(name):
            continue
        if restart_unfinished:
            echo(f"[trl-ext] stage {name!r}: removing the unfinished stage of a different recipe ({stage_dir}), "
                 f"--restart-unfinished")
            _remove_tree(stage_dir)
            continue
        origin = "of a different recipe (or different settings)" if started is not None else "of unknown origin"
        raise OutputDirError(
            f"{output_dir}: holds an unfinished stage {name!r} {origin}; continuing it would mix two trainings. Use "
            f"another --output-dir, or --restart-unfinished to delete it and start over"
        )


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


REMOVING_PREFIX = ".removing-"


def _remove_tree(path: Path) -> None:
    """Delete a folder so that an interruption never leaves half of it under its real name: rename it to
    ``.removing-<name>`` in one step, then delete; a kill in between leaves only that, which
    :func:`_finish_removals` deletes on the next run (one run per output directory, so the name is free)."""
    doomed = path.with_name(f"{REMOVING_PREFIX}{path.name}")
    if doomed.exists():
        shutil.rmtree(doomed)
    os.replace(path, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def _finish_removals(folder: Path) -> None:
    """Delete what interrupted :func:`_remove_tree` calls left in ``folder``."""
    for leftover in folder.glob(f"{REMOVING_PREFIX}*"):
        shutil.rmtree(leftover, ignore_errors=True)


# ---------------------------------------------------------------------------------------------------------------------
# One run per output directory
# ---------------------------------------------------------------------------------------------------------------------


class RunLock:
    """``DIR/.trl-ext.lock``: the PID, host and start time of the run using DIR.

    Taken atomically (the lock's content is written to a temporary file that is then hard-linked to the lock name,
    which fails if the lock exists, so a lock file is never empty or half-written). A lock whose process is gone (same
    host, PID not running, or running but started after the lock was taken: the PID was reused) is stale and taken
    over with a message; any other lock refuses the run, naming its holder.
    """

    def __init__(self, output_dir: Path, echo: Callable[[str], None] = print):
        self.path = output_dir / LOCK_FILE
        self.echo = echo
        self.held = False

    def acquire(self) -> "RunLock":
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise OutputDirError(f"output_dir: cannot create {str(self.path.parent)!r}: {exc.strerror}") from None
        me = {"pid": os.getpid(), "host": socket.gethostname(), "process_start": _process_start(os.getpid()),
              "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        tmp = self.path.with_name(f"{LOCK_FILE}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(me))
        try:
            for _attempt in range(3):
                try:
                    os.link(tmp, self.path)
                    self.held = True
                    return self
                except FileExistsError:
                    holder = _read_json(self.path) or {}
                    if not _is_stale(holder):
                        raise OutputDirError(
                            f"{self.path.parent}: in use by another trl-ext run (pid {holder.get('pid', '?')} on host "
                            f"{holder.get('host', '?')}, started {holder.get('started', '?')}); wait for it, use "
                            f"another --output-dir, or delete {self.path} if that run is gone"
                        ) from None
                    self.echo(f"[trl-ext] {self.path}: taking over a stale lock (pid {holder.get('pid', '?')} on "
                              f"{holder.get('host', '?')} is no longer running)")
                    stale = self.path.with_name(f"{LOCK_FILE}.stale-{os.getpid()}")
                    try:
                        os.replace(self.path, stale)  # whoever renames it first takes over; the others retry
                        stale.unlink()
                    except FileNotFoundError:
                        pass
            raise OutputDirError(f"{self.path}: could not take the lock (another run is starting concurrently)")
        finally:
            tmp.unlink(missing_ok=True)

    def release(self) -> None:
        if self.held and (_read_json(self.path) or {}).get("pid") == os.getpid():
            self.path.unlink(missing_ok=True)
        self.held = False


def _process_start(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (Linux), to tell a live holder from a reused PID."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _is_stale(holder: dict[str, Any]) -> bool:
    pid = holder.get("pid")
    if not holder or not isinstance(pid, int):
        return True  # not a lock this code wrote (content is always complete): nobody can be holding it
    if holder.get("host") != socket.gethostname():
        return False  # cannot see processes on another machine: never taken over
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False  # alive, another user's
    start = _process_start(pid)
    return holder.get("process_start") is not None and start is not None and start != holder["process_start"]


@dataclass
class RunContext:
    recipe: Recipe
    output_dir: Path
    catalog: Any
    echo: Callable[[str], None] = print
    extra_callbacks: list = field(default_factory=list)


# The run in progress, for plugins that resolve `stage:`/`embedded:` model refs or cache files next to the run's
# outputs (e.g. preference-pair builders). Set by `run_recipe` for the duration of the run; None outside a run.
_CURRENT_RUN: ContextVar[RunContext | None] = ContextVar("trl_ext_current_run", default=None)


def current_run() -> RunContext | None:
    """The :class:`RunContext` of the recipe being run (``None`` outside :func:`run_recipe`)."""
    return _CURRENT_RUN.get()


def run_recipe(recipe: Recipe, output_dir: str | Path, catalog, max_steps: int | None = None,
               extra_callbacks: list | None = None, echo: Callable[[str], None] = print,
               restart_unfinished: bool = False) -> dict[str, Any]:
    """Validate (as `trl-ext validate`), lock the output directory, then run every stage not already complete.
    Returns the run summary (also in run.json)."""
    output_dir = Path(output_dir)
    resolved = preflight(recipe, catalog, output_dir, max_steps=max_steps)
    fingerprints = stage_fingerprints(resolved)

    from accelerate import PartialState

    state = PartialState()
    keep_caches_in_run(output_dir)
    lock = RunLock(output_dir, echo)
    if state.is_main_process:
        lock.acquire()
    try:
        if state.is_main_process:
            check_output_dir(output_dir, fingerprints, restart_unfinished=restart_unfinished, echo=echo)
        state.wait_for_everyone()
        return _run_stages(recipe, resolved, fingerprints, output_dir, catalog, state, extra_callbacks, echo)
    finally:
        lock.release()


def keep_caches_in_run(output_dir: Path) -> None:
    """Point libraries' caches at ``<output_dir>/_cache`` unless the environment already says where they go.

    matplotlib (the curves and plugins' plots) writes its font cache and config under $HOME; it reads the setting when
    first imported, so only a run that imports it first sets it. ``torch.compile`` (``args.torch_compile``) writes its
    compiled graphs and kernels under ``$TMPDIR/torchinductor_<user>`` and Triton under ``~/.triton``; both read their
    variable when they compile. (Inductor's precompiled C++ headers stay in torch's default folder: torch fixes that
    path when it is imported, before the output directory is known.)"""
    cache = output_dir.resolve() / "_cache"
    if "matplotlib" not in sys.modules:
        os.environ.setdefault("MPLCONFIGDIR", str(cache / "matplotlib"))
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache / "torchinductor"))
    os.environ.setdefault("TRITON_CACHE_DIR", str(cache / "triton"))


def _run_stages(recipe: Recipe, resolved: list[ResolvedStage], fingerprints: dict[str, str], output_dir: Path, catalog,
                state, extra_callbacks: list | None, echo: Callable[[str], None]) -> dict[str, Any]:
    ctx = RunContext(recipe, output_dir, catalog, echo if state.is_main_process else (lambda _m: None),
                     list(extra_callbacks or []))
    run_info = {
        "recipe": recipe.model_dump(mode="json"),
        "resolved_args": {rs.spec.name: rs.args for rs in resolved},
        "plugins": {rs.spec.name: _plugin_versions(rs, catalog) for rs in resolved},
        "fingerprints": fingerprints,
        "status": "running",
        "stages": {},
    }
    if state.is_main_process:
        write_json_atomic(output_dir / "run.json", run_info)

    token = _CURRENT_RUN.set(ctx)
    try:
        for rs in resolved:
            done = _read_json(output_dir / rs.spec.name / COMPLETE_MARKER)
            if done is not None:
                ctx.echo(f"[trl-ext] stage {rs.spec.name!r}: already complete, skipping")
                run_info["stages"][rs.spec.name] = done.get("summary", {})
            else:
                run_info["stages"][rs.spec.name] = run_stage(rs, ctx, fingerprints[rs.spec.name])
                if state.is_main_process:
                    write_json_atomic(output_dir / "run.json", run_info)
            if state.is_main_process and not recipe.keep_checkpoints:
                prune_checkpoints(output_dir / rs.spec.name, ctx.echo)  # also what a kill left half-pruned
    finally:
        _CURRENT_RUN.reset(token)

    if state.is_main_process:
        from trl_ext.plotting import plot_curves

        metrics = {rs.spec.name: output_dir / rs.spec.name / "metrics.jsonl" for rs in resolved}
        evaluations = {name: summary.get("eval", {}) for name, summary in run_info["stages"].items()}
        run_info["plot"] = str(plot_curves({k: v for k, v in metrics.items() if v.exists()}, output_dir / "curves.png",
                                           evaluations))
        run_info["status"] = "complete"
        write_json_atomic(output_dir / "run.json", run_info)
        ctx.echo(format_summary(run_info))
    return run_info


def prune_checkpoints(stage_dir: Path, echo: Callable[[str], None]) -> None:
    """Delete a complete stage's training checkpoints (through :func:`_remove_tree`, so a kill mid-deletion leaves a
    ``.removing-checkpoints`` folder that this function, on the next run, finishes deleting)."""
    checkpoints = stage_dir / "checkpoints"
    if checkpoints.is_dir():
        saved = any(checkpoints.glob("checkpoint-*"))
        _remove_tree(checkpoints)
        if saved:
            echo(f"[trl-ext] stage {stage_dir.name!r}: removed its training checkpoints (keep_checkpoints: true keeps "
                 "them)")
    _finish_removals(stage_dir)


def _plugin_versions(rs: ResolvedStage, catalog) -> list[dict[str, Any]]:
    rows = []
    for plugin in rs.host.plugins:
        info = catalog.plugins[plugin.name]
        rows.append({"name": plugin.name, "distribution": info.distribution, "version": info.version,
                     "params": plugin.params.model_dump(mode="json")})
    return rows


# ---------------------------------------------------------------------------------------------------------------------


def resolve_model_ref(ref: str | None, ctx: RunContext) -> str | None:
    """stage:<name> -> that stage's folder; embedded:<name> -> materialized folder; anything else unchanged."""
    if ref is None:
        return None
    if ref.startswith(STAGE_PREFIX):
        return str(ctx.output_dir / ref[len(STAGE_PREFIX):])
    if ref.endswith(".gguf"):  # converted once into a plain model folder that TRL can reload by path
        from accelerate import PartialState

        from trl_ext.embedded.gguf import convert_gguf

        with PartialState().main_process_first():
            return str(convert_gguf(ref, ctx.output_dir / "_gguf" / Path(ref).stem))
    if ref.startswith(EMBEDDED_PREFIX):
        from accelerate import PartialState

        name = ref[len(EMBEDDED_PREFIX):]
        target = ctx.output_dir / "_embedded" / name
        materialize, _source = ctx.catalog.models[name]
        with PartialState().main_process_first():  # one writer; the others then find the finished folder
            return str(materialize(target, seed=ctx.recipe.seed or 0))
    return ref


def load_split(spec, catalog, stage: StageSpec, split_role: str, host):
    """Load a dataset split from an embedded builder, a local file/folder, or the hub; then run plugin pipelines."""
    import datasets

    source = spec.source
    if source.startswith("~"):  # validation expands it too (a ~/data.jsonl validated, then failed here)
        source = str(Path(source).expanduser())
    if source.startswith(EMBEDDED_PREFIX):
        build, _ = catalog.datasets[source[len(EMBEDDED_PREFIX):]]
        dataset = build(split=spec.split, **spec.params)
    elif Path(source).is_dir() and (Path(source) / "dataset_dict.json").exists():
        dataset = datasets.load_from_disk(source)[spec.split]  # validation checked the split exists
    elif Path(source).is_dir() and (Path(source) / "dataset_info.json").exists():
        dataset = datasets.load_from_disk(source)
    elif Path(source).is_file():
        suffix = Path(source).suffix.lstrip(".")
        builder = {"jsonl": "json", "json": "json", "csv": "csv", "parquet": "parquet"}.get(suffix)
        if builder is None:
            raise RecipeError(f"dataset {source!r}: unsupported file type .{suffix} (use json, jsonl, csv or parquet)")
        run = current_run()  # datasets' Arrow cache goes under the run, not ~/.cache/huggingface
        dataset = datasets.load_dataset(builder, data_files=source, split="train",
                                        cache_dir=str(run.output_dir / "_cache" / "datasets") if run else None)
    else:
        dataset = datasets.load_dataset(source, split=spec.split, **spec.params)
    if spec.limit is not None:
        dataset = dataset.select(range(min(spec.limit, len(dataset))))
    if host is not None:
        dataset = host.call_pipeline("trl_ext_prepare_dataset", dataset, split=split_role, stage=stage)
    return dataset


def latest_checkpoint(checkpoint_dir: Path, echo: Callable[[str], None] = print, remove_incomplete: bool = False
                      ) -> str | None:
    """The newest complete checkpoint (see :class:`trl_ext.callbacks.CheckpointCompletionCallback`), or None.

    Newer folders without the completion marker were interrupted while saving: skipped with a message and, with
    ``remove_incomplete`` (the main process), removed, so Trainer later writes that step's checkpoint afresh.
    """
    from trl_ext.callbacks import CHECKPOINT_COMPLETE

    candidates = sorted((p for p in checkpoint_dir.glob("checkpoint-*") if p.name.split("-")[-1].isdigit()),
                        key=lambda p: int(p.name.split("-")[-1]), reverse=True)
    for candidate in candidates:
        if (candidate / CHECKPOINT_COMPLETE).is_file():
            return str(candidate)
        echo(f"[trl-ext] skipping incomplete checkpoint {candidate} (interrupted while saving)")
        if remove_incomplete:
            _remove_tree(candidate)
    return None


def run_stage(rs: ResolvedStage, ctx: RunContext, fingerprint: str) -> dict[str, Any]:
    from accelerate import PartialState
    from transformers import AutoTokenizer

    from trl_ext.callbacks import (CheckpointCompletionCallback, LossAccountingCheckpoint, MetricsJsonlCallback,
                                   plugin_checkpoints_before_completion)
    from trl_ext.rewards import collect_reward_functions
    from trl_ext.tracking import StageReporting, heldout_logs, stage_run_name, tensorboard_dir, tensorboard_logging_dir
    from trl_ext.trainers import BuildContext, plugin_trainer_kwargs

    state = PartialState()
    spec = rs.spec
    stage_dir = ctx.output_dir / spec.name
    checkpoint_dir = stage_dir / "checkpoints"
    started = time.time()
    ctx.echo(f"[trl-ext] stage {spec.name!r} ({spec.trainer}) plugins: {rs.host.names() or 'none'}")
    if state.is_main_process and not (stage_dir / STARTED_MARKER).exists():
        write_json_atomic(stage_dir / STARTED_MARKER, {"fingerprint": fingerprint})

    model_path = resolve_model_ref(spec.model, ctx)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    train_dataset = load_split(spec.dataset, ctx.catalog, spec, "train", rs.host) if spec.dataset else None
    eval_dataset = load_split(spec.eval_dataset, ctx.catalog, spec, "eval", rs.host) if spec.eval_dataset else None

    args = dict(rs.args)
    args.setdefault("run_name", stage_run_name(ctx.output_dir, spec.name))  # one tracker run per stage: <run>/<stage>
    rewards = collect_reward_functions(rs.host, spec) if rs.kind.uses_rewards else []
    if rewards and "reward_weights" not in args:
        args["reward_weights"] = [r.weight for r in rewards]
    config = rs.kind.config_cls(output_dir=str(checkpoint_dir), **args)
    resume_from = latest_checkpoint(checkpoint_dir, ctx.echo, remove_incomplete=state.is_main_process)
    state.wait_for_everyone()

    metrics_path = stage_dir / "metrics.jsonl"
    build = BuildContext(
        model=model_path,
        ref_model=resolve_model_ref(spec.ref_model, ctx),
        teacher=resolve_model_ref(spec.teacher, ctx),
        config=config,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        tokenizer=tokenizer,
        peft_config=build_peft_config(spec.peft),
        callbacks=[MetricsJsonlCallback(metrics_path, resume_step=_step_of(resume_from)),
                   CheckpointCompletionCallback(), *ctx.extra_callbacks],
        host=rs.host,
        reward_funcs=[r.as_trl_callable() for r in rewards],
        reward_weights=[r.weight for r in rewards],
        trainer_kwargs=plugin_trainer_kwargs(rs.host, spec, tokenizer),
    )
    with tensorboard_logging_dir(tensorboard_dir(ctx.output_dir, spec.name)):
        trainer = rs.kind.build(build)
    reporting = StageReporting(trainer).hold()  # report_to backends stay open for the held-out results
    with plugin_checkpoints_before_completion(trainer):  # plugins' checkpoint files precede the completion marker
        if hasattr(trainer, "add_callback"):  # a merge stage trains nothing and has no callbacks
            trainer.add_callback(LossAccountingCheckpoint(trainer))
        rs.host.hook.trl_ext_trainer_created(trainer=trainer)

    evaluation = _load_eval(stage_dir)
    if spec.evaluation is not None and "before" not in evaluation:
        evaluation["before"] = evaluate_stage(trainer, tokenizer, spec, ctx, rs)
        if state.is_main_process:
            write_json_atomic(stage_dir / "eval.json", evaluation)
    if resume_from and _checkpoint_is_final(resume_from):
        # Killed after its last step (while saving the final model or later): Trainer would train one step more
        # when resumed at max_steps, so the weights are taken from the last checkpoint and nothing is trained.
        ctx.echo(f"[trl-ext] stage {spec.name!r}: {resume_from} is the last step; finishing the stage from it")
        result = _finish_from_final_checkpoint(trainer, resume_from, metrics_path, state.is_main_process)
    else:
        if resume_from:
            ctx.echo(f"[trl-ext] stage {spec.name!r}: resuming from {resume_from}")
        result = trainer.train(resume_from_checkpoint=resume_from)
    crash_point("train_end")
    merged = wants_merged_copy(spec, ctx.recipe)
    save_stage_model(trainer, tokenizer, stage_dir, is_main=state.is_main_process, merged=merged)

    summary: dict[str, Any] = {"trainer": spec.trainer, "plugins": rs.host.names(),
                               "model": str(stage_dir if merged else stage_dir / "adapter"),
                               "global_step": trainer.state.global_step,
                               "train_loss": getattr(result, "training_loss", None)}
    for extra in reversed(rs.host.pm.hook.trl_ext_after_stage.get_hookimpls()):
        summary.update(extra.function(stage=spec, output_dir=str(stage_dir), trainer=trainer) or {})
    if spec.evaluation is not None:
        evaluation["after"] = evaluate_stage(trainer, tokenizer, spec, ctx, rs)
        summary["eval"] = evaluation
    reporting.finish(heldout_logs(evaluation))
    summary["last_logged"] = _last_logged(metrics_path)
    summary["seconds"] = round(time.time() - started, 1)
    if state.is_main_process:
        write_json_atomic(stage_dir / "eval.json", evaluation) if spec.evaluation is not None else None
        write_json_atomic(stage_dir / COMPLETE_MARKER, {"fingerprint": fingerprint, "summary": summary})
    state.wait_for_everyone()
    del trainer
    gc.collect()
    return summary


def wants_merged_copy(spec: StageSpec, recipe: Recipe) -> bool:
    """A PEFT stage's merged copy is saved when ``peft.save_merged`` says so or, by default, when a later stage of the
    recipe names this one (as its model, reference, teacher, or in a plugin parameter)."""
    if spec.peft is None:
        return True  # not a PEFT stage: the model is saved whole anyway
    asked = getattr(spec.peft, "save_merged", None)
    if asked is not None:
        return asked
    later = recipe.stages[[s.name for s in recipe.stages].index(spec.name) + 1:]
    wanted = STAGE_PREFIX + spec.name
    return any(value == wanted for stage in later for _path, value in string_leaves(stage.model_dump(mode="json")))


def save_stage_model(trainer, tokenizer, stage_dir: Path, is_main: bool, merged: bool = True) -> None:
    """Save the stage's model as an ordinary Hugging Face folder that later stages can load by path.

    A PEFT-trained model saves its adapter alone under ``adapter/`` (what TRL would save) and, when ``merged``, the
    adapter merged into the base weights at the top, so ``stage:<name>`` is a plain model for the next stage.

    Written into a temporary folder first and then moved into place, file by file; an interruption anywhere leaves the
    stage without ``stage.json``, and the rerun resumes from the last step's checkpoint and saves again.
    """
    from accelerate import PartialState
    from peft import PeftModel

    tmp = stage_dir / FINAL_TMP
    if is_main and tmp.exists():
        shutil.rmtree(tmp)
    PartialState().wait_for_everyone()
    model = trainer.accelerator.unwrap_model(trainer.model)
    if not isinstance(model, PeftModel):
        trainer.save_model(str(tmp))
    elif is_main:
        model.save_pretrained(str(tmp / "adapter"))
        if merged:
            import copy

            copy.deepcopy(model).merge_and_unload().save_pretrained(str(tmp))
    if is_main:
        tokenizer.save_pretrained(str(tmp))
        crash_point("final_save")
        for item in sorted(tmp.iterdir()):
            target = stage_dir / item.name
            if target.is_dir() and not target.is_symlink():
                _remove_tree(target)
            os.replace(item, target)
        tmp.rmdir()
    PartialState().wait_for_everyone()


def _checkpoint_is_final(checkpoint: str) -> bool:
    state = _read_json(Path(checkpoint) / "trainer_state.json") or {}
    max_steps = state.get("max_steps") or 0
    return max_steps > 0 and state.get("global_step", 0) >= max_steps


def _finish_from_final_checkpoint(trainer, checkpoint: str, metrics_path: Path, is_main: bool):
    """What ``trainer.train`` leaves behind, from a checkpoint of the last step: its weights and state, the plugins'
    checkpointed state, and metrics.jsonl repaired (torn line, rows after the step) with the end-of-training row kept
    when it was written."""
    from transformers import TrainerState
    from transformers.trainer_utils import TrainOutput

    from trl_ext.callbacks import read_jsonl, read_loss_accounting, restore_plugin_checkpoint_state, rewrite_jsonl

    trainer._load_from_checkpoint(checkpoint)
    trainer.state = TrainerState.load_from_json(str(Path(checkpoint) / "trainer_state.json"))
    restore_plugin_checkpoint_state(trainer)  # what on_train_begin would restore (e.g. ppo's critic)
    step = trainer.state.global_step
    rows = [row for row in read_jsonl(metrics_path) if row.get("step", 0) <= step]
    if is_main:
        rewrite_jsonl(metrics_path, rows)
    train_loss = next((row["train_loss"] for row in reversed(rows) if "train_loss" in row), None)
    accounting = read_loss_accounting(Path(checkpoint).parent, step)
    if accounting is not None and step > 0:  # Trainer's own formula: logged losses plus the undrained rest, per step
        train_loss = (accounting["total_loss_scalar"] + accounting["tr_loss"]) / step
    return TrainOutput(step, train_loss, {})


def _step_of(checkpoint: str | None) -> int | None:
    return int(checkpoint.rsplit("-", 1)[-1]) if checkpoint else None


def _load_eval(stage_dir: Path) -> dict[str, Any]:
    path = stage_dir / "eval.json"
    return json.loads(path.read_text()) if path.exists() else {}


def _last_logged(metrics_path: Path) -> dict[str, Any]:
    if not metrics_path.exists():
        return {}
    last: dict[str, Any] = {}
    from trl_ext.callbacks import read_jsonl

    for row in read_jsonl(metrics_path):
        last.update({k: v for k, v in row.items() if isinstance(v, (int, float))})
    return {k: last[k] for k in ("loss", "reward", "train_loss") if k in last}


def evaluate_stage(trainer, tokenizer, spec: StageSpec, ctx: RunContext, rs: ResolvedStage) -> dict[str, Any]:
    """Greedy held-out evaluation scored by the evaluation's reward plugin, and the sampled one when the evaluation
    asks for ``mean_at_k`` (main process; others wait, or evaluate in step when the model is sharded)."""
    from accelerate import PartialState

    from trl_ext.evaluation import evaluation_model, training_reward_kwargs

    state = PartialState()
    result: dict[str, Any] = {}
    # entered on every rank: a sharded model (ZeRO-3, FSDP) is evaluated by every rank in step
    with evaluation_model(trainer, state.is_main_process) as (model, evaluate_here):
        if evaluate_here:
            result = _evaluate(model, tokenizer, spec, ctx, rs, training_reward_kwargs(trainer))
    state.wait_for_everyone()
    return result if state.is_main_process else {}


def _evaluate(model, tokenizer, spec: StageSpec, ctx: RunContext, rs: ResolvedStage,
              reward_kwargs: dict[str, Any]) -> dict[str, Any]:
    from trl_ext.evaluation import evaluate_generation, sampled_evaluation
    from trl_ext.host import PluginHost
    from trl_ext.rewards import collect_reward_functions, weighted_reward

    ev = spec.evaluation
    plugins = evaluation_reward_plugins(spec, rs.index, ctx.catalog)
    reward_fn = weighted_reward(collect_reward_functions(PluginHost(plugins), spec))
    dataset = load_split(ev.dataset, ctx.catalog, spec, "evaluation", None)
    if ev.limit is not None:
        dataset = dataset.select(range(min(ev.limit, len(dataset))))
    result = evaluate_generation(model, tokenizer, dataset, reward_fn, max_new_tokens=ev.max_new_tokens,
                                 batch_size=ev.batch_size, reward_kwargs=reward_kwargs)
    if ev.mean_at_k:
        result.update(sampled_evaluation(model, tokenizer, dataset, reward_fn, ev.mean_at_k, ev.temperature,
                                         seed=ctx.recipe.seed or 0, max_new_tokens=ev.max_new_tokens,
                                         batch_size=ev.batch_size, reward_kwargs=reward_kwargs))
    ctx.echo(f"[trl-ext] stage {spec.name!r} held-out: " + ", ".join(f"{k}={v:.4g}" for k, v in result.items()
                                                                       if isinstance(v, (int, float))))
    return result


def format_summary(run_info: dict[str, Any]) -> str:
    lines = ["", "trl-ext run summary", "-" * 72]
    for name, summary in run_info["stages"].items():
        ev = summary.get("eval", {})
        before, after = ev.get("before", {}), ev.get("after", {})
        eval_text = ""
        if "accuracy" in before and "accuracy" in after:
            eval_text = f" held-out accuracy {before['accuracy']:.3f} -> {after['accuracy']:.3f}"
        if "sampled_accuracy" in before and "sampled_accuracy" in after:
            eval_text += f", sampled {before['sampled_accuracy']:.3f} -> {after['sampled_accuracy']:.3f}"
        logged = ", ".join(f"{k}={v:.4g}" for k, v in summary.get("last_logged", {}).items())
        lines.append(f"{name:<12} {summary.get('trainer', ''):<12} steps={summary.get('global_step')} "
                     f"{logged}{eval_text} ({summary.get('seconds')} s)")
        if summary.get("model"):
            lines.append(f"{'':<12} model: {summary['model']}")
    if "plot" in run_info:
        lines.append(f"curves: {run_info['plot']}")
    return "\n".join(lines)
