"""Training curves of a multi-stage run: loss and reward against a global step axis."""

import json
from pathlib import Path

from matplotlib.figure import Figure

LOSS_KEY = "loss"


def plot_curves(metrics_files: dict[str, Path], out_png: Path) -> Path:
    """Draw loss (left panel) and reward (right panel) of each stage and save them to `out_png`.

    `metrics_files` maps stage names, in run order, to JSON-lines files with one TRL log record per
    line, each with a "step" key. Stages are laid end to end: a stage's steps are offset by the last
    step of the stages before it, and a dashed line marks where each stage after the first begins.
    The reward is TRL's "reward" (GRPO, RLOO) or, failing that, the first "rewards/<name>/mean".
    Records or stages lacking a key are skipped, and a panel with no data says so.
    """
    out_png = Path(out_png)
    # A bare Figure renders with Agg without touching pyplot's global state or needing a display.
    figure = Figure(figsize=(11, 4), layout="constrained")
    # Shared x axis: both panels span the whole run even when only later stages log a reward.
    loss_axes, reward_axes = figure.subplots(1, 2, sharex=True)
    panels = ((loss_axes, "loss"), (reward_axes, "reward"))

    offset = 0
    boundaries = set()
    for index, (stage, path) in enumerate(metrics_files.items()):
        records = _read_records(Path(path))
        for axes, kind in panels:
            key = LOSS_KEY if kind == "loss" else _reward_key(records)
            points = [(offset + r["step"], r[key]) for r in records if key is not None and _is_number(r.get(key))]
            if points:
                steps, values = zip(*points)
                # One colour per stage in both panels, so a stage reads the same on either side.
                axes.plot(steps, values, label=stage, color=f"C{index}")
        if index > 0 and records:
            boundaries.add(offset)
        offset += max((r["step"] for r in records), default=0)

    for axes, kind in panels:
        for boundary in sorted(boundaries):
            axes.axvline(boundary, color="grey", linestyle="--", linewidth=0.8)
        axes.set_xlabel("global step")
        axes.set_ylabel(kind)
        axes.set_title(kind)
        if axes.get_lines():
            axes.legend()
        else:
            axes.text(0.5, 0.5, f"no {kind} logged", ha="center", va="center", transform=axes.transAxes)

    out_png.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out_png, dpi=100)
    return out_png


def _read_records(path: Path) -> list[dict]:
    # A missing file is an empty stage (e.g. a stage that logged nothing); records without a step,
    # such as a final summary written by something other than TRL, cannot be placed and are dropped.
    if not path.exists():
        return []
    records = (json.loads(line) for line in path.read_text().splitlines() if line.strip())
    return [r for r in records if _is_number(r.get("step"))]


def _reward_key(records: list[dict]) -> str | None:
    keys = {key for record in records for key in record}
    if "reward" in keys:
        return "reward"
    named = sorted(k for k in keys if k.startswith("rewards/") and k.endswith("/mean"))
    return named[0] if named else None


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
