"""``dpo``: Direct Preference Optimization's logistic loss on the implicit reward margin."""

from __future__ import annotations

from trl_ext import NoParams, hookimpl, ops
from trl_ext_plugins.preference.common import PreferenceLoss


class DPO(PreferenceLoss):
    """DPO (Rafailov et al. 2023, arXiv 2305.18290).

    ``L = -log sigmoid(beta * [(log pi/pi_ref)(y_w) - (log pi/pi_ref)(y_l)])`` with sequence log-probs *summed* over
    completion tokens (the paper's and TRL's convention; SimPO/ORPO use means). ``beta`` is TRL's ``args.beta``
    (default 0.1, the paper's main setting; 0.5 for TL;DR). At initialisation (pi = pi_ref) the loss is ln 2.
    Parity with TRL's ``loss_type=["sigmoid"]`` is tested.
    """

    name = "dpo"
    Params = NoParams

    @hookimpl
    def trl_ext_preference_loss(self, inputs):
        chosen = inputs.chosen_logps - inputs.ref_chosen_logps
        rejected = inputs.rejected_logps - inputs.ref_rejected_logps
        return ops.dpo_sigmoid_loss(chosen, rejected, inputs.beta)
