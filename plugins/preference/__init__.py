"""Preference-optimisation losses for the DPO trainer."""

from trl_ext import hookimpl
from trl_ext_plugins.preference.dpo import DPO


@hookimpl
def trl_ext_register_plugins(register):
    register(DPO)
