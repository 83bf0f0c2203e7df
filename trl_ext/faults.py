"""Fault injection for the crash-safety tests: a kill -9 at a chosen write point of a run.

``TRL_EXT_CRASH_AT=<point>[:<n>]`` ends the process with ``os._exit(137)`` (no cleanup, no ``finally`` blocks, open
files left as they are: what SIGKILL leaves) the n-th time (default 1) the run reaches ``<point>``. Points are named
where they are called: ``checkpoint`` (a checkpoint's files written, its completion marker not yet), ``metrics``
(half a metrics.jsonl line written), ``train_end`` (training done, final save not started), ``final_save`` (the final
model written to its temporary folder, not yet moved into place), ``write:<file name>`` (an atomic JSON write's
temporary file written, not yet renamed). Unset, every call is a dictionary lookup and nothing else.
"""

from __future__ import annotations

import os

ENV_CRASH_AT = "TRL_EXT_CRASH_AT"
_reached: dict[str, int] = {}


def crash_point(name: str) -> None:
    spec = os.environ.get(ENV_CRASH_AT)
    if not spec:
        return
    point, _, count = spec.rpartition(":")
    if not count.isdigit():
        point, count = spec, "1"
    if point != name:
        return
    _reached[name] = _reached.get(name, 0) + 1
    if _reached[name] == int(count):
        os._exit(137)
