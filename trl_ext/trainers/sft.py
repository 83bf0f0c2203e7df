"""SFT trainer: TRL's ``SFTTrainer`` with the loss-aggregation seam.

When a plugin implements ``trl_ext_aggregate_loss`` (for example ``sft`` with ``normalization: sequence``) the
per-token NLL is computed from the logits and reduced by the plugin; a plugin returning ``None`` (``sft`` with the
default token normalisation) leaves TRL's fused-head path untouched.

TRL 1.16 internals relied on: ``SFTTrainer.compute_loss(model, inputs, return_outputs, num_items_in_batch)`` and the
collator's ``labels`` (-100 on positions that do not count).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from trl import SFTTrainer

from trl_ext.batches import AggregationContext
from trl_ext.trainers.base import HostMixin


def shifted_token_nll(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token NLL of next-token prediction and its mask, both (B, T-1); ignored labels (-100) get 0 loss."""
    logits, labels = logits[:, :-1].float(), labels[:, 1:]
    mask = labels != -100
    nll = F.cross_entropy(logits.transpose(1, 2), labels.masked_fill(~mask, 0), reduction="none")
    return nll * mask, mask.to(nll.dtype)


class ExtSFTTrainer(HostMixin, SFTTrainer):
    def __init__(self, *args, plugin_host, **kwargs):
        self._init_host(plugin_host)
        super().__init__(*args, **kwargs)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if return_outputs or not self.plugin_host.implements("trl_ext_aggregate_loss"):
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        model_inputs = {k: v for k, v in inputs.items() if k != "labels"}
        model_inputs["use_cache"] = False
        per_token_nll, mask = shifted_token_nll(model(**model_inputs).logits, inputs["labels"])
        training = self.model.training
        ctx = AggregationContext(
            num_items_in_batch=num_items_in_batch if num_items_in_batch is not None else mask.sum(),
            grad_accum_steps=self.current_gradient_accumulation_steps if training else 1,
            steps_per_generation=1,
            num_processes=self.accelerator.num_processes,
            training=training,
            loss_type=self.args.loss_type,
            max_completion_length=None,
        )
        loss = self.plugin_host.hook.trl_ext_aggregate_loss(per_token_loss=per_token_nll, mask=mask, inputs=ctx)
        # The hook contract says the plugin's loss is already scaled for gradient accumulation; tell HF's
        # training_step (read right after this returns) so it does not divide again. TRL's path keeps HF's own rule.
        self.loss_is_scaled_for_ga = None if loss is None else True
        if loss is None:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        return loss
