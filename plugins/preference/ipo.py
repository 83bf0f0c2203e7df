"""``ipo``: Identity Preference Optimization, squared regression of the log-ratio gap onto 1/(2 tau)."""

from __future__ import annotations

from pydantic import Field

from trl_ext import PluginParams, hookimpl
from trl_ext_plugins.preference.common import PreferenceLoss
from trl_ext_plugins.preference.math import ipo_loss


class IPOParams(PluginParams):
    length_normalize: bool = Field(
        True, description="Average each completion's log-ratio over its tokens before the gap (TRL's convention, "
                          "confirmed with the IPO authors); false uses summed log-ratios (NeMo-Aligner).")


class IPO(PreferenceLoss):
    """IPO (Azar et al., AISTATS 2024, arXiv 2310.12036), the Psi-PO with identity Psi.

    ``L = (h - 1/(2 tau))**2`` with ``h = (log pi/pi_ref)(y_w) - (log pi/pi_ref)(y_l)``; ``tau`` is TRL's
    ``args.beta`` (default 0.1, so the target gap is 5). Convention: by default each log-ratio is the per-token mean
    over the completion, exactly as TRL's ``DPOConfig(loss_type=["ipo"])`` (parity tested) except where a row's first
    sequence token is a completion token (an empty prompt, or ``truncation_mode: keep_end`` cutting the whole prompt):
    TRL then also counts that token, which has no log-prob, in the length, and trl-ext counts the log-probs it sums;
    set ``length_normalize: false`` for the paper's summed sequence log-ratios (OpenRLHF, NeMo-Aligner). The minimum
    (0) is at ``h = 1/(2 tau)``,
    so unlike DPO the gap is not pushed to infinity.
    """

    name = "ipo"
    Params = IPOParams

    @hookimpl
    def trl_ext_preference_loss(self, inputs):
        chosen = inputs.chosen_logps - inputs.ref_chosen_logps
        rejected = inputs.rejected_logps - inputs.ref_rejected_logps
        if self.params.length_normalize:
            chosen = chosen / inputs.chosen_lengths.clamp(min=1)
            rejected = rejected / inputs.rejected_lengths.clamp(min=1)
        return ipo_loss(chosen, rejected, inputs.beta)
