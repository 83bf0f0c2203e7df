"""Trainers whose seams are the generic ones (dataset, reward functions, trainer-created, after-stage): thin
subclasses so every stage has a plugin host. The distillation trainer's generation goes through ``trl_ext_generate``
(for GKD's on/off-policy mix); the RLOO trainer asks ``trl_ext_train_sampler`` for its train sampler (TRL 1.16:
``_get_train_sampler(dataset)`` returns a ``RepeatSampler``).

TRL 1.16 internals relied on: ``DistillationTrainer._generate(prompts)`` returns ``(prompt_ids, completion_ids,
tool_mask, images, tool_images)`` (lists of token-id lists) and ``_generate_and_score_completions(inputs)`` receives the
generation batch's dataset rows."""

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
        self.generation_rows: list[dict] = []  # dataset rows of the generation batch being built (for plugins)
        super().__init__(*args, **kwargs)

    def _generate_and_score_completions(self, inputs):
        self.generation_rows = inputs
        return super()._generate_and_score_completions(inputs)

    def _generate(self, prompts):
        if not self.plugin_host.implements("trl_ext_generate"):
            return super()._generate(prompts)
        result = self.plugin_host.hook.trl_ext_generate(trainer=self, prompts=prompts, generate=super()._generate)
        return super()._generate(prompts) if result is None else result


class ExtRLOOTrainer(HostMixin, RLOOTrainer):
    def __init__(self, *args, plugin_host, **kwargs):
        self._init_host(plugin_host)
        super().__init__(*args, **kwargs)

    def _get_train_sampler(self, dataset=None):
        return self._plugin_train_sampler(dataset, lambda: super(ExtRLOOTrainer, self)._get_train_sampler(dataset))
