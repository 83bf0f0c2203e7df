"""Merge Hugging Face model folders tensor by tensor through safetensors, so peak memory stays near one model.

A model folder holds ``model.safetensors`` or shards listed in ``model.safetensors.index.json``. Names, shapes and
dtypes are read from the safetensors headers only (no tensor is loaded) to check that the sources match. A merge is
a per-tensor linear combination of the sources (fixed weights for averages; weights from the task vectors' Gram
matrix for SLERP), so each output tensor is built in row chunks: a slice of every source is read (one ``safe_open``
per read, closed straight away, so no source stays memory-mapped), combined in float64 and copied into the output
tensor, which is kept until its shard is written. Peak memory is therefore about one output shard (one model for a
single-file model) plus K float64 chunks.

The output mirrors the base source's layout (same shard files, same index), so ``from_pretrained`` reads it like the
base. Non-floating tensors (integer and bool buffers) are copied from the base source, never merged.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from trl_ext_plugins.merge.math import (
    ArchitectureMismatchError,
    MalformedWeightsError,
    NonFiniteWeightsError,
    check_same_tensors,
    weighted_average,
)

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")


@dataclass(frozen=True)
class TensorInfo:
    file: str  # the shard's file name inside the folder
    shape: tuple[int, ...]
    dtype: str  # safetensors dtype code (F32, BF16, I64, BOOL ...)


def weight_files(folder: str | Path) -> list[str]:
    """The safetensors weight files of a model folder (file names), in index order.

    An index is read as untrusted input: it must be JSON with a ``weight_map`` of tensor name -> a plain
    ``*.safetensors`` file name in the folder, so no entry can point the merge at (or make it write) a path outside
    the folder; anything else is refused naming the index file.
    """
    folder = Path(folder)
    if (folder / INDEX_FILE).is_file():
        index_path = folder / INDEX_FILE
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
        except (ValueError, UnicodeDecodeError) as exc:
            raise MalformedWeightsError(f"{index_path}: not a JSON safetensors index ({exc})") from None
        except (KeyError, TypeError):
            raise MalformedWeightsError(f"{index_path}: no 'weight_map' object (tensor name -> shard file)") from None
        if not isinstance(weight_map, dict) or not weight_map:
            raise MalformedWeightsError(f"{index_path}: 'weight_map' must be a non-empty object (tensor name -> "
                                        f"shard file)")
        for name, file_name in weight_map.items():
            if not _plain_shard_name(file_name):
                raise MalformedWeightsError(f"{index_path}: weight_map[{name!r}] = {file_name!r} is not a "
                                            f"*.safetensors file name inside the folder")
        return sorted(set(weight_map.values()))
    if (folder / SINGLE_FILE).is_file():
        return [SINGLE_FILE]
    found = "adapter weights (a PEFT checkpoint)" if (folder / "adapter_model.safetensors").is_file() else "none"
    raise FileNotFoundError(f"{folder}: no {SINGLE_FILE} or {INDEX_FILE} (found {found}); merging needs full "
                            f"safetensors model weights")


def _plain_shard_name(file_name) -> bool:
    """A bare ``*.safetensors`` file name: no directory part, no ``..``, no hidden or absolute path."""
    return (isinstance(file_name, str) and file_name.endswith(".safetensors") and not file_name.startswith(".")
            and "/" not in file_name and "\\" not in file_name and "\0" not in file_name
            and Path(file_name).name == file_name)


def tensor_index(folder: str | Path) -> dict[str, TensorInfo]:
    """Name -> (file, shape, dtype) of every tensor in a model folder, read from the headers only.

    A shard that is missing or unreadable, and an index entry whose tensor is not in the shard it names, are refused
    naming the file (the merge would otherwise fail later without a name, or copy an index that lies).
    """
    from safetensors import safe_open

    folder = Path(folder)
    index: dict[str, TensorInfo] = {}
    for name in weight_files(folder):
        path = folder / name
        if not path.is_file():
            raise FileNotFoundError(f"{path}: weight file missing (listed in {folder / INDEX_FILE})")
        try:
            with safe_open(str(path), framework="pt") as handle:
                for key in handle.keys():
                    piece = handle.get_slice(key)
                    index[key] = TensorInfo(name, tuple(piece.get_shape()), piece.get_dtype())
        except Exception as exc:  # safetensors raises its own error types for a bad header or a truncated file
            if isinstance(exc, MalformedWeightsError):
                raise
            raise MalformedWeightsError(f"{path}: not a readable safetensors file ({type(exc).__name__}: "
                                        f"{str(exc).splitlines()[0] if str(exc) else 'no detail'})") from None
    if (folder / INDEX_FILE).is_file():
        listed = json.loads((folder / INDEX_FILE).read_text())["weight_map"]
        for key, file_name in listed.items():
            if key not in index or index[key].file != file_name:
                raise MalformedWeightsError(f"{folder / INDEX_FILE}: tensor {key!r} is listed in {file_name!r} but "
                                            f"that file does not hold it")
    for key, info in index.items():
        if info.dtype not in FLOAT_CODES | COPIED_CODES:
            raise MalformedWeightsError(f"{folder / info.file}: tensor {key!r} has dtype {info.dtype}, which merging "
                                        f"does not support (floating types are merged, integer and bool ones "
                                        f"copied)")
    return index


def check_sources(sources: Sequence[str | Path], who: str) -> list[dict[str, TensorInfo]]:
    """Tensor indexes of all sources, refusing mismatched names or shapes (the error names the tensor)."""
    indexes = [tensor_index(s) for s in sources]
    check_same_tensors([{k: v.shape for k, v in idx.items()} for idx in indexes], [str(s) for s in sources], who)
    for key, info in indexes[0].items():  # float vs integer/bool is an architecture difference, not a precision one
        for source, idx in zip(sources[1:], indexes[1:]):
            if (idx[key].dtype in FLOAT_CODES) != (info.dtype in FLOAT_CODES):
                raise ArchitectureMismatchError(f"{who}: tensor {key!r} is {idx[key].dtype} in {str(source)!r} but "
                                                f"{info.dtype} in {str(sources[0])!r}")
    return indexes


# A merge as weights: (tensor name, Gram matrix of the task vectors sources[1:] - sources[0] when asked for, else
# None) -> one weight per source; the merged tensor is sum_k w_k theta_k. Averages have fixed weights; WARP's SLERP +
# LITI is also a linear combination of the sources, with weights that depend on the task vectors' angles.
WeightsFn = Callable[[str, "torch.Tensor | None"], Sequence[float]]

# safetensors dtype codes: floating ones are merged (float8 read and combined in float64 like the others), integer and
# bool ones are copied from the base; any other code (complex, sub-byte floats) is refused by tensor_index.
FLOAT_CODES = frozenset({"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2", "F8_E4M3FNUZ", "F8_E5M2FNUZ"})
COPIED_CODES = frozenset({"BOOL", "I8", "I16", "I32", "I64", "U8", "U16", "U32", "U64"})


def read_rows(folder: Path, info: TensorInfo, name: str, rows: slice | None) -> torch.Tensor:
    """Rows ``rows`` of a tensor (all of it when None or 0-d), through a handle closed straight after the read."""
    from safetensors import safe_open

    with safe_open(str(folder / info.file), framework="pt") as handle:
        if rows is None or not info.shape:
            return handle.get_tensor(name)
        return handle.get_slice(name)[rows]


def row_chunks(shape: tuple[int, ...], chunk_elements: int) -> list[slice | None]:
    """Slices of the first dimension holding about ``chunk_elements`` elements each (None: the tensor is one chunk)."""
    total = math.prod(shape)
    if not shape or total <= chunk_elements:
        return [None]
    per_row = max(total // shape[0], 1)
    step = max(chunk_elements // per_row, 1)
    return [slice(start, min(start + step, shape[0])) for start in range(0, shape[0], step)]


def task_vector_gram(sources: Sequence[Path], indexes: Sequence[dict[str, TensorInfo]], name: str,
                     chunk_elements: int) -> torch.Tensor:
    """``G[i, j] = <theta_{i+1} - theta_0, theta_{j+1} - theta_0>`` over the whole tensor, accumulated chunk by chunk."""
    m = len(sources) - 1
    gram = torch.zeros((m, m), dtype=torch.float64)
    for rows in row_chunks(indexes[0][name].shape, chunk_elements):
        init = read_rows(sources[0], indexes[0][name], name, rows).to(torch.float64).flatten()
        deltas = torch.stack([read_rows(src, idx[name], name, rows).to(torch.float64).flatten() - init
                              for src, idx in zip(sources[1:], indexes[1:])])
        gram += deltas @ deltas.T
    return gram


@torch.no_grad()
def stream_merge(sources: Sequence[str | Path], out_dir: str | Path, weights_fn: WeightsFn, base: int = 0,
                 who: str = "merge", gram: bool = False, chunk_elements: int = 1 << 20) -> dict[str, int]:
    """Write ``sum_k w_k sources[k]`` per floating-point tensor into ``out_dir`` (weight files only), chunk by chunk.

    ``weights_fn(name, G)`` gives the weights of one tensor; ``G`` (with ``gram=True``) is the Gram matrix of the task
    vectors relative to ``sources[0]``, computed in a first pass over the tensor. Each tensor is then built in row
    chunks of about ``chunk_elements`` elements: a chunk of every source is read (float64), combined, and written into
    the output tensor in the base's dtype. Non-floating tensors are copied from ``sources[base]``, whose layout (shards,
    index, dtypes) the output mirrors. ``out_dir`` may be one of the sources: the new files are written to a temporary
    folder first and moved in at the end. Returns counts of merged and copied tensors.
    """
    from safetensors.torch import save_file

    sources = [Path(s) for s in sources]
    out_dir = Path(out_dir)
    indexes = check_sources(sources, who)
    base_index, base_dir = indexes[base], sources[base]
    for stale in out_dir.glob(".merge-tmp-*"):  # left by a merge that crashed; the stage is being re-run
        shutil.rmtree(stale, ignore_errors=True)
    tmp = out_dir / f".merge-tmp-{os.getpid()}"
    tmp.mkdir(parents=True)
    counts = {"merged_tensors": 0, "copied_tensors": 0}
    for file_name in weight_files(base_dir):
        shard: dict[str, torch.Tensor] = {}
        for name, info in base_index.items():
            if info.file != file_name:
                continue
            if info.dtype not in FLOAT_CODES:
                shard[name] = read_rows(base_dir, info, name, None)
                counts["copied_tensors"] += 1
                continue
            weights = [float(w) for w in weights_fn(name, task_vector_gram(sources, indexes, name, chunk_elements)
                                                    if gram else None)]
            out = None
            for rows in row_chunks(info.shape, chunk_elements):
                pieces = [read_rows(src, idx[name], name, rows) for src, idx in zip(sources, indexes)]
                for src, piece in zip(sources, pieces):
                    if not bool(torch.isfinite(piece.to(torch.float64)).all()):  # isfinite has no float8 kernel
                        raise NonFiniteWeightsError(f"{who}: tensor {name!r} holds NaN or Inf in {str(src)!r}")
                if out is None:
                    out = torch.empty(info.shape, dtype=pieces[base].dtype)
                merged = weighted_average(pieces, weights, out.dtype)
                (out if rows is None else out[rows]).copy_(merged)
                del pieces, merged
            shard[name] = out
            counts["merged_tensors"] += 1
        save_file(shard, str(tmp / file_name), metadata={"format": "pt"})
        del shard
    if (base_dir / INDEX_FILE).is_file():
        shutil.copyfile(base_dir / INDEX_FILE, tmp / INDEX_FILE)
    _replace_weights(out_dir, tmp)
    return counts


def _replace_weights(out_dir: Path, tmp: Path) -> None:
    """Move the new weight files in so that a kill at any instant leaves a folder that reads as one whole model.

    The folder is read through its index when it has one, else through ``model.safetensors``. So new shards go in
    first (unreferenced until their index arrives), then the file that switches the folder to the new layout (the new
    index; or the new single file, followed by removing an old index), and only then are old files the new layout does
    not use removed. Shards that keep their names are replaced one by one: a kill between two of them leaves a whole
    but partly merged model, which the rerun of the unfinished stage rewrites (the runner reruns any stage without its
    completion record).
    """
    new = sorted(p.name for p in tmp.iterdir())
    switch = INDEX_FILE if INDEX_FILE in new else SINGLE_FILE
    for name in new:
        if name != switch:
            os.replace(tmp / name, out_dir / name)
    os.replace(tmp / switch, out_dir / switch)
    if switch == SINGLE_FILE:
        (out_dir / INDEX_FILE).unlink(missing_ok=True)
    for old in out_dir.glob("model*.safetensors"):
        if old.name not in new:
            old.unlink()
    tmp.rmdir()


def checkpoint_folders(checkpoint_dir: str | Path) -> list[Path]:
    """Complete ``checkpoint-<step>`` folders of a stage, oldest first (by step number, not by name).

    Complete means marked by the runner once every file was written (``trl_ext.callbacks.CHECKPOINT_COMPLETE``): a
    folder left by a process killed while saving is never averaged.
    """
    from trl_ext.callbacks import CHECKPOINT_COMPLETE

    checkpoint_dir = Path(checkpoint_dir)
    if not checkpoint_dir.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in checkpoint_dir.iterdir()
             if p.is_dir() and (m := CHECKPOINT_RE.match(p.name)) and (p / CHECKPOINT_COMPLETE).is_file()]
    return [p for _, p in sorted(found)]


def step_of(checkpoint: Path) -> int:
    return int(CHECKPOINT_RE.match(checkpoint.name).group(1))


@torch.no_grad()
def load_into_model(model, folder: str | Path) -> bool:
    """Copy a model folder's tensors into ``model``'s parameters and buffers in place (no second model in memory).

    Returns False (and changes nothing) when the file's tensor names or shapes are not exactly the module's (e.g. a
    checkpoint format transformers converts on load, or parameters sharded by ZeRO-3 or FSDP2); the files on disk are
    then the only merged copy (later stages read them; the stage's own after-evaluation then scores the last weights).
    """
    index = tensor_index(folder)
    targets = dict(model.state_dict(keep_vars=True))
    if any(name not in targets or tuple(targets[name].shape) != info.shape for name, info in index.items()):
        return False
    if any(type(t).__name__ == "DTensor" for t in targets.values()):  # FSDP2 shards: a full-tensor copy_ is refused
        return False
    for name, info in index.items():
        target = targets[name]
        target.data.copy_(read_rows(Path(folder), info, name, None).to(target.dtype))
    return True
