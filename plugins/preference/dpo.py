"""``dpo``: Direct Preference Optimization's logistic loss on the implicit reward margin."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from trl_ext import PluginParams, hookimpl, ops
from trl_ext_plugins.preference.common import PreferenceLoss


class DPOParams(PluginParams):
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
    """

    name = "dpo"
    Params = DPOParams

    @hookimpl
    def trl_ext_preference_loss(self, inputs):
        chosen = inputs.chosen_logps - inputs.ref_chosen_logps
        rejected = inputs.rejected_logps - inputs.ref_rejected_logps
        loss = ops.dpo_sigmoid_loss(chosen, rejected, inputs.beta)
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
