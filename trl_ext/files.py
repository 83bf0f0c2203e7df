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
    write_bytes_atomic(path, text.encode("utf-8"))


def save_figure_atomic(figure, path: Path, **savefig_kwargs) -> Path:
    """A matplotlib figure as PNG at ``path``, written like :func:`write_bytes_atomic`: ``savefig`` straight to the
    path opened whatever was there, and followed a symlink planted under the output directory out of it."""
    import io

    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", **savefig_kwargs)
    write_bytes_atomic(Path(path), buffer.getvalue())
    return Path(path)


def write_bytes_atomic(path: Path, data: bytes) -> None:
    """``data`` at ``path`` (see :func:`write_text_atomic`); the rename replaces a symlink at ``path`` itself, never
    the file it points to."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as handle:
        handle.write(data)
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


def read_jsonl(path: Path) -> list[dict]:
    """The rows of a JSON-lines file, skipping a torn (half-written) line such as a killed process leaves."""
    rows = []
    if not path.exists():
        return rows
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows
