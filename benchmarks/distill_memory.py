"""Peak memory of ``gkd`` and ``opd_reward`` against TRL's own DistillationTrainer, at vocabulary 32k and 128k.

Run: python benchmarks/distill_memory.py [--vocab 32000 128000] [--steps 3] [--batch 8] [--tokens 32]

Each variant trains ``--steps`` steps in a fresh Python process (so one variant's allocator state cannot leak into
another's) on the same tiny random Qwen2 student (hidden 64, 2 layers) and teacher (hidden 96, 2 layers) with the
given vocabulary, the same prompts, the same seed and ``max_completion_length`` = ``--tokens``:

* ``trl``: TRL's ``DistillationTrainer`` (reverse KL, chunked divergence kernel);
* ``gkd``: trl-ext's distillation trainer with the ``gkd`` plugin (reverse KL, lmbda 1);
* ``gkd_mix``: the same with ``lmbda: 0.5`` (on/off-policy mix; off-policy batches read dataset completions);
* ``opd``: trl-ext's GRPO trainer with ``opd_reward`` (``num_generations`` 2, same number of completions per step).

Peak memory is CUDA peak allocated on a GPU, else the process's peak RSS growth during ``train()`` (sampled); with
``--repeats R`` each variant runs in R fresh processes, interleaved with the other variants' (``measure.run_variants``),
and the run with the median peak is reported (RSS growth varies between runs).
The ``opd`` row also reports the teacher's scoring time per sampled student token (one forward with TRL's fused
head, only the sampled tokens projected). Ratios are against the ``trl`` row of the same vocabulary.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from measure import run_variants  # benchmarks/measure.py, on sys.path when run as a script

VARIANTS = ("trl", "gkd", "gkd_mix", "opd")


def _save_model(directory: Path, vocab: int, hidden: int, seed: int) -> str:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from trl_ext.embedded.tokenizer import build_tokenizer

    tokenizer = build_tokenizer()
    config = Qwen2Config(hidden_size=hidden, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=2 * hidden, vocab_size=vocab, max_position_embeddings=512,
                         tie_word_embeddings=False, pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id)
    torch.manual_seed(seed)
    Qwen2ForCausalLM(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return str(directory)


def run_variant(variant: str, vocab: int, steps: int, batch: int, tokens: int) -> dict:
    import torch
    from transformers import AutoTokenizer

    sys.path.insert(0, str(Path(__file__).parent))
    from measure import PeakRSS

    from trl_ext.embedded.arithmetic import arithmetic_dataset
    from trl_ext.host import PluginHost
    from trl_ext.stage import default_args
    from trl_ext.trainers import TRAINER_KINDS, BuildContext

    tmp = Path(tempfile.mkdtemp(prefix="distill-mem-"))
    student = _save_model(tmp / "student", vocab, 64, seed=0)
    teacher = _save_model(tmp / "teacher", vocab, 96, seed=1)
    tokenizer = AutoTokenizer.from_pretrained(student)
    common = dict(max_steps=steps, learning_rate=1e-4, logging_steps=1, save_strategy="no", seed=0,
                  gradient_checkpointing=False, max_completion_length=tokens, report_to="none")
    scoring = {"seconds": 0.0, "tokens": 0}
    if variant in ("trl", "gkd", "gkd_mix"):
        from trl import DistillationConfig, DistillationTrainer

        from trl_ext_plugins.distill.gkd import GKD, GKDParams

        dataset = arithmetic_dataset("train", format="prompt_completion", size=batch * steps * 2)
        config = DistillationConfig(output_dir=str(tmp / "out"), per_device_train_batch_size=batch, beta=1.0,
                                    **{**default_args(TRAINER_KINDS["distillation"]), **common})
        if variant == "trl":
            trainer = DistillationTrainer(model=student, teacher_model=teacher, args=config, train_dataset=dataset,
                                          processing_class=tokenizer)
        else:
            host = PluginHost([GKD(GKDParams(lmbda=1.0 if variant == "gkd" else 0.5))])
            ctx = BuildContext(model=student, ref_model=None, teacher=teacher, config=config, train_dataset=dataset,
                               eval_dataset=None, tokenizer=tokenizer, peft_config=None, callbacks=[], host=host,
                               reward_funcs=[], reward_weights=[])
            trainer = TRAINER_KINDS["distillation"].build(ctx)
            host.hook.trl_ext_trainer_created(trainer=trainer)
    else:
        from trl import GRPOConfig

        from trl_ext.embedded.arithmetic import exact_match_reward
        from trl_ext_plugins.distill import opd, teachers
        from trl_ext_plugins.distill.opd import OPDReward, OPDRewardParams

        original = teachers.sampled_token_logps

        def timed(*args, **kwargs):
            start = time.perf_counter()
            out = original(*args, **kwargs)
            scoring["seconds"] += time.perf_counter() - start
            scoring["tokens"] += int(args[4].sum())  # completion_mask
            return out

        teachers.sampled_token_logps = timed
        opd.tch.sampled_token_logps = timed
        dataset = arithmetic_dataset("train", format="prompt", size=batch * steps)
        config = GRPOConfig(output_dir=str(tmp / "out"), per_device_train_batch_size=batch, num_generations=2,
                            **{**default_args(TRAINER_KINDS["grpo"]), **common})
        host = PluginHost([OPDReward(OPDRewardParams(), teacher=teacher)])
        ctx = BuildContext(model=student, ref_model=None, teacher=teacher, config=config, train_dataset=dataset,
                           eval_dataset=None, tokenizer=tokenizer, peft_config=None, callbacks=[], host=host,
                           reward_funcs=[exact_match_reward], reward_weights=[])
        trainer = TRAINER_KINDS["grpo"].build(ctx)
        host.hook.trl_ext_trainer_created(trainer=trainer)
        trainer.plugin_host.plugins[0].pool.get("teacher")  # load before measuring, like TRL's trainer does

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    start = time.perf_counter()
    with PeakRSS() as rss:
        trainer.train()
    seconds = time.perf_counter() - start
    peak = (torch.cuda.max_memory_allocated() - base) if cuda else rss.delta
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    row = {"variant": variant, "vocab": vocab, "peak_mb": peak / 2**20, "seconds": seconds, "final_loss": losses[-1]}
    if scoring["tokens"]:
        row["teacher_us_per_token"] = 1e6 * scoring["seconds"] / scoring["tokens"]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--vocab", type=int, nargs="+", default=[32000, 128000])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=1, help="fresh processes per variant; the median peak is kept")
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS),
                        help="variants to run (trl always runs: it is the denominator)")
    parser.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)  # child process mode
    args = parser.parse_args()
    if args.variant:
        print(json.dumps(run_variant(args.variant, args.vocab[0], args.steps, args.batch, args.tokens)))
        return
    print(f"{'vocab':>7} {'variant':<8} {'peak MB':>9} {'ratio vs trl':>12} {'s':>7} {'teacher us/token':>16}",
          flush=True)
    for vocab in args.vocab:
        order = ["trl"] + [v for v in args.variants if v != "trl"]
        runs = run_variants(__file__, order, ["--vocab", vocab, "--steps", args.steps, "--batch", args.batch,
                                              "--tokens", args.tokens], args.repeats)
        # median run by peak (upper for even)
        rows = {variant: sorted(rs, key=lambda r: r["peak_mb"])[len(rs) // 2] for variant, rs in runs.items()}
        for variant, row in rows.items():
            ratio = row["peak_mb"] / rows["trl"]["peak_mb"]
            teacher = f"{row['teacher_us_per_token']:.1f}" if "teacher_us_per_token" in row else "-"
            print(f"{vocab:>7} {variant:<8} {row['peak_mb']:>9.1f} {ratio:>12.3f} {row['seconds']:>7.1f} {teacher:>16}",
                  flush=True)


if __name__ == "__main__":
    main()
