"""Benchmark: peak memory of sampling with rollout_logprobs' recorder, against the same generation without it, and
against transformers' ``output_scores`` (what the plugin used before), each variant in its own fresh process.

A tiny Qwen2 with a realistic vocabulary (32k) samples ``--rows`` completions of ``--new-tokens`` tokens (no early
stop). Reported per variant: the process's peak RSS and its growth during ``generate`` (median over ``--repeats``
fresh processes), and both as ratios to plain generation. Target: recorder <= 1.05x plain.

    python benchmarks/rollout_logprobs_memory.py [--rows 32] [--new-tokens 256] [--vocab 32000] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from measure import run_variants  # benchmarks/measure.py, on sys.path when run as a script

VARIANTS = ("plain", "recorder", "output_scores")


def one_run(variant: str, rows: int, new_tokens: int, vocab: int) -> dict:
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from measure import PeakRSS

    from trl_ext_plugins.rollout.rollout_logprobs import recording_logprobs

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512,
                                         tie_word_embeddings=True)).eval()
    prompts = torch.randint(3, vocab, (rows, 8))
    config = GenerationConfig(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=True, top_k=0,
                              pad_token_id=0, eos_token_id=2)
    with torch.no_grad(), PeakRSS() as peak:
        if variant == "output_scores":
            out = model.generate(input_ids=prompts, generation_config=config, output_scores=True,
                                 return_dict_in_generate=True)
            steps = len(out.scores)
        elif variant == "recorder":
            with recording_logprobs(model, new_tokens) as recorder:
                sequences = model.generate(input_ids=prompts, generation_config=config)
            steps = recorder.result(sequences[:, prompts.size(1):]).size(1)
        else:
            steps = model.generate(input_ids=prompts, generation_config=config).size(1) - prompts.size(1)
    return {"peak": peak.peak, "growth": peak.delta,
            "steps": steps}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)  # internal: one run in this process
    args = parser.parse_args()
    if args.variant:
        print(json.dumps(one_run(args.variant, args.rows, args.new_tokens, args.vocab)))
        return
    # interleaved, each in a fresh process: no allocator growth carried between them
    results = run_variants(__file__, VARIANTS, ["--rows", args.rows, "--new-tokens", args.new_tokens,
                                                "--vocab", args.vocab], args.repeats)
    median = {v: {k: statistics.median(r[k] for r in runs) for k in ("peak", "growth")} for v, runs in results.items()}
    kept = args.rows * args.new_tokens * args.vocab * 4 / 2**20
    print(f"rows {args.rows}, new tokens {args.new_tokens}, vocab {args.vocab}; output_scores keeps {kept:.0f} MiB "
          f"of scores; median of {args.repeats} fresh processes per variant")
    for variant in VARIANTS:
        m = median[variant]
        print(f"{variant:14s} peak RSS {m['peak'] / 2**20:8.1f} MiB ({m['peak'] / median['plain']['peak']:.3f}x plain)"
              f"   growth in generate {m['growth'] / 2**20:8.1f} MiB "
              f"({m['growth'] / median['plain']['growth']:.3f}x plain)")


if __name__ == "__main__":
    main()
