"""Advantage estimators (ALGORITHMS.md items 27-30, 38, 39): rewards -> advantages through ``trl_ext_compute_advantages``.

Plugin modules are imported when registered, so ``trl_ext_plugins.advantages.math`` stays importable without TRL.
"""

from trl_ext import hookimpl


def plugin_classes() -> tuple[type, ...]:
    from trl_ext_plugins.advantages.group_norm import GroupNorm
    from trl_ext_plugins.advantages.reinforce_baseline import ReinforceBaseline
    from trl_ext_plugins.advantages.reinforce_pp import ReinforcePP, ReinforcePPBaseline
    from trl_ext_plugins.advantages.remax import ReMax
    from trl_ext_plugins.advantages.ppo import PPO
    from trl_ext_plugins.advantages.rloo import RLOO
    from trl_ext_plugins.advantages.vapo import VAPO

    return RLOO, ReinforceBaseline, ReMax, ReinforcePP, ReinforcePPBaseline, PPO, VAPO, GroupNorm


@hookimpl
def trl_ext_register_plugins(register):
    for plugin in plugin_classes():
        register(plugin)
