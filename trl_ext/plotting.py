"""Training curves of a multi-stage run: loss, reward and held-out accuracy against a global step axis."""

from pathlib import Path

from matplotlib.figure import Figure

from trl_ext.files import read_jsonl, save_figure_atomic

LOSS_KEY = "loss"


def plot_curves(metrics_files: dict[str, Path], out_png: Path,
                evaluations: dict[str, dict] | None = None) -> Path:
    """Draw loss, reward and held-out accuracy of each stage and save them to `out_png`.

    `metrics_files` maps stage names, in run order, to JSON-lines files with one TRL log record per
    line, each with a "step" key. Stages are laid end to end: a stage's steps are offset by the last
    step of the stages before it, and a dashed line marks where each stage after the first begins.
    The reward is TRL's "reward" (GRPO, RLOO) or, failing that, the first "rewards/<name>/mean".
    `evaluations` maps stage names to their held-out evaluation ({"before": {"accuracy": ...}, "after": ...}), drawn
    as one segment per stage from its first to its last step. Panels with nothing to draw are left out; with no
    data at all the figure says so.
    """
    out_png = Path(out_png)
    evaluations = evaluations or {}
    series: dict[str, list[tuple[str, int, list, list]]] = {"loss": [], "reward": [], "held-out accuracy": []}
    offset = 0
    boundaries = []
    for index, (stage, path) in enumerate(metrics_files.items()):
        records = _read_records(Path(path))
        for kind, key in (("loss", LOSS_KEY), ("reward", _reward_key(records))):
            points = [(offset + r["step"], r[key]) for r in records if key is not None and _is_number(r.get(key))]
            if points:
                steps, values = zip(*points)
                series[kind].append((stage, index, list(steps), list(values)))
        last = offset + max((r["step"] for r in records), default=0)
        before = evaluations.get(stage, {}).get("before", {}).get("accuracy")
        after = evaluations.get(stage, {}).get("after", {}).get("accuracy")
        if _is_number(before) and _is_number(after):
            series["held-out accuracy"].append((stage, index, [offset, last], [before, after]))
        if index > 0 and records:
            boundaries.append(offset)
        offset = last

    drawn = [kind for kind, lines in series.items() if lines]
    # A bare Figure renders with Agg without touching pyplot's global state or needing a display.
    figure = Figure(figsize=(5.5 * max(len(drawn), 1), 4), layout="constrained")
    if not drawn:
        axes = figure.subplots()
        axes.text(0.5, 0.5, "nothing logged", ha="center", va="center", transform=axes.transAxes)
        axes.set_axis_off()
    else:
        # Shared x axis: every panel spans the whole run even when only later stages log a reward.
        panels = figure.subplots(1, len(drawn), sharex=True, squeeze=False)[0]
        for axes, kind in zip(panels, drawn):
            for stage, index, steps, values in series[kind]:
                # One colour per stage in every panel, so a stage reads the same everywhere.
                style = {"marker": "o"} if kind == "held-out accuracy" else {}
                axes.plot(steps, values, label=stage, color=f"C{index}", **style)
            for boundary in boundaries:
                axes.axvline(boundary, color="grey", linestyle="--", linewidth=0.8)
            axes.set_xlabel("global step")
            axes.set_ylabel(kind)
            axes.set_title(kind)
            axes.legend()

    out_png.parent.mkdir(parents=True, exist_ok=True)
    save_figure_atomic(figure, out_png, dpi=100)
    return out_png


def _read_records(path: Path) -> list[dict]:
    # A missing file is an empty stage (e.g. a stage that logged nothing); records without a step,
    # such as a final summary written by something other than TRL, cannot be placed and are dropped.
    if not path.exists():
        return []
    records = read_jsonl(path)  # a torn last line (a killed run) is skipped, not a failed plot
    return [r for r in records if _is_number(r.get("step"))]


def _reward_key(records: list[dict]) -> str | None:
    keys = {key for record in records for key in record}
    if "reward" in keys:
        return "reward"
    named = sorted(k for k in keys if k.startswith("rewards/") and k.endswith("/mean"))
    return named[0] if named else None


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
