"""Experiment tracking across stages: one tracker run per stage, named ``<run>/<stage>``.

Each stage is its own TRL training run with its own step counter, so each gets its own tracker run (W&B, MLflow,
Trackio, ... name it by TRL's ``run_name``; TensorBoard by its log folder) rather than one run whose step counter
restarts at every stage. The stage's held-out evaluation (``eval.json``) is also sent to every ``report_to`` backend, at
the stage's last step, before the backend closes its run.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

TENSORBOARD_ENV = "TENSORBOARD_LOGGING_DIR"  # where transformers' TensorBoardCallback writes (read when it is built)
TENSORBOARD_SUBDIR = "tensorboard"


def stage_run_name(output_dir: Path, stage: str) -> str:
    """``<run>/<stage>``, the run being the output directory's name (``runs/quickstart`` -> ``quickstart/sft``)."""
    return f"{Path(output_dir).resolve().name}/{stage}"


def tensorboard_dir(output_dir: Path, stage: str) -> Path:
    """``<output_dir>/<stage>/tensorboard``; with ``TENSORBOARD_LOGGING_DIR`` set, ``$TENSORBOARD_LOGGING_DIR/<run>/
    <stage>`` instead, so one TensorBoard pointed at that folder lists every run's stages by name."""
    root = os.environ.get(TENSORBOARD_ENV)
    if root:
        return Path(root).expanduser() / stage_run_name(output_dir, stage)
    return Path(output_dir) / stage / TENSORBOARD_SUBDIR


@contextmanager
def tensorboard_logging_dir(path: Path) -> Iterator[None]:
    """Point the TensorBoard callbacks built inside the block at ``path`` (transformers 5 has no ``logging_dir``
    argument; its callback reads ``TENSORBOARD_LOGGING_DIR`` when the trainer builds it). The variable is restored on
    exit, so the next stage gets its own folder."""
    previous = os.environ.get(TENSORBOARD_ENV)
    os.environ[TENSORBOARD_ENV] = str(path)
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(TENSORBOARD_ENV, None)
        else:
            os.environ[TENSORBOARD_ENV] = previous


def heldout_logs(evaluation: dict[str, Any]) -> dict[str, float]:
    """The numbers of ``eval.json`` as log keys: ``{"before": {"accuracy": 0.4}}`` -> ``eval_heldout_accuracy_before``.

    The ``eval_`` prefix is transformers' convention for evaluation metrics (its integrations file them under
    ``eval/``, e.g. ``eval/heldout_accuracy_before`` in TensorBoard and W&B)."""
    logs: dict[str, float] = {}
    for when in ("before", "after"):
        for key, value in (evaluation.get(when) or {}).items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                logs[f"eval_heldout_{key}_{when}"] = value
    return logs


def integration_callbacks(trainer) -> list:
    """The trainer's ``report_to`` callbacks (transformers' integrations: TensorBoard, W&B, MLflow, Trackio, ...)."""
    from transformers.integrations.integration_utils import INTEGRATION_TO_CALLBACK

    kinds = tuple(INTEGRATION_TO_CALLBACK.values())
    handler = getattr(trainer, "callback_handler", None)  # trainers that train nothing (merge stages) have none
    return [callback for callback in getattr(handler, "callbacks", []) if isinstance(callback, kinds)]


class StageReporting:
    """Holds the ``report_to`` integrations' end of training until the stage's held-out evaluation is logged.

    At ``on_train_end`` TensorBoard closes its writer and MLflow and Trackio end their run; a metric logged after that
    would open a new, unnamed run. :meth:`hold` defers each integration's ``on_train_end``; :meth:`finish` sends
    ``logs`` to each integration's ``on_log`` at the trainer's current (last) step, then runs the deferred
    ``on_train_end``, and ends a W&B run (its callback leaves the run open, and the next stage's callback would log
    into it instead of starting its own).
    """

    def __init__(self, trainer):
        self.trainer = trainer
        self.callbacks = integration_callbacks(trainer)
        self.held: dict[int, list[tuple[tuple, dict]]] = {}

    def hold(self) -> "StageReporting":
        for callback in self.callbacks:
            calls: list[tuple[tuple, dict]] = []
            self.held[id(callback)] = calls
            callback.on_train_end = _recorder(calls)  # instance attribute: shadows the class's method
        return self

    def finish(self, logs: dict[str, float]) -> None:
        if not self.callbacks:
            return
        from transformers.integrations.integration_utils import INTEGRATION_TO_CALLBACK

        trainer = self.trainer
        args, state, control = trainer.args, trainer.state, trainer.control
        for callback in self.callbacks:
            if logs and state.is_world_process_zero:
                callback.on_log(args, state, control, logs=dict(logs), model=trainer.model)
            calls = self.held.pop(id(callback), [])
            vars(callback).pop("on_train_end", None)  # the class's method again
            # Nothing held: training did not run (a stage finished from its last checkpoint), but on_log may have
            # opened a run, which is ended here all the same.
            for call_args, call_kwargs in calls or [((args, state, control), {"model": trainer.model})]:
                callback.on_train_end(*call_args, **call_kwargs)
            if isinstance(callback, INTEGRATION_TO_CALLBACK["wandb"]) and state.is_world_process_zero:
                wandb = getattr(callback, "_wandb", None)
                if wandb is not None and getattr(wandb, "run", None) is not None:
                    wandb.finish()


def _recorder(calls: list) -> Callable[..., None]:
    def on_train_end(*args, **kwargs):
        calls.append((args, kwargs))

    return on_train_end
