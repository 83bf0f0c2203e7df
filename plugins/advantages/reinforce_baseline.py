"""``reinforce_baseline``: REINFORCE advantages ``R - b`` with a choice of baseline."""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field

from trl_ext import Plugin, PluginParams, Slot, hookimpl
from trl_ext_plugins.advantages.math import (
    baseline_advantages,
    batch_mean_baseline,
    ema_update,
    group_mean_baseline,
)
from trl_ext_plugins.advantages.rollout import kept_rewards, local


class ReinforceBaselineParams(PluginParams):
    baseline: Literal["none", "batch_mean", "group_mean", "moving_average"] = Field(
        "group_mean", description="b(x): none (b = 0), batch_mean (mean reward of the gathered batch), group_mean "
        "(mean of the prompt's samples) or moving_average (exponential moving average of past batch means).")
    decay: float = Field(0.9, ge=0.0, lt=1.0, description="moving_average: b <- decay * b + (1 - decay) * mean(R), "
                         "updated after the batch's advantages are computed.")
    initial: float = Field(0.0, description="moving_average: the baseline used for the first batch.")


def _none(rewards, batch, plugin):
    return torch.zeros_like(rewards)


def _batch_mean(rewards, batch, plugin):
    return batch_mean_baseline(rewards)


def _group_mean(rewards, batch, plugin):
    return group_mean_baseline(rewards, batch.num_generations)


def _moving_average(rewards, batch, plugin):
    baseline = torch.full_like(rewards, plugin.running_baseline)
    if batch.trainer is None or batch.trainer.model.training:  # evaluation batches do not move the training baseline
        plugin.running_baseline = ema_update(plugin.running_baseline, rewards, plugin.params.decay)
    return baseline


BASELINES = {"none": _none, "batch_mean": _batch_mean, "group_mean": _group_mean, "moving_average": _moving_average}


class ReinforceBaseline(Plugin):
    """REINFORCE with a baseline (Williams 1992; for LLMs Ahmadian et al. 2024, arXiv 2402.14740).

    ``A = R(x, y) - b(x)``, one value per sequence broadcast to its tokens. This plugin is only the *advantage*
    side; pair it with the ``reinforce`` objective of the losses family (no ratio, ``-A * log pi``) for the plain
    estimator, or with any other objective. The baseline is unbiased when it does not depend on ``y``: ``none``,
    ``moving_average`` (the value from *previous* batches is used, then updated) and, approximately,
    ``batch_mean``/``group_mean`` (which include the sample itself; ``rloo`` is the leave-one-out fix).

    Defaults: ``baseline: group_mean`` (TRL GRPO with ``scale_rewards: none`` gives the same numbers), EMA ``decay``
    0.9, ``initial`` 0. Unscorable rows, and rows ``trl_ext_filter_groups`` dropped, are left out of the means
    (the moving average included) and get advantage 0. The moving average is plugin
    state kept identically on every rank (rewards are gathered), updated by training batches only (evaluation uses
    it without moving it); the main process saves it with every checkpoint and every rank restores it on resume
    (:class:`trl_ext.callbacks.PluginStateCheckpoint`), so a resumed run continues the uninterrupted run's baseline.
    """

    name = "reinforce_baseline"
    family = "advantage"
    trainers = frozenset({"grpo"})
    slots = frozenset({Slot.ADVANTAGE})
    Params = ReinforceBaselineParams

    def __init__(self, params=None):
        super().__init__(params)
        self.running_baseline = self.params.initial

    @hookimpl
    def trl_ext_trainer_created(self, trainer):
        if self.params.baseline == "moving_average":
            from trl_ext.callbacks import PluginStateCheckpoint

            trainer.add_callback(PluginStateCheckpoint(self.name, self.baseline_state, self.load_baseline_state))

    def baseline_state(self) -> dict:
        return {"running_baseline": self.running_baseline}

    def load_baseline_state(self, state: dict) -> None:
        self.running_baseline = float(state["running_baseline"])

    @hookimpl
    def trl_ext_compute_advantages(self, rewards, batch):
        rewards = kept_rewards(rewards, batch)  # rows a filter dropped move no batch mean and no running baseline
        baseline = BASELINES[self.params.baseline](rewards, batch, self)
        batch.metrics["advantages/baseline_mean"] = torch.nanmean(baseline).item()
        return local(baseline_advantages(rewards, baseline), batch)
