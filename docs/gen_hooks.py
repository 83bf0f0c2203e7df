"""Generate docs/hooks.md from the docstrings in trl_ext/hookspecs.py: python docs/gen_hooks.py"""

import inspect
from pathlib import Path

from trl_ext import hookspecs


def render() -> str:
    lines = ["# trl-ext hook reference", "", "Generated from `trl_ext/hookspecs.py` by `python docs/gen_hooks.py`.", "",
             inspect.getdoc(hookspecs), ""]
    for name, fn in inspect.getmembers(hookspecs, inspect.isfunction):
        if not name.startswith("trl_ext_"):
            continue
        opts = getattr(fn, "trl_ext_spec", {}) or {}
        kind = " (firstresult)" if opts.get("firstresult") else ""
        lines += [f"## `{name}{inspect.signature(fn)}`{kind}", "", inspect.getdoc(fn), ""]
    return "\n".join(lines)


if __name__ == "__main__":
    Path(__file__).with_name("hooks.md").write_text(render())
