"""Trainer callbacks the runner attaches to every stage: metrics rows, and checkpoints that are safe to resume from."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from transformers import TrainerCallback

from trl_ext.faults import crash_point
from trl_ext.files import read_jsonl  # noqa: F401 - re-exported: the runner and tests read metrics with it

CHECKPOINT_COMPLETE = "trl_ext_complete.json"
# Keys of the end-of-training row Trainer.train logs; a resumed run logs its own, so an interrupted run's is dropped.
_SUMMARY_KEYS = ("train_runtime", "train_samples_per_second")


def rewrite_jsonl(path: Path, rows: list[dict]) -> None:
    """Replace a JSON-lines file atomically (temp file + fsync + rename)."""
    from trl_ext.files import write_text_atomic

    write_text_atomic(path, "".join(json.dumps(row) + "\n" for row in rows))


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

    # Off for a plugin whose ``train`` runs several trainings to ``max_steps`` (iterative_dpo's rounds): there the
    # first round's last step is not the stage's, and resuming from it would finish the stage after one round.
    save_last_step = True

    def on_step_end(self, args, state, control, **kwargs):
        if self.save_last_step and state.max_steps > 0 and state.global_step >= state.max_steps:
            control.should_save = True
        return control

    def on_save(self, args, state, control, **kwargs):
        from accelerate import PartialState

        folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        PartialState().wait_for_everyone()
        if state.is_world_process_zero and folder.is_dir():
            from trl_ext.files import fsync_folder, write_text_atomic

            # Trainer does not fsync what it wrote: flushed here, so after a power loss a checkpoint marked complete
            # holds whole files and not only their names.
            for item in sorted(p for p in folder.rglob("*") if p.is_file()):
                with open(item, "rb") as handle:
                    os.fsync(handle.fileno())
            for sub in sorted(p for p in folder.rglob("*") if p.is_dir()):
                fsync_folder(sub)
            fsync_folder(folder)
            crash_point("checkpoint")
            write_text_atomic(folder / CHECKPOINT_COMPLETE, json.dumps({"global_step": state.global_step}))
        PartialState().wait_for_everyone()


LOSS_ACCOUNTING_DIR = "trl_ext_loss_accounting"


class LossAccountingCheckpoint(TrainerCallback):
    """Checkpoints Trainer's running-loss accounting, so a resumed stage reports what the uninterrupted one does.

    Trainer keeps the loss of the steps since the last log on each rank (``_tr_loss``), the logged losses summed
    (``_total_loss_scalar``) and the last logged step, and starts them afresh in every ``train`` call: a resumed
    session's first logged ``loss`` then averaged only its own steps since the checkpoint, and its ``train_loss``
    (end-of-training row, stage summary) only the resumed session's steps (4.3248 against 4.3401 uninterrupted). Each
    rank writes its figures with every checkpoint (before the completion marker) and reads them back at
    ``on_train_begin``, where Trainer has just reset them; the run's first step then counts from 0 again. A checkpoint
    without the file (written by an older version) resumes as before.
    """

    def __init__(self, trainer):
        self.trainer = trainer

    @staticmethod
    def path(output_dir, step: int, rank: int) -> Path:
        return Path(output_dir) / f"checkpoint-{step}" / LOSS_ACCOUNTING_DIR / f"rank{rank}.json"

    def on_save(self, args, state, control, **kwargs):
        from trl_ext.files import write_json_atomic

        trainer = self.trainer
        pending = getattr(trainer, "_tr_loss", None)
        write_json_atomic(self.path(args.output_dir, state.global_step, trainer.accelerator.process_index), {
            "total_loss_scalar": float(getattr(trainer, "_total_loss_scalar", 0.0)),
            "tr_loss": float(pending.item()) if pending is not None else 0.0,
            "globalstep_last_logged": int(getattr(trainer, "_globalstep_last_logged", state.global_step))})

    def on_train_begin(self, args, state, control, **kwargs):
        import torch

        trainer = self.trainer
        saved = read_loss_accounting(args.output_dir, state.global_step, trainer.accelerator.process_index)
        if saved is None:
            return
        trainer._total_loss_scalar = saved["total_loss_scalar"]
        trainer._tr_loss = torch.tensor(saved["tr_loss"], dtype=trainer._tr_loss.dtype, device=trainer._tr_loss.device)
        trainer._globalstep_last_logged = saved["globalstep_last_logged"]
        trainer._initial_global_step = 0  # train_loss divides by the steps since this: the whole run's


def read_loss_accounting(output_dir, step: int, rank: int = 0) -> dict | None:
    """The loss accounting :class:`LossAccountingCheckpoint` saved with ``checkpoint-<step>`` (None: none saved)."""
    if step == 0:
        return None
    path = LossAccountingCheckpoint.path(output_dir, step, rank)
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None


def restore_plugin_checkpoint_state(trainer) -> None:
    """Bring plugin state back from the checkpoint the trainer was loaded from, without training.

    Callbacks that keep plugin state in checkpoints restore it at ``on_train_begin``; a stage killed after its last
    step is finished from that step's checkpoint without ``trainer.train`` (see ``trl_ext.runner``), so that event
    never comes and a plugin writing its state after the stage (``ppo``'s ``critic.pt``) would write the state it was
    built with. Every callback with a ``restore_from_checkpoint(args, state)`` method is asked here instead.
    """
    handler = getattr(trainer, "callback_handler", None)
    for callback in handler.callbacks if handler is not None else []:
        restore = getattr(callback, "restore_from_checkpoint", None)
        if callable(restore):
            restore(trainer.args, trainer.state)


@contextmanager
def plugin_checkpoints_before_completion(trainer) -> Iterator[None]:
    """Callbacks added inside the block (plugins' ``trl_ext_trainer_created``) run before
    :class:`CheckpointCompletionCallback`.

    Plugins add their own checkpoint callbacks (``partial_rollout``'s buffer, ``ppo``'s critic,
    :class:`ReferenceModelCheckpoint`, :class:`PluginStateCheckpoint`) after the trainer was built with the completion
    callback; Trainer runs ``on_save`` in list order, so without this a kill between the marker and a plugin's file
    left a checkpoint marked complete that lacks the file. Only callbacks added after the completion callback move;
    one a plugin placed earlier on purpose (``iterative_dpo`` inserts its row tag first, ahead of the metrics file's
    writer) keeps its place, as do the other callbacks.
    """
    handler = getattr(trainer, "callback_handler", None)  # trainers that train nothing (merge stages) have none
    before = list(handler.callbacks) if handler is not None else []
    yield
    if handler is None:
        return
    at = next((i for i, c in enumerate(handler.callbacks) if isinstance(c, CheckpointCompletionCallback)), None)
    if at is None:
        return
    late = [c for c in handler.callbacks[at + 1:] if not any(c is b for b in before)]
    rest = [c for c in handler.callbacks if not any(c is a for a in late)]
    at = next(i for i, c in enumerate(rest) if isinstance(c, CheckpointCompletionCallback))
    handler.callbacks[:] = rest[:at] + late + rest[at:]


PLUGIN_STATE_DIR = "trl_ext_plugin_state"


class PluginStateCheckpoint(TrainerCallback):
    """Saves one plugin's JSON state with every checkpoint and restores it on every rank when training resumes.

    For state that every rank holds identically (computed from gathered values, e.g. a moving-average baseline): the
    main process writes ``checkpoint-N/trl_ext_plugin_state/<name>.json`` atomically (before the checkpoint is marked
    complete, see :func:`plugin_checkpoints_before_completion`); on a resumed run every rank reads it back at
    ``on_train_begin`` (Trainer has loaded the checkpoint's ``global_step`` by then). A plugin adds it in
    ``trl_ext_trainer_created``.
    """

    def __init__(self, name: str, get_state, set_state):
        self.name, self.get_state, self.set_state = name, get_state, set_state

    def _path(self, args, step: int) -> Path:
        return Path(args.output_dir) / f"checkpoint-{step}" / PLUGIN_STATE_DIR / f"{self.name}.json"

    def on_save(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            from trl_ext.files import write_json_atomic

            write_json_atomic(self._path(args, state.global_step), self.get_state())

    def on_train_begin(self, args, state, control, **kwargs):
        self.restore_from_checkpoint(args, state)

    def restore_from_checkpoint(self, args, state) -> None:
        if state.global_step == 0:
            return
        path = self._path(args, state.global_step)
        if not path.is_file():
            raise FileNotFoundError(f"plugin {self.name!r}: resuming at step {state.global_step} but {path} is "
                                    "missing; its state cannot be restored")
        self.set_state(json.loads(path.read_text(encoding="utf-8")))


REFERENCE_FILE = "ema_anchor.safetensors"


def zero3_gathered(accelerator, parameters, modifier_rank: int | None = None):
    """Under DeepSpeed ZeRO-3, a context in which ``parameters`` hold their full values on every rank (entered by every
    rank: gathering is a collective; with ``modifier_rank`` that rank's changes are kept and re-partitioned on exit);
    otherwise a no-op. ZeRO-3 keeps only this rank's partition of each parameter, and ``.data`` is empty."""
    import contextlib

    plugin = accelerator.state.deepspeed_plugin
    if plugin is None or plugin.zero_stage != 3:
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(list(parameters), modifier_rank=modifier_rank)


class ReferenceModelCheckpoint(TrainerCallback):
    """Saves TRL's reference model with every checkpoint and restores it on resume, for plugins that move it during
    training (``warp``'s and ``bond``'s EMA anchor).

    TRL checkpoints hold the policy and optimizer, not the reference model; without this a stage resumed after a crash
    would restart its anchor from the initial model instead of the EMA it had reached. A plugin adds it in
    ``trl_ext_trainer_created``, so it writes before the checkpoint is marked complete. Under DeepSpeed ZeRO-3 every
    rank gathers the reference's partitions for the save (rank 0 writes) and the restore (else size-0 tensors).
    """

    def __init__(self, trainer):
        self.trainer, self._checked = trainer, False

    def _reference(self):
        return self.trainer.accelerator.unwrap_model(self.trainer.ref_model)

    def on_save(self, args, state, control, **kwargs):
        from safetensors.torch import save_model

        reference = self._reference()
        with zero3_gathered(self.trainer.accelerator, reference.parameters()):  # every rank: a collective
            if state.is_world_process_zero:
                folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"
                save_model(reference, str(folder / REFERENCE_FILE))

    def on_step_begin(self, args, state, control, **kwargs):
        if self._checked:
            return
        self._checked = True
        if state.global_step == 0:  # a fresh start: the reference is the stage's initial model, as TRL built it
            return
        import warnings

        from safetensors.torch import load_model

        path = Path(args.output_dir) / f"checkpoint-{state.global_step}" / REFERENCE_FILE
        if path.is_file():
            reference = self._reference()
            with zero3_gathered(self.trainer.accelerator, reference.parameters(), modifier_rank=0):
                load_model(reference, str(path))
        else:
            warnings.warn(f"resuming at step {state.global_step} without {path}; the moving reference model restarts "
                          f"from the stage's initial model", stacklevel=1)
