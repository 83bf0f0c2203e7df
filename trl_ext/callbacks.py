"""Trainer callbacks the runner attaches to every stage: metrics rows, and checkpoints that are safe to resume from."""

from __future__ import annotations

import json
import os
from pathlib import Path

from transformers import TrainerCallback

from trl_ext.faults import crash_point

CHECKPOINT_COMPLETE = "trl_ext_complete.json"
# Keys of the end-of-training row Trainer.train logs; a resumed run logs its own, so an interrupted run's is dropped.
_SUMMARY_KEYS = ("train_runtime", "train_samples_per_second")


def read_jsonl(path: Path) -> list[dict]:
    """The rows of a JSON-lines file, skipping a torn (half-written) line such as a killed process leaves."""
    rows = []
    if not path.exists():
        return rows
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows


def rewrite_jsonl(path: Path, rows: list[dict]) -> None:
    """Replace a JSON-lines file atomically (temp file + rename)."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    os.replace(tmp, path)


class MetricsJsonlCallback(TrainerCallback):
    """Append one JSON object per logged step (TRL's log keys plus ``step``) to ``metrics.jsonl``, main process only.

    On resume, the file is repaired first: a torn last line is dropped, and so are rows logged after the checkpoint's
    step and the interrupted session's end-of-training row, so a resumed run's file reads like an uninterrupted one.
    (That end row is Trainer's own: its ``train_loss`` averages the steps of the session that logs it.)
    """

    def __init__(self, path: Path, resume_step: int | None = None):
        self.path = Path(path)
        self.resume_step = resume_step

    def on_train_begin(self, args, state, control, **kwargs):
        if not state.is_world_process_zero:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.resume_step is None:
            rewrite_jsonl(self.path, [])
        else:
            kept = [row for row in read_jsonl(self.path)
                    if row.get("step", 0) <= self.resume_step and not any(k in row for k in _SUMMARY_KEYS)]
            rewrite_jsonl(self.path, kept)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs:
            return
        row = {"step": state.global_step, **{k: v for k, v in logs.items() if isinstance(v, (int, float, str))}}
        line = json.dumps(row) + "\n"
        with self.path.open("a", encoding="utf-8") as handle:
            handle.write(line[: len(line) // 2])
            handle.flush()
            crash_point("metrics")
            handle.write(line[len(line) // 2:])


class CheckpointCompletionCallback(TrainerCallback):
    """Mark each checkpoint complete once every file of it is written, and checkpoint the last step.

    Trainer writes a checkpoint's files one after another into ``checkpoint-N``; a process killed on the way leaves a
    folder that looks like a checkpoint. The runner resumes only from folders holding :data:`CHECKPOINT_COMPLETE`,
    written here after Trainer's save (and, with several processes, after every rank has written its part).

    The last step is always checkpointed (whatever ``save_steps``): a stage killed while saving its final model then
    resumes at its last step and trains nothing again.
    """

    def on_step_end(self, args, state, control, **kwargs):
        if state.max_steps > 0 and state.global_step >= state.max_steps:
            control.should_save = True
        return control

    def on_save(self, args, state, control, **kwargs):
        from accelerate import PartialState

        folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        PartialState().wait_for_everyone()
        if state.is_world_process_zero and folder.is_dir():
            crash_point("checkpoint")
            tmp = folder / f".{CHECKPOINT_COMPLETE}.tmp"
            tmp.write_text(json.dumps({"global_step": state.global_step}))
            os.replace(tmp, folder / CHECKPOINT_COMPLETE)
        PartialState().wait_for_everyone()
