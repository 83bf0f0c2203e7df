"""Policy-gradient objectives, clipping variants and aggregations for the GRPO trainer."""

from trl_ext import hookimpl
from trl_ext_plugins.losses.grpo import GRPO


@hookimpl
def trl_ext_register_plugins(register):
    register(GRPO)
