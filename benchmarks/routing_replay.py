"""Benchmark: routing_replay's overhead on the embedded tiny Qwen3-MoE, against the same work without it, in one run.

* capture: batched sampling (``model.generate``, KV cache) with the rollout routing recorded (the plugin's
  process-wide router hook plus the alignment into TRL's layout) / the same generation without it;
* replay: the training forward + backward with the recorded routes replayed (router hooks, gates recomputed from the
  training logits, mismatch counters) / the same forward + backward with no hook installed.

Runs alternate (plain, with, plain, with, ...) so machine noise hits both sides alike; each figure is the median over
repeats after a warm-up. Target: <= 1.05x each.

It also samples the same prompts with a bfloat16 copy of the policy (a rollout engine in lower precision) and scores
them in float32 with and without R3, printing the routing mismatch and the spread of the per-token log importance
ratio log pi_train - log pi_rollout (``--plot FILE`` draws both).

    python benchmarks/routing_replay.py [--rows 64] [--new-tokens 16] [--repeats 15] [--plot mismatch.png]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from trl_ext.embedded.arithmetic import arithmetic_dataset
from trl_ext.embedded.models import build_model
from trl_ext.embedded.tokenizer import build_tokenizer
from trl_ext_plugins.moe.routing import GenerationCapture, ModelRouting, align_generation_routes


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--plot", default=None, help="write a figure of mismatch and ratio spread to this file")
    ns = parser.parse_args()
    torch.manual_seed(0)
    model = build_model("tiny-qwen3-moe", seed=0)
    tokenizer = build_tokenizer()
    prompts = [row["prompt"] for row in arithmetic_dataset("train", format="prompt", size=ns.rows)]
    batch = tokenizer(prompts, return_tensors="pt", padding=True, padding_side="left")
    generation = dict(max_new_tokens=ns.new_tokens, min_new_tokens=ns.new_tokens, do_sample=True, temperature=1.0,
                      pad_token_id=tokenizer.pad_token_id)
    routing = ModelRouting(model)  # installed for both sides of the capture comparison: inactive hooks cost too

    def generate():
        with torch.no_grad():
            return model.generate(**batch, **generation)

    def generate_and_capture():
        with GenerationCapture(routing.dtype) as capture:
            out = generate()
        prompt_lengths = batch["attention_mask"].sum(1).tolist()
        return align_generation_routes(capture.calls, routing.num_layers, prompt_lengths,
                                       [ns.new_tokens] * ns.rows, None, routing.dtype)

    routes = generate_and_capture()
    sequences = generate()
    attention = torch.cat([batch["attention_mask"], torch.ones(ns.rows, ns.new_tokens, dtype=torch.long)], 1)
    model.train()

    def train_forward(replay: bool):
        def run():
            if replay:
                routing.begin(routes, replay=True, record=False)
            model(input_ids=sequences, attention_mask=attention).logits.float().logsumexp(-1).mean().backward()
            if replay:
                routing.end()
            model.zero_grad(set_to_none=True)
        return run

    times = {"generate": [], "generate+capture": [], "train": [], "train+replay": []}
    for repeat in range(ns.repeats + 1):
        sample = {"generate": timed(generate), "generate+capture": timed(generate_and_capture)}
        routing.remove()  # the plain training forward runs with no hook at all
        sample["train"] = timed(train_forward(False))
        routing = ModelRouting(model)
        sample["train+replay"] = timed(train_forward(True))
        if repeat:  # the first round warms up
            for key, value in sample.items():
                times[key].append(value)
    median = {key: statistics.median(values) for key, values in times.items()}
    tokens = ns.rows * (batch["input_ids"].size(1) + ns.new_tokens)
    print(f"tiny-qwen3-moe: {ns.rows} rows, {batch['input_ids'].size(1)} prompt + {ns.new_tokens} new tokens, "
          f"{routing.num_layers} MoE layers, top-{routing.top_k}; median of {ns.repeats} alternating repeats")
    print(f"routes stored: {routes.nbytes} bytes ({routes.nbytes / tokens:.1f} bytes/token, {routes.dtype})")
    print(f"generation {median['generate'] * 1e3:8.1f} ms, with capture {median['generate+capture'] * 1e3:8.1f} ms: "
          f"capture overhead {median['generate+capture'] / median['generate']:.3f}x")
    print(f"train fwd+bwd {median['train'] * 1e3:8.1f} ms, with replay {median['train+replay'] * 1e3:8.1f} ms: "
          f"replay overhead {median['train+replay'] / median['train']:.3f}x")

    routing.remove()
    mismatch_and_ratio_spread(model, batch, generation, ns.plot)


def mismatch_and_ratio_spread(model, batch, generation, plot):
    """bfloat16 rollout vs float32 scoring: routing mismatch and log-ratio spread, without and with R3."""
    sampler = build_model("tiny-qwen3-moe", seed=0).to(torch.bfloat16)
    sampler.load_state_dict(model.state_dict())
    dtype = ModelRouting(sampler).dtype
    torch.manual_seed(1)
    with GenerationCapture(dtype) as capture, torch.no_grad():
        out = sampler.generate(**batch, **generation, output_scores=True, return_dict_in_generate=True)
    prompt_width = batch["input_ids"].size(1)
    completion = out.sequences[:, prompt_width:]
    sampled = torch.stack([torch.log_softmax(step.float(), -1).gather(-1, completion[:, t:t + 1]).squeeze(-1)
                           for t, step in enumerate(out.scores)], 1)
    rows, new = completion.shape
    routes = align_generation_routes(capture.calls, 2, batch["attention_mask"].sum(1).tolist(), [new] * rows, None,
                                     dtype)
    attention = torch.cat([batch["attention_mask"], torch.ones_like(completion)], 1)
    routing = ModelRouting(model)
    results = {}
    for label, replay in (("without replay", False), ("R3", True)):
        routing.begin(routes, replay=replay, record=False)
        with torch.no_grad():
            logits = model(input_ids=out.sequences, attention_mask=attention).logits.float()
        _, counts = routing.end()
        scored = torch.log_softmax(logits[:, prompt_width - 1:-1], -1).gather(-1, completion.unsqueeze(-1)).squeeze(-1)
        log_ratio = scored - sampled
        used = counts[:, 2 if replay else 0].sum().item() / counts[:, 1].sum().item()
        results[label] = (used, log_ratio.std().item(), log_ratio.abs().max().item())
        print(f"{label:15s}: experts differing from the rollout's {used:.4f} of token-layers; log(pi_train/pi_rollout) "
              f"std {log_ratio.std().item():.5f}, max |.| {log_ratio.abs().max().item():.5f}")
    routing.remove()
    if plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, 2, figsize=(8, 3))
        labels = list(results)
        axes[0].bar(labels, [results[k][0] for k in labels])
        axes[0].set_title("routing mismatch vs rollout")
        axes[1].bar(labels, [results[k][1] for k in labels])
        axes[1].set_title("std of log importance ratio")
        fig.suptitle("tiny-qwen3-moe: bfloat16 rollout, float32 training")
        fig.tight_layout()
        fig.savefig(plot)
        print(f"figure: {plot}")


if __name__ == "__main__":
    main()
