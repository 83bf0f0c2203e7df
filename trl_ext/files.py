"""Writes that a resume depends on: all-or-nothing, so a kill at any instant leaves the old file or the new one."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from trl_ext.faults import crash_point


def write_json_atomic(path: Path, payload: Any) -> None:
    """``payload`` as JSON at ``path``: written to a temporary file beside it, then renamed over it (``os.replace`` is
    atomic on one file system)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(payload, indent=2, sort_keys=True, default=str))
    crash_point(f"write:{path.name}")
    os.replace(tmp, path)
