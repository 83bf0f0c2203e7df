"""SFT trainer: TRL's ``SFTTrainer`` with the loss-aggregation seam.

When a plugin implements ``trl_ext_aggregate_loss`` (for example ``sft`` with ``normalization: sequence``) the
per-token NLL comes from TRL's fused LM head (no full logits) and is reduced by the plugin; a plugin returning ``None`` (``sft`` with the
default token normalisation) leaves TRL's fused-head path untouched. Whether a plugin reduces the loss is asked once,
with a one-token probe, so the untouched path runs one forward per micro-batch, not a plugin forward and then TRL's.

TRL 1.16 internals relied on: ``SFTTrainer.compute_loss(model, inputs, return_outputs, num_items_in_batch)``, the
collator's ``labels`` (-100 on positions that do not count) and the fused head ``add_fused_lm_head`` puts on the model
(``model(..., fused_lm_head=True)`` returns ``log_probs``, ``entropy``, ``is_top1``, ``label_mask`` aligned with the
shifted labels, and ``aux_loss`` when asked for router logits); ``aux_loss_enabled``/``router_aux_loss_coef``,
``_total_train_tokens``/``_tp_size`` and ``self._metrics[mode]``, which the plugin path fills as TRL's does.
"""

from __future__ import annotations

import torch
from trl import SFTTrainer

from trl_ext.batches import AggregationContext
from trl_ext.trainers.base import HostMixin


# TRL's per-token weight of the NLL for each ``args.loss_type`` (``dft``: Dynamic Fine-Tuning, arXiv 2508.05629, scales
# each token's NLL by its detached probability); applied before a plugin reduces the loss, as TRL applies it before
# its token-mean.
SFT_TOKEN_WEIGHTS = {
    "nll": lambda log_probs: None,
    "dft": lambda log_probs: log_probs.exp().detach(),
}

# TRL options that need the full (B, T, V) logits, which the plugin path (fused head) never builds.
UNSUPPORTED_WITH_AGGREGATION = {"label_smoothing_factor": 0.0}


def sft_per_token_loss(log_probs: torch.Tensor, loss_type: str) -> torch.Tensor:
    """TRL's per-token SFT loss for ``loss_type`` from the fused head's label log-probs (0 where ignored)."""
    weight = SFT_TOKEN_WEIGHTS[loss_type](log_probs)
    return -log_probs if weight is None else -log_probs * weight


def probe_reduces_loss(host, loss_type: str) -> bool:
    """Whether a plugin of ``host`` replaces TRL's token-mean: its ``trl_ext_aggregate_loss`` on a one-token probe is
    not ``None`` (the hook spec asks that ``None`` depend on the plugin's configuration, not the batch)."""
    return host.implements("trl_ext_aggregate_loss") and host.hook.trl_ext_aggregate_loss(
        per_token_loss=torch.zeros(1, 1), mask=torch.ones(1, 1),
        inputs=AggregationContext(num_items_in_batch=torch.tensor(1.0), grad_accum_steps=1, steps_per_generation=1,
                                  num_processes=1, training=True, loss_type=loss_type, max_completion_length=None),
    ) is not None


def check_stage(host, stage, args: dict, where: str) -> list[str]:
    """SFT's own validation: with a plugin reducing the loss, TRL options the fused-head path cannot honour are
    refused (they were silently ignored)."""
    if not probe_reduces_loss(host, args.get("loss_type", "nll")):
        return []
    active = [p.name for p in host.plugins if "trl_ext_aggregate_loss" in p.implemented_hooks()]
    return [f"{where}.args.{key}: not supported together with the loss aggregation of plugin(s) {active} (it needs "
            f"the full logits)" for key, neutral in UNSUPPORTED_WITH_AGGREGATION.items()
            if key in args and args[key] != neutral]


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
            self._plugin_reduces_loss = probe_reduces_loss(self.plugin_host, self.args.loss_type)
            errors = check_stage(self.plugin_host, None, vars(self.args), "args") if self._plugin_reduces_loss else []
            if errors:
                raise ValueError("; ".join(errors))
        return self._plugin_reduces_loss

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if return_outputs or not self.plugin_reduces_loss():
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        # TRL's fused LM head (added to every SFT model): per-token log-probs of the shifted labels, computed in tiles,
        # so neither the (B, T, V) logits nor a float32 copy of them is built. Zero where the label is ignored.
        forward = {**inputs, "use_cache": False}
        if self.aux_loss_enabled:  # MoE: the router logits give the load-balancing loss TRL adds
            forward["output_router_logits"] = True
        outputs = model(**forward, fused_lm_head=True)
        per_token_nll = sft_per_token_loss(outputs.log_probs, self.args.loss_type)
        mask = outputs.label_mask.to(outputs.log_probs.dtype)
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
        if self.aux_loss_enabled:  # scaled for accumulation like the plugin's loss (HF does not divide it)
            loss = loss + self.router_aux_loss_coef * outputs.aux_loss / ctx.grad_accum_steps
        self._log_fused_metrics(inputs, outputs, "train" if training else "eval")
        return loss

    def _log_fused_metrics(self, inputs, outputs, mode: str) -> None:
        """TRL's SFT metrics, with TRL's definitions: token entropy and top-1 accuracy over the counted labels of all
        ranks, the running ``num_tokens`` (input tokens, counted in training) and the MoE ``aux_loss``."""
        gather = self.accelerator.gather_for_metrics
        counted = gather(outputs.label_mask.sum()).sum()
        for key, per_token in (("entropy", outputs.entropy), ("mean_token_accuracy", outputs.is_top1)):
            total = gather(per_token.detach().sum()).sum()
            self._metrics[mode][key].append((total / counted).item() if counted > 0 else 0.0)
        if mode == "train":
            # padding-free batches have no attention mask: every position of the packed row is a token
            if "attention_mask" in inputs:
                tokens = inputs["attention_mask"].sum()
            else:
                tokens = torch.tensor(inputs["position_ids"].size(1), device=inputs["position_ids"].device)
            self._total_train_tokens += gather(tokens).sum().item() // self._tp_size
        self._metrics[mode]["num_tokens"] = [self._total_train_tokens]
        if self.aux_loss_enabled:
            self._metrics[mode]["aux_loss"].append(gather(outputs.aux_loss).mean().item())


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
