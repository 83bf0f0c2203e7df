"""Tiny randomly initialised causal LMs built in code, and a way to save them for TRL.

The models are small enough that every TRL trainer runs at a few hundredths of a second per step on a
CPU. TRL re-loads a reference model from the policy's `_name_or_path` (GRPO with beta != 0, RLOO), so
`materialize_model` writes a model to a directory that can be passed to TRL by path.
"""

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
from transformers import (
    Glm4MoeConfig,
    Glm4MoeForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from trl_ext.embedded.tokenizer import build_tokenizer
from trl_ext.embedded.tool_tokenizer import build_tool_tokenizer

# Written last into a materialized directory: its presence means the copy is complete, and its content
# says which model and seed the copy holds.
MARKER_FILE = "trl_ext_embedded.json"


def _special_token_ids(make_tokenizer: Callable[[], PreTrainedTokenizerFast] = build_tokenizer) -> dict[str, int]:
    # The model configs must agree with the tokenizer, or generation would not stop at eos.
    tokenizer = make_tokenizer()
    return {
        "vocab_size": len(tokenizer),
        "pad_token_id": tokenizer.pad_token_id,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
    }


def _qwen2_config(hidden_size: int, num_layers: int, num_heads: int, intermediate_size: int) -> Qwen2Config:
    return Qwen2Config(
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads // 2,
        intermediate_size=intermediate_size,
        max_position_embeddings=512,
        # Tied embeddings keep the vocabulary from dominating the parameter count.
        tie_word_embeddings=True,
        **_special_token_ids(),
    )


def _tiny_qwen2() -> Qwen2Config:
    # About 310K parameters: 400 SFT steps (20 s on one CPU core) teach it part of two-operand addition.
    return _qwen2_config(hidden_size=96, num_layers=3, num_heads=4, intermediate_size=256)


def _tiny_qwen2_small() -> Qwen2Config:
    # About 55K parameters: the "weak" model of weak-versus-strong experiments.
    return _qwen2_config(hidden_size=48, num_layers=2, num_heads=2, intermediate_size=128)


def _tiny_qwen3_moe() -> Qwen3MoeConfig:
    # About 360K parameters. Every layer is sparse (4 experts, top-2), so MoE routing code finds a router
    # (`model.model.layers[i].mlp.gate`) in each layer.
    return Qwen3MoeConfig(
        hidden_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=24,
        intermediate_size=256,
        moe_intermediate_size=128,
        num_experts=4,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        **_special_token_ids(),
    )


def _tiny_glm4_moe_mtp() -> Glm4MoeConfig:
    # A GLM-4.5-Air-shaped model with one multi-token-prediction layer, about 430K parameters. It has 46 decoder
    # layers because transformers 5.24 finds GLM-4-MoE's MTP weights only at the layer indices of the released
    # checkpoints (`model.layers.46` / `92`, Glm4MoeForCausalLM._keys_to_ignore_on_load_unexpected): with 46 layers,
    # heads saved at `model.layers.46` load through `generate(use_mtp=True)` unchanged. The trunk is dense
    # (first_k_dense_replace=46); the MTP layer is sparse, as transformers builds it (4 experts, top-2, 1 shared).
    # The materialized checkpoint has no MTP weights: the `mtp` trainer attaches fresh heads.
    return Glm4MoeConfig(
        hidden_size=32,
        num_hidden_layers=46,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        intermediate_size=64,
        moe_intermediate_size=32,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        first_k_dense_replace=46,
        num_mtp_layers=1,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        **_special_token_ids(),
    )


def _tiny_qwen3_tools() -> Qwen3Config:
    # About 120K parameters, with the tool-calling tokenizer (trl_ext.embedded.tool_tokenizer): TRL's Qwen3 chat
    # template, so GRPO's `environment_factory` tool loop runs. Positions reach 2048 because the template writes each
    # tool's JSON schema into the prompt, one token per character (about 1100 tokens for three tools).
    return Qwen3Config(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        **_special_token_ids(build_tool_tokenizer),
    )


_CONFIGS: dict[str, tuple[Callable[[], PretrainedConfig], type[PreTrainedModel]]] = {
    "tiny-qwen2": (_tiny_qwen2, Qwen2ForCausalLM),
    "tiny-qwen2-small": (_tiny_qwen2_small, Qwen2ForCausalLM),
    "tiny-qwen3-moe": (_tiny_qwen3_moe, Qwen3MoeForCausalLM),
    "tiny-glm4-moe-mtp": (_tiny_glm4_moe_mtp, Glm4MoeForCausalLM),
    "tiny-qwen3-tools": (_tiny_qwen3_tools, Qwen3ForCausalLM),
}
# The tokenizer each model is saved with; models not listed use the embedded character tokenizer.
_TOKENIZERS: dict[str, Callable[[], PreTrainedTokenizerFast]] = {"tiny-qwen3-tools": build_tool_tokenizer}


def embedded_tokenizer(name: str) -> PreTrainedTokenizerFast:
    """The tokenizer embedded model `name` is saved with (its vocabulary matches the model's embeddings)."""
    if name not in _CONFIGS:
        raise ValueError(f"Unknown embedded model {name!r}; choose one of {sorted(_CONFIGS)}")
    return _TOKENIZERS.get(name, build_tokenizer)()


def embedded_config(name: str) -> PretrainedConfig:
    """The config of embedded model `name` with `architectures` naming its class, without building weights (for
    checks at recipe validation, e.g. whether the model is a mixture of experts)."""
    if name not in _CONFIGS:
        raise ValueError(f"Unknown embedded model {name!r}; choose one of {sorted(_CONFIGS)}")
    make_config, model_class = _CONFIGS[name]
    config = make_config()
    config.architectures = [model_class.__name__]
    return config


def build_model(name: str = "tiny-qwen2", seed: int = 0) -> PreTrainedModel:
    """Build the embedded model `name` with random weights drawn from `seed` (same seed, same weights)."""
    if name not in _CONFIGS:
        raise ValueError(f"Unknown embedded model {name!r}; choose one of {sorted(_CONFIGS)}")
    make_config, model_class = _CONFIGS[name]
    # Fork the RNG so that building a model neither depends on nor disturbs the caller's random state.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_class(make_config())
    # Keep the generation defaults in step with the tokenizer (greedy stops at eos, pads with pad).
    model.generation_config.pad_token_id = model.config.pad_token_id
    model.generation_config.eos_token_id = model.config.eos_token_id
    model.generation_config.bos_token_id = model.config.bos_token_id
    return model


# Builders taking an optional `seed`, e.g. `EMBEDDED_MODELS["tiny-qwen2"](seed=1)`.
EMBEDDED_MODELS: dict[str, Callable[..., PreTrainedModel]] = {name: partial(build_model, name) for name in _CONFIGS}


def materialize_model(name: str, directory: str | Path, seed: int = 0) -> Path:
    """Save model `name` (seed `seed`) with its tokenizer into `directory` and return the directory.

    The copy is written to a temporary sibling directory and renamed into place, so `directory` is
    either absent or complete, even if several processes (e.g. the ranks of a torchrun job) materialize
    the same model at once. A complete copy of the same model and seed is returned unchanged; a
    directory holding anything else raises rather than being overwritten.
    """
    directory = Path(directory)
    expected = {"name": name, "seed": seed}
    if _existing_copy(directory, expected):
        return directory
    if directory.exists() and any(directory.iterdir()):
        raise FileExistsError(f"{directory} is not empty and holds no embedded model copy")

    directory.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{directory.name}.", dir=directory.parent))
    try:
        build_model(name, seed).save_pretrained(staging, safe_serialization=True)
        embedded_tokenizer(name).save_pretrained(staging)
        (staging / MARKER_FILE).write_text(json.dumps(expected))
        try:
            # rename(2) replaces a missing or empty directory atomically and fails on a non-empty one.
            os.replace(staging, directory)
        except OSError:
            # Another process may have renamed its own complete copy into place first.
            if not _existing_copy(directory, expected):
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)  # still there only if the rename did not happen
    return directory


def _existing_copy(directory: Path, expected: dict) -> bool:
    marker = directory / MARKER_FILE
    if not marker.is_file():
        return False
    found = json.loads(marker.read_text())
    if found != expected:
        raise FileExistsError(f"{directory} holds embedded model {found}, not {expected}")
    return True
