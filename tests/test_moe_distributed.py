"""routing_replay R3 on 2 CPU processes (gloo) under DDP, FSDP2 and DeepSpeed ZeRO-3 (slow): a recipe's
``distributed:`` section makes ``trl-ext train`` start torchrun; every logged step replays the rollout routing
exactly. FSDP2 needs CUDA (refused on CPU, where accelerate would run the ranks under DDP)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from tests.markers import NEEDS_DEEPSPEED


# accelerate enables FSDP only for GPU process groups; trl-ext refuses fsdp2 without CUDA (CPU ranks would run DDP)
NEEDS_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="FSDP2 needs CUDA (refused on CPU)")


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["ddp", pytest.param("fsdp2", marks=NEEDS_CUDA),
                                     pytest.param("zero3", marks=NEEDS_DEEPSPEED)])
def test_r3_on_two_processes(tmp_path, backend):
    recipe = {
        "seed": 0, "name": "grpo", "trainer": "grpo", "model": "embedded:tiny-qwen3-moe",
        "dataset": {"source": "embedded:arithmetic", "params": {"format": "prompt"}, "limit": 64},
        "plugins": ["grpo", "routing_replay", "exact_match"],
        "args": {"max_steps": 2, "per_device_train_batch_size": 8, "num_generations": 4, "num_iterations": 2,
                 "max_completion_length": 4, "logging_steps": 1, "save_strategy": "no", "learning_rate": 1e-2,
                 "gradient_checkpointing": False},
        "distributed": {"num_processes": 2, "backend": backend},
    }
    path = tmp_path / "recipe.yaml"
    path.write_text(json.dumps(recipe))
    out = tmp_path / "out"
    result = subprocess.run([sys.executable, "-m", "trl_ext.cli", "train", str(path), "--output-dir", str(out)],
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    logged = [json.loads(line) for line in (out / "grpo" / "metrics.jsonl").read_text().splitlines()]
    rows = [row for row in logged if "routing_replay/replayed_mismatch" in row]
    assert len(rows) == 2
    assert all(row["routing_replay/replayed_mismatch"] == 0.0 for row in rows)
    # the old-policy forward runs once per generation batch (num_iterations 2: the first of the two steps)
    assert [row.get("routing_replay/old_policy/replayed_mismatch") for row in rows] == [0.0, None]
