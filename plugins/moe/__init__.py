"""Mixture-of-experts plugins: ``routing_replay`` (R3 rollout routing replay and R2 old-policy replay)."""

from trl_ext import hookimpl

PLUGINS: tuple = ()


@hookimpl
def trl_ext_register_plugins(register):
    for plugin in PLUGINS:
        register(plugin)
