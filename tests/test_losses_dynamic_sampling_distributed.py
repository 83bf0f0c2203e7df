"""``dynamic_sampling`` on 2 CPU processes (torchrun, gloo): ranks run the same number of refill rounds, keep their
batch size, and together hold only whole groups with reward variance, including a group split across the ranks."""

import json
import os
import socket
import subprocess
import sys
import textwrap

import pytest

WORKER = textwrap.dedent('''
    import json, os, sys
    import torch
    import torch.distributed as dist
    from transformers import AutoTokenizer
    from trl import GRPOConfig
    from trl_ext.embedded.arithmetic import arithmetic_dataset
    from trl_ext.host import PluginHost
    from trl_ext.trainers.grpo import ExtGRPOTrainer
    from trl_ext_plugins.rollout.dynamic_sampling import DynamicSampling

    def odd_sum_varies(completions, answer, **kwargs):
        return [0.0 if int(a) % 2 == 0 else float(sum(map(ord, c)) % 97) for c, a in zip(completions, answer)]

    model_dir, out_dir = sys.argv[1], sys.argv[2]
    round_prompts = int(sys.argv[3]) if len(sys.argv) > 3 else None
    plugin = DynamicSampling(DynamicSampling.Params(max_rounds=20, round_prompts=round_prompts))
    # 6 rows per rank, groups of 4: the second group of each generation batch spans both ranks
    args = GRPOConfig(output_dir=out_dir, per_device_train_batch_size=6, num_generations=4, max_completion_length=4,
                      max_steps=2, bf16=False, use_cpu=True, report_to="none", gradient_checkpointing=False,
                      temperature=1.0, logging_steps=1, save_strategy="no", seed=0)
    trainer = ExtGRPOTrainer(model=model_dir, reward_funcs=[odd_sum_varies], args=args,
                             train_dataset=arithmetic_dataset("train", format="prompt", size=64),
                             processing_class=AutoTokenizer.from_pretrained(model_dir),
                             plugin_host=PluginHost([plugin]))
    seen = []
    score = trainer._generate_and_score_completions

    def recording(inputs):
        output = score(inputs)
        texts = trainer.processing_class.batch_decode(output["prompt_ids"], skip_special_tokens=True)
        seen.append({"sums": [sum(int(x) for x in t.strip().rstrip("=").split("+")) for t in texts],
                     "advantages": output["advantages"].tolist(),
                     "tokens": output["completion_mask"].sum(1).tolist(),
                     "num_items_in_batch": int(output["num_items_in_batch"])})
        return output

    trainer._generate_and_score_completions = recording
    result = trainer.train()
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, {"seen": seen, "history": plugin.history, "step": result.global_step,
                                   "backend": dist.get_backend()})
    if dist.get_rank() == 0:
        print(json.dumps(parts), flush=True)
    dist.barrier()
    # Leave without interpreter teardown: destroying the trainer's DDP/gloo state at exit intermittently aborts
    # ("terminate called without an active exception") after all work is done, which would fail the run for nothing.
    sys.stderr.flush()
    os._exit(0)
''')


def _free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# rounds of the target's 3 prompts, or of 4 (8 rows per rank; a second 2-process run, so slow)
@pytest.mark.parametrize("round_prompts", [None, pytest.param(4, marks=pytest.mark.slow)])
def test_ranks_stay_in_sync_and_hold_only_groups_with_variance(tmp_path, round_prompts):
    from trl_ext.embedded.models import materialize_model

    model_dir = materialize_model("tiny-qwen2", tmp_path / "model", seed=0)
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    torchrun = [sys.executable, "-m", "torch.distributed.run"]  # this interpreter's torch, whatever its bin/ holds
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    done = subprocess.run([*torchrun, "--nproc_per_node", "2", "--master_port", str(_free_port()), str(script),
                           str(model_dir), str(tmp_path / "out"), *([str(round_prompts)] if round_prompts else [])],
                          capture_output=True, text=True, timeout=400, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = json.loads([line for line in done.stdout.splitlines() if line.startswith("[")][-1])

    assert all(r["backend"] == "gloo" and r["step"] == 2 for r in ranks)
    assert ranks[0]["history"] == ranks[1]["history"] and len(ranks[0]["history"]) == 2  # same rounds everywhere
    # refills ran; with round_prompts 4 every batch merges the loader's 3 prompts with 1 drawn one (2 rows per rank:
    # that group spans both ranks), whether or not more rounds were needed
    assert round_prompts or any(h["dynamic_sampling/rounds"] > 1 for h in ranks[0]["history"]), ranks[0]["history"]
    for h in ranks[0]["history"]:
        size = round_prompts or 3  # every round, the first one completed to its size, has `size` prompts
        assert h["dynamic_sampling/prompts"] == size * h["dynamic_sampling/rounds"] and h["dynamic_sampling/cap_hit"] == 0
    for step in range(2):
        local = [r["seen"][step] for r in ranks]
        assert [len(part["sums"]) for part in local] == [6, 6]  # batch size unchanged on every rank
        sums = local[0]["sums"] + local[1]["sums"]
        advantages = local[0]["advantages"] + local[1]["advantages"]
        for g in range(3):  # the global batch: 3 whole groups, each of an odd-sum prompt with varying rewards
            group = sums[4 * g:4 * g + 4]
            assert len(set(group)) == 1 and group[0] % 2 == 1, sums
            assert any(abs(a) > 0 for a in advantages[4 * g:4 * g + 4]) and abs(sum(advantages[4 * g:4 * g + 4])) < 1e-3
        tokens = sum(local[0]["tokens"]) + sum(local[1]["tokens"])
        assert local[0]["num_items_in_batch"] == local[1]["num_items_in_batch"] == tokens
