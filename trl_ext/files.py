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
    write_text_atomic(path, json.dumps(payload, indent=2, sort_keys=True, default=str))


def write_text_atomic(path: Path, text: str) -> None:
    """``text`` at ``path`` through a temporary file beside it, flushed to disk before the rename and the rename
    flushed after it: a kill leaves the old file or the new one, and so does a power loss (without the fsync a file
    system may commit the rename before the data, leaving an empty file under the new name)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    crash_point(f"write:{path.name}")
    os.replace(tmp, path)
    fsync_folder(path.parent)


def fsync_folder(folder: Path) -> None:
    """Flush a folder's entries (a rename or new file in it) to disk; a no-op where folders cannot be opened."""
    try:
        descriptor = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(descriptor)
    except OSError:
        pass
    finally:
        os.close(descriptor)
