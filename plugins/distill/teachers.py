"""Teacher models the distillation plugins share: reference checks, tokenizer agreement, loading and scoring.

* A teacher is referenced like the runner's ``model:`` field: ``stage:<name>`` (an earlier stage's output folder),
  ``embedded:<name>`` (a model built in code), a local folder, or a hub id. Local folders are checked at validation
  time (they must hold a ``config.json``); ``stage:`` references are checked by the recipe validator (they must name
  an earlier stage); hub ids can only be checked when loaded.
* Teacher and student must share the tokenizer (the teacher scores the student's token ids): compared by vocabulary
  (token -> id) and special tokens; a mismatch is an error naming both models. TRL's cross-tokenizer path (GOLD's ULD
  loss) is not offered.
* Scoring a sampled token never builds ``[batch, tokens, vocabulary]`` logits: the teacher gets TRL's fused LM head
  (``trl.trainer.utils.add_fused_lm_head``), which projects the hidden states in vocabulary tiles and returns only the
  log-probability of each label.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from trl_ext.recipe import EMBEDDED_PREFIX, STAGE_PREFIX


class TeacherError(ValueError):
    """A teacher that cannot serve the student (unloadable, or a different tokenizer)."""


def is_local_path(ref: str) -> bool:
    """A reference that names the file system (not a hub id): absolute, relative with ./ or ../, ~, or existing."""
    return ref.startswith(("/", "./", "../", "~")) or Path(ref).exists()


def teacher_ref_problem(ref: str, where: str) -> str | None:
    """Why ``ref`` cannot be a teacher, checked before any model loads (``None``: fine or only checkable later)."""
    if ref.startswith((STAGE_PREFIX, EMBEDDED_PREFIX)) or not is_local_path(ref):
        return None
    folder = Path(ref).expanduser()
    if not folder.is_dir():
        return f"{where}: teacher {ref!r} does not exist (expected a model folder, stage:<name> or embedded:<name>)"
    if not (folder / "config.json").is_file():
        return f"{where}: teacher {ref!r} is not a model folder (no config.json)"
    return None


def tokenizer_fingerprint(tokenizer) -> dict[str, Any]:
    return {"vocab": tokenizer.get_vocab(), "eos": tokenizer.eos_token, "pad": tokenizer.pad_token,
            "bos": tokenizer.bos_token}


def check_same_tokenizer(student, teacher, student_name: str, teacher_name: str) -> None:
    """Raise :class:`TeacherError` naming both models unless the two tokenizers map tokens to the same ids."""
    s, t = tokenizer_fingerprint(student), tokenizer_fingerprint(teacher)
    if s == t:
        return
    if s["vocab"] != t["vocab"]:
        only_s = len(set(s["vocab"].items()) - set(t["vocab"].items()))
        detail = (f"vocabularies differ ({len(s['vocab'])} vs {len(t['vocab'])} tokens, {only_s} student tokens "
                  f"absent or renumbered in the teacher)")
    else:
        detail = "special tokens differ (" + ", ".join(
            f"{k}: {s[k]!r} vs {t[k]!r}" for k in ("eos", "pad", "bos") if s[k] != t[k]) + ")"
    raise TeacherError(f"teacher {teacher_name!r} and student {student_name!r} use different tokenizers: {detail}; "
                       "the teacher must score the student's token ids (use a teacher of the same model family)")


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as exc:
        raise TeacherError(f"teacher {path!r} cannot be loaded: {exc}") from None


def check_paths_share_tokenizer(student_path: str, teacher_path: str) -> None:
    check_same_tokenizer(load_tokenizer(student_path), load_tokenizer(teacher_path), student_path, teacher_path)


def load_teacher(path: str, device: torch.device | str = "cpu", temperature: float = 1.0,
                 dtype: torch.dtype | None = None):
    """A frozen teacher in eval mode with TRL's fused LM head (scores labels without full logits)."""
    from transformers import AutoModelForCausalLM
    from trl.trainer.utils import add_fused_lm_head

    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype) if dtype else \
            AutoModelForCausalLM.from_pretrained(path)
    except (OSError, ValueError) as exc:
        raise TeacherError(f"teacher {path!r} cannot be loaded: {exc}") from None
    model.to(device).eval().requires_grad_(False)
    add_fused_lm_head(model, temperature=temperature)
    return model


@torch.no_grad()
def sampled_token_logps(teacher, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, completion_ids: torch.Tensor,
                        completion_mask: torch.Tensor, batch_size: int | None = None) -> torch.Tensor:
    """The teacher's log-probability of each sampled completion token, ``(B, T)``, 0 on padding.

    One teacher forward per micro-batch of ``batch_size`` rows; only the completion tokens are scored (labels are
    -100 on the prompt and on padding), so the vocabulary projection covers those positions in tiles.
    """
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
    attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
    labels = torch.where(torch.cat([torch.zeros_like(prompt_mask), completion_mask], dim=1).bool(), input_ids,
                         torch.full_like(input_ids, -100))
    width = completion_ids.size(1)
    step = batch_size or input_ids.size(0)
    out = []
    for start in range(0, input_ids.size(0), step):
        rows = slice(start, start + step)
        result = teacher(input_ids=input_ids[rows], attention_mask=attention_mask[rows], labels=labels[rows],
                         fused_lm_head=True)
        out.append(result.log_probs[:, -width:].float())
    return torch.cat(out, dim=0)
