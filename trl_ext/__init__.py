"""trl-ext: post-training algorithms as pluggy plugins over Hugging Face TRL's own trainers."""

from trl_ext.hookspecs import hookimpl
from trl_ext.plugin import Need, NoParams, Plugin, PluginParams, Slot

__version__ = "0.1.0"
__all__ = ["hookimpl", "Need", "NoParams", "Plugin", "PluginParams", "Slot", "__version__"]
