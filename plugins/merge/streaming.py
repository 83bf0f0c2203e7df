"""Merge Hugging Face model folders tensor by tensor through safetensors, so peak memory stays near one model.

A model folder holds ``model.safetensors`` or shards listed in ``model.safetensors.index.json``. Names, shapes and
dtypes are read from the safetensors headers only (no tensor is loaded) to check that the sources match; then, for
each output shard, every tensor is read from each source (one ``safe_open`` per read, closed straight away, so no
source stays memory-mapped), merged, and kept until the shard is written. Peak memory is therefore about one output
shard (one model for a single-file model) plus the K source copies of the largest tensor.

The output mirrors the base source's layout (same shard files, same index), so ``from_pretrained`` reads it like the
base. Non-floating tensors (integer and bool buffers) are copied from the base source, never merged.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from trl_ext_plugins.merge.math import check_same_tensors

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")


@dataclass(frozen=True)
class TensorInfo:
    file: str  # the shard's file name inside the folder
    shape: tuple[int, ...]
    dtype: str  # safetensors dtype code (F32, BF16, I64, BOOL ...)


def weight_files(folder: str | Path) -> list[str]:
    """The safetensors weight files of a model folder (file names), in index order."""
    folder = Path(folder)
    if (folder / INDEX_FILE).is_file():
        weight_map = json.loads((folder / INDEX_FILE).read_text())["weight_map"]
        return sorted(set(weight_map.values()))
    if (folder / SINGLE_FILE).is_file():
        return [SINGLE_FILE]
    found = "adapter weights (a PEFT checkpoint)" if (folder / "adapter_model.safetensors").is_file() else "none"
    raise FileNotFoundError(f"{folder}: no {SINGLE_FILE} or {INDEX_FILE} (found {found}); merging needs full "
                            f"safetensors model weights")


def tensor_index(folder: str | Path) -> dict[str, TensorInfo]:
    """Name -> (file, shape, dtype) of every tensor in a model folder, read from the headers only."""
    from safetensors import safe_open

    folder = Path(folder)
    index: dict[str, TensorInfo] = {}
    for name in weight_files(folder):
        with safe_open(str(folder / name), framework="pt") as handle:
            for key in handle.keys():
                piece = handle.get_slice(key)
                index[key] = TensorInfo(name, tuple(piece.get_shape()), piece.get_dtype())
    return index


def read_tensor(folder: str | Path, info: TensorInfo, name: str) -> torch.Tensor:
    """One tensor, read through a handle opened and closed here (no mapping outlives the read)."""
    from safetensors import safe_open

    with safe_open(str(Path(folder) / info.file), framework="pt") as handle:
        return handle.get_tensor(name)


def check_sources(sources: Sequence[str | Path], who: str) -> list[dict[str, TensorInfo]]:
    """Tensor indexes of all sources, refusing mismatched names or shapes (the error names the tensor)."""
    indexes = [tensor_index(s) for s in sources]
    check_same_tensors([{k: v.shape for k, v in idx.items()} for idx in indexes], [str(s) for s in sources], who)
    return indexes


# A merge rule: (tensor name, the tensors of the sources in order) -> merged floating-point tensor (any float dtype;
# the caller casts it to the base's dtype).
MergeRule = Callable[[str, list[torch.Tensor]], torch.Tensor]


@torch.no_grad()
def stream_merge(sources: Sequence[str | Path], out_dir: str | Path, rule: MergeRule, base: int = 0,
                 who: str = "merge") -> dict[str, int]:
    """Write the merge of ``sources`` into ``out_dir`` (weight files only), tensor by tensor.

    ``rule`` merges one floating-point tensor; non-floating tensors are copied from ``sources[base]``, whose layout
    (shards, index, dtypes) the output mirrors. ``out_dir`` may be one of the sources: the new files are written to a
    temporary folder first and moved in at the end, replacing the old weight files. Returns counts of merged and
    copied tensors.
    """
    from safetensors.torch import save_file

    sources = [Path(s) for s in sources]
    out_dir = Path(out_dir)
    indexes = check_sources(sources, who)
    base_index, base_dir = indexes[base], sources[base]
    tmp = out_dir / f".merge-tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    counts = {"merged_tensors": 0, "copied_tensors": 0}
    for file_name in weight_files(base_dir):
        shard: dict[str, torch.Tensor] = {}
        for name, info in base_index.items():
            if info.file != file_name:
                continue
            reference = read_tensor(base_dir, info, name)
            if not reference.is_floating_point():
                shard[name] = reference
                counts["copied_tensors"] += 1
                continue
            tensors = [reference if i == base else read_tensor(src, idx[name], name)
                       for i, (src, idx) in enumerate(zip(sources, indexes))]
            shard[name] = rule(name, tensors).to(reference.dtype).contiguous()
            del tensors
            counts["merged_tensors"] += 1
        save_file(shard, str(tmp / file_name), metadata={"format": "pt"})
        del shard
    if (base_dir / INDEX_FILE).is_file():
        shutil.copyfile(base_dir / INDEX_FILE, tmp / INDEX_FILE)
    _replace_weights(out_dir, tmp)
    return counts


def _replace_weights(out_dir: Path, tmp: Path) -> None:
    """Move the new weight files in, after removing weight files of the old layout they do not overwrite."""
    new = {p.name for p in tmp.iterdir()}
    for old in [*out_dir.glob("model*.safetensors"), out_dir / INDEX_FILE]:
        if old.is_file() and old.name not in new:
            old.unlink()
    for name in new:
        os.replace(tmp / name, out_dir / name)
    tmp.rmdir()


def checkpoint_folders(checkpoint_dir: str | Path) -> list[Path]:
    """``checkpoint-<step>`` folders of a TRL/HF run, oldest first (by step number, not by name)."""
    checkpoint_dir = Path(checkpoint_dir)
    if not checkpoint_dir.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in checkpoint_dir.iterdir() if p.is_dir() and (m := CHECKPOINT_RE.match(p.name))]
    return [p for _, p in sorted(found)]


def step_of(checkpoint: Path) -> int:
    return int(CHECKPOINT_RE.match(checkpoint.name).group(1))


@torch.no_grad()
def load_into_model(model, folder: str | Path) -> bool:
    """Copy a model folder's tensors into ``model``'s parameters and buffers in place (no second model in memory).

    Returns False (and changes nothing) when the file's tensor names or shapes are not exactly the module's (e.g. a
    checkpoint format transformers converts on load, or parameters sharded by ZeRO-3); the files on disk are then
    the only merged copy.
    """
    index = tensor_index(folder)
    targets = dict(model.state_dict(keep_vars=True))
    if any(name not in targets or tuple(targets[name].shape) != info.shape for name, info in index.items()):
        return False
    for name, info in index.items():
        target = targets[name]
        target.data.copy_(read_tensor(folder, info, name).to(target.dtype))
    return True
