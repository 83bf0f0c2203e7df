"""Multi-token-prediction plugins: ``mtp_heads`` (retrain the MTP draft heads after RL, trunk frozen)."""

from trl_ext import hookimpl

PLUGINS: tuple = ()


@hookimpl
def trl_ext_register_plugins(register):
    for plugin in PLUGINS:
        register(plugin)
