"""The GPU device check (benchmarks/vllm_device.py): safe everywhere, real where a CUDA GPU and vLLM exist.

On a machine without them the script writes its reason and exits 0 (checked here, always); the real run (GRPO with
vLLM rollouts, trl-ext against TRL, colocate mode) runs only where both exist, and is skipped with that reason here.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "vllm_device.py"
NO_DEVICE = None if torch.cuda.is_available() and importlib.util.find_spec("vllm") else (
    "needs a CUDA GPU and the vllm extra (this project's CI machine has neither; run the script on a device)")


def test_without_a_gpu_the_script_records_why_and_succeeds(tmp_path):
    if NO_DEVICE is None:
        pytest.skip("this machine has a GPU and vLLM: the real check below runs instead")
    out = tmp_path / "vllm.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    reason = json.loads(out.read_text())["skipped"]
    assert reason in ("no CUDA GPU on this machine", "vLLM is not installed: pip install 'trl-ext[vllm]'")


@pytest.mark.slow
@pytest.mark.skipif(NO_DEVICE is not None, reason=str(NO_DEVICE))
def test_vllm_colocate_sampling_logprobs_reach_tis(tmp_path):
    out = tmp_path / "vllm.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--out", str(out), "--modes", "colocate", "--steps", "4",
                           "--completion", "32"], timeout=1800)
    assert proc.returncode == 0
    result = json.loads(out.read_text())
    rows = {r["variant"]: r for r in result["rows"]}
    assert "error" not in rows["trl"] and "error" not in rows["trl-ext"], rows
    assert "tis/rho/mean" in rows["trl-ext"]  # vLLM's sampling log-probs flowed into the correction
    assert result["step_time_ratio_trl_ext_over_trl"]["colocate"] > 0
