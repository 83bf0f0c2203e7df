"""Mixture-of-experts plugins: ``routing_replay`` (R3 rollout routing replay and R2 old-policy replay)."""

from trl_ext import hookimpl
from trl_ext_plugins.moe.routing_replay import RoutingReplay

PLUGINS: tuple = (RoutingReplay,)


@hookimpl
def trl_ext_register_plugins(register):
    for plugin in PLUGINS:
        register(plugin)
