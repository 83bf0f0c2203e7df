"""Rollout-side plugins of the losses/corrections work: ``rollout_logprobs`` (sampling log-probs without vLLM) and
``dynamic_sampling`` (DAPO: drop zero-variance groups, refill the batch)."""

from trl_ext import hookimpl
from trl_ext_plugins.rollout.dynamic_sampling import DynamicSampling
from trl_ext_plugins.rollout.rollout_logprobs import RolloutLogprobs

PLUGINS = (RolloutLogprobs, DynamicSampling)


@hookimpl
def trl_ext_register_plugins(register):
    for plugin in PLUGINS:
        register(plugin)
