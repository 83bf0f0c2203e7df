"""What every trl-ext trainer subclass shares: the plugin host and plugin-metric logging."""

from __future__ import annotations

from trl_ext.host import PluginHost


class HostMixin:
    """Mixed in front of a TRL trainer class; holds the stage's :class:`PluginHost`."""

    plugin_host: PluginHost

    def _init_host(self, plugin_host: PluginHost | None) -> None:
        # Set before TRL's __init__ runs: TRL may call overridden methods (e.g. dataset preparation) from it.
        self.plugin_host = plugin_host if plugin_host is not None else PluginHost()

    def _plugin_train_sampler(self, dataset, default):
        """``trl_ext_train_sampler``'s sampler for ``dataset`` (the train dataset when ``None``), else ``default()``
        (TRL's own). Used by the RL trainers' ``_get_train_sampler``."""
        dataset = self.train_dataset if dataset is None else dataset
        sampler = None
        if self.plugin_host.implements("trl_ext_train_sampler"):
            sampler = self.plugin_host.hook.trl_ext_train_sampler(trainer=self, dataset=dataset)
        return default() if sampler is None else sampler

    def _log_plugin_metrics(self, metrics: dict[str, float]) -> None:
        """Append plugin figures to TRL's metric buffers; TRL averages them into each logged step."""
        if not metrics:
            return
        mode = "train" if self.model.training else "eval"
        for key, value in metrics.items():
            self._metrics[mode][key].append(float(value))
