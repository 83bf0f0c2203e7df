"""A GRPO stage launched on 2 CPU processes through torchrun (gloo) trains and writes one consistent run."""

import json
import subprocess
import sys



def test_grpo_stage_on_two_processes(tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(json.dumps({
        "seed": 0, "name": "grpo", "trainer": "grpo", "model": "embedded:tiny-qwen2",
        "dataset": {"source": "embedded:arithmetic", "params": {"format": "prompt"}, "limit": 64},
        "plugins": ["grpo", "exact_match"],
        "args": {"max_steps": 2, "per_device_train_batch_size": 4, "num_generations": 4, "max_completion_length": 4,
                 "logging_steps": 1, "gradient_checkpointing": False, "use_cpu": True},
    }))
    out = tmp_path / "out"
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "-m", "trl_ext.cli", "train",
               str(recipe), "--output-dir", str(out)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    run = json.loads((out / "run.json").read_text())
    assert run["status"] == "complete" and run["stages"]["grpo"]["global_step"] == 2
    rows = [json.loads(line) for line in (out / "grpo" / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows if "loss" in row] == [1, 2]  # main process only: no duplicated rows
    assert result.stdout.count("trl-ext run summary") == 1
