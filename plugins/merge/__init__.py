"""Weight-space merging plugins: ``checkpoint_average`` (soups, LAWA, EMA) and ``warp`` (EMA anchor, SLERP, LITI)."""

from trl_ext import hookimpl
from trl_ext_plugins.merge.checkpoint_average import CheckpointAverage
from trl_ext_plugins.merge.warp import Warp

PLUGINS: tuple = (CheckpointAverage, Warp)


@hookimpl
def trl_ext_register_plugins(register):
    for plugin in PLUGINS:
        register(plugin)
