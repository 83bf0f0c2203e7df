"""Does the pass-rate filter leave fewer zero-variance groups, and does re-estimating it during training help?

Run: python benchmarks/pass_rate_filter.py [--steps 400] [--reestimate-every 100] [--seed 0] [--output-dir DIR]

One recipe through the trl-ext runner: the quickstart's SFT warm-up (configs/quickstart.yaml), then three GRPO stages
from it with configs/pass_rate_filter.yaml's arguments and the same seed and budget: ``unfiltered`` (no plugin),
``filtered`` (``pass_rate_filter`` as configured there: pass rates from 8 samples of the warm-up model, prompts at 0 or
1 dropped, easy -> hard) and ``reestimated`` (the same, plus ``reestimate_every``: the undrawn prompts are re-sampled
with the current policy and the rest of the pass re-filtered). Printed per stage: held-out greedy accuracy after,
wall time, and per window of steps the mean of TRL's ``frac_reward_zero_std`` (the share of prompt groups whose
rewards are all equal, which carry no GRPO signal) and of the train reward.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--reestimate-every", type=int, default=100)
    parser.add_argument("--window", type=int, default=100, help="steps per reported window")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-dir", default=None)
    a = parser.parse_args()

    import yaml

    from trl_ext.catalog import Catalog
    from trl_ext.recipe import parse_recipe
    from trl_ext.runner import run_recipe

    root = Path(__file__).resolve().parents[1] / "configs"
    warm_up = yaml.safe_load((root / "quickstart.yaml").read_text())["stages"][0]
    grpo = yaml.safe_load((root / "pass_rate_filter.yaml").read_text())["stages"][0]
    grpo = {**grpo, "model": "stage:sft", "args": {**grpo["args"], "max_steps": a.steps, "save_strategy": "no"}}
    filtered_plugins = grpo["plugins"]
    filter_params = next(p["pass_rate_filter"] for p in filtered_plugins if isinstance(p, dict))
    reestimating = [{"pass_rate_filter": {**filter_params, "reestimate_every": a.reestimate_every}}
                    if isinstance(p, dict) else p for p in filtered_plugins]
    stages = {"unfiltered": ["grpo", "exact_match"], "filtered": filtered_plugins, "reestimated": reestimating}
    out = Path(a.output_dir or tempfile.mkdtemp(prefix="pass-rate-"))
    recipe = {"seed": a.seed, "stages": [warm_up] + [{**grpo, "name": n, "plugins": p} for n, p in stages.items()]}
    info = run_recipe(parse_recipe(recipe), str(out), Catalog.discover(), echo=lambda _m: None)

    windows = [(start + 1, min(start + a.window, a.steps)) for start in range(0, a.steps, a.window)]
    print(f"held-out greedy accuracy after the SFT warm-up: {info['stages']['sft']['eval']['after']['accuracy']:.3f}")
    print(f"{'GRPO stage':<13}{'held-out':>9}{'seconds':>9}"
          + "".join(f"{f'zero-std {lo}-{hi}':>19}" for lo, hi in windows)
          + "".join(f"{f'reward {lo}-{hi}':>17}" for lo, hi in windows))
    for name in stages:
        rows = [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines() if line]

        def window_mean(key, lo, hi):
            values = [r[key] for r in rows if key in r and lo <= r["step"] <= hi]
            return statistics.mean(values) if values else float("nan")

        stage = info["stages"][name]
        print(f"{name:<13}{stage['eval']['after']['accuracy']:>9.3f}{stage.get('seconds', float('nan')):>9.0f}"
              + "".join(f"{window_mean('frac_reward_zero_std', lo, hi):>19.3f}" for lo, hi in windows)
              + "".join(f"{window_mean('reward', lo, hi):>17.3f}" for lo, hi in windows))


if __name__ == "__main__":
    main()
