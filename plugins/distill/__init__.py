"""Distillation plugins: teacher traces, rejection sampling, GKD, on-policy distillation as RL, multi-teacher and
own-stage teachers, BOND."""

from trl_ext import hookimpl
from trl_ext_plugins.distill.gkd import GKD

PLUGINS: tuple = (GKD,)


@hookimpl
def trl_ext_register_plugins(register):
    for plugin in PLUGINS:
        register(plugin)
