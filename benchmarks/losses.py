"""Benchmark: trl-ext's composed loss pipeline against TRL's own ``_compute_loss`` on the same batch, each side in
fresh processes.

Plugin side: ``dapo`` objective + ``icepop`` correction (beta 2) + ``aggregation: token-mean`` on ``ExtGRPOTrainer``.
TRL side: ``GRPOTrainer`` with the matching config (``loss_type="dapo"``, ``epsilon_high=0.28``, ``beta=0``) and
TRL's vLLM token-mask correction (``vllm_importance_sampling_mode="token_mask"``, clip [0.5, 2]): its ratio tensor is
what TRL's rollout would put in the batch (computed once here, outside the timed loss, as TRL does at rollout time),
while icepop computes its weights inside the loss. The loss values must agree (same math).

Shape: 16 sequences x 2048 completion tokens (+16 prompt tokens) through a one-layer Qwen2 (hidden 64) with a
``--vocab``-sized LM head (default 4096, bounded by the memory of a shared CPU box), so the forward, the log-softmax
and the backward are real. One step = ``_compute_loss`` + ``backward``.

How it measures: every timed step runs in its own fresh Python process (``measure.run_variants``), so neither side
inherits the other's allocator growth or warmed caches. Each process builds both trainers on one model and the same
batch (identical setup), takes one warm-up step of its side, then one timed step (wall time, and process CPU time,
less sensitive to other load on a shared machine), then one more step for peak memory = the highest process RSS
(psutil, sampled every 2 ms in a thread, which is why timing runs without it) minus the RSS just before it. ``--repeats`` processes per side run interleaved
(TRL, trl-ext, trl-ext, TRL, ...); the medians are reported. tracemalloc is not used: it sees only Python
allocations, not torch's CPU allocator. The loss and gradient agreement and the allocation count below run in one
more process, not timed.

Full-vocabulary tensors: a ``TorchDispatchMode`` records every op (forward and backward) whose output owns new
storage of at least B x T x V x 2 bytes (any float type of a full ``(B, T, V)`` tensor); the plugin path must create
exactly as many as TRL's.

    python benchmarks/losses.py [--repeats 5] [--vocab 4096]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections import Counter

import torch
import trl
from datasets import Dataset
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

from trl_ext.embedded.models import materialize_model
from trl_ext.host import PluginHost
from trl_ext.trainers.grpo import ExtGRPOTrainer
from trl_ext_plugins.corrections.icepop import IcePop
from trl_ext_plugins.losses.aggregation import Aggregation
from trl_ext_plugins.losses.dapo import DAPO
from measure import PeakRSS, run_variants  # benchmarks/measure.py, on sys.path when run as a script


B, P, T = 16, 16, 2048


class LargeAllocations(TorchDispatchMode):
    """Counts ops whose outputs own new storage of at least ``min_bytes`` (by op name)."""

    def __init__(self, min_bytes: int):
        super().__init__()
        self.min_bytes, self.ops = min_bytes, Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if (isinstance(t, torch.Tensor) and t.untyped_storage().nbytes() >= self.min_bytes
                    and t.untyped_storage().data_ptr() not in inputs):
                self.ops[str(func)] += 1
        return out


def build_trainers(tmp: str, vocab: int):
    tokenizer = AutoTokenizer.from_pretrained(materialize_model("tiny-qwen2", f"{tmp}/tok"))
    config = Qwen2Config(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=P + T,
                         tie_word_embeddings=True, pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    data = Dataset.from_dict({"prompt": ["1+1="] * B})
    common = dict(output_dir=f"{tmp}/out", bf16=False, report_to="none", per_device_train_batch_size=B,
                  num_generations=4, max_completion_length=T, gradient_checkpointing=False, use_cpu=True,
                  loss_type="dapo", epsilon_high=0.28, beta=0.0, mask_truncated_completions=True, disable_tqdm=True)

    def reward(completions, **kwargs):
        return [0.0] * len(completions)

    ours = ExtGRPOTrainer(model=model, reward_funcs=[reward], args=trl.GRPOConfig(
        **common, vllm_importance_sampling_correction=False), train_dataset=data, processing_class=tokenizer,
        plugin_host=PluginHost([DAPO(), IcePop(), Aggregation(Aggregation.Params(mode="token-mean"))]))
    theirs = trl.GRPOTrainer(model=model, reward_funcs=[reward], args=trl.GRPOConfig(
        **common, vllm_importance_sampling_mode="token_mask", vllm_importance_sampling_clip_min=0.5,
        vllm_importance_sampling_clip_max=2.0), train_dataset=data, processing_class=tokenizer)
    # The loss reads these two flags only to apply the precomputed ratio; nothing here generates with vLLM.
    theirs.use_vllm, theirs.vllm_importance_sampling_correction = True, True
    for trainer in (ours, theirs):
        trainer.model.train()
        trainer.current_gradient_accumulation_steps = 1
    return ours, theirs, model


def make_batch(trainer, vocab: int):
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(T // 2, T + 1, (B,), generator=g)
    completion_mask = (torch.arange(T) < lengths.unsqueeze(1)).long()
    batch = {
        "prompt_ids": torch.randint(0, vocab, (B, P), generator=g), "prompt_mask": torch.ones(B, P, dtype=torch.long),
        "completion_ids": torch.randint(0, vocab, (B, T), generator=g) * completion_mask,
        "completion_mask": completion_mask,
        "advantages": torch.randn(B, generator=g),
        "num_items_in_batch": completion_mask.sum(),
    }
    with torch.no_grad():
        current, _, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model, torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1),
            torch.cat([batch["prompt_mask"], completion_mask], 1), T)
    old = current + 0.1 * torch.randn(B, T, generator=g)  # pi_theta / pi_old around 1: some tokens clip
    sampling = old + 0.5 * torch.randn(B, T, generator=g)  # pi_old / pi_rollout: some tokens leave [0.5, 2]
    ratio = torch.exp((old - sampling) * completion_mask)
    ratio = ratio.masked_fill((ratio < 0.5) | (ratio > 2.0), 0.0)  # TRL's token_mask mode
    ours = {**batch, "old_per_token_logps": old, "sampling_per_token_logps": sampling}
    theirs = {**ours, "importance_sampling_ratio": ratio}
    return ours, theirs


def step(trainer, model, inputs):
    """One loss forward + backward: (wall seconds, process CPU seconds, loss)."""
    model.zero_grad(set_to_none=True)
    start, cpu = time.perf_counter(), time.process_time()
    loss = trainer._compute_loss(model, inputs)
    loss.backward()
    return time.perf_counter() - start, time.process_time() - cpu, loss.detach()


def check(vocab: int) -> dict:
    """Child process: loss and gradient agreement of the two sides, and the full-vocabulary tensors each creates."""
    with tempfile.TemporaryDirectory() as tmp:
        ours, theirs, model = build_trainers(tmp, vocab)
        inputs = dict(zip(("ours", "theirs"), make_batch(ours, vocab), strict=True))
        sides = {"theirs": theirs, "ours": ours}
        losses = {name: step(trainer, model, inputs[name])[2].item() for name, trainer in sides.items()}
        grads = {}
        for name, trainer in sides.items():
            step(trainer, model, inputs[name])
            grads[name] = [p.grad.clone() for p in model.parameters()]
        grad_diff = max((a - b).abs().max().item() for a, b in zip(grads["ours"], grads["theirs"], strict=True))
        del grads
        allocations = {}
        for name, trainer in sides.items():
            with LargeAllocations(B * T * vocab * 2) as counter:
                step(trainer, model, inputs[name])
            allocations[name] = dict(counter.ops)
    return {"losses": losses, "grad_diff": grad_diff, "allocations": allocations}


def measure_side(side: str, vocab: int) -> dict:
    """Child process: one warm-up step of ``side`` ("theirs" or "ours"), one timed step, one step for memory."""
    with tempfile.TemporaryDirectory() as tmp:
        ours, theirs, model = build_trainers(tmp, vocab)
        inputs = dict(zip(("ours", "theirs"), make_batch(ours, vocab), strict=True))[side]
        trainer = {"theirs": theirs, "ours": ours}[side]
        step(trainer, model, inputs)  # warm-up
        # Timed without the RSS sampler, whose polling thread takes the GIL from the step (it slowed the side with
        # more Python code); memory is measured on one more step.
        elapsed, cpu, loss = step(trainer, model, inputs)
        with PeakRSS() as memory:
            step(trainer, model, inputs)
    return {"time": elapsed, "cpu": cpu, "peak": memory.delta, "loss": loss.item()}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--variant", choices=("check", "theirs", "ours"), help=argparse.SUPPRESS)  # child process
    ns = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    if ns.variant:
        print(json.dumps(check(ns.vocab) if ns.variant == "check" else measure_side(ns.variant, ns.vocab)))
        return
    checked = run_variants(__file__, ["check"], ["--vocab", ns.vocab])["check"][0]
    losses, grad_diff, allocations = checked["losses"], checked["grad_diff"], checked["allocations"]
    runs = run_variants(__file__, ["theirs", "ours"], ["--vocab", ns.vocab], ns.repeats)

    t, c, m = ({k: statistics.median(r[key] for r in v) for k, v in runs.items()} for key in ("time", "cpu", "peak"))
    full_vocab = B * T * ns.vocab * 4 / 2**20
    print(f"shape: {B} x {T} completion tokens, vocab {ns.vocab} (one fp32 full-vocab tensor = {full_vocab:.0f} MiB); "
          f"{ns.repeats} fresh processes per side (interleaved; one warm-up + one timed + one memory step each), "
          f"torch threads {torch.get_num_threads()}")
    print(f"loss       TRL {losses['theirs']:.8f}  trl-ext {losses['ours']:.8f}  "
          f"|diff| {abs(losses['theirs'] - losses['ours']):.2e}; max |grad diff| {grad_diff:.2e}")
    print(f"step time  TRL {t['theirs'] * 1000:.0f} ms  trl-ext {t['ours'] * 1000:.0f} ms  "
          f"ratio {t['ours'] / t['theirs']:.3f} (target <= 1.05)")
    print(f"CPU time   TRL {c['theirs'] * 1000:.0f} ms  trl-ext {c['ours'] * 1000:.0f} ms  "
          f"ratio {c['ours'] / c['theirs']:.3f} (process CPU seconds: less sensitive to other load on the machine)")
    print(f"peak RSS   TRL {m['theirs'] / 2**20:.0f} MiB  trl-ext {m['ours'] / 2**20:.0f} MiB  "
          f"ratio {m['ours'] / m['theirs']:.3f} (target <= 1.05)")
    print(f"full-vocab tensors created (fwd+bwd): TRL {sum(allocations['theirs'].values())} "
          f"{allocations['theirs']}  trl-ext {sum(allocations['ours'].values())} {allocations['ours']}")
    extra = sum(allocations["ours"].values()) - sum(allocations["theirs"].values())
    assert extra <= 0, f"the plugin path creates {extra} extra full-vocabulary tensor(s)"
    print("no extra full-vocabulary tensor on the plugin path")


if __name__ == "__main__":
    main()
