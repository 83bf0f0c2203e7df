"""``rpo``: Reward-aware Preference Optimization (Nemotron-4), regressing the implicit reward gap onto the RM gap."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from trl_ext import PluginParams, hookimpl
from trl_ext import metrics as figures
from trl_ext_plugins.preference.common import Column, PreferenceLoss
from trl_ext_plugins.preference.math import rpo_bwd_kl_loss, rpo_fwd_kl_loss, rpo_sq_loss

_FORMS = {"bwd_kl": rpo_bwd_kl_loss, "fwd_kl": rpo_fwd_kl_loss, "sq": rpo_sq_loss}


class RPOParams(PluginParams):
    form: Literal["bwd_kl", "fwd_kl", "sq"] = Field(
        "bwd_kl", description="Distance D: 'bwd_kl' = KL(Bern(sigma(eta dr*)) || Bern(sigma(beta dlogratio))) "
                              "(the report's form), 'fwd_kl' its reverse, 'sq' the squared gap difference.")
    eta: float = Field(1.0, description="Scale of the reward model's gap (NeMo-Aligner gt_reward_scale, default 1.0).")
    chosen_reward_column: str = Field("chosen_reward", description="Dataset column with r*(x, y_w).")
    rejected_reward_column: str = Field("rejected_reward", description="Dataset column with r*(x, y_l).")


class RPO(PreferenceLoss):
    """RPO, reward-aware preference optimization (Nemotron-4 340B report, NVIDIA 2024, arXiv 2406.11704).

    ``L = D[beta (r_w - r_l) || eta (r*(x, y_w) - r*(x, y_l))]`` with ``r = log pi/pi_ref`` summed over completion
    tokens (NeMo-Aligner's default ``preference_average_log_probs: False``) and ``beta`` TRL's ``args.beta`` (0.1;
    NeMo-Aligner's default is 0.2). The loss is 0 when the implicit gap equals the scaled reward gap, so, unlike DPO,
    pairs the reward model barely separates are not pushed apart. Reward-model scores come from two dataset columns
    (``chosen_reward``/``rejected_reward`` by default; NaN or missing values are refused before training; NeMo's
    fallback of 1/0 for missing rewards is deliberately not applied). Not in TRL; formulas follow NeMo-Aligner's
    ``rpo_bwd_kl``/``rpo_fwd_kl``/``rpo_sq``.
    """

    name = "rpo"
    Params = RPOParams

    def columns(self):
        return (Column(self.params.chosen_reward_column), Column(self.params.rejected_reward_column))

    @hookimpl
    def trl_ext_preference_loss(self, inputs):
        policy_gap = inputs.beta * ((inputs.chosen_logps - inputs.ref_chosen_logps)
                                    - (inputs.rejected_logps - inputs.ref_rejected_logps))
        chosen_reward = inputs.batch[self.params.chosen_reward_column].to(policy_gap)
        rejected_reward = inputs.batch[self.params.rejected_reward_column].to(policy_gap)
        target_gap = self.params.eta * (chosen_reward - rejected_reward)
        # means over every rank's pairs (figure parts the trainer reduces)
        inputs.metrics["rpo/target_gap"] = figures.mean(target_gap.sum(), target_gap.numel())
        inputs.metrics["rpo/policy_gap"] = figures.mean(policy_gap.detach().sum(), policy_gap.numel())
        return _FORMS[self.params.form](policy_gap, target_gap)
