"""Rollout-side plugins of the losses/corrections work: ``rollout_logprobs`` (sampling log-probs without vLLM) and
``dynamic_sampling`` (DAPO: drop zero-variance groups, refill the batch); rollout control: ``pass_rate_filter``
(difficulty filter and curriculum), ``partial_rollout`` (stop at a finished fraction, resume the rest), ``multi_env`` (several environments in one run),
``self_play`` (R-Zero proposer / solver), ``pivot_rl`` (turn-level GRPO at pivot turns), ``reasoning_gym`` (a reasoning-gym family's verifier as a reward)."""

from trl_ext import hookimpl
from trl_ext_plugins.rollout.dynamic_sampling import DynamicSampling
from trl_ext_plugins.rollout.multi_env import MultiEnv
from trl_ext_plugins.rollout.partial_rollout import PartialRollout
from trl_ext_plugins.rollout.pass_rate_filter import PassRateFilter
from trl_ext_plugins.rollout.pivot_rl import PivotRL
from trl_ext_plugins.rollout.reasoning_gym_env import ReasoningGymScore
from trl_ext_plugins.rollout.rollout_logprobs import RolloutLogprobs
from trl_ext_plugins.rollout.self_play import SelfPlay

PLUGINS = (RolloutLogprobs, DynamicSampling, PassRateFilter, PartialRollout, MultiEnv, SelfPlay, PivotRL,
           ReasoningGymScore)


@hookimpl
def trl_ext_register_plugins(register):
    for plugin in PLUGINS:
        register(plugin)


@hookimpl
def trl_ext_register_datasets(register):
    from trl_ext_plugins.rollout.datasets import DATASETS

    for name, build in DATASETS.items():
        register(name, build)
