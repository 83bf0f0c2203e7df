"""The per-stage plugin host: a pluggy manager holding the plugin instances one recipe stage selected.

Built from the recipe, the same way on every rank (no module-global manager). Plugins are registered in reverse
recipe order because pluggy calls implementations last-registered-first; so every hook runs in recipe order.
"""

from __future__ import annotations

from typing import Any

import pluggy

from trl_ext import hookspecs
from trl_ext.plugin import Need, Plugin, Slot


class PluginHost:
    """Selected plugin instances for one stage, and the pluggy hook relay that calls them."""

    def __init__(self, plugins: list[Plugin] | None = None):
        self.plugins: list[Plugin] = list(plugins or [])
        self.pm = pluggy.PluginManager(hookspecs.PROJECT)
        self.pm.add_hookspecs(hookspecs)
        for index, plugin in reversed(list(enumerate(self.plugins))):
            self.pm.register(plugin, name=f"{index}:{plugin.name}")
        self.pm.check_pending()

    @property
    def hook(self) -> pluggy.HookRelay:
        return self.pm.hook

    def implements(self, hook_name: str) -> bool:
        """True when some selected plugin implements ``hook_name`` (lets trainers skip work nobody asked for)."""
        return bool(getattr(self.pm.hook, hook_name).get_hookimpls())

    def filling(self, slot: Slot) -> Plugin | None:
        return next((p for p in self.plugins if slot in p.slots), None)

    def needs(self) -> set[Need]:
        return {need for plugin in self.plugins for need in plugin.needs}

    def names(self) -> list[str]:
        return [p.name for p in self.plugins]

    def get(self, name: str) -> Plugin | None:
        return next((p for p in self.plugins if p.name == name), None)

    def call_pipeline(self, hook_name: str, value: Any, **kwargs: Any) -> Any:
        """Chain a pipeline hook: each plugin (recipe order) gets the previous plugin's result; None = unchanged."""
        for impl in reversed(getattr(self.pm.hook, hook_name).get_hookimpls()):
            result = impl.function(**{_first_arg(hook_name): value, **kwargs})
            if result is not None:
                value = result
        return value


# The argument a pipeline hook threads through its implementations.
_PIPELINE_ARG = {
    "trl_ext_prepare_dataset": "dataset",
    "trl_ext_shape_rewards": "rewards_per_func",
}


def _first_arg(hook_name: str) -> str:
    return _PIPELINE_ARG[hook_name]
