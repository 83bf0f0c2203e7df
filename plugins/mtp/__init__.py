"""Multi-token-prediction plugins: ``mtp_heads`` (retrain the MTP draft heads after RL, trunk frozen)."""

from trl_ext import hookimpl
from trl_ext_plugins.mtp.mtp_heads import MtpHeads

PLUGINS: tuple = (MtpHeads,)


@hookimpl
def trl_ext_register_plugins(register):
    for plugin in PLUGINS:
        register(plugin)
