"""Step time and peak memory of each preference loss on trl-ext's DPO trainer, against TRL's own loss where one exists.

Run: python benchmarks/preference.py [--steps 10] [--batch 16] [--repeats 3]

Same tiny embedded model and data, same seed: for each loss, build the trainer, train ``--steps`` steps (after one
warm-up step) and report the mean optimizer-step time and the peak memory (CUDA peak allocated on a GPU, else the
process's max RSS growth from just before the trainer is built) plus the ratio trl-ext / TRL. TRL rows use
``DPOConfig(loss_type=...)`` on the same trl-ext trainer class with no plugin (TRL's ``_compute_loss`` runs
untouched). Reference-free losses (simpo, orpo) have no TRL row on the DPO trainer (TRL has them only in experimental
trainers); the ``ref fwd`` column shows they do not pay for a reference pass.

How it measures: every run (one loss, trl-ext or TRL) is its own fresh Python process (``measure.run_variants``), so
no run inherits another's allocator growth or peak RSS; the runs of all losses interleave over ``--repeats`` rounds
(order reversed every other round) and each column is the median over its ``--repeats`` runs.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import tempfile
import time

import torch

from trl_ext.embedded.arithmetic import arithmetic_dataset
from trl_ext.embedded.models import materialize_model
from trl_ext.host import PluginHost
from trl_ext.stage import default_args
from trl_ext.trainers import TRAINER_KINDS, BuildContext
from trl_ext_plugins.preference import APO, DPO, IPO, ORPO, QRPO, RPO, SimPO
from trl_ext_plugins.preference.data import arithmetic_reward_pairs
from measure import run_variants  # benchmarks/measure.py, on sys.path when run as a script

CASES = [  # (name, plugin factory, TRL loss_type or None, needs reward columns)
    ("dpo", DPO, "sigmoid", False),
    ("ipo", IPO, "ipo", False),
    ("apo_zero", lambda: APO(APO.Params(variant="zero")), "apo_zero", False),
    ("apo_down", lambda: APO(APO.Params(variant="down")), "apo_down", False),
    ("simpo", SimPO, None, False),
    ("orpo", ORPO, None, False),
    ("rpo", RPO, None, True),
    ("qrpo", QRPO, None, True),
]


class _Timer:
    def __init__(self):
        self.times, self.start = [], None

    def on_step_begin(self):
        self.start = time.perf_counter()

    def on_step_end(self):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.times.append(time.perf_counter() - self.start)


def _build(model_dir, tokenizer, plugins, args, dataset, out):
    from transformers import TrainerCallback

    timer = _Timer()

    class Callback(TrainerCallback):
        def on_step_begin(self, *a, **k):
            timer.on_step_begin()

        def on_step_end(self, *a, **k):
            timer.on_step_end()

    kind = TRAINER_KINDS["dpo"]
    host = PluginHost(plugins)
    merged = {**default_args(kind), "save_strategy": "no", "seed": 0, "logging_steps": 1000, **args}
    for impl in reversed(host.pm.hook.trl_ext_configure_args.get_hookimpls()):
        merged.update(impl.function(trainer="dpo", args={}) or {})
    ctx = BuildContext(model=model_dir, ref_model=None, teacher=None, config=kind.config_cls(output_dir=out, **merged),
                       train_dataset=dataset, eval_dataset=None, tokenizer=tokenizer, peft_config=None,
                       callbacks=[Callback()], host=host, reward_funcs=[], reward_weights=[])
    trainer = kind.build(ctx)
    host.hook.trl_ext_trainer_created(trainer=trainer)
    return trainer, timer


def _measure(model_dir, tokenizer, plugins, args, dataset, steps):
    ref_calls = []
    with tempfile.TemporaryDirectory() as out:
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        trainer, timer = _build(model_dir, tokenizer, plugins, {**args, "max_steps": steps + 1}, dataset, out)
        if trainer.ref_model is not None:
            trainer.ref_model.register_forward_pre_hook(lambda *_: ref_calls.append(1))
        trainer.train()
        peak = (torch.cuda.max_memory_allocated() if torch.cuda.is_available()
                else (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0) * 1024)
        del trainer
    step = sum(timer.times[1:]) / max(1, len(timer.times) - 1)
    return step, peak / 2**20, len(ref_calls)


def _run_variant(variant, model_dir, steps, batch):
    """Child process: one loss (``name:ext`` or ``name:trl``), its (step seconds, peak MiB, reference forwards)."""
    from transformers import AutoTokenizer

    name, side = variant.split(":")
    _, factory, loss_type, needs_rewards = next(case for case in CASES if case[0] == name)
    size = batch * (steps + 1)
    data = (arithmetic_reward_pairs("train", size=size) if needs_rewards
            else arithmetic_dataset("train", format="preference", size=size))
    args = {"per_device_train_batch_size": batch, "max_length": 32, "beta": 0.1}
    plugins, args = ([factory()], args) if side == "ext" else ([], {**args, "loss_type": [loss_type]})
    step, peak, refs = _measure(model_dir, AutoTokenizer.from_pretrained(model_dir), plugins, args, data, steps)
    return {"step": step, "peak": peak, "ref": refs}


VARIANTS = [f"{name}:{side}" for name, _, loss_type, _ in CASES for side in ("ext", "trl")
            if side == "ext" or loss_type is not None]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3, help="fresh processes per loss and side; medians reported")
    parser.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)  # child process: one run
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    opts = parser.parse_args()
    if opts.variant:
        print(json.dumps(_run_variant(opts.variant, opts.model_dir, opts.steps, opts.batch)))
        return

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(materialize_model("tiny-qwen2", f"{tmp}/tiny", seed=0))
        runs = run_variants(__file__, VARIANTS, ["--model-dir", model_dir, "--steps", opts.steps,
                                                 "--batch", opts.batch], opts.repeats)
    med = {v: {k: statistics.median(r[k] for r in rs) for k in ("step", "peak", "ref")} for v, rs in runs.items()}
    print(f"{'loss':<10}{'ext ms/step':>12}{'TRL ms/step':>12}{'ratio':>7}{'ext MiB':>9}{'TRL MiB':>9}"
          f"{'ref fwd':>9}")
    for name, _, loss_type, _ in CASES:
        ext = med[f"{name}:ext"]
        if loss_type is not None:
            trl = med[f"{name}:trl"]
            trl_cols = (f"{trl['step'] * 1e3:>12.1f}{ext['step'] / trl['step']:>7.2f}{ext['peak']:>9.1f}"
                        f"{trl['peak']:>9.1f}")
        else:
            trl_cols = f"{'-':>12}{'-':>7}{ext['peak']:>9.1f}{'-':>9}"
        print(f"{name:<10}{ext['step'] * 1e3:>12.1f}{trl_cols}{ext['ref']:>9g}")


if __name__ == "__main__":
    main()
