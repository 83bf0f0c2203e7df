"""Learned reward models used as rewards: model references, batched scoring, weight averaging.

Shared by ``reward_model``, ``warm`` and ``prm``/``orm``. Nothing here knows about a particular plugin.

Model references (the ``path`` / ``paths`` parameters) follow the recipe's conventions:

* ``stage:<name>``: the output folder of an earlier stage of the same run. A reward function is built before the
  trainer, so the reference is resolved lazily, at the first scoring call, against the *run directory*: the nearest
  ancestor of the trainer's ``output_dir`` that holds the runner's ``run.json`` (the runner writes stages to
  ``DIR/<stage>/checkpoints``, so this is ``DIR``); without one, the grandparent of ``output_dir``.
* ``embedded:<name>``: a model built in code, materialized into ``DIR/_embedded/<name>`` (as the runner does);
* anything else: a local folder (or hub id).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from trl_ext_plugins.merge.math import ArchitectureMismatchError, check_same_tensors

STAGE_PREFIX = "stage:"
EMBEDDED_PREFIX = "embedded:"


def run_dir_of(output_dir: str | Path) -> Path:
    """The run directory a trainer's ``output_dir`` belongs to (see the module docstring)."""
    start = Path(output_dir).resolve()
    for folder in (start, *start.parents):
        if (folder / "run.json").is_file():
            return folder
    return start.parent.parent


def _run_seed(run_dir: Path | None) -> int:
    """The seed the runner materializes embedded models with (``recipe.seed or 0``), read from ``run.json``."""
    import json

    try:
        return int(json.loads((run_dir / "run.json").read_text())["recipe"].get("seed") or 0)
    except (TypeError, OSError, KeyError, ValueError):
        return 0


def resolve_ref(ref: str, run_dir: Path | None) -> str:
    """Turn a model reference into a local folder (or leave a plain path / hub id unchanged).

    An embedded model is materialized with the run's seed, so it is the very folder the runner builds for a stage
    naming the same model (never a second copy with another seed overwriting it).
    """
    if ref.startswith(STAGE_PREFIX):
        if run_dir is None:
            raise ValueError(f"{ref!r}: a stage reference needs the run directory (use the model inside a recipe run)")
        folder = run_dir / ref[len(STAGE_PREFIX):]
        if not (folder / "config.json").is_file():
            raise FileNotFoundError(f"{ref!r}: no finished model in {folder} (is the stage earlier in the recipe?)")
        return str(folder)
    if ref.startswith(EMBEDDED_PREFIX):
        from trl_ext.catalog import Catalog

        name = ref[len(EMBEDDED_PREFIX):]
        models = Catalog.discover().models
        if name not in models:
            raise ValueError(f"{ref!r}: unknown embedded model; known: {sorted(models)}")
        base = run_dir if run_dir is not None else Path.cwd() / "runs"
        materialize, _source = models[name]
        return str(materialize(base / "_embedded" / name, seed=_run_seed(run_dir)))
    return ref


def load_sequence_classifier(path: str, dtype: torch.dtype = torch.float32):
    """A reward model (``AutoModelForSequenceClassification`` with one label) and its tokenizer, in eval mode.

    A causal-LM folder also loads (a fresh, seeded head is added: TRL's RewardTrainer does the same at training start).
    """
    from transformers import AutoModelForSequenceClassification, AutoTokenizer
    from trl.trainer.reward_trainer import suppress_seqcls_warning

    with suppress_seqcls_warning():
        model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1, dtype=dtype)
    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    if model.config.pad_token_id is None:
        model.config.pad_token_id = tokenizer.pad_token_id
    return model.eval().requires_grad_(False), tokenizer


def join_prompt_completion(prompt: Any, completion: Any, tokenizer) -> str:
    """Text the reward model reads: ``prompt + completion`` (plain), or the chat template of the messages."""
    if isinstance(completion, list):  # conversational: lists of messages
        messages = (prompt if isinstance(prompt, list) else [{"role": "user", "content": str(prompt)}]) + completion
        return tokenizer.apply_chat_template(messages, tokenize=False)
    return f"{prompt}{completion}"


@torch.no_grad()
def score_texts(model, tokenizer, texts: Sequence[str], batch_size: int = 32, max_length: int | None = None,
                append_eos: bool = True, conversational: bool = False) -> list[float]:
    """Scalar reward of each text, ``batch_size`` texts per forward pass (right padding, left truncation).

    ``append_eos`` adds the eos token where a text lacks it: TRL's RewardTrainer trains on ``prompt + chosen + eos``
    and the sequence-classification head reads the last non-pad token, while GRPO completions are decoded without
    special tokens; scoring without it would read the head at a position it was never trained on. ``conversational``
    (chat-template renderings): no eos appended and no special tokens added, as TRL's RewardTrainer tokenizes
    conversations with ``apply_chat_template``; plain texts are tokenized with the tokenizer's special tokens (e.g. a
    bos), as its ``processing_class(text=...)`` does.
    """
    device = next(model.parameters()).device
    eos = tokenizer.eos_token or ""
    # As TRL's RewardTrainer (1.16 `_prepare_dataset`): eos is appended to plain texts only, which are tokenized with
    # the tokenizer's special tokens (`processing_class(text=...)`, e.g. bos); a chat-template rendering already holds
    # its special tokens and gets no eos.
    if not conversational:
        texts = [t if not append_eos or t.endswith(eos) else t + eos for t in texts]
    out: list[float] = []
    side = tokenizer.padding_side, tokenizer.truncation_side
    tokenizer.padding_side, tokenizer.truncation_side = "right", "left"
    try:
        for start in range(0, len(texts), batch_size):
            chunk = list(texts[start:start + batch_size])
            enc = tokenizer(chunk, return_tensors="pt", padding=True, add_special_tokens=not conversational,
                            truncation=max_length is not None, max_length=max_length)
            logits = model(input_ids=enc["input_ids"].to(device), attention_mask=enc["attention_mask"].to(device)).logits
            out.extend(logits[:, 0].float().cpu().tolist())
    finally:
        tokenizer.padding_side, tokenizer.truncation_side = side
    return out


# ----------------------------------------------------------------------------------------------------------------
# Weight averaging (WARM): the averaging math and the tensor checks live in the merge family
# ----------------------------------------------------------------------------------------------------------------


def _architecture(model) -> tuple:
    config = model.config
    return (type(model).__name__, config.model_type, getattr(config, "num_labels", None))


def check_same_architecture(models: Sequence[Any], names: Sequence[str]) -> None:
    """Refuse models whose class, config type, parameter names or shapes differ; the message names both models."""
    first, first_name = models[0], names[0]
    arch0 = _architecture(first)
    for model, name in zip(models[1:], names[1:]):
        arch = _architecture(model)
        if arch != arch0:
            raise ArchitectureMismatchError(
                f"warm: {name!r} is a {arch[0]} ({arch[1]}, num_labels={arch[2]}) but {first_name!r} is a "
                f"{arch0[0]} ({arch0[1]}, num_labels={arch0[2]}); averaged models must share an architecture")
    check_same_tensors([{k: tuple(v.shape) for k, v in m.state_dict().items()} for m in models], names, "warm")


# ----------------------------------------------------------------------------------------------------------------
# A reward callable over a lazily loaded model
# ----------------------------------------------------------------------------------------------------------------


class LazyScorer:
    """Loads a reward model at the first scoring call and scores ``prompts``/``completions`` in batches.

    ``load(run_dir) -> (model, tokenizer)``; ``bind(trainer)`` (from ``trl_ext_trainer_created``) records the run
    directory and the trainer's device. Loading is lazy because reward functions are handed to TRL before the
    trainer exists. The model is frozen, in eval mode, and never part of the optimiser.
    """

    def __init__(self, load, batch_size: int = 32, max_length: int | None = None, append_eos: bool = True):
        self._load = load
        self.batch_size, self.max_length, self.append_eos = batch_size, max_length, append_eos
        self.run_dir: Path | None = None
        self.device: torch.device | None = None
        self.model = self.tokenizer = None

    def bind(self, trainer) -> None:
        self.run_dir = run_dir_of(trainer.args.output_dir)
        self.device = getattr(getattr(trainer, "accelerator", None), "device", None)

    def ensure_loaded(self):
        if self.model is None:
            model, self.tokenizer = self._load(self.run_dir)
            self.model = model.to(self.device) if self.device is not None else model
        return self.model, self.tokenizer

    def __call__(self, prompts, completions, **_kwargs) -> list[float]:
        model, tokenizer = self.ensure_loaded()
        texts = [join_prompt_completion(p, c, tokenizer) for p, c in zip(prompts, completions, strict=True)]
        conversational = bool(completions) and isinstance(completions[0], list)
        return score_texts(model, tokenizer, texts, self.batch_size, self.max_length, self.append_eos, conversational)
