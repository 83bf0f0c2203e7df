"""Trainer callbacks the runner attaches to every stage."""

from __future__ import annotations

import json
from pathlib import Path

from transformers import TrainerCallback


class MetricsJsonlCallback(TrainerCallback):
    """Append one JSON object per logged step (TRL's log keys plus ``step``) to ``metrics.jsonl``, main process only.

    On resume, rows logged after the checkpoint's step are dropped first, so a resumed run's file reads like an
    uninterrupted one.
    """

    def __init__(self, path: Path, resume_step: int | None = None):
        self.path = Path(path)
        self.resume_step = resume_step

    def on_train_begin(self, args, state, control, **kwargs):
        if not state.is_world_process_zero:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.resume_step is None:
            self.path.write_text("")
        elif self.path.exists():
            kept = [line for line in self.path.read_text().splitlines()
                    if line and json.loads(line).get("step", 0) <= self.resume_step]
            self.path.write_text("".join(line + "\n" for line in kept))

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs:
            return
        row = {"step": state.global_step, **{k: v for k, v in logs.items() if isinstance(v, (int, float, str))}}
        with self.path.open("a") as handle:
            handle.write(json.dumps(row) + "\n")
