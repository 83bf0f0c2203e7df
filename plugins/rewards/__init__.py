"""Reward plugins for RL trainers (GRPO, RLOO) and held-out evaluation."""

from trl_ext import hookimpl
from trl_ext_plugins.rewards.exact_match import ExactMatch


@hookimpl
def trl_ext_register_plugins(register):
    register(ExactMatch)
