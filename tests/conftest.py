"""Shared test setup: offline, quiet, deterministic."""

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
os.environ.setdefault("TRL_EXT_TEST", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture
def no_model_loads(monkeypatch):
    """Validation must never load a model: make every loader fail loudly (``usefixtures`` in validation tests)."""
    import transformers

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded during validation")

    monkeypatch.setattr(transformers.PreTrainedModel, "from_pretrained", classmethod(refuse))
    monkeypatch.setattr("trl_ext.embedded.models.materialize_model", refuse)
