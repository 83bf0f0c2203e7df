"""Model references in merge plugin parameters and the main-process-writes / all-wait pattern of after-stage merges."""

from __future__ import annotations

from pathlib import Path

STAGE_PREFIX = "stage:"


def resolve_source(ref: str, stage_dir: Path, who: str) -> Path:
    """``stage:<name>`` -> that stage's folder in this run; ``embedded:<name>`` -> the run's materialized copy;
    anything else a local folder. The folder must hold a finished model (``config.json``)."""
    from trl_ext.runner import current_run, resolve_model_ref

    ctx = current_run()
    if ref.startswith(STAGE_PREFIX):
        run_dir = ctx.output_dir if ctx is not None else stage_dir.parent  # the runner writes DIR/<stage>
        folder = Path(run_dir) / ref[len(STAGE_PREFIX):]
    elif ctx is not None:
        folder = Path(resolve_model_ref(ref, ctx))
    else:
        folder = Path(ref)
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"{who}: {ref!r}: no finished model in {folder} (is it an earlier stage of the recipe?)")
    return folder


def on_main_then_wait(fn):
    """Run ``fn()`` on the main process only, then synchronise every process; returns ``fn``'s result (None elsewhere)."""
    from accelerate import PartialState

    state = PartialState()
    result = fn() if state.is_main_process else None
    state.wait_for_everyone()
    return result
