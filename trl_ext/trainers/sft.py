"""SFT trainer: TRL's ``SFTTrainer`` with the loss-aggregation seam.

When a plugin implements ``trl_ext_aggregate_loss`` (for example ``sft`` with ``normalization: sequence``) the
per-token NLL comes from TRL's fused LM head (no full logits) and is reduced by the plugin; a plugin returning ``None`` (``sft`` with the
default token normalisation) leaves TRL's fused-head path untouched. Whether a plugin reduces the loss is asked once,
with a one-token probe, so the untouched path runs one forward per micro-batch, not a plugin forward and then TRL's.

TRL 1.16 internals relied on: ``SFTTrainer.compute_loss(model, inputs, return_outputs, num_items_in_batch)``, the
collator's ``labels`` (-100 on positions that do not count) and the fused head ``add_fused_lm_head`` puts on the model
(``model(..., fused_lm_head=True)`` returns ``log_probs`` and ``label_mask`` aligned with the shifted labels).
"""

from __future__ import annotations

import torch
from trl import SFTTrainer

from trl_ext.batches import AggregationContext
from trl_ext.trainers.base import HostMixin


class ExtSFTTrainer(HostMixin, SFTTrainer):
    def train(self, resume_from_checkpoint=None, **kwargs):
        # TRL counts `num_tokens` in the trainer, not in the checkpoint: a resumed run would count from 0 again. The
        # checkpoint's log history holds the count at its last logged step.
        if isinstance(resume_from_checkpoint, str):
            import json
            from pathlib import Path

            history = json.loads((Path(resume_from_checkpoint) / "trainer_state.json").read_text()).get("log_history", [])
            counts = [row["num_tokens"] for row in history if "num_tokens" in row]
            if counts:
                self._total_train_tokens = counts[-1]
        return super().train(resume_from_checkpoint=resume_from_checkpoint, **kwargs)

    def __init__(self, *args, plugin_host, **kwargs):
        self._init_host(plugin_host)
        self._plugin_reduces_loss: bool | None = None  # asked on first use (a plugin's params decide it)
        super().__init__(*args, **kwargs)

    def plugin_reduces_loss(self) -> bool:
        """Whether a selected plugin replaces TRL's token-mean: its ``trl_ext_aggregate_loss`` on a one-token probe is
        not ``None`` (the hook spec asks that ``None`` depend on the plugin's configuration, not the batch). Asked
        once: calling the hook on every micro-batch would need the fused-head forward first, and TRL's own loss then
        runs a second one (measured 1.3-1.5x step time on 2 processes)."""
        if self._plugin_reduces_loss is None:
            self._plugin_reduces_loss = self.plugin_host.implements("trl_ext_aggregate_loss") and (
                self.plugin_host.hook.trl_ext_aggregate_loss(
                    per_token_loss=torch.zeros(1, 1), mask=torch.ones(1, 1),
                    inputs=AggregationContext(num_items_in_batch=torch.tensor(1.0), grad_accum_steps=1,
                                              steps_per_generation=1, num_processes=1, training=True,
                                              loss_type=self.args.loss_type, max_completion_length=None),
                ) is not None)
        return self._plugin_reduces_loss

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if return_outputs or not self.plugin_reduces_loss():
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        # TRL's fused LM head (added to every SFT model): per-token log-probs of the shifted labels, computed in tiles,
        # so neither the (B, T, V) logits nor a float32 copy of them is built. Zero where the label is ignored.
        outputs = model(**{**inputs, "use_cache": False}, fused_lm_head=True)
        per_token_nll, mask = -outputs.log_probs, outputs.label_mask.to(outputs.log_probs.dtype)
        if inputs.get("position_ids") is not None:  # packing / padding-free: a row may hold several examples
            per_token_nll, mask = split_packed_examples(per_token_nll, mask, inputs["position_ids"])
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


def split_packed_examples(per_token: torch.Tensor, mask: torch.Tensor,
                          position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One row per example, so a per-sequence reduction sees examples, not packed rows.

    With ``packing`` (or padding-free batches) TRL puts several examples in one row, each starting at position 0.
    ``per_token``/``mask`` are ``(B, T - 1)``, aligned with ``labels[:, 1:]``, so a column belongs to the example of
    its label token. Returns ``(E, T - 1)`` tensors, example ``e`` keeping its own columns of its row (the mask is 0
    elsewhere); unchanged when no row holds more than one example. Right padding also has position 0 (TRL pads
    ``position_ids`` with 0), so a later "example" with no loss token is padding and is dropped; a row's first example
    always stays, as an unpacked row does.
    """
    starts = position_ids == 0
    per_row = starts.sum(-1).clamp(min=1)
    if int(per_row.max()) <= 1:
        return per_token, mask
    example = (starts.long().cumsum(-1) - 1).clamp(min=0)[:, 1:]  # example index of each label column, per row
    rows = torch.repeat_interleave(torch.arange(len(per_row), device=per_row.device), per_row)
    local = torch.cat([torch.arange(int(n), device=per_row.device) for n in per_row])
    own = example[rows] == local.unsqueeze(-1)
    split = torch.where(own, mask[rows], torch.zeros_like(mask[rows]))
    keep = (local == 0) | (split.sum(-1) > 0)
    return per_token[rows][keep], split[keep]
