"""Peak memory and step time of SFT with an aggregation plugin against TRL's own SFTTrainer, each in a fresh process.

Run: python benchmarks/sft_memory.py [--vocab 32000] [--batch 8] [--tokens 256] [--steps 4] [--repeats 3]

Variants, on the same tiny random Qwen2 (hidden 64, 2 layers, the given vocabulary), the same rows and seed:

* ``trl``: TRL's ``SFTTrainer`` (its fused LM head: per-token log-probs in vocabulary tiles, no full logits);
* ``trl-ext``: trl-ext's SFT trainer with ``sft: {normalization: sequence}`` (an aggregation plugin active: the
  per-token NLL still comes from TRL's fused head and only the reduction changes).

Each run is its own Python process (``measure.run_variants``; repeats interleave the variants), so no variant inherits
another's allocator growth. Peak memory is the process's resident high-water mark (``ru_maxrss``) after ``train()``
minus the RSS just before it (no sampling thread, which would slow the side with more Python); step time is the
median over the steps after the first. Figures are medians over repeats; ratios are against ``trl``.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import tempfile
from pathlib import Path

from measure import run_variants, step_timer  # benchmarks/measure.py, on sys.path when run as a script

VARIANTS = ("trl", "trl-ext")


def _save_model(directory: Path, vocab: int, tokens: int) -> str:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from trl_ext.embedded.tokenizer import build_tokenizer

    tokenizer = build_tokenizer()
    config = Qwen2Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=128, vocab_size=vocab, max_position_embeddings=max(512, 2 * tokens),
                         tie_word_embeddings=False, pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id)
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return str(directory)


def _rows(count: int, tokens: int, vocab: int):
    """Rows of exactly ``tokens`` ids (``input_ids`` given directly, so the length does not depend on the tokenizer)."""
    import datasets
    import torch

    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(10, vocab, (count, tokens), generator=generator)
    return datasets.Dataset.from_dict({"input_ids": ids.tolist()})


def run_once(variant: str, vocab: int, batch: int, tokens: int, steps: int) -> dict:
    """Runs inside the fresh process: one training run; (median step seconds, peak RSS growth, last loss)."""
    import psutil
    import trl
    from transformers import AutoTokenizer

    from trl_ext.host import PluginHost
    from trl_ext.stage import default_args
    from trl_ext.trainers import TRAINER_KINDS, BuildContext
    from trl_ext_plugins.trainers.sft import SFT, SFTParams

    tmp = Path(tempfile.mkdtemp(prefix="sft-mem-"))
    model_dir = _save_model(tmp / "model", vocab, tokens)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    timer = step_timer()
    config = trl.SFTConfig(output_dir=str(tmp / "out"), per_device_train_batch_size=batch, max_steps=steps,
                           learning_rate=1e-4, logging_steps=1, save_strategy="no", seed=0, max_length=tokens,
                           gradient_checkpointing=False, disable_tqdm=True,
                           **{k: v for k, v in default_args(TRAINER_KINDS["sft"]).items() if k != "report_to"},
                           report_to="none")
    dataset = _rows(batch * steps, tokens, vocab)
    if variant == "trl":
        trainer = trl.SFTTrainer(model=model_dir, args=config, train_dataset=dataset, processing_class=tokenizer,
                                 callbacks=[timer])
    else:
        host = PluginHost([SFT(SFTParams(normalization="sequence"))])
        ctx = BuildContext(model=model_dir, ref_model=None, teacher=None, config=config, train_dataset=dataset,
                           eval_dataset=None, tokenizer=tokenizer, peft_config=None, callbacks=[timer], host=host,
                           reward_funcs=[], reward_weights=[])
        trainer = TRAINER_KINDS["sft"].build(ctx)
        host.hook.trl_ext_trainer_created(trainer=trainer)
    before = psutil.Process().memory_info().rss
    trainer.train()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return {"step": statistics.median(timer.times[1:]), "peak": max(peak, 1), "loss": losses[-1]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)  # child process: one run
    ns = parser.parse_args()
    if ns.steps < 2:
        parser.error("--steps must be at least 2 (the first step is not timed)")
    args = ["--vocab", ns.vocab, "--batch", ns.batch, "--tokens", ns.tokens, "--steps", ns.steps]
    if ns.variant:
        print(json.dumps(run_once(ns.variant, ns.vocab, ns.batch, ns.tokens, ns.steps)))
        return
    results = run_variants(__file__, VARIANTS, args, ns.repeats)
    step = {k: statistics.median(r["step"] for r in v) for k, v in results.items()}
    peak = {k: statistics.median(r["peak"] for r in v) for k, v in results.items()}
    print(f"SFT, vocabulary {ns.vocab}, batch {ns.batch} x {ns.tokens} tokens, median of {ns.repeats} fresh processes")
    for variant in VARIANTS:
        print(f"  {variant:12s} peak RSS growth {peak[variant] / 2**20:8.1f} MiB ({peak[variant] / peak['trl']:.3f}x)"
              f"   step {step[variant] * 1000:7.1f} ms ({step[variant] / step['trl']:.3f}x)"
              f"   last loss {results[variant][-1]['loss']:.4f}")


if __name__ == "__main__":
    main()
