"""The ``merge`` trainer: a stage that trains nothing and whose plugins build its model from other models.

Pipelines end in weight-space merges (checkpoint soups, WARP's SLERP + LITI) of earlier stages. Such a stage is a
recipe stage like any other (its output is ``stage:<name>`` for later stages, it is skipped once complete, and it
resumes by re-running), but it has no optimiser, data loader or checkpoints, so it is not a TRL trainer:

* ``train()`` does nothing (zero steps);
* ``save_model(dir)`` copies the config and weight files of the stage's ``model:`` folder without loading them; the
  stage's merge plugin then overwrites the weights in ``trl_ext_after_stage`` and calls ``use_weights(stage_dir)``;
* ``model`` is a stand-in that loads the model at its first use (the ``model:`` before the merge, the stage folder
  after ``use_weights``), so a stage ``evaluation`` scores the ``model:`` before and the merge after, and a stage
  without evaluation never loads a whole model (the runner's save step only inspects ``trainer.model``; the merge
  itself streams).

A merge stage takes no ``dataset:`` (one is refused at validation). Under several processes only the main process
copies and merges; the others wait for it.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from transformers import TrainerState, TrainingArguments
from transformers.trainer_utils import TrainOutput

from trl_ext.trainers.base import HostMixin


def _model_files(folder: Path) -> list[Path]:
    """The files of a model folder the merge stage copies from its ``model:`` (config and weights; the runner saves
    the tokenizer itself, and an earlier stage's own markers and metrics must not be copied)."""
    def keep(path: Path) -> bool:
        name = path.name
        return name in {"config.json", "generation_config.json"} or (
            name.startswith("model") and name.endswith((".safetensors", ".safetensors.index.json")))

    return [p for p in sorted(folder.iterdir()) if p.is_file() and keep(p)]


class MergeConfig(TrainingArguments):
    """``TrainingArguments`` (so ``seed``, ``report_to`` and the runner's ``--max-steps`` cap parse); none is used."""


class _NoAccelerator:
    """What the runner and plugins read from ``trainer.accelerator`` on a stage that never distributes a model."""

    def __init__(self):
        from accelerate import PartialState

        self.state = PartialState()
        self.device = self.state.device
        self.is_main_process = self.state.is_main_process

    @staticmethod
    def unwrap_model(model):
        return model

    def wait_for_everyone(self):
        self.state.wait_for_everyone()


class _LazyModel:
    """Forwards attribute access and calls to a model loaded at first use (``generate``, ``eval``, ``device`` ...)."""

    def __init__(self, folder: Path, device):
        self._folder, self._device, self._loaded = folder, device, None

    def _get(self):
        if self._loaded is None:
            from transformers import AutoModelForCausalLM

            self._loaded = AutoModelForCausalLM.from_pretrained(self._folder).to(self._device)
        return self._loaded

    def __getattr__(self, name):
        return getattr(self._get(), name)

    def __call__(self, *args, **kwargs):
        return self._get()(*args, **kwargs)


def check_stage(host, stage, args, where: str) -> list[str]:
    """A merge stage without a plugin that writes its weights would silently be a copy of its ``model:``."""
    if host.implements("trl_ext_after_stage"):
        return []
    return [f"{where}.plugins: the merge trainer needs a merge plugin (checkpoint_average or warp); the stage selects "
            f"{host.names() or 'none'}"]


class ExtMergeTrainer(HostMixin):
    def __init__(self, model: str, args: MergeConfig, processing_class=None, *, plugin_host, **_unused):
        self._init_host(plugin_host)
        self.args = args
        self.model_path = Path(model)
        self.state = TrainerState()
        self.accelerator = _NoAccelerator()
        self.model = _LazyModel(self.model_path, self.accelerator.device)

    def train(self, resume_from_checkpoint=None):
        return TrainOutput(global_step=0, training_loss=None, metrics={})

    def save_model(self, output_dir: str) -> None:
        """Copy the ``model:`` folder's config and weights (the merge plugin replaces the weights next)."""
        target = Path(output_dir)
        if self.accelerator.is_main_process:
            target.mkdir(parents=True, exist_ok=True)
            sources = _model_files(self.model_path)
            # A rerun after a kill mid-merge finds the weight files of a half-moved merge here: a shard or an index
            # the model: folder does not have would be read with the copied files and mix two layouts.
            for stale in _model_files(target):
                if stale.name not in {item.name for item in sources}:
                    stale.unlink()
            for item in sources:
                shutil.copyfile(item, target / item.name)
        self.accelerator.wait_for_everyone()

    def use_weights(self, folder: str | Path) -> None:
        """Called by the merge plugin once the merged model is in ``folder``: later uses of ``model`` load it."""
        self.model = _LazyModel(Path(folder), self.accelerator.device)
