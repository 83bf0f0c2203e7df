"""MTP trainer: train a causal LM's multi-token-prediction (MTP) heads with every trunk parameter frozen.

The heads are transformers' own ``MtpModel`` / ``MtpLayer`` (``transformers.modeling_layers``), the modules
``generate(use_mtp=True)`` drafts with; this module writes no MTP layer of its own. transformers 5.24 only runs them
for speculative decoding (no training path: ``MtpModel.forward(labels=...)`` adds to a ``None`` loss), so the trainer
drives them one depth at a time through ``MtpModel.forward_layer``, the per-layer entry point transformers exposes for
frameworks that own the drafting loop, and reproduces the drafting loop's inputs with teacher forcing:

* the trunk runs once per batch without gradient, with ``output_hidden_states=-1`` exactly as
  ``MTPCandidateGenerator`` calls it, giving the last hidden states ``h`` and the policy's logits;
* depth k (0-based) at hidden position j reads the token ``x[j+k+1]`` (embedded by the shared embedding), the previous
  depth's output at j (``h`` for k = 0), position id ``j+k+1``, and predicts ``x[j+k+2]``: the same shift as
  ``MtpModel.forward`` (its inputs are the main model's shifted by one, then rolled by one per depth). Its target is
  the policy's next-token distribution at position t = j+k+1.

Loss (``MtpConfig.mtp_loss``):

* ``soft`` (default): cross-entropy ``-sum_v p_t(v) log q(v)`` against the detached policy distribution ``p_t``
  (softmax of the trunk's logits at temperature 1). Speculative sampling accepts a draft with probability
  ``sum_v min(p, q)``, which rises as the draft distribution ``q`` approaches ``p``, so matching the whole distribution
  is what raises acceptance; it equals KL(p || q) plus the constant entropy H(p) (same gradient), and uses every
  position's full distribution rather than one sampled token.
* ``hard``: cross-entropy on the realised next token ``x[t+1]`` (DeepSeek-V3's MTP loss, arXiv 2412.19437, and the
  "SFT-style loss" of Nemotron 3 Super's MTP healing, arXiv 2604.12374).

Both average over the counted positions of the batch per depth, then over depths (DeepSeek-V3's 1/D sum; its weight
lambda only rescales the loss here, since nothing else trains). Counted positions: t from the prompt length P to L-2
(the next token ``x[t+1]`` is a response token after the first, which the trunk itself predicts): the positions at
which ``generate(use_mtp=True)`` drafts. Rows are ``prompt`` + ``completion`` strings, or ``prompt_ids`` +
``completion_ids`` token lists (what the ``mtp_heads`` plugin samples from the policy).

Heads at the start: the checkpoint's own MTP weights when it has them (``MtpModel.from_pretrained``; the checkpoint is
a folder or a hub id, resolved as ``from_pretrained`` resolves it), otherwise fresh ones initialised by the model
family's ``_init_weights`` (``MtpModel``'s generic init leaves e.g. GLM-4-MoE's expert tensors uninitialised), seeded
by ``args.seed``; a plugin may replace them with ``load_heads`` (another checkpoint's). Either way they are built in the
trunk's dtype (a bf16 model trains bf16 heads, as ``Trainer`` trains a model in its own dtype), except tensors the
family keeps in float32. ``num_mtp_layers`` sets the depth when the checkpoint's config has none (0).

Saving (``save_model`` and every checkpoint): the trunk as ``save_pretrained`` writes it plus the heads as the
decoder layers after ``num_hidden_layers`` (``model.layers.{N+k}.{enorm,hnorm,eh_proj,shared_head.norm,...}``, the
DeepSeek-V3 / GLM-4.5 layout, in the family's on-disk weight format), so ``AutoModelForCausalLM.from_pretrained``
loads the folder unchanged and ``generate(use_mtp=True)`` drafts with the trained heads; the main process writes it
(``save_model`` calls ``_save`` on every rank). Resuming reads the heads back from the newest checkpoint folder.
DeepSpeed ZeRO-3 is refused (at validation and by the trainer): transformers would load the frozen trunk partitioned,
but only the heads enter the engine that gathers weights, so the trunk's forward would see size-0 weights.

Depends on no TRL internals. transformers internals used: ``MtpModel.{from_pretrained, forward_layer,
_project_to_logits, get_mtp_weights_regex}``, ``PreTrainedModel._init_weights``,
``core_model_loading.revert_weight_conversion`` (the conversion ``save_pretrained`` applies), ``utils.cached_file``
(private ``_raise_exceptions_for_*`` flags), ``Trainer._save`` / ``_load_from_checkpoint``.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, PreTrainedModel, Trainer, TrainingArguments

from trl_ext import metrics as figures
from trl_ext.files import write_text_atomic
from trl_ext.trainers.base import HostMixin

MTP_LOSSES = ("soft", "hard")


@dataclass
class MtpConfig(TrainingArguments):
    """``TrainingArguments`` plus the MTP-head fields."""

    mtp_loss: Literal["soft", "hard"] = field(default="soft", metadata={
        "help": "soft: cross-entropy against the detached policy's next-token distribution (default; matches the "
                "distribution speculative sampling accepts against); hard: cross-entropy on the realised token"})
    num_mtp_layers: int | None = field(default=None, metadata={
        "help": "MTP depth to attach when the checkpoint's config has none (num_mtp_layers 0 or unset); must "
                "agree with the config when it has one"})
    max_length: int | None = field(default=512, metadata={"help": "truncate prompt+completion to this many tokens"})
    model_init_kwargs: dict[str, Any] | None = field(default=None, metadata={"help": "kwargs for from_pretrained"})

    def __post_init__(self):
        super().__post_init__()
        # The collator's columns (completion_mask) are not model arguments; keep them.
        self.remove_unused_columns = False


# ------------------------------------------------------------------------------------------------------------------
# Losses (pure functions)
# ------------------------------------------------------------------------------------------------------------------


def soft_cross_entropy(draft_logits: torch.Tensor, target_logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean over masked positions of ``-sum_v softmax(target)_v * log_softmax(draft)_v``.

    ``draft_logits``/``target_logits``: (B, T, V); ``mask``: (B, T) bool. The target is detached. Vocabulary entries
    with zero target probability contribute exactly 0 even where the draft's log-probability is -inf, and masked
    positions contribute 0 whatever their values. Returns 0 (with a graph) when nothing is masked in.
    """
    # Masked positions are zeroed before any arithmetic: an inf there would turn the backward pass into NaN even
    # though torch.where drops it from the forward value.
    keep = mask.unsqueeze(-1)
    log_q = F.log_softmax(torch.where(keep, draft_logits.float(), 0.0), dim=-1)
    p = F.softmax(torch.where(keep, target_logits.detach().float(), 0.0), dim=-1)
    terms = torch.where(p > 0, p * log_q, torch.zeros_like(log_q))
    per_position = -terms.sum(-1)
    per_position = torch.where(mask, per_position, torch.zeros_like(per_position))
    return per_position.sum() / mask.sum().clamp(min=1)


def hard_cross_entropy(draft_logits: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean over masked positions of ``-log_softmax(draft)[label]``; ``labels``: (B, T) token ids."""
    log_q = F.log_softmax(torch.where(mask.unsqueeze(-1), draft_logits.float(), 0.0), dim=-1)
    picked = log_q.gather(-1, torch.where(mask, labels, torch.zeros_like(labels)).unsqueeze(-1)).squeeze(-1)
    per_position = torch.where(mask, -picked, torch.zeros_like(picked))
    return per_position.sum() / mask.sum().clamp(min=1)


def draft_target_mask(prompt_lengths: torch.Tensor, lengths: torch.Tensor, width: int) -> torch.Tensor:
    """(B, width) bool: target position t counts when prompt_length <= t <= length - 2 (see module docstring)."""
    t = torch.arange(width, device=lengths.device)[None, :]
    return (t >= prompt_lengths[:, None]) & (t <= lengths[:, None] - 2)


# ------------------------------------------------------------------------------------------------------------------
# Heads: support check, load, attach fresh, save in the checkpoint layout
# ------------------------------------------------------------------------------------------------------------------


class MtpSupportError(ValueError):
    """The model class cannot carry MTP heads that transformers' ``generate(use_mtp=True)`` would load."""


def text_config(config):
    return config.get_text_config()


def configured_depth(config) -> int | None:
    """``num_mtp_layers`` of the text config (``None`` when the config class has no such field)."""
    return getattr(text_config(config), "num_mtp_layers", None) if _has_mtp_field(config) else None


def _has_mtp_field(config) -> bool:
    # MTP families declare `num_mtp_layers` (often an alias of the checkpoints' `num_nextn_predict_layers`).
    return hasattr(text_config(config), "num_mtp_layers")


def decoder_layers_prefix(model: PreTrainedModel) -> str:
    """State-dict prefix of the decoder's layer list, e.g. ``model.layers``."""
    layers = model.get_decoder().layers
    return next(name for name, module in model.named_modules() if module is layers)


def mtp_support_problem(model_cls: type, config, depth: int | None = None) -> str | None:
    """Why ``model_cls`` with ``config`` cannot carry ``depth`` MTP heads in a checkpoint that transformers' MTP
    drafting loads, or ``None``. Builds the model on the meta device only (no weights are allocated or read)."""
    from transformers import __version__
    from transformers.modeling_layers import MtpModel

    name = model_cls.__name__
    if not _has_mtp_field(config):
        return (f"{name} has no multi-token-prediction support in transformers {__version__}: its config "
                f"{type(text_config(config)).__name__} has no num_mtp_layers (MTP families include DeepSeek-V3 and "
                f"GLM-4-MoE)")
    depth = depth or configured_depth(config)
    if not depth:
        return f"{name}: the config has num_mtp_layers={configured_depth(config)}; set args.num_mtp_layers"
    with torch.device("meta"):
        model = model_cls(config)
    try:
        regex = MtpModel.get_mtp_weights_regex(model)
    except ValueError as exc:
        return f"{name} has no multi-token-prediction support: {exc}"
    try:
        prefix = decoder_layers_prefix(model)
    except (AttributeError, StopIteration):
        return f"{name} has no decoder layer list for MTP layers to follow"
    n = text_config(config).num_hidden_layers
    missing = [k for k in range(n, n + depth) if not regex.search(f"{prefix}.{k}.eh_proj.weight")]
    if missing:
        return (f"{name} with num_hidden_layers={n}: transformers reads MTP weights only at checkpoint keys matching "
                f"{regex.pattern} (the layer indices of released checkpoints, hard-coded in "
                f"_keys_to_ignore_on_load_unexpected), so heads saved at {prefix}.{missing[0]} would not be found by "
                f"generate(use_mtp=True); use a layer count those indices follow")
    return None


def known_model_class(ref: str) -> tuple[type, Any] | None:
    """(model class, config) of ``embedded:<name>`` or a local folder, without loading weights; ``None`` when only
    known at run time (``stage:<name>``, hub ids, third-party embedded models)."""
    from trl_ext.recipe import EMBEDDED_PREFIX

    if ref.startswith(EMBEDDED_PREFIX):
        from trl_ext.embedded.models import _CONFIGS

        entry = _CONFIGS.get(ref[len(EMBEDDED_PREFIX):])
        return None if entry is None else (entry[1], entry[0]())
    if (Path(ref) / "config.json").is_file():
        from transformers import AutoConfig
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

        config = AutoConfig.from_pretrained(ref)
        try:
            return MODEL_FOR_CAUSAL_LM_MAPPING[type(config)], config
        except KeyError:
            return None
    return None


# ZeRO-3 builds the frozen trunk partitioned (transformers loads it inside ``deepspeed.zero.Init``) but only the heads
# enter the DeepSpeed engine, so the trunk's forward met size-0 weights at the first step.
ZERO3_REFUSAL = ("the mtp trainer does not run under DeepSpeed ZeRO-3 (the frozen trunk would be partitioned outside "
                 "the engine that gathers weights); use backend 'ddp' or 'zero2'")


def zero_stage(deepspeed) -> int | None:
    """The ZeRO stage of a ``deepspeed`` training argument (a config dict or the path of a JSON config), or None."""
    if isinstance(deepspeed, (str, os.PathLike)) and Path(deepspeed).is_file():
        deepspeed = json.loads(Path(deepspeed).read_text())
    if not isinstance(deepspeed, dict):
        return None
    return (deepspeed.get("zero_optimization") or {}).get("stage")


def check_stage(stage, args: dict[str, Any], where: str) -> list[str]:
    """Validation of an ``mtp`` stage before any model loads: the model class must carry MTP heads that
    ``generate(use_mtp=True)`` loads (when the class is known now; otherwise the trainer checks before training)."""
    errors = []
    if stage.evaluation is not None:
        errors.append(f"{where}.evaluation: the mtp trainer changes no policy output (greedy answers are the trunk's); "
                      f"measure speculative acceptance with the mtp_heads plugin instead")
    if stage.peft is not None:
        errors.append(f"{where}.peft: the mtp trainer trains the MTP heads in full; remove `peft`")
    if zero_stage(args.get("deepspeed")) == 3:
        errors.append(f"{where}.args.deepspeed: {ZERO3_REFUSAL}")
    known = known_model_class(stage.model)
    if known is not None:
        problem = mtp_support_problem(known[0], known[1], args.get("num_mtp_layers"))
        if problem:
            errors.append(f"{where}.model: {stage.model}: {problem}")
    return errors


def set_depth(config, depth: int) -> None:
    text = text_config(config)
    current = getattr(text, "num_mtp_layers", None)
    if current and current != depth:
        raise MtpSupportError(f"args.num_mtp_layers={depth} disagrees with the checkpoint's num_mtp_layers={current}")
    text.num_mtp_layers = depth


def checkpoint_weight_names(ref: str | os.PathLike) -> list[str]:
    """Tensor names of the safetensors checkpoint ``ref`` (a folder or a hub id), from the files
    ``MtpModel.from_pretrained`` reads: the index's weight map when sharded, else ``model.safetensors``. A hub id is
    resolved by transformers' ``cached_file`` like ``from_pretrained`` resolves it (the local cache only when
    ``HF_HUB_OFFLINE`` is set); a sharded hub checkpoint needs only its index. ``[]`` when neither file resolves."""
    from safetensors import safe_open
    from transformers.utils import SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME, cached_file

    def resolve(filename: str) -> str | None:
        try:
            return cached_file(str(ref), filename, _raise_exceptions_for_missing_entries=False,
                               _raise_exceptions_for_connection_errors=False)
        except OSError:  # neither a folder nor a repo id the hub (or its cache) knows
            return None

    index = resolve(SAFE_WEIGHTS_INDEX_NAME)
    if index is not None:
        return list(json.loads(Path(index).read_text())["weight_map"])
    single = resolve(SAFE_WEIGHTS_NAME)
    if single is None:
        return []
    with safe_open(single, framework="pt") as handle:
        return list(handle.keys())


def checkpoint_has_heads(model: PreTrainedModel, ref: str | os.PathLike) -> bool:
    """Whether the checkpoint ``ref`` (a folder or a hub id, see :func:`checkpoint_weight_names`) holds keys of
    ``model``'s MTP weight pattern. Looking only in a local folder made a hub-id model start from fresh heads
    although it had its own, and refused ``heads_from: <hub id>``."""
    from transformers.modeling_layers import MtpModel

    regex = MtpModel.get_mtp_weights_regex(model)
    return any(regex.search(key) for key in checkpoint_weight_names(ref))


@contextlib.contextmanager
def _reading_from(model: PreTrainedModel, directory: str):
    """``MtpModel.from_pretrained(main_model)`` reads ``main_model.config.name_or_path``: point it elsewhere. It also
    builds the heads under ``config.dtype``, which ``save_pretrained`` leaves as a string ('float32') that it cannot
    use; a stage resumed after the model was saved once (mtp_heads saves the starting model to measure it) failed with
    "'str' object has no attribute 'is_floating_point'". The model's own dtype is used for the duration."""
    saved = model.config.name_or_path, model.config.dtype
    model.config.name_or_path = str(directory)
    model.config.dtype = model.dtype
    try:
        yield
    finally:
        model.config.name_or_path, model.config.dtype = saved


def load_heads(model: PreTrainedModel, directory: str | os.PathLike):
    """transformers' ``MtpModel.from_pretrained`` on the MTP weights stored in ``directory`` (a folder or a hub id;
    same architecture). The heads take the model's dtype (``_reading_from``) and device."""
    from transformers.modeling_layers import MtpModel

    if not checkpoint_has_heads(model, directory):
        raise MtpSupportError(f"{directory}: holds no MTP weights matching "
                              f"{MtpModel.get_mtp_weights_regex(model).pattern!r} (looked for "
                              f"model.safetensors[.index.json] in the folder, or in the hub repo or its cache)")
    with _reading_from(model, str(directory)):
        return MtpModel.from_pretrained(model, device_map={"": model.device})


def fresh_heads(model: PreTrainedModel, depth: int, seed: int):
    """New ``MtpModel`` layers initialised by the model family's own ``_init_weights`` (seeded, RNG forked), in the
    model's dtype and on its device, as :func:`load_heads` builds them: a bf16 trunk's hidden states fed float32
    heads and training failed at the first step.

    Built under the model's dtype as torch's default (what ``MtpModel.from_pretrained`` does) rather than cast
    afterwards: tensors a family keeps in float32 on purpose (e.g. GLM-4-MoE's router weight and score bias) stay
    float32 as in the trunk, and ``.to(dtype)`` would also cast the trunk's rotary buffers the heads share."""
    from transformers.modeling_layers import MtpModel

    default_dtype = torch.get_default_dtype()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        torch.set_default_dtype(model.dtype)
        try:
            heads = MtpModel(model, depth)
            for module in heads.layers.modules():
                model._init_weights(module)
        finally:
            torch.set_default_dtype(default_dtype)
    return heads.to(model.device)


def head_state_dict(model: PreTrainedModel, heads) -> dict[str, torch.Tensor]:
    """The heads' tensors under the checkpoint keys ``MtpModel.from_pretrained`` reads back: depth k becomes decoder
    layer ``N+k``; ``mtp_block.*`` sits directly under it, ``post_norm`` is ``shared_head.norm`` (DeepSeek-V3
    layout); then the family's save-time weight conversion (e.g. fused experts split per expert)."""
    from transformers.core_model_loading import revert_weight_conversion

    if getattr(heads, "use_shared_post_norm", False) or not getattr(heads, "use_post_norm", True):
        raise MtpSupportError(f"{type(model).__name__}: only the per-layer MTP layout (DeepSeek-V3 / GLM-4.5) is "
                              f"written; this family chains a shared post-norm")
    n = text_config(model.config).num_hidden_layers
    prefix = decoder_layers_prefix(model)
    out = {}
    for name, tensor in heads.state_dict().items():
        match = re.match(r"layers\.(\d+)\.(.+)", name)
        if match is None:  # the shared embedding / head belong to the trunk
            continue
        depth, rest = int(match.group(1)), match.group(2)
        rest = rest.removeprefix("mtp_block.")
        if rest.startswith("post_norm."):
            rest = "shared_head.norm." + rest.removeprefix("post_norm.")
        out[f"{prefix}.{n + depth}.{rest}"] = tensor.detach().cpu().contiguous()
    return revert_weight_conversion(model, out)


def write_heads(model: PreTrainedModel, heads, directory: str | os.PathLike) -> None:
    """Add the heads to the checkpoint ``model.save_pretrained(directory)`` wrote (single file or sharded)."""
    from safetensors.torch import load_file, save_file

    directory = Path(directory)
    tensors = head_state_dict(model, heads)
    index_path = directory / "model.safetensors.index.json"
    if index_path.exists():
        shard = "model-mtp.safetensors"
        save_file(tensors, str(directory / shard), metadata={"format": "pt"})
        index = json.loads(index_path.read_text())
        index["weight_map"].update({key: shard for key in tensors})
        write_text_atomic(index_path, json.dumps(index, indent=2, sort_keys=True))  # never half an index
        return
    path = directory / "model.safetensors"
    state = load_file(str(path))
    state.update(tensors)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    save_file(state, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, path)


def save_with_heads(model: PreTrainedModel, heads, directory: str | os.PathLike, tokenizer=None) -> None:
    """Save trunk + heads as one ordinary Hugging Face folder (see module docstring)."""
    set_depth(model.config, len(heads.layers))
    model.save_pretrained(str(directory))
    write_heads(model, heads, directory)
    if tokenizer is not None:
        tokenizer.save_pretrained(str(directory))


# ------------------------------------------------------------------------------------------------------------------
# Forward of all depths with teacher forcing
# ------------------------------------------------------------------------------------------------------------------


@dataclass
class DepthOutput:
    logits: torch.Tensor  # (B, L-k-1, V): depth k's prediction at hidden positions j = 0 .. L-k-2
    target_logits: torch.Tensor  # (B, L-k-1, V): the policy's logits at t = j+k+1
    labels: torch.Tensor  # (B, L-k-1): x[t+1] (0 past the end; never counted there)
    mask: torch.Tensor  # (B, L-k-1) bool


@torch.no_grad()
def trunk_forward(model: PreTrainedModel, input_ids: torch.Tensor, attention_mask: torch.Tensor):
    """Last hidden states and logits, as ``MTPCandidateGenerator`` obtains them (``output_hidden_states=-1``)."""
    out = model(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=-1, use_cache=False)
    return out.hidden_states[-1], out.logits


def depth_outputs(heads, hidden: torch.Tensor, policy_logits: torch.Tensor, input_ids: torch.Tensor,
                  target_mask: torch.Tensor) -> list[DepthOutput]:
    """Run every MTP depth over right-padded rows (causal attention only: padding sits after every counted
    position, so it cannot leak into them)."""
    batch, width = input_ids.shape
    previous = hidden
    outputs = []
    labels_full = F.pad(input_ids, (0, 1), value=0)
    for k in range(len(heads.layers)):
        length = width - k - 1
        if length <= 0:
            break
        positions = torch.arange(k + 1, width, device=input_ids.device).expand(batch, -1)
        previous = heads.forward_layer(k, previous[:, :length], positions, None, input_ids=input_ids[:, k + 1:])
        outputs.append(DepthOutput(
            logits=heads._project_to_logits(previous),
            target_logits=policy_logits[:, k + 1:],
            labels=labels_full[:, k + 2: k + 2 + length],
            mask=target_mask[:, k + 1:],
        ))
    return outputs


def mtp_loss(outputs: list[DepthOutput], kind: str) -> tuple[torch.Tensor, dict[str, figures.Summed]]:
    """Mean over depths of the per-depth loss; also each depth's loss and top-1 agreement with the policy, as token
    means over every rank's positions (figure parts, :func:`trl_ext.metrics.reduce_figures` gives the floats)."""
    if kind not in MTP_LOSSES:
        raise ValueError(f"mtp_loss must be one of {MTP_LOSSES}, got {kind!r}")
    losses, metrics = [], {}
    for k, out in enumerate(outputs):
        if kind == "soft":
            loss = soft_cross_entropy(out.logits, out.target_logits, out.mask)
        else:
            loss = hard_cross_entropy(out.logits, out.labels, out.mask)
        losses.append(loss)
        agree = (out.logits.argmax(-1) == out.target_logits.argmax(-1)) & out.mask
        count = out.mask.sum()
        metrics[f"mtp/depth{k + 1}_loss"] = figures.mean(loss.detach() * count, count)  # the loss is sum / count
        metrics[f"mtp/depth{k + 1}_top1_agreement"] = figures.mean(agree.sum(), count)
    return torch.stack(losses).mean(), metrics


# ------------------------------------------------------------------------------------------------------------------
# Data
# ------------------------------------------------------------------------------------------------------------------


def encode_rows(dataset, tokenizer, max_length: int | None):
    """``prompt_ids`` + ``completion_ids`` per row (from those columns, else by tokenizing ``prompt``/``completion``
    without special tokens), truncated to ``max_length`` in total."""
    columns = set(dataset.column_names)
    if {"prompt_ids", "completion_ids"} <= columns:
        def encode(row):
            return {"prompt_ids": list(row["prompt_ids"]), "completion_ids": list(row["completion_ids"])}
    elif {"prompt", "completion"} <= columns:
        def encode(row):
            tok = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
            return {"prompt_ids": tok(row["prompt"]), "completion_ids": tok(row["completion"])}
    else:
        raise ValueError(f"the mtp trainer needs prompt + completion (or prompt_ids + completion_ids) columns; "
                         f"got {sorted(columns)} (the mtp_heads plugin samples completions from the policy)")

    def clip(row):
        row = encode(row)
        if max_length is not None:
            keep = max(0, max_length - len(row["prompt_ids"]))
            row["prompt_ids"] = row["prompt_ids"][:max_length]
            row["completion_ids"] = row["completion_ids"][:keep]
        return row

    return dataset.map(clip, remove_columns=dataset.column_names)


class _Collator:
    def __init__(self, pad_id: int):
        self.pad_id = pad_id

    def __call__(self, rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        sequences = [list(r["prompt_ids"]) + list(r["completion_ids"]) for r in rows]
        width = max(len(s) for s in sequences)
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        attention = torch.zeros((len(rows), width), dtype=torch.long)
        for i, seq in enumerate(sequences):  # right padding: see depth_outputs
            ids[i, :len(seq)] = torch.tensor(seq, dtype=torch.long)
            attention[i, :len(seq)] = 1
        prompt_lengths = torch.tensor([len(r["prompt_ids"]) for r in rows])
        lengths = torch.tensor([len(s) for s in sequences])
        return {"input_ids": ids, "attention_mask": attention,
                "target_mask": draft_target_mask(prompt_lengths, lengths, width)}


# ------------------------------------------------------------------------------------------------------------------
# Trainer
# ------------------------------------------------------------------------------------------------------------------


class ExtMtpTrainer(HostMixin, Trainer):
    """``self.model`` is the ``MtpModel`` (its shared embedding and head frozen with the trunk); ``self.policy`` the
    frozen causal LM."""

    def __init__(self, model, args: MtpConfig, train_dataset, processing_class, eval_dataset=None, callbacks=None,
                 peft_config=None, *, plugin_host):
        self._init_host(plugin_host)
        if peft_config is not None:
            raise ValueError("the mtp trainer trains the MTP heads in full; remove the stage's `peft`")
        from transformers.integrations import is_deepspeed_zero3_enabled

        if is_deepspeed_zero3_enabled():  # also a ZeRO-3 config given outside the recipe (accelerate launch)
            raise MtpSupportError(ZERO3_REFUSAL)
        if isinstance(model, str):
            model = AutoModelForCausalLM.from_pretrained(model, **(args.model_init_kwargs or {}))
        problem = mtp_support_problem(type(model), model.config, args.num_mtp_layers)
        if problem:
            raise MtpSupportError(problem)
        depth = args.num_mtp_layers or configured_depth(model.config)
        set_depth(model.config, depth)
        self.policy = model.eval().requires_grad_(False)
        source = model.config.name_or_path
        heads = (load_heads(model, source) if source and checkpoint_has_heads(model, source)
                 else fresh_heads(model, depth, args.seed))
        self._set_heads(heads)
        self._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
        prepare = lambda d: None if d is None else encode_rows(d, processing_class, args.max_length)  # noqa: E731
        super().__init__(model=self.heads, args=args, train_dataset=prepare(train_dataset),
                         eval_dataset=prepare(eval_dataset), processing_class=processing_class,
                         data_collator=_Collator(processing_class.pad_token_id), callbacks=callbacks)
        self.model_accepts_loss_kwargs = False  # per-micro-batch means: let Trainer scale them for accumulation
        self.policy.to(self.args.device)

    def _set_heads(self, heads) -> None:
        # The shared embedding and output head are trunk parameters: frozen (requires_grad_ above covers the policy's
        # own modules, which the heads hold by reference); every other head parameter trains.
        shared = {id(p) for p in self.policy.parameters()}
        for param in heads.parameters():
            param.requires_grad_(id(param) not in shared)
        self.heads = heads

    def load_heads(self, directory: str | os.PathLike) -> None:
        """Replace the heads with those stored in ``directory`` (before training starts)."""
        heads = load_heads(self.policy, directory)
        self._set_heads(heads)
        self.model = self.model_wrapped = heads

    def head_parameters(self) -> dict[str, torch.Tensor]:
        shared = {id(p) for p in self.policy.parameters()}
        return {n: p for n, p in self.heads.named_parameters() if id(p) not in shared}

    def _set_signature_columns_if_needed(self):
        if self._signature_columns is None:
            self._signature_columns = ["prompt_ids", "completion_ids"]

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        hidden, policy_logits = trunk_forward(self.policy, inputs["input_ids"], inputs["attention_mask"])
        outputs = depth_outputs(model, hidden, policy_logits, inputs["input_ids"], inputs["target_mask"])
        loss, metrics = mtp_loss(outputs, self.args.mtp_loss)
        self._log_plugin_metrics(metrics)  # reduced over every rank: TRL/Trainer log rank 0's buffers
        return (loss, outputs) if return_outputs else loss

    def log(self, logs: dict[str, float], *args, **kwargs) -> None:
        mode = "train" if self.model.training else "eval"
        prefix = "eval_" if mode == "eval" and "eval_loss" in logs else ""
        logs.update({prefix + k: sum(v) / len(v) for k, v in self._metrics[mode].items() if v})
        self._metrics[mode].clear()
        super().log(logs, *args, **kwargs)

    def _save(self, output_dir: str | None = None, state_dict=None) -> None:
        if not self.args.should_save:  # save_model calls this on every rank: one writer, as Trainer._save
            return
        output_dir = output_dir or self.args.output_dir
        os.makedirs(output_dir, exist_ok=True)
        save_with_heads(self.policy, self.heads, output_dir, self.processing_class)
        torch.save(self.args, os.path.join(output_dir, "training_args.bin"))

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None) -> None:
        loaded = load_heads(self.policy, resume_from_checkpoint)
        self.heads.load_state_dict(loaded.state_dict())
