"""Rollout wall time per step with ``partial_rollout`` against the same GRPO trainer without it (tiny model, CPU).

Run: python benchmarks/partial_rollout.py [--rollouts 8] [--batch 32] [--generations 4] [--max-completion-length 64]
     [--eos-bias 1.6] [--fractions 0.75 0.5]

The untrained tiny model gets a constant bonus on the EOS logit (a forward hook on ``lm_head``), so every decoding step
ends a trajectory with a small fixed probability: completion lengths are geometric, a long-tailed distribution where
the slowest trajectory of a batch sets the step's decoding time. Each configuration (no plugin, then
``partial_rollout`` at each lambda) runs the same number of rollouts (``_generate_and_score_completions`` on the same
prompts, same seed) in this one process; between rollouts ``state.global_step`` advances, as after an optimizer step,
so resumed tokens carry older policy versions. Reported per configuration: mean rollout seconds per step, decoding
steps per rollout, trajectories that trained (belong to finished groups) per step, and the ratios against the run
without the plugin: time per step, and time per trained trajectory (the fair figure: partial rollouts defer groups).

``--held-out STEPS`` measures learning instead of speed: the recipe of configs/partial_rollout.yaml (quickstart's SFT
warm-up, then GRPO on addition) from one warm-up through the trl-ext runner, without the plugin and with
``partial_rollout`` at each ``--fractions`` lambda (+ the ``--correction`` plugin, ``tis`` by default, ``none`` for no
correction), same seed and budget; it prints the train reward every 50 steps, the held-out greedy accuracy after the
warm-up and after each stage, the stage's wall time, its rollout seconds per step (time inside the trainer's generation,
timed here) and per trained trajectory, each with its ratio to the run without the plugin. ``--eval-every N`` keeps a
checkpoint every N steps and prints the held-out curve with the trajectories trained by each point, so runs that train
different numbers per step compare.
``--grpo-seeds S ...`` runs every GRPO configuration once per seed from the one warm-up and prints each one's mean and
spread; ``--half-batch`` adds TRL at half the batch for ``--partial-steps`` steps (the batch the plugin trains per
step); ``--mask-offpolicy`` turns on the plugin's ``mask_offpolicy``; ``--stop-unit groups`` makes lambda count
complete groups (the plugin's ``stop_unit``, both modes).
``--long-tail FRACTION`` makes the length distribution long-tailed: the warm-up learns answers of which FRACTION carry a
verbose tail of up to 48 tokens (the embedded task's ``tail_fraction``; exact_match ignores it) and the completion cap
rises to 64.
Measured (2-core CPU, transformers 5.25; the plugin docstring has the table). The held-out figures with groups
deferred predate 66d3dd6, when deferred rows still counted in grpo's mean over sequences (each step then moved the
policy by the trained fraction of a full step); the plugin docstring gives the re-measurements since (short answers,
six GRPO seeds: lambda 0.75 + tis 0.444 against TRL at 8 x 8 per step 0.429), and this one:
- after the fix, ``--held-out 400 --partial-steps 1000 --fractions 0.75 --long-tail 0.1 --eval-every 100 --grpo-seeds
  0 1 2`` (warm-up 0.465): 0.56 / 0.53 of TRL's rollout seconds per step (seeds 1 / 2), 1.16 / 1.12 per trained
  trajectory; held-out, mean of three seeds, TRL 0.543 / 0.587 / 0.503 at 25.6k / 38.4k / 51.2k trajectories, lambda
  0.75 0.387 / 0.532 / 0.527 at about 25k / 39k / 53k (0.530 at the end, 60k).
- ``--max-deferrals`` (the plugin's bound on how often a group waits):
  - ``--held-out 200 --partial-steps 400 --fractions 0.75 --long-tail 0.1 --eval-every 100 --grpo-seeds 0 1
    --max-deferrals none 1``, then ``--held-out 400 --partial-steps 700 ... --grpo-seeds 2 3 --max-deferrals 1``
    (warm-up 0.465).
  - With the bound at 1 the held-out reads 0.430 / 0.415 / 0.484 at about 8k / 16k / 24k trajectories (four seeds).
    Unbounded reads 0.383 / 0.378 at about 8k / 13k, and 0.480 at 18k (seeds 0 and 1).
  - TRL reads 0.488 / 0.523 at 12.8k / 25.6k.
  - At about 52k (seeds 2 and 3) the bound reads 0.560 against TRL's 0.508.
  - Time was not measured in these runs: the CPU was shared. On an idle CPU, ``--held-out 100 --partial-steps 100
    --fractions 0.75 --long-tail 0.1 --grpo-seeds 0 --max-deferrals none 1``: rollout seconds per step were 0.55 of
    TRL's with the bound and 0.21 without it; per trained trajectory 0.87 and 0.62.
  - Speed, ``--rollouts 16 --fractions 0.75 --max-deferrals none 1 2``, run twice: 0.56 / 0.62 of TRL's seconds per
    step with the bound of 1, 0.54 / 0.58 unbounded.
- ``--arms`` runs only the named configurations (the runs are deterministic on one machine): ``--half-batch --arms
  half --partial-steps 800 --long-tail 0.1 --eval-every 100 --grpo-seeds 0 1`` (TRL at 8 x 8 per step): 0.400 /
  0.415 / 0.433 / 0.528 / 0.443 / 0.508 / 0.503 / 0.568 at 6.4k ... 51.2k trajectories, at or below the bound's
  0.430 / 0.415 / 0.484 at about 8k / 16k / 24k.
- ``--partial-batch ROWS`` over-provisions the plugin's generation batch (APRIL): ``--held-out 400 --partial-steps 400
  --partial-batch 200 --fractions 0.75 --max-deferrals 1 --long-tail 0.1 --eval-every 100 --arms partial75_d1
  --grpo-seeds 4 5``: 0.430 / 0.410 / 0.533 / 0.590 at steps 100-400 (116-128 trained per step) against TRL's 0.510 /
  0.513 / 0.530 / 0.590 (``--arms plain``, same seeds); on an idle CPU (``--held-out 100 --partial-steps 100
  --partial-batch 200 ... --arms plain partial75_d1 --grpo-seeds 4``) 0.66 of TRL's rollout seconds per step and per
  trained trajectory.
Before the fix:
- speed, ``--fractions 0.75 0.9`` (defaults above): rollout seconds per step 0.58 and 0.85 of TRL's, per trained
  trajectory 1.06 and 1.08; ``--fractions 1.0`` 1.03 (1.14 with ``--batch 128 --generations 8
  --max-completion-length 8 --eos-bias 0``).
- ``--held-out 400 --partial-steps 800 --grpo-seeds 0 1 2 --half-batch`` (warm-up 0.415): TRL 0.508 (sd 0.024), TRL
  at batch 64 0.498 (sd 0.003), lambda 0.75 + tis 0.440 (sd 0.035); with ``--mask-offpolicy`` 0.268; with
  ``--correction rollout_ratio`` 0.427 (sd 0.025); ``--fractions 1.0`` (400 steps) 0.505; ``--fractions 0.9
  --partial-steps 528`` 0.538.
- ``--held-out 400 --partial-steps 1000 --fractions 0.75 --long-tail 0.1 --eval-every 100``, seed 0 (warm-up 0.495):
  0.47 of TRL's rollout seconds per step, 1.01 per trained trajectory; held-out TRL 0.520 / 0.630 / 0.585 at 25.6k /
  38.4k / 51.2k trajectories, partial 0.450 / 0.515 / 0.555 at 24.4k / 38.1k / 52.6k. With ``--fractions 0.9
  --partial-steps 800``: 1.04 of TRL's rollout seconds per step (the same in a second run), 1.24 per trained trajectory;
  held-out 0.420 / 0.560 / 0.585 at 23.2k / 34.8k / 47.6k, 0.625 at 86.0k. (An earlier warm-up, seeds 0 and 1 at lambda
  0.75, measured matching curves and 0.52-0.59 of TRL's time per step.)
- ``--stop-unit groups``: speed ``--fractions 0.75 0.9`` 0.85 and 1.08 of TRL's seconds per step (at 0.9 all 8 groups
  of a call must complete); ``--held-out 400 --partial-steps 533 --fractions 0.75 --grpo-seeds 0 1 2`` 0.523 (sd 0.038;
  0.545 / 0.480 / 0.545) against TRL's 0.508 in the same run, rollout seconds per step 1.08-1.13 of TRL's;
  ``--held-out 400 --partial-steps 500 --fractions 0.75 --long-tail 0.1 --eval-every 100``: 1.27 of TRL's rollout
  seconds per step, held-out 0.405 / 0.530 / 0.565 / 0.625 / 0.405 at 9.8k / 19.6k / 31.5k / 44.3k / 57.1k.
  With a lighter tail, ``--long-tail 0.03 --partial-steps 450`` (warm-up 0.430): 0.91 of TRL's rollout seconds per
  step (35.5 decoding steps against 56.5), 1.10 per trained trajectory; held-out 0.370 / 0.465 / 0.370 / 0.500 / 0.450
  at 9.8k / 19.5k / 29.5k / 41.6k / 48.0k trajectories against TRL's 0.480 / 0.470 / 0.540 / 0.530 at 12.8k / 25.6k /
  38.4k / 51.2k (one seed; in both runs the verbose tails spread, mean length 4 -> 13 tokens, as the reward ignores
  them).
Transformers generation decodes every row until the call ends, finished or not, so cutting decoding steps saves time
per step but not per trained trajectory; engines that free a finished row's slot (vLLM) are where the saving is
reported (APRIL), and the plugin does not drive them yet.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import tempfile
import time
from pathlib import Path

import torch


def build(plugin, model_dir: Path, out: Path, batch: int, generations: int, length: int, eos_bias: float):
    from transformers import AutoTokenizer

    from trl_ext.embedded.arithmetic import arithmetic_dataset, exact_match_reward
    from trl_ext.host import PluginHost
    from trl_ext.stage import default_args
    from trl_ext.trainers import TRAINER_KINDS, BuildContext

    kind = TRAINER_KINDS["grpo"]
    args = {**default_args(kind), "max_steps": 1, "save_strategy": "no", "seed": 0, "per_device_train_batch_size": batch,
            "num_generations": generations, "max_completion_length": length, "gradient_checkpointing": False,
            "temperature": 1.0}
    host = PluginHost([plugin] if plugin is not None else [])
    ctx = BuildContext(model=str(model_dir), ref_model=None, teacher=None,
                       config=kind.config_cls(output_dir=str(out), **args),
                       train_dataset=arithmetic_dataset("train", format="prompt", size=512), eval_dataset=None,
                       tokenizer=AutoTokenizer.from_pretrained(model_dir), peft_config=None, callbacks=[], host=host,
                       reward_funcs=[exact_match_reward], reward_weights=[])
    trainer = kind.build(ctx)
    host.hook.trl_ext_trainer_created(trainer=trainer)
    trainer.model.train()
    eos = trainer.eos_token_ids[0]

    def add_eos_bias(module, inputs, output):
        output = output.clone()
        output[..., eos] += eos_bias
        return output

    trainer.model.lm_head.register_forward_hook(add_eos_bias)
    return trainer


def run(trainer, plugin, rollouts: int, batch: int, generations: int) -> dict[str, float]:
    """Mean seconds per rollout, decoding steps per rollout and trained trajectories per rollout."""
    seconds, steps, trained = 0.0, 0, 0
    torch.manual_seed(0)
    for r in range(rollouts):
        inputs = [trainer.train_dataset[(r * batch + i) // generations] for i in range(batch)]
        start = time.perf_counter()
        output = trainer._generate_and_score_completions(inputs)
        seconds += time.perf_counter() - start
        trained += int((output["completion_mask"].sum(1) > 0).sum())
        steps += (plugin.history[-1]["partial_rollout/generation_steps"] if plugin is not None
                  else int(output["completion_mask"].sum(1).max()))
        trainer.state.global_step += 1
    return {"seconds": seconds / rollouts, "decode_steps": steps / rollouts, "trained": trained / rollouts}


@contextlib.contextmanager
def timed_rollouts():
    """Seconds spent in training-time generation (the GRPO trainer's ``_generate``, plugins included), per stage
    folder: the rollout wall time the plugin is meant to cut, apart from the optimizer step."""
    from trl_ext.trainers.grpo import ExtGRPOTrainer

    seconds: dict[str, float] = {}
    original = ExtGRPOTrainer._generate

    def timed(trainer, prompts):
        start = time.perf_counter()
        try:
            return original(trainer, prompts)
        finally:
            if trainer.model.training:
                stage = Path(trainer.args.output_dir).parent.name  # <run>/<stage>/checkpoints
                seconds[stage] = seconds.get(stage, 0.0) + time.perf_counter() - start

    ExtGRPOTrainer._generate = timed
    try:
        yield seconds
    finally:
        ExtGRPOTrainer._generate = original


def held_out(steps: int, partial_steps: int, fractions: list[float], correction: str, seed: int, out: Path,
             long_tail: float, eval_every: int, grpo_seeds: list[int] | None = None, half_batch: bool = False,
             mask_offpolicy: bool = False, stop_unit: str = "trajectories",
             max_deferrals: list[int | None] = (None,), arms: list[str] | None = None,
             partial_batch: int | None = None) -> None:
    """configs/partial_rollout.yaml's GRPO stage without the plugin and at each lambda, from one SFT warm-up."""
    import yaml

    from trl_ext import Slot
    from trl_ext.catalog import Catalog
    from trl_ext.recipe import parse_recipe
    from trl_ext.runner import run_recipe

    catalog = Catalog.discover()
    root = Path(__file__).resolve().parents[1] / "configs"
    warm_up = yaml.safe_load((root / "quickstart.yaml").read_text())["stages"][0]
    grpo = yaml.safe_load((root / "partial_rollout.yaml").read_text())["stages"][0]
    grpo_args = {**grpo["args"], "max_steps": steps, "save_strategy": "no"}
    if long_tail:
        # Verbose tails of up to LONG_TAIL dots after the answer: the warm-up learns to emit them, the reward ignores
        # them, so GRPO samples a long-tailed length distribution up to the completion cap.
        warm_up = {**warm_up, "dataset": {**warm_up["dataset"], "params": {**warm_up["dataset"]["params"],
                                                                          "tail_fraction": long_tail,
                                                                          "tail_max": LONG_TAIL}},
                   "args": {**warm_up["args"], "max_length": 2 * LONG_TAIL}}
        grpo_args["max_completion_length"] = LONG_TAIL + 16
    if eval_every:
        grpo_args.update(save_strategy="steps", save_steps=eval_every, save_only_model=True)
    grpo = {**grpo, "model": "stage:sft", "args": grpo_args}
    configurations = {"plain": ("no plugin (TRL)", ["grpo", "exact_match"], {})}
    if half_batch:
        # TRL training the batch the plugin trains per step (about half its generation batch), for as many steps.
        half = grpo_args["per_device_train_batch_size"] // 2
        configurations["half"] = (f"TRL batch {half}", ["grpo", "exact_match"],
                                  {"max_steps": partial_steps, "per_device_train_batch_size": half})
    corrections = [] if correction == "none" else [correction]
    # a correction that is itself the objective (rollout_ratio) replaces grpo's
    objective = any(Slot.OBJECTIVE in catalog.resolve(name).cls.slots for name in corrections)
    for fraction in fractions:
        for bound in max_deferrals:
            plugin = {"partial_rollout": {"finish_fraction": fraction, "mask_offpolicy": mask_offpolicy,
                                          "stop_unit": stop_unit, "max_deferrals": bound}}
            configurations[f"partial{round(fraction * 100)}" + ("" if bound is None else f"_d{bound}")] = (
                f"partial_rollout {fraction}" + (" groups" if stop_unit == "groups" else "")
                + ("" if bound is None else f" defer<={bound}")
                + (f" + {correction}" if correction != "none" else "")
                + (" masked" if mask_offpolicy else "") + (f" gen {partial_batch}" if partial_batch else ""),
                [*([] if objective else ["grpo"]), plugin, *corrections, "exact_match"],
                {"max_steps": partial_steps,
                 **({"per_device_train_batch_size": partial_batch} if partial_batch else {})})
    if arms:
        unknown = sorted(set(arms) - set(configurations))
        if unknown:
            raise SystemExit(f"--arms: unknown {unknown}; this command's arms are {sorted(configurations)}")
        configurations = {key: value for key, value in configurations.items() if key in arms}
    stages, labels, steps_of = {}, {}, {}
    for seed_of_grpo in grpo_seeds or [None]:
        for key, (label, plugins, overrides) in configurations.items():
            name = key if seed_of_grpo is None else f"{key}_seed{seed_of_grpo}"
            args = {**grpo["args"], **overrides, **({} if seed_of_grpo is None else {"seed": seed_of_grpo})}
            stages[name] = {**grpo, "name": name, "plugins": plugins, "args": args}
            labels[name] = label if seed_of_grpo is None else f"{label} [seed {seed_of_grpo}]"
            steps_of[name] = args["max_steps"]
    with timed_rollouts() as rollout_seconds:
        info = run_recipe(parse_recipe({"seed": seed, "keep_checkpoints": bool(eval_every),
                                        "stages": [warm_up, *stages.values()]}), str(out), catalog,
                          echo=lambda _m: None)
    print(f"held-out greedy accuracy after the SFT warm-up: {info['stages']['sft']['eval']['after']['accuracy']:.3f}"
          + (f" (warm-up with verbose tails on {long_tail:.0%} of answers, up to {LONG_TAIL} tokens; completion cap "
             f"{grpo_args['max_completion_length']})" if long_tail else ""))
    print(f"{'GRPO stage':<28}{'steps':>6}{'held-out':>9}{'stage s':>8}{'rollout s/step':>15}{'ratio':>7}"
          f"{'decode/step':>12}{'trained/step':>13}{'rollout s/trained':>18}{'ratio':>7}")
    rows, bases = {}, {}
    for name, label in labels.items():
        stage, logs = info["stages"][name], _metrics(out / name)
        n = steps_of[name]
        trained = _mean(logs, "partial_rollout/trained_fraction", default=1.0) * stages[name]["args"][
            "per_device_train_batch_size"]
        decode = _mean(logs, "partial_rollout/generation_steps", default=None) or _mean(logs, "completions/max_length")
        per_step = rollout_seconds[name] / n
        # ratios against TRL's stage of the same GRPO seed (the first configuration of each seed), so a slow spell on
        # the machine during one seed's TRL stage does not skew every other seed's ratios
        seed_key = name.rpartition("_seed")[2] if name.rpartition("_seed")[2].isdigit() else ""
        base = bases.setdefault(seed_key, (per_step, per_step / trained))
        rows[name] = logs
        print(f"{label:<28}{n:>6}{stage['eval']['after']['accuracy']:>9.3f}{stage.get('seconds', float('nan')):>8.0f}"
              f"{per_step:>15.3f}{per_step / base[0]:>7.2f}{decode:>12.1f}{trained:>13.1f}"
              f"{per_step / trained * 1000:>16.2f}ms{per_step / trained / base[1]:>7.2f}")
    if grpo_seeds:
        print(f"held-out greedy accuracy over GRPO seeds {grpo_seeds} (one warm-up, recipe seed {seed}):")
        for key, (label, _plugins, _overrides) in configurations.items():
            scores = [info["stages"][f"{key}_seed{s}"]["eval"]["after"]["accuracy"] for s in grpo_seeds]
            mean = sum(scores) / len(scores)
            spread = (sum((x - mean) ** 2 for x in scores) / max(len(scores) - 1, 1)) ** 0.5
            print(f"  {label:<28} mean {mean:.3f}  sd {spread:.3f}  runs " + " ".join(f"{x:.3f}" for x in scores))
    if eval_every:
        print("held-out greedy accuracy at each checkpoint, with the trajectories trained by then (thousands):")
        for name, label in labels.items():
            curve, logs = _checkpoint_curve(out / name), rows[name]
            size = stages[name]["args"]["per_device_train_batch_size"]
            cells = [f"{step}: {acc:.3f} ({_trained_by(logs, step, size) / 1000:.1f}k)" for step, acc in curve.items()]
            print(f"  {label:<28}" + "  ".join(cells))
    curves = {name: {r["step"]: r["reward"] for r in logs if "reward" in r} for name, logs in rows.items()}
    marks = [s for s in range(50, max(steps, partial_steps) + 1, 50) if any(s in c for c in curves.values())]
    print("train reward by step:")
    print(f"{'GRPO stage':<28}" + "".join(f"{m:>7}" for m in marks))
    for name, label in labels.items():
        print(f"{label:<28}" + "".join(f"{curves[name][m]:>7.3f}" if m in curves[name] else f"{'-':>7}" for m in marks))


LONG_TAIL = 48  # --long-tail: the longest verbose tail of the warm-up data


def _metrics(stage_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (stage_dir / "metrics.jsonl").read_text().splitlines() if line]


def _mean(logs: list[dict], key: str, default=float("nan")):
    values = [r[key] for r in logs if key in r]
    return sum(values) / len(values) if values else default


def _trained_by(logs: list[dict], step: int, batch: int) -> float:
    """Trajectories trained up to ``step``: the logged trained fraction (a mean over each logging window) times the
    batch, summed over the windows (every trajectory without the plugin)."""
    total, last = 0.0, 0
    for r in logs:
        if "reward" in r and r["step"] <= step:
            total += r.get("partial_rollout/trained_fraction", 1.0) * batch * (r["step"] - last)
            last = r["step"]
    return total


def _checkpoint_curve(stage_dir: Path) -> dict[int, float]:
    """Greedy held-out accuracy (exact_match on the embedded test split) of each saved checkpoint."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trl_ext.embedded.arithmetic import arithmetic_dataset, exact_match_reward
    from trl_ext.evaluation import evaluate_generation

    tokenizer = AutoTokenizer.from_pretrained(stage_dir)
    test = arithmetic_dataset("test", format="prompt")
    curve = {}
    for checkpoint in sorted((stage_dir / "checkpoints").glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1])):
        model = AutoModelForCausalLM.from_pretrained(checkpoint)
        curve[int(checkpoint.name.split("-")[1])] = evaluate_generation(model, tokenizer, test,
                                                                        exact_match_reward)["accuracy"]
    return curve


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rollouts", type=int, default=8)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--generations", type=int, default=4)
    parser.add_argument("--max-completion-length", type=int, default=64)
    parser.add_argument("--eos-bias", type=float, default=1.6)
    parser.add_argument("--fractions", type=float, nargs="+", default=[0.75, 0.5])
    parser.add_argument("--held-out", type=int, default=0, metavar="STEPS",
                        help="compare learning instead: GRPO for STEPS steps with and without the plugin")
    parser.add_argument("--partial-steps", type=int, default=0, help="--held-out: steps of the partial_rollout "
                        "stages (default: the same STEPS; more matches the trajectories trained, as deferred groups "
                        "do not train in the step that deferred them)")
    parser.add_argument("--correction", default="tis", help="--held-out: the plugin correcting the stale tokens "
                        "(tis, icepop, mis, rollout_ratio, ...), or none")
    parser.add_argument("--seed", type=int, default=0, help="--held-out: the recipe seed (warm-up and GRPO)")
    parser.add_argument("--long-tail", type=float, default=0.0, metavar="FRACTION",
                        help="--held-out: warm up on answers of which FRACTION carry a verbose tail (up to "
                        f"{LONG_TAIL} tokens, ignored by the reward) and raise the completion cap, so GRPO samples a "
                        "long-tailed length distribution")
    parser.add_argument("--eval-every", type=int, default=0, metavar="N",
                        help="--held-out: save a checkpoint every N steps and print the held-out curve")
    parser.add_argument("--grpo-seeds", type=int, nargs="+", default=None, metavar="SEED",
                        help="--held-out: run every GRPO configuration once per seed, from the one warm-up, and "
                        "print each configuration's mean and spread (the noise a single comparison hides)")
    parser.add_argument("--mask-offpolicy", action="store_true", help="--held-out: the plugin's mask_offpolicy "
                        "(tokens of an older policy version leave the loss)")
    parser.add_argument("--half-batch", action="store_true", help="--held-out: add TRL at half the batch for "
                        "--partial-steps steps, the per-step batch the plugin trains")
    parser.add_argument("--stop-unit", choices=["trajectories", "groups"], default="trajectories",
                        help="what lambda counts (the plugin's stop_unit): finished trajectories or complete groups")
    parser.add_argument("--max-deferrals", nargs="+", default=["none"], metavar="K",
                        help="--held-out: one partial_rollout configuration per value of the plugin's max_deferrals "
                        "(a group deferred K times is generated to the end next round; none: unbounded)")
    parser.add_argument("--output-dir", default=None, help="where --held-out runs (default: a temporary folder)")
    parser.add_argument("--partial-batch", type=int, default=None, metavar="ROWS",
                        help="--held-out: the partial_rollout arms' generation batch (per_device_train_batch_size; TRL "
                        "keeps the recipe's): over-provisioning, as APRIL does, so the groups that finish fill about "
                        "TRL's batch per step")
    parser.add_argument("--arms", nargs="+", default=None, metavar="NAME",
                        help="--held-out: run only these configurations (plain, half, partial75, partial75_d1, ...); "
                        "the runs are deterministic on one machine, so an arm measured before need not run again")
    a = parser.parse_args()
    if a.held_out:
        out = Path(a.output_dir or tempfile.mkdtemp(prefix="partial-heldout-"))
        held_out(a.held_out, a.partial_steps or a.held_out, a.fractions, a.correction, a.seed, out, a.long_tail,
                 a.eval_every, a.grpo_seeds, a.half_batch, a.mask_offpolicy, a.stop_unit,
                 [None if k == "none" else int(k) for k in a.max_deferrals], a.arms, a.partial_batch)
        return

    from trl_ext.embedded.models import materialize_model
    from trl_ext_plugins.rollout.partial_rollout import PartialRollout

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = materialize_model("tiny-qwen2", Path(tmp) / "model", seed=0)
        results = {}
        bounds = [None if k == "none" else int(k) for k in a.max_deferrals]
        for fraction, bound in [(None, None), *((f, b) for f in a.fractions for b in bounds)]:
            plugin = None if fraction is None else PartialRollout(PartialRollout.Params(
                finish_fraction=fraction, stop_unit=a.stop_unit, max_deferrals=bound))
            trainer = build(plugin, model_dir, Path(tmp) / f"out-{fraction}-{bound}", a.batch, a.generations,
                            a.max_completion_length, a.eos_bias)
            run(trainer, plugin, 1, a.batch, a.generations)  # warm-up (not timed)
            results[fraction, bound] = run(trainer, plugin, a.rollouts, a.batch, a.generations)
    base = results[None, None]
    print(f"{a.rollouts} rollouts of {a.batch} trajectories ({a.batch // a.generations} prompts x {a.generations}), "
          f"max_completion_length {a.max_completion_length}, EOS bias {a.eos_bias} (geometric lengths)")
    print(f"{'configuration':<38}{'s/step':>9}{'decode steps':>14}{'trained/step':>14}{'time ratio':>12}"
          f"{'s/trained ratio':>17}")
    for (fraction, bound), r in results.items():
        name = "no plugin (TRL)" if fraction is None else f"partial_rollout lambda={fraction}" + (
            " groups" if a.stop_unit == "groups" else "") + ("" if bound is None else f" defer<={bound}")
        per_trained = (r["seconds"] / r["trained"]) / (base["seconds"] / base["trained"]) if r["trained"] else float("inf")
        print(f"{name:<38}{r['seconds']:>9.3f}{r['decode_steps']:>14.1f}{r['trained']:>14.1f}"
              f"{r['seconds'] / base['seconds']:>12.2f}{per_trained:>17.2f}")


if __name__ == "__main__":
    main()
