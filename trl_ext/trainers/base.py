"""What every trl-ext trainer subclass shares: the plugin host, plugin-metric logging and resuming weights."""

from __future__ import annotations

import json
import os

from trl_ext.host import PluginHost
from trl_ext.metrics import reduce_figures


def saved_weight_names(folder: str | os.PathLike) -> set[str] | None:
    """The tensor names of a checkpoint's ``model.safetensors`` (or its sharded index); None when it has neither."""
    from safetensors import safe_open

    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as handle:
            return set(json.load(handle)["weight_map"])
    single = os.path.join(folder, "model.safetensors")
    if os.path.isfile(single):
        with safe_open(single, framework="pt") as handle:
            return set(handle.keys())
    return None


def load_converted_weights(model, folder: str | os.PathLike) -> bool:
    """Load a checkpoint's weights into ``model`` through transformers' own loading when their names differ from the
    model's parameters; False (nothing done) when they match.

    transformers converts some weights between memory and disk: an MoE layer's experts (Qwen3-MoE, GLM-4-MoE, ...)
    are fused in memory (``mlp.experts.gate_up_proj``) and saved one expert at a time (``mlp.experts.0.gate_proj.
    weight``). ``save_pretrained`` converts on the way out; Trainer's resume loads the file with ``load_state_dict(...,
    strict=False)``, which matches no expert name, only warns, and trains on from the *initial* experts (a resumed
    GRPO run on tiny-qwen3-moe ended 0.0026 away from the uninterrupted one). ``from_pretrained`` applies the
    conversion, so the checkpoint is loaded by it and copied in; every parameter but tied ones must be found.
    """
    from transformers import PreTrainedModel

    names = saved_weight_names(folder)
    if names is None or not isinstance(model, PreTrainedModel):
        return False
    tied = set(getattr(model, "all_tied_weights_keys", None) or {})
    wanted = {name for name in model.state_dict() if name not in tied}
    if wanted <= names:
        return False
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), None)
    loaded = type(model).from_pretrained(folder, dtype=dtype)
    result = model.load_state_dict(loaded.state_dict(), strict=False)
    del loaded
    missing = [name for name in result.missing_keys if name not in tied]
    if missing or result.unexpected_keys:
        raise RuntimeError(f"resuming from {folder}: the checkpoint's weights do not fit the model (missing "
                           f"{missing[:5]}, unexpected {result.unexpected_keys[:5]})")
    return True


class HostMixin:
    """Mixed in front of a TRL trainer class; holds the stage's :class:`PluginHost`."""

    plugin_host: PluginHost

    def _init_host(self, plugin_host: PluginHost | None) -> None:
        # Set before TRL's __init__ runs: TRL may call overridden methods (e.g. dataset preparation) from it.
        self.plugin_host = plugin_host if plugin_host is not None else PluginHost()

    def _plugin_train_sampler(self, dataset, default):
        """``trl_ext_train_sampler``'s sampler for ``dataset`` (the train dataset when ``None``), else ``default()``
        (TRL's own). Used by the RL trainers' ``_get_train_sampler``."""
        dataset = self.train_dataset if dataset is None else dataset
        sampler = None
        if self.plugin_host.implements("trl_ext_train_sampler"):
            sampler = self.plugin_host.hook.trl_ext_train_sampler(trainer=self, dataset=dataset)
        return default() if sampler is None else sampler

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None) -> None:
        """Trainer's resume, except for weights transformers converts on loading (see :func:`load_converted_weights`);
        adapters (PEFT) and sharded engines keep Trainer's own paths."""
        from transformers.trainer_utils import _is_peft_model

        target = self.model if model is None else model
        sharded = getattr(self, "is_fsdp_enabled", False) or getattr(self, "is_deepspeed_enabled", False)
        if sharded or _is_peft_model(target) or not load_converted_weights(target, resume_from_checkpoint):
            super()._load_from_checkpoint(resume_from_checkpoint, model)

    def _log_plugin_metrics(self, metrics: dict) -> None:
        """Append plugin figures to TRL's metric buffers; TRL averages them into each logged step. TRL logs rank 0's
        buffers, so figures handed as parts (:mod:`trl_ext.metrics`) are reduced over every rank first: called on
        every rank, with the same keys."""
        if not metrics:
            return
        mode = "train" if self.model.training else "eval"
        for key, value in reduce_figures(metrics, self.accelerator).items():
            self._metrics[mode][key].append(value)
