"""``icepop``: zero the tokens whose train/inference ratio leaves [1/beta, beta] (GLM-5 form)."""

from __future__ import annotations

from pydantic import Field

from trl_ext_plugins.corrections import math
from trl_ext_plugins.corrections.base import CorrectionParams, RolloutCorrection


class IcePopParams(CorrectionParams):
    beta: float = Field(2.0, gt=1, description="Band [1/beta, beta] unless `lower` is set (GLM-5: 2; the original "
                                               "IcePop / verl / OpenRLHF use [0.5, 5]).")
    lower: float | None = Field(None, gt=0, description="Explicit lower bound alpha (None: 1/beta).")

    def band(self):
        return self.lower, self.beta


class IcePop(RolloutCorrection):
    """IcePop (Ling Team 2025, Ring-1T arXiv 2510.18855; GLM-5 arXiv 2602.15763 section 3.2, beta = 2).

    ``L = -(1/G) sum_i (1/|y_i|) sum_t pop(rho_it, 1/beta, beta) clipobj(r_it, A_it)`` with rho = pi_old(train) /
    pi_old(infer) and ``pop(rho, a, b) = rho if a <= rho <= b else 0``: tokens in the band are re-weighted by rho,
    tokens outside get weight 0 and zero gradient; the objective's own clip ("clip the rest") is untouched. Default
    beta = 2 (GLM-5). Convention 8: weight 0, the token stays in the denominator (verl). Equal to TRL's
    ``vllm_importance_sampling_mode=token_mask`` with ``clip_min=1/beta, clip_max=beta`` (parity tested). Combine
    with ``grpo`` for the GLM-5 loss (seq-mean-token-mean) and ``args.epsilon_high: 0.28``.
    """

    name = "icepop"
    Params = IcePopParams

    def weights(self, log_rho, mask):
        p = self.params
        rho = math.rho_from_log(log_rho)
        weight = math.band_weight(rho, p.lower if p.lower is not None else 1 / p.beta, p.beta)
        return weight, (weight == 0) & (rho != 0)
