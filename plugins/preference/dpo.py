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
    nll_normalization: Literal["mean", "sum"] = Field(
        "mean", description="NLL of the chosen response per token (mean: -log pi(y_w)/|y_w|, Iterative RPO's "
                            "length-normalised form) or summed over its tokens (sum: -log pi(y_w), TRL's 'sft' term in "
                            "loss_type=['sigmoid', 'sft'])")


class DPO(PreferenceLoss):
    """DPO (Rafailov et al. 2023, arXiv 2305.18290).

    ``L = -log sigmoid(beta * [(log pi/pi_ref)(y_w) - (log pi/pi_ref)(y_l)])`` with sequence log-probs *summed* over
    completion tokens (the paper's and TRL's convention; SimPO/ORPO use means). ``beta`` is TRL's ``args.beta``
    (default 0.1, the paper's main setting; 0.5 for TL;DR). At initialisation (pi = pi_ref) the loss is ln 2.
    Parity with TRL's ``loss_type=["sigmoid"]`` is tested.

    ``nll_weight`` (default 0) adds ``alpha * (-log pi(y_w)/|y_w|)``, the per-token NLL of the chosen response, as in
    Iterative Reasoning Preference Optimization (Pang et al. 2024, arXiv 2404.19733). On self-generated pairs that
    share most tokens, plain DPO can lower the chosen response's likelihood along with the rejected one's
    ("likelihood displacement"); the NLL term keeps the chosen answer likely. ``nll_normalization: sum`` uses the
    summed NLL ``-log pi(y_w)`` instead, the convention of TRL's ``["sigmoid", "sft"]`` mix (which weights it by
    ``loss_weights``); the default ``mean`` is the paper's per-token form.
    """

    name = "dpo"
    Params = DPOParams

    @hookimpl
    def trl_ext_preference_loss(self, inputs):
        chosen = inputs.chosen_logps - inputs.ref_chosen_logps
        rejected = inputs.rejected_logps - inputs.ref_rejected_logps
        loss = ops.dpo_sigmoid_loss(chosen, rejected, inputs.beta)
        if self.params.nll_weight:
            nll = -inputs.chosen_logps if self.params.nll_normalization == "sum" else -inputs.chosen_mean_logps
            loss = loss + self.params.nll_weight * nll
        return loss
