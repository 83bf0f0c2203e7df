"""``sft``: supervised fine-tuning, token-level cross-entropy on response tokens."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from trl_ext import Plugin, PluginParams, Slot, hookimpl, ops


class SFTParams(PluginParams):
    normalization: Literal["token", "sequence"] = Field(
        "token",
        description="'token': sum of token NLL / number of response tokens in the batch (TRL's default); "
        "'sequence': mean NLL per sequence, then mean over sequences (long answers do not dominate)",
    )


class SFT(Plugin):
    """Supervised fine-tuning: L = -(1/N_tok) sum_t m_t log pi(y_t | x, y_<t) on response tokens.

    Paper: InstructGPT step 1 (Ouyang et al. 2022, arXiv 2203.02155); FLAN (arXiv 2109.01652).
    Defaults: ``normalization: token`` is TRL's SFTTrainer loss unchanged (the plugin then adds nothing to TRL's
    path). Convention: ``sequence`` is the per-conversation mean Nemotron 3 Super (arXiv 2604.12374) uses in its second
    SFT stage; sequences [1] and [0, 0, 0] give 0.25 under ``token`` and 0.5 under ``sequence``. Which tokens count
    is TRL's choice (``completion_only_loss`` / ``assistant_only_loss``), not the plugin's. With ``packing`` (or
    padding-free batches) a sequence is an example, not a packed row: the trainer splits packed rows at position 0.
    Under ``sequence``, TRL's ``args.loss_type: dft`` token weight, the MoE router aux loss and TRL's metrics apply as
    on TRL's path; ``args.label_smoothing_factor`` (it needs the full logits) is refused.
    """

    name = "sft"
    family = "trainer"
    trainers = frozenset({"sft"})
    slots = frozenset({Slot.AGGREGATION})
    Params = SFTParams

    @hookimpl
    def trl_ext_aggregate_loss(self, per_token_loss, mask, inputs):
        if self.params.normalization == "token":
            return None  # TRL's own token-mean over the accumulated batch
        loss = ops.sequence_mean_nll(per_token_loss, mask)
        return loss / (inputs.grad_accum_steps if inputs.training else 1)
