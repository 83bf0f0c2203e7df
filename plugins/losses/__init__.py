"""Policy-gradient objectives, clipping variants and aggregations for the GRPO trainer.

Objectives fill the exclusive ``objective`` slot (``trl_ext_policy_loss``) and pin the TRL ``loss_type`` whose
aggregation their paper uses; ``aggregation`` fills the ``aggregation`` slot and overrides that choice. The math is in
:mod:`trl_ext_plugins.losses.math` (plus the generic pieces of :mod:`trl_ext.ops`).
"""

from trl_ext import hookimpl
from trl_ext_plugins.losses.aggregation import Aggregation
from trl_ext_plugins.losses.ce_gppo import CEGPPO
from trl_ext_plugins.losses.cispo import CISPO
from trl_ext_plugins.losses.clip_higher import ClipHigher
from trl_ext_plugins.losses.dapo import DAPO
from trl_ext_plugins.losses.dr_grpo import DrGRPO
from trl_ext_plugins.losses.gmpo import GMPO
from trl_ext_plugins.losses.grpo import GRPO
from trl_ext_plugins.losses.gspo import GSPO
from trl_ext_plugins.losses.reinforce import REINFORCE
from trl_ext_plugins.losses.sapo import SAPO

PLUGINS = (GRPO, DrGRPO, DAPO, GSPO, GMPO, SAPO, CISPO, CEGPPO, ClipHigher, REINFORCE, Aggregation)


@hookimpl
def trl_ext_register_plugins(register):
    for plugin in PLUGINS:
        register(plugin)
