"""``apo``: Anchored Preference Optimization (APO-zero / APO-down), paired (DPO trainer) or unpaired (KTO trainer)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from trl_ext import PluginParams, hookimpl
from trl_ext_plugins.preference.common import PreferenceLoss
from trl_ext_plugins.preference.math import apo_down_loss, apo_zero_loss

_PAIRED = {"zero": apo_zero_loss, "down": apo_down_loss}
_UNPAIRED_LOSS_TYPE = {"zero": "apo_zero_unpaired"}  # what TRL's KTOTrainer offers


class APOParams(PluginParams):
    variant: Literal["zero", "down"] = Field(
        "zero", description="'zero': chosen outputs are better than the model's (raise chosen, lower rejected); "
                            "'down': chosen are worse (lower chosen, lower rejected more). Unpaired: only 'zero'.")


class APO(PreferenceLoss):
    """APO (D'Oosterlinck et al. 2024, arXiv 2408.06266), anchored preference objectives.

    With ``r = log pi/pi_ref`` summed over completion tokens and ``beta`` = TRL's ``args.beta`` (default 0.1):
    APO-zero ``(1 - sigma(beta r_w)) + sigma(beta r_l)`` (Eq. 7); APO-down
    ``sigma(beta r_w) + (1 - sigma(beta (r_w - r_l)))`` (Eq. 8). Both equal 1 at initialisation. On the DPO trainer
    the loss is computed here (parity with TRL's ``loss_type=["apo_zero"]``/``["apo_down"]`` tested). On the KTO
    trainer (unpaired ``prompt/completion/label`` data) the plugin selects TRL's own ``apo_zero_unpaired`` loss:
    ``1 - sigma(beta r)`` for desirable, ``sigma(beta r)`` for undesirable completions (no unpaired APO-down exists).
    """

    name = "apo"
    trainers = frozenset({"dpo", "kto"})
    Params = APOParams

    @hookimpl
    def trl_ext_validate_stage(self, stage, plugins):
        errors = super().trl_ext_validate_stage(stage, plugins)
        if stage.trainer == "kto" and self.params.variant not in _UNPAIRED_LOSS_TYPE:
            errors.append(f"plugins: apo variant {self.params.variant!r} has no unpaired form; use variant 'zero' "
                          "on the kto trainer")
        return errors

    @hookimpl
    def trl_ext_configure_args(self, trainer, args):
        if trainer == "kto":
            return {"loss_type": _UNPAIRED_LOSS_TYPE.get(self.params.variant, "apo_zero_unpaired")}
        return super().trl_ext_configure_args(trainer, args)

    @hookimpl
    def trl_ext_preference_loss(self, inputs):
        chosen = inputs.chosen_logps - inputs.ref_chosen_logps
        rejected = inputs.rejected_logps - inputs.ref_rejected_logps
        return _PAIRED[self.params.variant](chosen, rejected, inputs.beta)
