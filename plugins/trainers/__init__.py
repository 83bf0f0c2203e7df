"""Trainer-level plugins (SFT family)."""

from trl_ext import hookimpl
from trl_ext_plugins.trainers.sft import SFT


@hookimpl
def trl_ext_register_plugins(register):
    register(SFT)
