"""``mis``: masked importance sampling (tokens or sequences whose ratio leaves a band get weight 0)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from trl_ext_plugins.corrections import math
from trl_ext_plugins.corrections.base import CorrectionParams, RolloutCorrection, reciprocal_lower


class MISParams(CorrectionParams):
    upper: float = Field(2.0, gt=0, description="C: rho above C is masked.")
    lower: float | None = Field(0.5, ge=0, description="Rho below this is masked (not given: 1/C, so 0.5 at the "
                                                       "default C = 2, as verl's lower bound defaults to 1/upper; "
                                                       "None: no lower bound, TRL's clip_min default).")

    @model_validator(mode="before")
    @classmethod
    def _lower_is_one_over_upper(cls, data):
        # [1/C, C]: a user who sets only C means that band (the lower bound followed a fixed 0.5 before)
        if isinstance(data, dict) and "upper" in data and "lower" not in data:
            return {**data, "lower": reciprocal_lower(data["upper"], "mis")}
        return data
    level: Literal["token", "sequence", "geometric"] = Field(
        "token", description="token: per-token rho (TRL token_mask); sequence: rho = prod_t rho_t (TRL sequence_mask); "
                             "geometric: rho = exp(mean_t log rho_t) per sequence ('Geo-RS').")
    drop_from_denominator: bool = Field(False, description="False: masked tokens get weight 0 and stay in the "
                                        "aggregation denominator (TRL, verl); true: they are removed from it.")

    def band(self):
        return self.lower, self.upper


class MIS(RolloutCorrection):
    """MIS, masked importance sampling (Liu, Li et al. 2025, "When Speed Kills Stability", richardli.xyz/rl-collapse).

    Weight ``rho * 1[lower <= rho <= upper]`` (detached), rho = pi_old / pi_rollout per token, per sequence (product)
    or as a per-sequence geometric mean. Defaults C = 2 with the band [1/C, C] = [0.5, 2] (verl; a C given alone moves
    the lower bound to 1/C). Convention 8: by
    default a masked token gets weight 0 and still counts in the denominator (as TRL's ``*_mask`` modes and verl), so
    parity with TRL's ``vllm_importance_sampling_mode=token_mask / sequence_mask`` holds (tested);
    ``drop_from_denominator: true`` removes it instead. Ratios are exp of log rho clamped to +-20 (TRL does not clamp):
    parity holds while |log rho| <= 20, always so for the masking decision unless a bound lies beyond e^+-20.
    """

    name = "mis"
    Params = MISParams

    @property
    def drops_from_denominator(self):
        return self.params.drop_from_denominator

    def weights(self, log_rho, mask):
        p = self.params
        if p.level != "token":
            log_rho = math.sequence_log_rho(log_rho, mask, geometric=p.level == "geometric")
        rho = math.rho_from_log(log_rho)
        weight = math.band_weight(rho, p.lower, p.upper)
        return weight, (weight == 0) & (rho != 0)
