"""``qrpo``: Quantile Reward Policy Optimization, pointwise regression onto a quantile reward with exact log Z."""

from __future__ import annotations

from pydantic import Field

from trl_ext import PluginParams, hookimpl
from trl_ext_plugins.preference.common import Column, PreferenceLoss
from trl_ext_plugins.preference.math import qrpo_log_partition, qrpo_loss, quantile_reward


class QRPOParams(PluginParams):
    exact_log_partition: bool = Field(
        True, description="log Z = log(beta (e^{1/beta} - 1)) (exact for a uniform quantile reward); false uses the "
                          "reference implementation's log beta + 1/beta.")
    chosen_reward_column: str = Field("chosen_reward", description="Dataset column with r(x, y_w).")
    rejected_reward_column: str = Field("rejected_reward", description="Dataset column with r(x, y_l).")
    ref_rewards_column: str = Field(
        "ref_rewards", description="Dataset column with the rewards of n >= 2 reference-policy completions of the "
                                   "prompt (a list per row).")


class QRPO(PreferenceLoss):
    """QRPO (Matrenok, Moalla, Gulcehre 2025, arXiv 2507.08068).

    Quantile reward ``r_q(x, y) = P_{y'~pi_ref}[r(x, y') <= r(x, y)]``, estimated from the ``n`` reference rewards in
    the ``ref_rewards`` column; under pi_ref it is U(0, 1), so ``Z = beta (e^{1/beta} - 1)`` exactly. Pointwise loss
    ``(r_q - beta log Z - beta log pi/pi_ref(y))**2`` on each completion; on a preference row both the chosen and the
    rejected completion are such points (each with its own reward column) and the per-row loss is their mean. The
    log-ratio is summed over completion tokens; ``beta`` is TRL's ``args.beta``. Rows need at least 2 reference
    rewards (checked before training). The reference completions and their rewards are dataset input here: this
    plugin does not generate them.
    """

    name = "qrpo"
    Params = QRPOParams

    def columns(self):
        return (Column(self.params.chosen_reward_column), Column(self.params.rejected_reward_column),
                Column(self.params.ref_rewards_column, is_list=True, min_items=2))

    @hookimpl
    def trl_ext_preference_loss(self, inputs):
        log_z = qrpo_log_partition(inputs.beta, exact=self.params.exact_log_partition)
        ref_rewards = inputs.batch[self.params.ref_rewards_column].to(inputs.chosen_logps)
        losses = []
        for side, logps, ref_logps in (("chosen", inputs.chosen_logps, inputs.ref_chosen_logps),
                                       ("rejected", inputs.rejected_logps, inputs.ref_rejected_logps)):
            reward = inputs.batch[getattr(self.params, f"{side}_reward_column")].to(logps)
            r_q = quantile_reward(reward, ref_rewards)
            inputs.metrics[f"qrpo/{side}_quantile_reward"] = r_q.mean().item()
            losses.append(qrpo_loss(r_q, logps - ref_logps, inputs.beta, log_z))
        return (losses[0] + losses[1]) / 2
