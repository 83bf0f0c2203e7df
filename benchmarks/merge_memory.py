"""Peak memory of the streamed merges (checkpoint_average, warp) against loading one model, each in a fresh process.

Run: python benchmarks/merge_memory.py [--hidden 512] [--layers 8] [--checkpoints 4]

Writes K random checkpoints of a Qwen2-shaped model (float32, single safetensors file, about 0.23 GB at the defaults)
into a temporary folder, then runs each variant in its own Python process, which imports everything first and then
measures its peak RSS above that baseline (benchmarks/measure.py samples RSS every 2 ms):

  load_one         AutoModelForCausalLM.from_pretrained of one checkpoint (the reference: "one model")
  stream_average   checkpoint_average's uniform average of the K checkpoints (stream_merge, tensor by tensor)
  stream_warp      warp's SLERP + LITI of 2 runs against an init (3 sources)
  in_memory_avg    the naive way for contrast: load K state dicts, average them in memory

and prints each peak and its ratio to load_one. The target for the streamed variants is <= 1.2x one model.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

VARIANTS = ("load_one", "stream_average", "stream_warp", "in_memory_avg")


def write_checkpoints(root: Path, hidden: int, layers: int, count: int) -> list[Path]:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(vocab_size=32000, hidden_size=hidden, intermediate_size=int(hidden * 2.75),
                         num_hidden_layers=layers, num_attention_heads=16, num_key_value_heads=16,
                         tie_word_embeddings=False)
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in AutoModelForCausalLM.from_config(config).state_dict().items()}
    folders = []
    for i in range(count):
        gen = torch.Generator().manual_seed(i)
        folder = root / f"checkpoint-{i + 1}"
        folder.mkdir()
        save_file({k: torch.randn(s, generator=gen) * 0.02 for k, s in shapes.items()}, str(folder / "model.safetensors"),
                  metadata={"format": "pt"})
        config.save_pretrained(folder)
        folders.append(folder)
    return folders


def run_variant(variant: str, folders: list[str], out: str) -> dict:
    """Runs inside the fresh process: imports first, then measures only the variant's work."""
    from transformers import AutoModelForCausalLM

    from measure import PeakRSS  # benchmarks/measure.py; running this file puts benchmarks/ on sys.path
    from trl_ext_plugins.merge.math import average_state_dicts, normalized_weights
    from trl_ext_plugins.merge.streaming import stream_merge
    from trl_ext_plugins.merge.warp import warp_weights

    start = time.perf_counter()
    with PeakRSS() as peak:
        if variant == "load_one":
            model = AutoModelForCausalLM.from_pretrained(folders[0])
            # touch every weight: weights left memory-mapped and unread would not count as resident yet
            size = sum(t.numel() * t.element_size() for t in model.state_dict().values() if float(t.sum()) or True)
        elif variant == "stream_average":
            weights = normalized_weights(len(folders))
            stream_merge(folders, out, lambda _n, _g: weights, base=len(folders) - 1)
        elif variant == "stream_warp":
            stats = {"linear_fallback_tensors": 0, "zero_task_vector_tensors": 0}
            stream_merge(folders[:3], out, warp_weights(0.3, None, 0.9995, "error", ["a", "b"], stats), gram=True)
        elif variant == "in_memory_avg":
            from safetensors.torch import load_file

            sds = [load_file(str(Path(f) / "model.safetensors")) for f in folders]
            merged = average_state_dicts(sds)
            del sds, merged
    result = {"variant": variant, "peak_bytes": peak.delta, "seconds": round(time.perf_counter() - start, 1)}
    if variant == "load_one":
        result["model_bytes"] = size
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--checkpoints", type=int, default=4)
    parser.add_argument("--worker", nargs=3, metavar=("VARIANT", "FOLDERS_JSON", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        variant, folders, out = args.worker
        print(json.dumps(run_variant(variant, json.loads(folders), out)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        folders = [str(f) for f in write_checkpoints(root, args.hidden, args.layers, args.checkpoints)]
        results = {}
        for variant in VARIANTS:
            out = root / f"out-{variant}"
            out.mkdir()
            proc = subprocess.run([sys.executable, __file__, "--worker", variant, json.dumps(folders), str(out)],
                                  capture_output=True, text=True)
            if proc.returncode != 0:
                raise SystemExit(f"{variant} failed:\n{proc.stderr[-3000:]}")
            results[variant] = json.loads(proc.stdout.strip().splitlines()[-1])
    one = results["load_one"]["peak_bytes"]
    print(f"model: {results['load_one']['model_bytes'] / 2**20:.0f} MiB of float32 weights; "
          f"{args.checkpoints} checkpoints; peak RSS above the post-import baseline, fresh process per variant")
    for variant in VARIANTS:
        r = results[variant]
        print(f"{variant:<15} peak {r['peak_bytes'] / 2**20:8.0f} MiB  ratio to load_one {r['peak_bytes'] / one:5.2f}x  "
              f"({r['seconds']} s)")


if __name__ == "__main__":
    main()
