"""Shared test setup: offline, quiet, deterministic."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
os.environ.setdefault("TRL_EXT_TEST", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
