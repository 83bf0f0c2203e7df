"""Run a validated recipe: stages in order, each an ordinary TRL training run into its own folder.

Output directory layout::

    DIR/run.json                 resolved recipe, active plugins with versions, status, per-stage summary
    DIR/<stage>/                 the stage's final model (an ordinary Hugging Face model folder)
    DIR/<stage>/metrics.jsonl    one JSON object per logged step (TRL's log keys plus "step")
    DIR/<stage>/eval.json        held-out evaluation before and after the stage (when the stage has `evaluation`)
    DIR/<stage>/stage.json       written last: marks the stage complete, with the fingerprint it was run with
    DIR/<stage>/checkpoints/     TRL/HF checkpoints; an interrupted stage resumes from the newest one
    DIR/_embedded/<name>/        embedded models materialized for this run
    DIR/curves.png               loss and reward curves of all stages

Every JSON file is written atomically (temp file + rename), so an interrupted run never leaves a half-written file.
"""

from __future__ import annotations

import gc
import hashlib
import json
import os
import time
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from trl_ext.errors import OutputDirError, RecipeError
from trl_ext.recipe import EMBEDDED_PREFIX, STAGE_PREFIX, Recipe, StageSpec
from trl_ext.stage import ResolvedStage, resolve_stage

COMPLETE_MARKER = "stage.json"


def write_json_atomic(path: Path, payload: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(payload, indent=2, sort_keys=True, default=str))
    os.replace(tmp, path)


def resolve_recipe(recipe: Recipe, catalog, max_steps: int | None = None) -> list[ResolvedStage]:
    """Resolve every stage (all errors of all stages reported together). Loads no model."""
    backend_errors = check_distributed(recipe)
    if backend_errors:  # the stages' configs cannot even be built without the backend
        raise RecipeError(backend_errors)
    resolved, errors = [], []
    recipe = with_backend_args(recipe)
    for index, stage in enumerate(recipe.stages):
        try:
            resolved.append(resolve_stage(stage, index, catalog, seed=recipe.seed, extra_args=_cap(stage, max_steps)))
        except RecipeError as exc:
            errors.extend(exc.messages)
    from trl_ext.recipe import validate_recipe

    errors.extend(m for m in validate_recipe(recipe, catalog) if m not in errors)
    if errors:
        raise RecipeError(errors)
    return resolved


def check_distributed(recipe: Recipe) -> list[str]:
    """The ``distributed`` section's needs that the schema cannot see (installed backends)."""
    import importlib.util

    spec = recipe.distributed
    if spec is not None and spec.backend in ("zero2", "zero3") and importlib.util.find_spec("deepspeed") is None:
        return [f"distributed.backend: {spec.backend!r} needs DeepSpeed: pip install 'trl-ext[deepspeed]'"]
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
        blob = json.dumps([rs.spec.model_dump(mode="json"), rs.args], sort_keys=True, default=str)
        chain = hashlib.sha256((chain + blob).encode()).hexdigest()[:16]
        out[rs.spec.name] = chain
    return out


def check_output_dir(output_dir: Path, fingerprints: dict[str, str]) -> None:
    """Refuse a directory holding finished stages of a different recipe (before any model loads)."""
    if not output_dir.exists():
        return
    for marker in sorted(output_dir.glob(f"*/{COMPLETE_MARKER}")):
        try:
            finished = json.loads(marker.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        name = marker.parent.name
        if fingerprints.get(name) != finished.get("fingerprint"):
            raise OutputDirError(
                f"{output_dir}: holds a finished stage {name!r} of a different recipe (or different settings); "
                f"use another --output-dir or remove {marker.parent}"
            )


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
               extra_callbacks: list | None = None, echo: Callable[[str], None] = print) -> dict[str, Any]:
    """Validate, then run every stage not already complete. Returns the run summary (also in run.json)."""
    output_dir = Path(output_dir)
    resolved = resolve_recipe(recipe, catalog, max_steps=max_steps)
    fingerprints = stage_fingerprints(resolved)
    check_output_dir(output_dir, fingerprints)

    from accelerate import PartialState

    state = PartialState()
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
            marker = output_dir / rs.spec.name / COMPLETE_MARKER
            if marker.exists():
                done = json.loads(marker.read_text())
                ctx.echo(f"[trl-ext] stage {rs.spec.name!r}: already complete, skipping")
                run_info["stages"][rs.spec.name] = done.get("summary", {})
                continue
            summary = run_stage(rs, ctx, fingerprints[rs.spec.name])
            run_info["stages"][rs.spec.name] = summary
            if state.is_main_process:
                write_json_atomic(output_dir / "run.json", run_info)
    finally:
        _CURRENT_RUN.reset(token)

    if state.is_main_process:
        from trl_ext.plotting import plot_curves

        metrics = {rs.spec.name: output_dir / rs.spec.name / "metrics.jsonl" for rs in resolved}
        run_info["plot"] = str(plot_curves({k: v for k, v in metrics.items() if v.exists()}, output_dir / "curves.png"))
        run_info["status"] = "complete"
        write_json_atomic(output_dir / "run.json", run_info)
        ctx.echo(format_summary(run_info))
    return run_info


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
    if source.startswith(EMBEDDED_PREFIX):
        build, _ = catalog.datasets[source[len(EMBEDDED_PREFIX):]]
        dataset = build(split=spec.split, **spec.params)
    elif Path(source).is_dir() and (Path(source) / "dataset_info.json").exists():
        dataset = datasets.load_from_disk(source)
    elif Path(source).is_file():
        suffix = Path(source).suffix.lstrip(".")
        builder = {"jsonl": "json", "json": "json", "csv": "csv", "parquet": "parquet"}.get(suffix)
        if builder is None:
            raise RecipeError(f"dataset {source!r}: unsupported file type .{suffix} (use json, jsonl, csv or parquet)")
        dataset = datasets.load_dataset(builder, data_files=source, split="train")
    else:
        dataset = datasets.load_dataset(source, split=spec.split, **spec.params)
    if spec.limit is not None:
        dataset = dataset.select(range(min(spec.limit, len(dataset))))
    if host is not None:
        dataset = host.call_pipeline("trl_ext_prepare_dataset", dataset, split=split_role, stage=stage)
    return dataset


def build_peft_config(spec):
    if spec is None:
        return None
    from peft.mapping import PEFT_TYPE_TO_CONFIG_MAPPING

    fields = spec.model_dump(exclude={"type"})
    config_cls = PEFT_TYPE_TO_CONFIG_MAPPING.get(spec.type.upper())
    if config_cls is None:
        raise RecipeError(f"peft.type: unknown PEFT method {spec.type!r}; known: {sorted(PEFT_TYPE_TO_CONFIG_MAPPING)}")
    fields.setdefault("task_type", "CAUSAL_LM")
    return config_cls(**fields)


def latest_checkpoint(checkpoint_dir: Path) -> str | None:
    candidates = [p for p in checkpoint_dir.glob("checkpoint-*") if p.name.split("-")[-1].isdigit()]
    if not candidates:
        return None
    return str(max(candidates, key=lambda p: int(p.name.split("-")[-1])))


def run_stage(rs: ResolvedStage, ctx: RunContext, fingerprint: str) -> dict[str, Any]:
    from accelerate import PartialState
    from transformers import AutoTokenizer

    from trl_ext.callbacks import MetricsJsonlCallback
    from trl_ext.rewards import collect_reward_functions
    from trl_ext.trainers import BuildContext

    state = PartialState()
    spec = rs.spec
    stage_dir = ctx.output_dir / spec.name
    checkpoint_dir = stage_dir / "checkpoints"
    started = time.time()
    ctx.echo(f"[trl-ext] stage {spec.name!r} ({spec.trainer}) plugins: {rs.host.names() or 'none'}")

    model_path = resolve_model_ref(spec.model, ctx)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    train_dataset = load_split(spec.dataset, ctx.catalog, spec, "train", rs.host)
    eval_dataset = load_split(spec.eval_dataset, ctx.catalog, spec, "eval", rs.host) if spec.eval_dataset else None

    args = dict(rs.args)
    rewards = collect_reward_functions(rs.host, spec) if rs.kind.uses_rewards else []
    if rewards and "reward_weights" not in args:
        args["reward_weights"] = [r.weight for r in rewards]
    config = rs.kind.config_cls(output_dir=str(checkpoint_dir), **args)
    resume_from = latest_checkpoint(checkpoint_dir)

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
        callbacks=[MetricsJsonlCallback(metrics_path, resume_step=_step_of(resume_from)), *ctx.extra_callbacks],
        host=rs.host,
        reward_funcs=[r.as_trl_callable() for r in rewards],
        reward_weights=[r.weight for r in rewards],
    )
    trainer = rs.kind.build(build)
    rs.host.hook.trl_ext_trainer_created(trainer=trainer)

    evaluation = _load_eval(stage_dir)
    if spec.evaluation is not None and "before" not in evaluation:
        evaluation["before"] = evaluate_stage(trainer, tokenizer, spec, ctx, rs)
        if state.is_main_process:
            write_json_atomic(stage_dir / "eval.json", evaluation)
    if resume_from:
        ctx.echo(f"[trl-ext] stage {spec.name!r}: resuming from {resume_from}")
    result = trainer.train(resume_from_checkpoint=resume_from)
    save_stage_model(trainer, tokenizer, stage_dir, is_main=state.is_main_process)
    state.wait_for_everyone()

    summary: dict[str, Any] = {"trainer": spec.trainer, "plugins": rs.host.names(),
                               "global_step": trainer.state.global_step,
                               "train_loss": getattr(result, "training_loss", None)}
    for extra in reversed(rs.host.pm.hook.trl_ext_after_stage.get_hookimpls()):
        summary.update(extra.function(stage=spec, output_dir=str(stage_dir), trainer=trainer) or {})
    if spec.evaluation is not None:
        evaluation["after"] = evaluate_stage(trainer, tokenizer, spec, ctx, rs)
        summary["eval"] = evaluation
    summary["last_logged"] = _last_logged(metrics_path)
    summary["seconds"] = round(time.time() - started, 1)
    if state.is_main_process:
        write_json_atomic(stage_dir / "eval.json", evaluation) if spec.evaluation is not None else None
        write_json_atomic(stage_dir / COMPLETE_MARKER, {"fingerprint": fingerprint, "summary": summary})
    state.wait_for_everyone()
    del trainer
    gc.collect()
    return summary


def save_stage_model(trainer, tokenizer, stage_dir: Path, is_main: bool) -> None:
    """Save the stage's model as an ordinary Hugging Face folder that later stages can load by path.

    A PEFT-trained model is saved twice: the adapter alone under ``adapter/`` (what TRL would save) and the adapter
    merged into the base weights at the top, so ``stage:<name>`` is a plain model for the next stage.
    """
    from peft import PeftModel

    model = trainer.accelerator.unwrap_model(trainer.model)
    if not isinstance(model, PeftModel):
        trainer.save_model(str(stage_dir))
    elif is_main:
        model.save_pretrained(str(stage_dir / "adapter"))
        import copy

        copy.deepcopy(model).merge_and_unload().save_pretrained(str(stage_dir))
    if is_main:
        tokenizer.save_pretrained(str(stage_dir))


def _step_of(checkpoint: str | None) -> int | None:
    return int(checkpoint.rsplit("-", 1)[-1]) if checkpoint else None


def _load_eval(stage_dir: Path) -> dict[str, Any]:
    path = stage_dir / "eval.json"
    return json.loads(path.read_text()) if path.exists() else {}


def _last_logged(metrics_path: Path) -> dict[str, Any]:
    if not metrics_path.exists():
        return {}
    last: dict[str, Any] = {}
    for line in metrics_path.read_text().splitlines():
        row = json.loads(line)
        last.update({k: v for k, v in row.items() if isinstance(v, (int, float))})
    return {k: last[k] for k in ("loss", "reward", "train_loss") if k in last}


def evaluate_stage(trainer, tokenizer, spec: StageSpec, ctx: RunContext, rs: ResolvedStage) -> dict[str, Any]:
    """Greedy held-out evaluation scored by the evaluation's reward plugin (main process; others wait)."""
    from accelerate import PartialState

    from trl_ext.evaluation import evaluate_generation
    from trl_ext.host import PluginHost
    from trl_ext.recipe import PluginSelection, instantiate_plugins
    from trl_ext.rewards import collect_reward_functions, weighted_reward

    state = PartialState()
    result: dict[str, Any] = {}
    if state.is_main_process:
        ev = spec.evaluation
        selection = ev.reward if isinstance(ev.reward, PluginSelection) else PluginSelection(name=ev.reward)
        probe = StageSpec(name=spec.name, trainer="grpo", model=spec.model, dataset=ev.dataset, plugins=[selection])
        plugins, errors = instantiate_plugins(probe, rs.index, ctx.catalog)
        if errors:
            raise RecipeError([e.replace(".plugins[0]", ".evaluation.reward") for e in errors])
        reward_fn = weighted_reward(collect_reward_functions(PluginHost(plugins), spec))
        dataset = load_split(ev.dataset, ctx.catalog, spec, "evaluation", None)
        if ev.limit is not None:
            dataset = dataset.select(range(min(ev.limit, len(dataset))))
        model = trainer.accelerator.unwrap_model(trainer.model)
        result = evaluate_generation(model, tokenizer, dataset, reward_fn, max_new_tokens=ev.max_new_tokens,
                                     batch_size=ev.batch_size)
        ctx.echo(f"[trl-ext] stage {spec.name!r} held-out: " + ", ".join(f"{k}={v:.4g}" for k, v in result.items()
                                                                           if isinstance(v, (int, float))))
    state.wait_for_everyone()
    return result


def format_summary(run_info: dict[str, Any]) -> str:
    lines = ["", "trl-ext run summary", "-" * 72]
    for name, summary in run_info["stages"].items():
        ev = summary.get("eval", {})
        before, after = ev.get("before", {}), ev.get("after", {})
        eval_text = ""
        if "accuracy" in before and "accuracy" in after:
            eval_text = f" held-out accuracy {before['accuracy']:.3f} -> {after['accuracy']:.3f}"
        logged = ", ".join(f"{k}={v:.4g}" for k, v in summary.get("last_logged", {}).items())
        lines.append(f"{name:<12} {summary.get('trainer', ''):<12} steps={summary.get('global_step')} "
                     f"{logged}{eval_text} ({summary.get('seconds')} s)")
    if "plot" in run_info:
        lines.append(f"curves: {run_info['plot']}")
    return "\n".join(lines)
