"""``dpo``: Direct Preference Optimization's logistic loss on the implicit reward margin."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from trl_ext import PluginParams, hookimpl, ops
from trl_ext_plugins.preference.common import PreferenceLoss
from trl_ext_plugins.preference.math import noisy_label_logistic


class DPOParams(PluginParams):
    label_smoothing: float = Field(
        0.0, ge=0.0, le=1.0, description="eps, the assumed share of flipped preference labels (0: plain DPO). "
        "conservative: -(1 - eps) log sigmoid(beta h) - eps log sigmoid(-beta h) (cDPO; OpenRLHF's DPOLoss "
        "label_smoothing; TRL 1.16's sigmoid ignores label_smoothing); robust: [-(1 - eps) log sigmoid(beta h) + eps "
        "log sigmoid(-beta h)] / (1 - 2 eps) (rDPO, TRL's loss_type robust; eps < 0.5).")
    label_smoothing_form: Literal["conservative", "robust"] = Field(
        "conservative", description="How label_smoothing enters: conservative (cDPO, Mitchell 2023) or robust (rDPO, "
        "Chowdhury et al. 2024, arXiv 2403.00409: an unbiased estimate of the clean-label loss).")
    length_normalize: bool = Field(
        False, description="Divide each completion's log-ratio by its token count before the margin (TRL's "
        "sigmoid_norm, NeMo-Aligner's preference_average_log_probs, Tulu 3's length-normalised DPO, arXiv "
        "2411.15124); false: summed log-ratios (the paper, TRL's sigmoid).")
    nll_weight: float = Field(
        0.0, ge=0,
        description="weight alpha of a length-normalised NLL term on the chosen response (Iterative RPO, arXiv "
                    "2404.19733); 0 is plain DPO",
    )
    nll_normalization: Literal["mean", "sum", "batch_token_mean"] = Field(
        "mean", description="NLL of the chosen response: mean: per sequence, -log pi(y_w)/|y_w| (Iterative RPO's "
                            "length-normalised form); sum: per sequence, summed over its tokens, -log pi(y_w); "
                            "batch_token_mean: one value per micro-batch, the chosen tokens' NLL summed over the batch "
                            "over their count (TRL's 'sft' term in loss_type=['sigmoid', 'sft'], parity tested)")

    @model_validator(mode="after")
    def _robust_needs_eps_below_half(self):
        if self.label_smoothing_form == "robust" and self.label_smoothing >= 0.5:
            raise ValueError(f"label_smoothing_form robust divides by 1 - 2 eps: label_smoothing must be below 0.5, "
                             f"got {self.label_smoothing}")
        return self


class DPO(PreferenceLoss):
    """DPO (Rafailov et al. 2023, arXiv 2305.18290).

    ``L = -log sigmoid(beta * [(log pi/pi_ref)(y_w) - (log pi/pi_ref)(y_l)])`` with sequence log-probs *summed* over
    completion tokens (the paper's and TRL's convention; SimPO/ORPO use means). ``beta`` is TRL's ``args.beta``
    (default 0.1, the paper's main setting; 0.5 for TL;DR). At initialisation (pi = pi_ref) the loss is ln 2.
    Parity with TRL's ``loss_type=["sigmoid"]`` is tested.

    ``nll_weight`` (default 0) adds ``alpha * (-log pi(y_w)/|y_w|)``, the per-token NLL of the chosen response, as in
    Iterative Reasoning Preference Optimization (Pang et al. 2024, arXiv 2404.19733). On self-generated pairs that
    share most tokens, plain DPO can lower the chosen response's likelihood along with the rejected one's
    ("likelihood displacement"); the NLL term keeps the chosen answer likely. Normalisations: ``mean`` (default,
    the paper's per-token form, each sequence its own mean), ``sum`` (the summed ``-log pi(y_w)`` per sequence: long
    answers weigh more) and ``batch_token_mean`` (TRL's ``loss_type=["sigmoid", "sft"]`` with ``loss_weights=[1,
    alpha]``: the mean over every chosen token of the micro-batch, so sequences weigh by their length; parity with
    TRL is pinned in tests/trl_fixtures).

    Noisy labels (``label_smoothing`` eps, default 0): ``conservative`` is cDPO (Mitchell 2023, "A note on DPO with
    noisy preferences"; OpenRLHF's ``DPOLoss(label_smoothing)``; TRL 1.16's ``sigmoid`` ignores ``label_smoothing``),
    the loss against soft labels 1 - eps / eps; ``robust`` is rDPO (Chowdhury et al. 2024, arXiv 2403.00409; TRL's
    ``robust``), unbiased for the clean-label loss, eps < 0.5 (it grows without bound towards 0.5).
    ``length_normalize`` divides each log-ratio by its completion's token count first (TRL's ``sigmoid_norm``; Tulu
    3's length-normalised DPO, arXiv 2411.15124), default off (the paper's sums).
    """

    name = "dpo"
    Params = DPOParams

    @hookimpl
    def trl_ext_preference_loss(self, inputs):
        p = self.params
        chosen = inputs.chosen_logps - inputs.ref_chosen_logps
        rejected = inputs.rejected_logps - inputs.ref_rejected_logps
        if p.length_normalize:
            chosen = chosen / inputs.chosen_lengths.clamp(min=1)
            rejected = rejected / inputs.rejected_lengths.clamp(min=1)
        if p.label_smoothing:
            loss = noisy_label_logistic(inputs.beta * (chosen - rejected), p.label_smoothing, p.label_smoothing_form)
        else:
            loss = ops.dpo_sigmoid_loss(chosen, rejected, inputs.beta)  # the loss parity with TRL is pinned on
        if self.params.nll_weight:
            loss = loss + self.params.nll_weight * chosen_nll(inputs, self.params.nll_normalization)
        return loss


def chosen_nll(inputs, normalization: str):
    """Per-sequence NLL of the chosen responses, ``(B,)``: ``mean`` -log pi(y_w)/|y_w|, ``sum`` -log pi(y_w), or
    ``batch_token_mean`` the micro-batch's summed chosen NLL over its chosen-token count, the same for every row."""
    if normalization == "sum":
        return -inputs.chosen_logps
    if normalization == "batch_token_mean":
        per_batch = -inputs.chosen_logps.sum() / inputs.chosen_lengths.sum().clamp(min=1)
        return per_batch.expand_as(inputs.chosen_logps)
    return -inputs.chosen_mean_logps
