"""``rollout_correction``: the train/inference mismatch corrections as one family (issue 10).

level {token, sequence, geometric} x mode {truncate, mask, reject} x rejection statistic {ratio, max, sum, and k2 / k3
as a sequence mean, sum or max} x thresholds {lower, upper}; ``tis``, ``mis`` and ``icepop`` are presets of it
(bit-identical, tested).
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field, ValidationInfo, field_validator, model_validator

from trl_ext import ops
from trl_ext_plugins.corrections import math
from trl_ext_plugins.corrections.base import CorrectionParams, RolloutCorrection, reciprocal_lower

# The grid each existing plugin is (its defaults). icepop's lower is 1/upper unless given (IcePop's [1/beta, beta]).
PRESETS: dict[str, dict] = {
    "tis": {"level": "token", "mode": "truncate", "statistic": "ratio", "lower": None, "upper": 2.0},
    "mis": {"level": "token", "mode": "mask", "statistic": "ratio", "lower": 0.5, "upper": 2.0},
    "icepop": {"level": "token", "mode": "mask", "statistic": "ratio", "upper": 2.0},
}
# Statistics measured in ratio units (rho = pi_old / pi_rollout): lower and upper bound a ratio.
RATIO_STATISTICS = ("ratio", "max", "sum")
# Divergence statistics (>= 0, upper threshold only): name -> (per-token estimator, reduction over a sequence's loss
# tokens), verl's rollout_rs names seq_{mean,sum,max}_{k2,k3}
KL_STATISTICS: dict[str, tuple[str, str]] = {
    "k2": ("k2", "mean"), "k2_sum": ("k2", "sum"), "k2_max": ("k2", "max"),
    "k3": ("k3", "mean"), "k3_sum": ("k3", "sum"), "k3_max": ("k3", "max"),
}


# -- pure functions --------------------------------------------------------------------------------------------------


def level_log_rho(log_rho: torch.Tensor, mask: torch.Tensor, level: str) -> torch.Tensor:
    """log of the level's ratio: per token ``(B, T)``; per sequence ``(B, 1)``, the sum (log prod_t rho_t) or, for
    ``geometric``, the mean over the sequence's loss tokens (log of the geometric mean)."""
    if level == "token":
        return log_rho
    return math.sequence_log_rho(log_rho, mask, geometric=level == "geometric")


def outside_band(rho: torch.Tensor, lower: float | None, upper: float | None) -> torch.Tensor:
    """rho < lower or rho > upper (bounds inclusive: rho == bound is kept; a None bound is absent)."""
    outside = torch.zeros_like(rho, dtype=torch.bool)
    if lower is not None:
        outside = outside | (rho < lower)
    if upper is not None:
        outside = outside | (rho > upper)
    return outside


def sequence_divergence(log_rho: torch.Tensor, mask: torch.Tensor, estimator: str = "k2",
                        reduce: str = "mean") -> torch.Tensor:
    """Per sequence, ``(B, 1)``, the ``reduce`` (mean, sum or max) over its loss tokens of ``k2 = 0.5 l^2`` or
    ``k3 = e^l - 1 - l`` with ``l = log rho_t`` (both >= 0; k3 is the k3 estimate of KL(pi_rollout || pi_old) from the
    rollout's samples, as verl's ``rollout_rs``). 0 for a sequence without loss tokens. ``l`` is clamped to +-20 first
    (verl's safety bound, :data:`trl_ext.ops.LOG_RATIO_CLAMP`), so k2 <= 200 and k3 <= e^20."""
    valid = mask.bool()
    clamped = log_rho.clamp(-ops.LOG_RATIO_CLAMP, ops.LOG_RATIO_CLAMP)
    per_token = 0.5 * clamped * clamped if estimator == "k2" else torch.expm1(clamped) - clamped
    per_token = torch.where(valid, per_token, torch.zeros_like(per_token))  # >= 0, so 0 is neutral for max too
    if reduce == "max":
        return per_token.max(-1, keepdim=True).values
    total = per_token.sum(-1, keepdim=True)
    return total if reduce == "sum" else total / valid.sum(-1, keepdim=True).clamp(min=1).to(total.dtype)



def rejected(log_rho: torch.Tensor, mask: torch.Tensor, level: str, statistic: str, lower: float | None,
             upper: float | None) -> torch.Tensor:
    """Which tokens (``(B, T)``, statistic ``ratio`` at token level) or sequences (``(B, 1)``) the statistic rejects.

    * ``ratio``: the level's rho (token, sequence product, geometric mean) outside [lower, upper];
    * ``sum``: the sequence product exp(sum_t log rho_t) outside [lower, upper] (whatever the level of the weight);
    * ``max``: any loss token's rho_t outside [lower, upper] (i.e. max_t |log rho_t| > log C for the band [1/C, C]);
    * ``k2``: the sequence mean of 0.5 (log rho_t)^2 above ``upper`` (no lower threshold); ``k2_sum``, ``k2_max``,
      ``k3``, ``k3_sum``, ``k3_max``: the sum or max of k2, or the mean, sum or max of k3 (:data:`KL_STATISTICS`).
    Ratios are the +-20-clamped exp of :func:`trl_ext.ops.safe_ratio`, as the weights.
    """
    valid = mask.bool()
    if statistic == "ratio":
        return outside_band(ops.safe_ratio(level_log_rho(log_rho, mask, level)), lower, upper)
    if statistic == "sum":
        return outside_band(ops.safe_ratio(math.sequence_log_rho(log_rho, mask)), lower, upper)
    if statistic == "max":
        return (outside_band(ops.safe_ratio(log_rho), lower, upper) & valid).any(-1, keepdim=True)
    if statistic in KL_STATISTICS:
        return sequence_divergence(log_rho, mask, *KL_STATISTICS[statistic]) > upper
    raise ValueError(f"unknown rejection statistic {statistic!r}")


def correction_weights(log_rho: torch.Tensor, mask: torch.Tensor, level: str, mode: str, statistic: str,
                       lower: float | None, upper: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(detached weight, changed flags) of the grid point; ``log_rho`` is 0 off the loss tokens.

    truncate: ``clamp(rho, lower, upper)``, changed where that differs from rho; mask: rho where not rejected, 0 where
    rejected (``torch.where``), changed = rejected; reject: 1 where not rejected, 0 where rejected (pure rejection
    sampling), changed = rejected. rho is the level's ratio; the weight is ``(B, 1)`` at sequence and geometric level
    and ``(B, T)`` at token level (a sequence rejection then zeroes every token of the row).
    """
    log_rho = log_rho.detach()
    rho = ops.safe_ratio(level_log_rho(log_rho, mask, level))
    if mode == "truncate":
        weight = math.truncated_weight(rho, lower, upper)
        return weight, weight != rho
    reject = rejected(log_rho, mask, level, statistic, lower, upper)
    kept = rho if mode == "mask" else torch.ones_like(rho)
    weight = torch.where(reject, torch.zeros_like(rho), kept)
    return weight, reject.expand_as(weight)


# -- plugin ----------------------------------------------------------------------------------------------------------


class RolloutCorrectionParams(CorrectionParams):
    preset: Literal["none", "tis", "mis", "icepop"] = Field(
        "none", description="none: the grid fields as given (defaults = mis's). tis / mis / icepop: the grid of that "
        "plugin's defaults (tis: token, truncate, ratio, upper 2; mis: token, mask, ratio, [0.5, 2]; icepop: token, "
        "mask, ratio, [1/upper, upper] with upper 2); fields given next to a preset override its values (icepop, and "
        "mis when upper is given: lower stays 1/upper unless given).")
    level: Literal["token", "sequence", "geometric"] = Field(
        "token", description="The ratio the weight is: token rho_t = pi_old/pi_rollout; sequence prod_t rho_t (TRL "
        "sequence_* modes); geometric exp(mean_t log rho_t) per sequence (Geo-RS).")
    mode: Literal["truncate", "mask", "reject"] = Field(
        "mask", description="truncate: weight clamp(rho, lower, upper) (TIS; needs statistic ratio); mask: weight rho, "
        "0 where the statistic rejects (MIS, IcePop; verl IS + RS); reject: weight 1, 0 where it rejects (pure "
        "rejection sampling: verl rollout_rs without rollout_is, e.g. its geometric-RS presets).")
    statistic: Literal["ratio", "max", "sum", "k2", "k2_sum", "k2_max", "k3", "k3_sum", "k3_max"] = Field(
        "ratio", description="What is compared with the thresholds. ratio: the level's rho; sum: the sequence product "
        "exp(sum_t log rho_t); max: every token's rho_t (one token outside rejects its sequence); k2: the sequence "
        "mean of 0.5 (log rho_t)^2; k2_sum / k2_max: its sum / max over the sequence; k3, k3_sum, k3_max: the same "
        "of e^l - 1 - l, l = log rho_t (verl rollout_rs seq_{mean,sum,max}_{k2,k3}; upper only). ratio/sum/max "
        "bounds are in ratio units.", validate_default=True)
    lower: float | None = Field(0.5, ge=0, validate_default=True, description="Lower ratio bound, inclusive (null: "
                                "none; with a k2/k3 statistic it defaults to null and is refused if given).")
    upper: float | None = Field(2.0, gt=0, validate_default=True, description="Upper bound, inclusive (null: none): a "
                                "ratio for ratio/sum/max; the divergence threshold for k2/k3 statistics (then "
                                "required, no default).")
    drop_from_denominator: bool = Field(False, description="mask/reject modes: false, a rejected token gets weight 0 "
                                        "and stays in the aggregation denominator (TRL, mis); true, it leaves it "
                                        "(verl's rejection mask).")

    @model_validator(mode="before")
    @classmethod
    def _fill_defaults(cls, data):
        if not isinstance(data, dict):
            return data
        given = dict(data)
        if given.get("statistic") in KL_STATISTICS:
            # The ratio-unit defaults (lower 0.5, upper 2, or a preset's) mean nothing for a divergence: lower defaults
            # to null and upper must be given.
            given.setdefault("lower", None)
            given.setdefault("upper", None)
        preset = given.get("preset")
        if preset not in PRESETS:
            return given
        filled = {**PRESETS[preset], **given}
        if preset == "icepop" and "lower" not in given:
            upper = filled["upper"]
            filled["lower"] = 1 / upper if isinstance(upper, (int, float)) and upper > 0 else None
        elif preset == "mis" and "upper" in given and "lower" not in given:
            filled["lower"] = reciprocal_lower(given["upper"], "rollout_correction (preset mis)")
        return filled

    @field_validator("statistic")
    @classmethod
    def _truncate_needs_ratio(cls, value, info: ValidationInfo):
        if info.data.get("mode") == "truncate" and value != "ratio":
            raise ValueError(f"mode 'truncate' clamps the level's ratio itself, so it takes statistic 'ratio', not "
                             f"{value!r} (use mode 'mask' to reject by {value!r})")
        return value

    @field_validator("lower")
    @classmethod
    def _k2_has_no_lower(cls, value, info: ValidationInfo):
        statistic = info.data.get("statistic")
        if value is not None and statistic in KL_STATISTICS:
            raise ValueError(f"statistic {statistic!r} (a divergence >= 0) takes only an upper threshold; set lower: "
                             "null")
        return value

    @field_validator("upper")
    @classmethod
    def _bounds(cls, value, info: ValidationInfo):
        statistic, lower = info.data.get("statistic"), info.data.get("lower")
        if value is None and statistic in KL_STATISTICS:
            raise ValueError(f"statistic {statistic!r} needs an upper threshold")
        if value is None and lower is None and "lower" in info.data:
            raise ValueError("give at least one of lower and upper")
        if value is not None and lower is not None and lower > value:
            raise ValueError(f"lower ({lower}) must not exceed upper ({value})")
        return value

    @field_validator("drop_from_denominator")
    @classmethod
    def _drop_needs_mask(cls, value, info: ValidationInfo):
        if value and info.data.get("mode") == "truncate":
            raise ValueError("mode 'truncate' rejects no token, so there is nothing to drop from the denominator; "
                             "use mode 'mask'")
        return value


class UnifiedCorrection(RolloutCorrection):
    """Rollout correction as one family: level x mode x rejection statistic x thresholds (issue 10), with ``tis``,
    ``mis`` and ``icepop`` as presets.

    rho_t = pi_old / pi_rollout per token (detached; +-20-clamped log space). The weight multiplies each token's loss:

    * ``level`` (the weight's ratio): ``token`` rho_t; ``sequence`` prod_t rho_t; ``geometric`` exp(mean_t log rho_t)
      (Geo-RS, Liu, Li et al., richardli.xyz/rl-collapse part 3; verl's former ``rollout_rs: geometric``, now
      ``seq_mean_k1``).
    * ``mode``: ``truncate``, weight ``clamp(rho, lower, upper)`` (TIS, Yao, Liu et al. 2025,
      fengyao.notion.site/off-policy-rl; TRL ``*_truncate``; with ``lower: null`` upper-only as the blog, TRL and
      verl ``rollout_is_threshold``; truncated tokens stay in the denominator); ``mask``, weight rho where the
      statistic accepts and 0 where it rejects (MIS, "When Speed Kills Stability"; IcePop, Ring-1T arXiv 2510.18855 and
      GLM-5 arXiv 2602.15763; TRL ``*_mask``; verl ``rollout_is`` plus ``rollout_rs`` at the same level when its IS
      threshold is >= upper, so its truncation is a no-op inside the band): the weight stays rho inside the band;
      ``reject``, weight 1 where the statistic accepts and 0 where it rejects (pure rejection sampling: verl
      ``rollout_rs`` without ``rollout_is``, e.g. its ``decoupled_geo_rs`` / ``bypass_pg_geo_rs`` presets with
      ``level: geometric, drop_from_denominator: true``). verl's presets that truncate IS weights *and* reject by a
      statistic (``decoupled_geo_rs_token_tis``: token TIS at 2 plus geometric RS; verl's IS weights are always
      truncated) are ``tis`` and ``rollout_correction`` in ``reject`` mode selected together (weights multiply;
      tested).
    * ``statistic`` (what decides a rejection; mask and reject modes): ``ratio``, the level's rho against [lower, upper]
      (token, or whole sequence at sequence/geometric level; verl ``token_k1`` / ``seq_sum_k1`` / ``seq_mean_k1``,
      whose k1 = log(pi_rollout/pi_old) has the opposite sign: their bounds (l, u) are ours (1/u, 1/l)); ``sum``,
      the sequence product exp(sum_t log rho_t) against [lower, upper], so a token-level weight can be rejected by
      sequence (at level sequence it equals ``ratio``; log rho_t summed unclamped, as TRL's sequence modes, where
      verl clamps each token first: they differ only for |log rho_t| > 20); ``max``, a sequence is rejected when any
      of its loss tokens has rho_t outside [lower, upper] (with [1/C, C]: max_t |log rho_t| > log C, equal to verl
      ``seq_max_k2`` at threshold 0.5 (log C)^2; ``lower`` alone is verl's former per-token veto); ``k2``, a sequence
      is rejected when mean_t 0.5 (log rho_t)^2 > ``upper`` (verl ``seq_mean_k2``, log rho_t clamped to +-20 as
      verl); ``k2_sum`` / ``k2_max`` the sum / max over the sequence (verl ``seq_sum_k2`` / ``seq_max_k2``), and ``k3``,
      ``k3_sum``, ``k3_max`` the mean / sum / max of ``e^l - 1 - l`` (verl ``seq_mean_k3`` / ``seq_sum_k3`` /
      ``seq_max_k3``). ratio/sum/max bounds are ratios, inclusive; k2/k3 statistics take only ``upper`` (a lower bound
      is refused). verl's per-token ``token_k2`` / ``token_k3`` are ``ratio`` at token level with the bounds where the
      divergence equals the threshold (``token_k2`` u: [e^-sqrt(2u), e^sqrt(2u)]); verl's comma-chained criteria are
      not covered.
    * ``drop_from_denominator`` (mask and reject modes): false, rejected tokens get weight 0 and stay in the aggregation
      denominator (TRL's ``*_mask``, mis, icepop; default); true, they leave it (verl's ``modified_response_mask``).

    Defaults: ``preset: none`` with the mis grid (token, mask, ratio, [0.5, 2]). ``preset`` fills the fields not given
    with tis's, mis's or icepop's defaults (icepop: lower = 1/upper unless given); fields given override it, so
    ``{preset: tis, level: sequence, upper: 3}`` is ``tis`` with those params. Refused at validation, naming the
    field: truncate with a statistic other than ratio or with drop_from_denominator, k2 with a lower bound or without
    an upper one, lower > upper, negative bounds, no bound at all, unknown preset. Diagnostics, needs and ``support``
    as every correction (:class:`~trl_ext_plugins.corrections.base.RolloutCorrection`), under ``rollout_correction/``.
    """

    name = "rollout_correction"
    Params = RolloutCorrectionParams

    @property
    def drops_from_denominator(self):
        return self.params.drop_from_denominator

    def weights(self, log_rho, mask):
        p = self.params
        return correction_weights(log_rho, mask, p.level, p.mode, p.statistic, p.lower, p.upper)
