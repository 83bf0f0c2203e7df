"""Generate docs/hooks.md from trl_ext/hookspecs.py, trl_ext/batches.py and four first-party plugins:
python docs/gen_hooks.py"""

import dataclasses
import inspect
import re
from pathlib import Path

from trl_ext import batches, hookspecs

# The bundles hooks receive, in the order a stage meets them.
HOOK_INPUTS = (batches.RolloutBatch, batches.AggregationContext, batches.LossInputs, batches.TokenWeights,
               batches.PreferenceInputs)
# One small real plugin per family, shown whole: the way to start a new one.
EXAMPLES = (
    ("a reward", "trl_ext_plugins.rewards.exact_match"),
    ("an advantage estimator", "trl_ext_plugins.advantages.rloo"),
    ("a policy objective (loss)", "trl_ext_plugins.losses.cispo"),
    ("a correction (token weights)", "trl_ext_plugins.corrections.tis"),
)
_FIELD = re.compile(r"^\s{4}(\w+):\s*([^=#]+?)\s*(?:=[^#]*)?(?:#\s*(.*))?$")


def field_comments(cls) -> dict[str, str]:
    """The trailing comment of each field line in the class body (batches.py documents fields that way)."""
    comments, above = {}, []
    for line in inspect.getsource(cls).splitlines():
        stripped = line.strip()
        if stripped.startswith("#"):  # a comment block above a field documents it too
            above.append(stripped.lstrip("# "))
            continue
        match = _FIELD.match(line)
        if match:
            text = " ".join(above + ([match.group(3).strip()] if match.group(3) else []))
            if text:
                comments[match.group(1)] = text
        above = []
    return comments


def render_inputs() -> list[str]:
    lines = ["# Hook inputs", "", "Fields of the bundles passed to run hooks (from `trl_ext/batches.py`).", ""]
    for cls in HOOK_INPUTS:
        own = {f.name for f in dataclasses.fields(cls)}
        base = next((b for b in cls.__mro__[1:] if dataclasses.is_dataclass(b)), None)
        inherited = {f.name for f in dataclasses.fields(base)} if base else set()
        comments = {**(field_comments(base) if base else {}), **field_comments(cls)}
        lines += [f"## `{cls.__name__}`", "", inspect.getdoc(cls), ""]
        if base:
            lines += [f"Also has every field of `{base.__name__}`.", ""]
        lines += ["| field | type | meaning |", "|---|---|---|"]
        for field in dataclasses.fields(cls):
            if field.name in inherited and field.name in own and base:
                continue
            kind = field.type if isinstance(field.type, str) else getattr(field.type, "__name__", str(field.type))
            cells = [f"`{field.name}`", f"`{kind}`", comments.get(field.name, "")]
            lines.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
        props = [n for n, v in vars(cls).items() if isinstance(v, property)]
        for name in props:
            doc = (inspect.getdoc(getattr(cls, name)) or "").split("\n")[0]
            lines.append(f"| `{name}` (property) | | {doc.replace('|', chr(92) + '|')} |")
        lines.append("")
    return lines


def render_examples() -> list[str]:
    import importlib

    lines = ["# One plugin per family", "",
             "Real first-party plugins, shown whole (each is registered in its family's `__init__.py`).", ""]
    for label, module_name in EXAMPLES:
        module = importlib.import_module(module_name)
        lines += [f"## {label}: `{module_name}`", "", "```python", inspect.getsource(module).rstrip(), "```", ""]
    return lines


def render() -> str:
    lines = ["# trl-ext hook reference", "", "Generated from `trl_ext/hookspecs.py`, `trl_ext/batches.py` and four "
             "first-party plugins by `python docs/gen_hooks.py`.", "", inspect.getdoc(hookspecs), ""]
    for name, fn in inspect.getmembers(hookspecs, inspect.isfunction):
        if not name.startswith("trl_ext_"):
            continue
        opts = getattr(fn, "trl_ext_spec", {}) or {}
        kind = " (firstresult)" if opts.get("firstresult") else ""
        lines += [f"## `{name}{inspect.signature(fn)}`{kind}", "", inspect.getdoc(fn), ""]
    return "\n".join(lines + render_inputs() + render_examples())


if __name__ == "__main__":
    Path(__file__).with_name("hooks.md").write_text(render())
