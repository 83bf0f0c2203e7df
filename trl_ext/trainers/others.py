"""Trainers whose seams are the generic ones (dataset, reward functions, trainer-created, after-stage): thin
subclasses so every stage has a plugin host. They override no TRL method."""

from __future__ import annotations

from trl import DistillationTrainer, RewardTrainer, RLOOTrainer

from trl_ext.trainers.base import HostMixin


class ExtRewardTrainer(HostMixin, RewardTrainer):
    def __init__(self, *args, plugin_host, **kwargs):
        self._init_host(plugin_host)
        super().__init__(*args, **kwargs)


class ExtDistillationTrainer(HostMixin, DistillationTrainer):
    def __init__(self, *args, plugin_host, **kwargs):
        self._init_host(plugin_host)
        super().__init__(*args, **kwargs)


class ExtRLOOTrainer(HostMixin, RLOOTrainer):
    def __init__(self, *args, plugin_host, **kwargs):
        self._init_host(plugin_host)
        super().__init__(*args, **kwargs)
