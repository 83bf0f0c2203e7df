"""Skip markers shared by test files, each with the reason the skip is allowed."""

from __future__ import annotations

import importlib.util

import pytest

HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None

# The README's test command installs only the `dev` extra, so multi-process DeepSpeed (ZeRO-2/3) tests cannot run
# there; they are marked slow and .ci/run installs the `deepspeed` extra before the slow suite, where they do run.
NEEDS_DEEPSPEED = pytest.mark.skipif(not HAS_DEEPSPEED, reason="DeepSpeed is an extra: pip install "
                                     "'trl-ext[deepspeed]' (.ci/run installs it before the slow suite)")
