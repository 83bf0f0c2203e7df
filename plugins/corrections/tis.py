"""``tis``: truncated importance sampling against the rollout engine's log-probs."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from trl_ext_plugins.corrections import math
from trl_ext_plugins.corrections.base import CorrectionParams, RolloutCorrection


class TISParams(CorrectionParams):
    upper: float = Field(2.0, gt=0, description="C: weights are min(rho, C).")
    lower: float | None = Field(None, ge=0, description="Optional lower clamp of rho (None: upper-only, as the blog).")
    level: Literal["token", "sequence"] = Field("token", description="token: rho per token (TRL token_truncate); "
                                                "sequence: rho = prod_t rho_t per sequence (TRL sequence_truncate).")

    def band(self):
        return self.lower, self.upper


class TIS(RolloutCorrection):
    """TIS, truncated importance sampling (Yao, Liu et al. 2025, "Your Efficient RL Framework Secretly Brings You
    Off-Policy RL Training", fengyao.notion.site/off-policy-rl).

    Multiplies each token's loss by the detached ``min(rho, C)``, rho = pi_old / pi_rollout (for PPO-style objectives
    the weight uses pi_old, not pi_theta, as the blog and TRL). Default C = 2 (verl, slime); TRL's field default is 3.
    ``level: sequence`` uses the product of the token ratios. Truncated tokens keep their place in the aggregation
    denominator. Equal to TRL's ``vllm_importance_sampling_mode=token_truncate / sequence_truncate`` given the same
    sampling log-probs (parity tested), but also without vLLM. Ratios are exp of log rho clamped to +-20 (TRL does not
    clamp), so parity holds while |log rho| <= 20 (a sequence's sum, at level sequence); beyond, the weight is
    e^-20 where TRL's is smaller.
    """

    name = "tis"
    Params = TISParams

    def weights(self, log_rho, mask):
        p = self.params
        if p.level == "sequence":
            log_rho = math.sequence_log_rho(log_rho, mask)
        rho = math.rho_from_log(log_rho)
        weight = math.truncated_weight(rho, p.lower, p.upper)
        return weight, weight != rho
