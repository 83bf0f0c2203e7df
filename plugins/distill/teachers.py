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
* ``vllm:<url>`` is a teacher served by vLLM (``vllm serve <teacher> --logprobs-mode processed_logprobs``), for teachers
  that do not fit beside the student or each other (:class:`ServedTeacher`). It is scored through the request TRL's
  own server-teacher client sends (``/v1/completions`` with ``max_tokens: 1`` and ``prompt_logprobs``, whose entry
  for each position always holds the sampled token), so it gives log-probabilities of the sampled tokens only:
  enough for on-policy distillation as RL, not for a full-distribution divergence.
"""

from __future__ import annotations

import json
import math
import urllib.request
from pathlib import Path
from typing import Any

import torch

from trl_ext.recipe import EMBEDDED_PREFIX, SERVED_PREFIX, STAGE_PREFIX


class TeacherError(ValueError):
    """A teacher that cannot serve the student (unloadable, or a different tokenizer)."""


def is_local_path(ref: str) -> bool:
    """A reference that names the file system (not a hub id): absolute, relative with ./ or ../, ~, or existing."""
    return ref.startswith(("/", "./", "../", "~")) or Path(ref).exists()


def teacher_ref_problem(ref: str, where: str) -> str | None:
    """Why ``ref`` cannot be a teacher, checked before any model loads (``None``: fine or only checkable later)."""
    if ref.startswith(SERVED_PREFIX):
        if not served_url(ref).startswith(("http://", "https://")):
            return (f"{where}: served teacher {ref!r} needs the server's http(s) URL after {SERVED_PREFIX!r} "
                    f"(e.g. {SERVED_PREFIX}http://127.0.0.1:8000)")
        return None
    if ref.startswith((STAGE_PREFIX, EMBEDDED_PREFIX)) or not is_local_path(ref):
        return None
    folder = Path(ref).expanduser()
    if not folder.is_dir():
        return f"{where}: teacher {ref!r} does not exist (expected a model folder, stage:<name> or embedded:<name>)"
    if not (folder / "config.json").is_file():
        return f"{where}: teacher {ref!r} is not a model folder (no config.json)"
    return None


def served_url(ref: str) -> str | None:
    """The server URL of a ``vllm:<url>`` teacher reference (``None`` for any other reference)."""
    return ref[len(SERVED_PREFIX):].rstrip("/") if ref.startswith(SERVED_PREFIX) else None


def check_same_tokenizer(student, teacher, student_name: str, teacher_name: str) -> None:
    """Raise :class:`TeacherError` naming both models unless the two tokenizers map tokens to the same ids.

    Only the token -> id map (added tokens included) is compared: the teacher scores the student's ids, and nothing
    else about its tokenizer is used on them. Special-token *roles* may differ: a pad-less tokenizer (Llama 3,
    Mistral) has its pad set to EOS for the student by the runner and TRL but not for a freshly loaded teacher, and
    an instruct teacher of a base student's family ends turns with another token of the same vocabulary.
    """
    s, t = student.get_vocab(), teacher.get_vocab()
    if s == t:
        return
    only_s = len(set(s.items()) - set(t.items()))
    raise TeacherError(f"teacher {teacher_name!r} and student {student_name!r} use different tokenizers: vocabularies "
                       f"differ ({len(s)} vs {len(t)} tokens, {only_s} student tokens absent or renumbered in the "
                       "teacher); the teacher must score the student's token ids (use a teacher of the same model "
                       "family)")


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


def score_sampled_tokens(teacher, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, completion_ids: torch.Tensor,
                         completion_mask: torch.Tensor, batch_size: int | None = None) -> torch.Tensor:
    """:func:`sampled_token_logps` for a loaded teacher, or the server's answer for a :class:`ServedTeacher`."""
    if isinstance(teacher, ServedTeacher):
        return teacher.sampled_token_logps(prompt_ids, prompt_mask, completion_ids, completion_mask, batch_size)
    return sampled_token_logps(teacher, prompt_ids, prompt_mask, completion_ids, completion_mask, batch_size)


def http_json(url: str, payload: dict[str, Any] | None = None, timeout: float = 600.0,
              api_key: str | None = None) -> dict[str, Any]:
    """GET ``url`` (no payload) or POST ``payload`` as JSON; the decoded JSON answer. Raises ``OSError`` (the
    connection or the HTTP status) or ``ValueError`` (not JSON)."""
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    data = None if payload is None else json.dumps(payload).encode()
    with urllib.request.urlopen(urllib.request.Request(url, data=data, headers=headers), timeout=timeout) as response:
        return json.loads(response.read())


# A probe whose tokenization tells model families apart: words, digits, punctuation, whitespace runs, code, accents
# and CJK (byte-level and sentencepiece vocabularies split these differently); the student's special tokens are added.
TOKENIZER_PROBE = "The quick brown fox, 12+34=46.\n\tdef f(x):  return x ** 2  # naïve café 学习"


class ServedTeacher:
    """A teacher behind a vLLM server (``vllm:<url>``), scored on the sampled tokens only.

    Start it with ``vllm serve <teacher> --logprobs-mode processed_logprobs`` (without that mode vLLM reports
    logprobs before the temperature, which :meth:`connect` detects when the trainer's temperature is not 1). Each
    batch is one ``POST <url>/v1/completions`` per ``batch_size`` rows, the request TRL's ``VLLMClient.
    get_sequence_logprobs`` sends: the unpadded prompt + completion token ids, ``max_tokens: 1``, the trainer's
    temperature and ``prompt_logprobs: 1``; entry ``i`` of a choice's ``prompt_logprobs`` scores token ``i`` given
    the tokens before it and always contains that token, whatever its rank. Connecting reads the served model name
    from ``/v1/models`` (exactly one) and compares the server's tokenization of :data:`TOKENIZER_PROBE` with the
    student's (``/tokenize``): a probe, weaker than the vocabulary comparison local teachers get.
    """

    def __init__(self, url: str, temperature: float = 1.0, timeout: float = 600.0):
        self.url, self.temperature, self.timeout = url.rstrip("/"), float(temperature), timeout
        self.model: str | None = None

    def _call(self, route: str, payload: dict[str, Any] | None = None) -> dict[str, Any]:
        try:
            return http_json(f"{self.url}/{route}", payload, self.timeout)
        except (OSError, ValueError) as exc:
            raise TeacherError(f"served teacher {SERVED_PREFIX}{self.url}: {route} failed: {exc}") from None

    def connect(self, tokenizer=None, student_name: str = "student") -> None:
        models = [m.get("id") for m in self._call("v1/models").get("data", [])]
        if len(models) != 1:
            raise TeacherError(f"served teacher {SERVED_PREFIX}{self.url} serves {len(models)} models {models}; "
                               "start one vLLM server per teacher")
        self.model = models[0]
        if tokenizer is None:
            return
        probe = TOKENIZER_PROBE + "".join(t for t in (tokenizer.bos_token, tokenizer.eos_token) if t)
        expected = tokenizer(probe, add_special_tokens=False)["input_ids"]
        served = self._call("tokenize", {"model": self.model, "prompt": probe, "add_special_tokens": False})
        if served.get("tokens") != expected:
            raise TeacherError(f"teacher {SERVED_PREFIX}{self.url} ({self.model}) and student {student_name!r} use "
                               "different tokenizers (they split a probe text differently); the teacher must score "
                               "the student's token ids (use a teacher of the same model family)")
        if self.temperature != 1.0:
            ids = expected[:16]  # position 0 has no log-probability, so compare from position 1
            if self._prompt_logps([ids], self.temperature)[0][1:] == self._prompt_logps([ids], 1.0)[0][1:]:
                raise TeacherError(f"served teacher {SERVED_PREFIX}{self.url} ignores the temperature "
                                   f"{self.temperature} in its log-probabilities; restart it with "
                                   "`--logprobs-mode processed_logprobs`")

    def _prompt_logps(self, sequences: list[list[int]], temperature: float) -> list[list[float]]:
        """Each sequence's per-position log-probability of its own token (position 0 has none: NaN)."""
        reply = self._call("v1/completions", {"model": self.model, "prompt": sequences, "max_tokens": 1,
                                              "temperature": temperature, "prompt_logprobs": 1})
        choices = sorted(reply.get("choices", []), key=lambda c: c.get("index", 0))
        if len(choices) != len(sequences):
            raise TeacherError(f"served teacher {SERVED_PREFIX}{self.url} answered {len(choices)} choices for "
                               f"{len(sequences)} sequences")
        out = []
        for choice, sequence in zip(choices, sequences):
            entries = choice.get("prompt_logprobs") or []
            if len(entries) != len(sequence):
                raise TeacherError(f"served teacher {SERVED_PREFIX}{self.url} returned {len(entries)} prompt "
                                   f"log-probabilities for {len(sequence)} tokens (is it a vLLM server?)")
            row = [math.nan]
            for position in range(1, len(sequence)):
                item = (entries[position] or {}).get(str(sequence[position]))
                value = item.get("logprob") if isinstance(item, dict) else item
                if value is None or not math.isfinite(value):
                    raise TeacherError(f"served teacher {SERVED_PREFIX}{self.url} gave no finite log-probability for "
                                       f"token {sequence[position]} at position {position} (got {item!r})")
                row.append(float(value))
            out.append(row)
        return out

    def sampled_token_logps(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, completion_ids: torch.Tensor,
                            completion_mask: torch.Tensor, batch_size: int | None = None) -> torch.Tensor:
        """``(B, T)`` log-probabilities of the completion tokens, 0 where ``completion_mask`` is 0 (as
        :func:`sampled_token_logps`). Padding is removed before sending: the server sees each sequence as generated."""
        if self.model is None:
            self.connect()
        lengths = [int(m.nonzero().max()) + 1 if m.any() else 0 for m in completion_mask]
        prompts = [ids[mask.bool()].tolist() for ids, mask in zip(prompt_ids, prompt_mask)]
        if any(not p for p in prompts):  # the first token has no log-probability without a context
            raise TeacherError(f"served teacher {SERVED_PREFIX}{self.url}: a row has an empty prompt")
        sequences = [p + c[:n].tolist() for p, c, n in zip(prompts, completion_ids, lengths)]
        step = batch_size or len(sequences)
        rows = []
        for start in range(0, len(sequences), step):
            rows += self._prompt_logps(sequences[start:start + step], self.temperature)
        out = torch.zeros(completion_ids.shape, dtype=torch.float32)
        for i, (row, prompt, n) in enumerate(zip(rows, prompts, lengths)):
            if n:
                out[i, :n] = torch.tensor(row[len(prompt):len(prompt) + n], dtype=torch.float32)
        out = out.to(completion_ids.device)
        return torch.where(completion_mask.bool(), out, torch.zeros_like(out))
