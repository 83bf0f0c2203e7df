"""Weight-space merging plugins: ``checkpoint_average`` (soups, LAWA, EMA) and ``warp`` (EMA anchor, SLERP, LITI)."""

from trl_ext import hookimpl

PLUGINS: tuple = ()


@hookimpl
def trl_ext_register_plugins(register):
    for plugin in PLUGINS:
        register(plugin)
