"""Preference optimisation for the DPO and KTO trainers: losses (ALGORITHMS.md items 18-25), delta-learning pairs
(item 8) and iterative DPO (item 26)."""

from trl_ext import hookimpl
from trl_ext_plugins.preference.apo import APO
from trl_ext_plugins.preference.delta_pairs import DeltaPairs
from trl_ext_plugins.preference.dpo import DPO
from trl_ext_plugins.preference.ipo import IPO
from trl_ext_plugins.preference.iterative_dpo import IterativeDPO
from trl_ext_plugins.preference.kto import KTO
from trl_ext_plugins.preference.orpo import ORPO
from trl_ext_plugins.preference.qrpo import QRPO
from trl_ext_plugins.preference.rpo import RPO
from trl_ext_plugins.preference.simpo import SimPO


@hookimpl
def trl_ext_register_plugins(register):
    for plugin in (DPO, IPO, APO, SimPO, ORPO, RPO, QRPO, KTO, DeltaPairs, IterativeDPO):
        register(plugin)


@hookimpl
def trl_ext_register_datasets(register):
    from trl_ext_plugins.preference.data import arithmetic_reward_pairs

    register("arithmetic_rewards", arithmetic_reward_pairs)
