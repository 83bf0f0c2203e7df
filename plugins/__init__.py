"""First-party trl-ext plugins, importable as ``trl_ext_plugins`` and registered through the ``trl_ext`` entry-point
group exactly like third-party plugins. One module per plugin, one package per family."""
