"""Off-policy corrections against the rollout policy: tis, mis, icepop and rollout_correction (their grid, token
weights), rollout_ratio (objective), m2po (token mask). Math in :mod:`trl_ext_plugins.corrections.math`."""

from trl_ext import hookimpl
from trl_ext_plugins.corrections.icepop import IcePop
from trl_ext_plugins.corrections.m2po import M2PO
from trl_ext_plugins.corrections.mis import MIS
from trl_ext_plugins.corrections.rollout_correction import UnifiedCorrection
from trl_ext_plugins.corrections.rollout_ratio import RolloutRatio
from trl_ext_plugins.corrections.tis import TIS

PLUGINS = (TIS, MIS, IcePop, UnifiedCorrection, RolloutRatio, M2PO)


@hookimpl
def trl_ext_register_plugins(register):
    for plugin in PLUGINS:
        register(plugin)
