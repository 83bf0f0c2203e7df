"""``reinforce``: plain policy gradient with a baseline (no ratio, no clip)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from trl_ext import PluginParams, hookimpl
from trl_ext_plugins.losses import math
from trl_ext_plugins.losses.base import (ObjectivePlugin, recipe_off_policy_reason,
                                         trainer_off_policy_reason)


class REINFORCEParams(PluginParams):
    scale_rewards: Literal["none", "group", "batch"] = Field(
        "none", description="Advantage = R - mean_G(R) ('none', the plain group-mean baseline), or also divided by "
                            "the group/batch std (TRL args.scale_rewards).")


class REINFORCE(ObjectivePlugin):
    """REINFORCE with a baseline (Williams 1992; "Back to Basics", Ahmadian et al. 2024, arXiv 2402.14740).

    ``L = -(R - b) * sum_t log pi(y_t)``: per token ``-A * log pi``, no ratio and no clipping. Baseline b: the group
    mean of the G samples of the prompt (TRL's advantage with ``scale_rewards: none``). Aggregation: the per-sequence
    *sum* over tokens, i.e. ``args.loss_type: dr_grpo`` (sum / (B * max_completion_length), the REINFORCE sum up to the
    constant 1/L). The estimator is on-policy only: a batch reused (``args.num_iterations > 1``) or split over several
    optimizer steps (``args.steps_per_generation`` > ``gradient_accumulation_steps``, also when implied by
    ``generation_batch_size``; TRL then recomputes pi_old, which this objective ignores) is refused, at validation
    where the recipe says so and otherwise when the trainer is built (use a ratio objective for off-policy batches).
    """

    name = "reinforce"
    Params = REINFORCEParams
    trl_args = {"loss_type": "dr_grpo"}

    def extra_trl_args(self):
        return {"scale_rewards": self.params.scale_rewards}

    @hookimpl
    def trl_ext_validate_stage(self, stage, plugins):
        reason = recipe_off_policy_reason(stage.args)
        return [self._refusal(reason)] if reason else None

    @hookimpl
    def trl_ext_trainer_created(self, trainer):
        # generation_batch_size sets steps_per_generation through the process count, known only now
        reason = trainer_off_policy_reason(trainer.args)
        if reason:
            raise ValueError(self._refusal(reason))

    def _refusal(self, reason: str) -> str:
        return f"plugin 'reinforce' is on-policy (no ratio), but {reason}; use a ratio objective for off-policy batches"

    @hookimpl
    def trl_ext_policy_loss(self, inputs):
        logps, _, advantages = math.masked_inputs(inputs)
        return math.reinforce_objective(logps, advantages)

