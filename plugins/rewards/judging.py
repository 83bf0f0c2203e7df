"""Shared judge machinery of ``llm_judge``, ``checklist_judge`` and ``self_judge`` (ALGORITHMS.md items 13-15).

* Pure verdict parsers (:func:`parse_score`, :func:`parse_preference`) and verdict arithmetic
  (:func:`normalise_score`, :func:`order_averaged_preference`, :func:`swap_consistency`).
* Prompt templates (pointwise, pairwise, with or without reasoning before the verdict).
* Judge backends, all ``generate(texts) -> list[str | None]`` (``None`` = the request failed):
  :class:`LocalJudge` (a frozen transformers causal LM, lazily loaded from a model reference, see
  :mod:`trl_ext_plugins.rewards.scoring`), :class:`EndpointJudge` (an OpenAI-compatible chat-completions server, e.g.
  vLLM, through ``urllib``), :class:`PolicyJudge` (the model a trainer is training, in judge mode).
* :class:`JudgeStats`: counters of unparsable verdicts and failed requests, logged as metrics.

Parsing conventions (both parsers read the *last* verdict, so reasoning before the verdict may mention numbers or
answers freely):

pointwise, in this order of precedence:
  1. the last ``<keyword> [:=] n`` with keyword one of score/rating/verdict/grade/"final score" (markdown ``*`` and
     brackets around the number allowed, an optional ``/d`` denominator);
  2. else the last MT-Bench ``[[n]]``; 3. else the last bold ``**n**``;
  4. else a text that is a number alone (``"7"``, ``"7/10"``, ``"7."``).
  The value must lie in ``[low, high]``; a denominator must equal ``high``; anything else is unparsable
  (``None``): out-of-range numbers, several bare numbers without a verdict marker, no number, empty text.
pairwise: the last ``[[A]]``/``[[B]]``/``[[C]]`` (MT-Bench, C = tie; never prose, so it comes first), else the last
  ``<keyword> [:=] A|B|tie`` (keyword verdict/winner/preferred/preference, or answer/choice/"better [response]" only
  when followed by ``is``, ``:`` or ``=``, since "Answer A has an error" is prose), else a text that is ``A`` or ``B``
  alone. A -> 1.0, B -> 0.0,
  tie -> 0.5 (the letters are upper case only, so "answer is a bit off" is no verdict); anything else
  ``None``.
"""

from __future__ import annotations

import json
import math
import re
import threading
import urllib.error
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

# ----------------------------------------------------------------------------------------------------------------
# Parsing (pure)
# ----------------------------------------------------------------------------------------------------------------

_NUM = r"[-+]?\d+(?:\.\d+)?"
# A verdict number must end there: "1e3", "7-8", "7,5", "5.5.5" are not the scores 1, 7, 7, 5.5.
_END = r"(?![\w,.-]*\d)"
_SCORE_KEYWORD = re.compile(
    rf"(?:final\s+score|score|rating|verdict|grade)\s*[:=]?\s*[*_\[\(]*\s*({_NUM})\s*(?:/\s*({_NUM}))?{_END}", re.I)
_SCORE_MTBENCH = re.compile(rf"\[\[\s*({_NUM})\s*(?:/\s*({_NUM}))?\s*\]\]")
_SCORE_BOLD = re.compile(rf"\*\*\s*({_NUM})\s*(?:/\s*({_NUM}))?\s*\*\*")
_SCORE_ALONE = re.compile(rf"^\s*[*_\[\(]*\s*({_NUM})\s*(?:/\s*({_NUM}))?\s*[*_\]\)]*\s*\.?\s*$")

# "verdict"/"winner"/"preferred"/"preference" announce a verdict by themselves; "answer", "choice" and "better" are
# also ordinary words of the judge's prose ("Answer A has an error, so B is better"), so they count only followed by
# "is", ":" or "=" ("Final answer: B", "the better response is A").
_PREF_KEYWORD = re.compile(
    r"(?:(?:verdict|winner|preferred|preference)\s*(?:is)?\s*[:=]?"
    r"|(?:answer|choice|better(?:\s+(?:response|answer|one))?)\s*(?:is\b|[:=]))"
    r"\s*[*_\[\(\"']*\s*(?:response|answer|assistant)?\s*((?-i:A|B)|tie)\b", re.I)
_PREF_MTBENCH = re.compile(r"\[\[\s*((?-i:A|B|C)|tie)\s*\]\]", re.I)
_PREF_ALONE = re.compile(r"^\s*[*_\[\(\"']*\s*(A|B)\s*[*_\]\)\"']*\s*\.?\s*$")
_PREF_VALUE = {"a": 1.0, "b": 0.0, "c": 0.5, "tie": 0.5}


def _last(pattern: re.Pattern, text: str):
    found = None
    for found in pattern.finditer(text):  # noqa: B007 - keep the last match
        pass
    return found


def parse_score(text: str | None, low: float = 1.0, high: float = 10.0) -> float | None:
    """The judge's score in ``[low, high]`` (the last verdict, see the module docstring), or ``None``."""
    if not text or not text.strip():
        return None
    for pattern in (_SCORE_KEYWORD, _SCORE_MTBENCH, _SCORE_BOLD):
        match = _last(pattern, text)
        if match is not None:
            break
    else:
        match = _SCORE_ALONE.match(text)
        if match is None:
            return None
    value = float(match.group(1))
    denominator = match.group(2)
    if denominator is not None and float(denominator) != float(high):
        return None
    if not low <= value <= high:
        return None
    return value


def parse_preference(text: str | None) -> float | None:
    """1.0 if the judge prefers A, 0.0 for B, 0.5 for a tie (the last verdict), or ``None``."""
    if not text or not text.strip():
        return None
    # the explicit [[A]] / [[B]] form first: it is never prose, while a keyword form can be ("[[B]] because answer A
    # is wrong" read as A before)
    match = _last(_PREF_MTBENCH, text) or _last(_PREF_KEYWORD, text) or _PREF_ALONE.match(text)
    if match is None:
        return None
    return _PREF_VALUE[match.group(1).lower()]


def normalise_score(score: float, low: float, high: float) -> float:
    """Map a score on ``[low, high]`` to ``[0, 1]``."""
    return (score - low) / (high - low)


def order_averaged_preference(v_ab: float, v_ba: float) -> float:
    """P(A > B) from both presentation orders: (v(A,B) + 1 - v(B,A)) / 2, v = 1 when the first shown wins.

    By construction P(A > B) + P(B > A) = 1, whatever position bias the judge has.
    """
    return 0.5 * (v_ab + 1.0 - v_ba)


def swap_consistency(v_ab: float, v_ba: float) -> float:
    """Agreement of the two orders: 1 - |v(A,B) - (1 - v(B,A))|; 1 = same winner both ways, 0 = the position won."""
    return 1.0 - abs(v_ab + v_ba - 1.0)


def preference_matrix(verdicts: dict[tuple[int, int], float | None], size: int,
                      neutral: float = 0.5) -> tuple[torch.Tensor, torch.Tensor]:
    """(P, C) over ``size`` samples from ordered verdicts ``{(i, j): v(i shown first, j second)}``.

    ``P[i, j]`` = order-averaged P(i > j) (an unparsable verdict counts as ``neutral``); ``C[i, j]`` = swap
    consistency of the pair (0 when either order is unparsable). Diagonals are 0.5 and 1.
    """
    p = torch.full((size, size), 0.5, dtype=torch.float64)
    c = torch.ones((size, size), dtype=torch.float64)
    for i in range(size):
        for j in range(i + 1, size):
            v_ij, v_ji = verdicts.get((i, j)), verdicts.get((j, i))
            p[i, j] = order_averaged_preference(neutral if v_ij is None else v_ij, neutral if v_ji is None else v_ji)
            p[j, i] = 1.0 - p[i, j]
            c[i, j] = c[j, i] = 0.0 if v_ij is None or v_ji is None else swap_consistency(v_ij, v_ji)
    return p, c


def mean_win_probability(preference: torch.Tensor) -> torch.Tensor:
    """Mean over the G - 1 opponents of P(i > j) (diagonal ignored); 0.5 for a group of one."""
    g = preference.shape[0]
    if g < 2:
        return torch.full((g,), 0.5, dtype=torch.float64)
    p = preference.to(torch.float64).clone()
    p.fill_diagonal_(0.0)
    return p.sum(dim=1) / (g - 1)


def split_group_error(stage, who: str, num_processes: int | None = None) -> str | None:
    """Why a pairwise judge cannot see whole groups on every process, or ``None``.

    TRL calls a reward function on each process's rows and requires only the generation batch over *all* processes to
    hold whole groups, so 6 rows per process with ``num_generations`` 4 split a group between two processes, each
    judging half of it (win rates from 1 opponent instead of 3). A stage whose rows per process are not a multiple of
    ``num_generations`` is refused (one process always holds whole groups: TRL checks that itself)."""
    from accelerate import PartialState

    from trl_ext.trainers import TRAINER_KINDS, stage_arg

    processes = PartialState().num_processes if num_processes is None else num_processes
    if processes <= 1 or stage.trainer not in TRAINER_KINDS:
        return None

    def value(name: str):
        return stage_arg(stage.args, stage.trainer, name)

    group = value("num_generations")
    if not isinstance(group, int) or group < 2:
        return None
    if value("generation_batch_size") is not None:
        rows = value("generation_batch_size") // processes
    else:
        rows = value("per_device_train_batch_size") * (value("steps_per_generation") or value(
            "gradient_accumulation_steps"))
    if rows % group == 0:
        return None
    return (f"plugin {who!r}: each of the {processes} processes holds {rows} rows of a generation batch, which splits "
            f"groups of num_generations={group} between processes; the pairwise judge compares a prompt's samples on "
            f"one process, so make the rows per process (per_device_train_batch_size x steps_per_generation) a "
            f"multiple of {group}")


def groups_of(prompts: Sequence[Any]) -> list[list[int]]:
    """Row indices of each group: maximal runs of consecutive rows with an equal prompt (TRL repeats each prompt
    ``num_generations`` times in a row)."""
    out: list[list[int]] = []
    for i, prompt in enumerate(prompts):
        if out and prompts[out[-1][0]] == prompt:
            out[-1].append(i)
        else:
            out.append([i])
    return out


# ----------------------------------------------------------------------------------------------------------------
# Prompt templates
# ----------------------------------------------------------------------------------------------------------------

POINTWISE_TEMPLATE = (
    "Rate the response to the question on a scale of {low} to {high} (higher is better).\n"
    "Question: {prompt}\nResponse: {completion}\n{instruction}"
)
PAIRWISE_TEMPLATE = (
    "Which response answers the question better?\n"
    "Question: {prompt}\nResponse A: {answer_a}\nResponse B: {answer_b}\n{instruction}"
)
CHECKLIST_TEMPLATE = (
    "Does the response satisfy this requirement? Rate from {low} (not at all) to {high} (fully).\n"
    "Question: {prompt}\nRequirement: {item}\nResponse: {completion}\n{instruction}"
)
POINTWISE_INSTRUCTION = {False: "Reply with 'Score: n' only.",
                         True: "Explain your reasoning briefly, then end with a final line 'Score: n'."}
PAIRWISE_INSTRUCTION = {False: "Reply with 'Verdict: A' or 'Verdict: B' only.",
                        True: "Explain your reasoning briefly, then end with a final line 'Verdict: A' or "
                              "'Verdict: B'."}


def as_text(value: Any) -> str:
    """Plain text of a prompt or completion (conversational: the last message's content)."""
    if isinstance(value, list):
        return str(value[-1].get("content", "")) if value else ""
    return str(value)


# ----------------------------------------------------------------------------------------------------------------
# Counters
# ----------------------------------------------------------------------------------------------------------------


@dataclass
class JudgeStats:
    """Running and per-call counts of judge verdicts, unparsable verdicts and failed requests."""

    prefix: str
    verdicts: int = 0
    unparsable: int = 0
    errors: int = 0
    _call: list[int] = field(default_factory=lambda: [0, 0, 0])

    def start(self) -> None:
        self._call = [0, 0, 0]

    def add(self, text: str | None, parsed: Any) -> None:
        self.verdicts += 1
        self._call[0] += 1
        if parsed is None:
            self.unparsable += 1
            self._call[1] += 1
        if text is None:
            self.errors += 1
            self._call[2] += 1

    def metrics(self, processes: int = 1) -> dict[str, float]:
        """This call's figures (fraction unparsable, count unparsable, failed requests) and the running total.

        TRL averages a ``log_metric`` value over the processes (every process scores its own rows), so each count is
        given times ``processes``: their mean is then the sum over processes, the batch's count (it read the count
        divided by the process count). The fraction is a mean already (equal rows per process)."""
        n, bad, err = self._call
        return {f"{self.prefix}/unparsable_frac": bad / n if n else 0.0,
                f"{self.prefix}/unparsable": float(bad * processes),
                f"{self.prefix}/request_errors": float(err * processes),
                f"{self.prefix}/unparsable_total": float(self.unparsable * processes)}

    def log(self, log_metric=None, extra: dict[str, float] | None = None) -> None:
        """Log through TRL's ``log_metric`` reward kwarg (averaged over each logging step); no-op without it."""
        if log_metric is None:
            return
        from accelerate import PartialState

        for name, value in {**self.metrics(PartialState().num_processes), **(extra or {})}.items():
            log_metric(name, value)


# ----------------------------------------------------------------------------------------------------------------
# Backends
# ----------------------------------------------------------------------------------------------------------------


def load_causal_lm(path: str):
    """A frozen causal LM and its tokenizer (left padding, pad = eos when missing), in eval mode."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model.eval().requires_grad_(False), tokenizer


def _chat_or_plain(tokenizer, text: str, use_chat_template: bool) -> str:
    if use_chat_template and getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                             add_generation_prompt=True)
    return text


PLACEHOLDER_TEXT = "Verdict:"  # the prompt of a generate call made only to keep the ranks in step (output dropped)


@torch.no_grad()
def generate_sequences(model, tokenizer, texts: Sequence[str], max_new_tokens: int, temperature: float = 0.0,
                       batch_size: int = 16, use_chat_template: bool = True, min_calls: int = 0
                       ) -> list[tuple[list[int], list[int], str]]:
    """Per text: (prompt token ids as fed to ``generate``, new token ids up to and including the first EOS, decoded
    new tokens). Greedy when ``temperature`` is 0, else pure sampling (top-p 1, top-k off); left-padded batches of
    ``batch_size``; the model runs in eval mode and its training mode is restored afterwards. ``min_calls``: at least
    this many ``generate`` calls, the missing ones on a placeholder prompt whose output is dropped (a ZeRO-3 or FSDP
    model generates in step with the other ranks: each call's forwards gather weights collectively)."""
    device = next(model.parameters()).device
    out: list[tuple[list[int], list[int], str]] = []
    side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    eos_ids = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    if tokenizer.eos_token_id is not None:
        eos_ids.add(tokenizer.eos_token_id)
    was_training = model.training
    model.eval()
    sampling = ({"do_sample": True, "temperature": temperature, "top_p": 1.0, "top_k": 0}
                if temperature > 0 else {"do_sample": False})
    try:
        for start in range(0, len(texts), batch_size):
            chunk = [_chat_or_plain(tokenizer, t, use_chat_template) for t in texts[start:start + batch_size]]
            enc = tokenizer(chunk, return_tensors="pt", padding=True, add_special_tokens=False).to(device)
            ids = model.generate(**enc, max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id,
                                 **sampling)
            new = ids[:, enc["input_ids"].shape[1]:]
            texts_out = tokenizer.batch_decode(new, skip_special_tokens=True)
            for row, text in enumerate(texts_out):
                prompt = enc["input_ids"][row][enc["attention_mask"][row].bool()].tolist()
                verdict = []
                for token in new[row].tolist():
                    verdict.append(token)
                    if token in eos_ids:
                        break
                out.append((prompt, verdict, text))
        for _ in range(min_calls - math.ceil(len(texts) / batch_size)):
            placeholder = [_chat_or_plain(tokenizer, PLACEHOLDER_TEXT, use_chat_template)]
            enc = tokenizer(placeholder, return_tensors="pt", add_special_tokens=False).to(device)
            model.generate(**enc, max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id, **sampling)
    finally:
        tokenizer.padding_side = side
        model.train(was_training)
    return out


def generate_texts(model, tokenizer, texts: Sequence[str], max_new_tokens: int, temperature: float = 0.0,
                   batch_size: int = 16, use_chat_template: bool = True) -> list[str]:
    """Decode ``max_new_tokens`` per text (greedy when ``temperature`` is 0), left-padded batches, new tokens only."""
    return [text for _, _, text in generate_sequences(model, tokenizer, texts, max_new_tokens, temperature,
                                                      batch_size, use_chat_template)]


class LocalJudge:
    """A transformers causal LM as judge, loaded at the first call through a :class:`LazyScorer` (so ``stage:`` and
    ``embedded:`` references resolve against the run directory once the trainer exists)."""

    def __init__(self, path: str, max_new_tokens: int, temperature: float = 0.0, batch_size: int = 16,
                 use_chat_template: bool = True):
        from trl_ext_plugins.rewards.scoring import LazyScorer, resolve_ref

        self.path, self.max_new_tokens, self.temperature = path, max_new_tokens, temperature
        self.batch_size, self.use_chat_template = batch_size, use_chat_template
        self.scorer = LazyScorer(lambda run_dir: load_causal_lm(resolve_ref(path, run_dir)))

    def bind(self, trainer) -> None:
        self.scorer.bind(trainer)

    def generate(self, texts: Sequence[str]) -> list[str | None]:
        model, tokenizer = self.scorer.ensure_loaded()
        return generate_texts(model, tokenizer, texts, self.max_new_tokens, self.temperature, self.batch_size,
                              self.use_chat_template)


class PolicyJudge:
    """The model a trainer is training, used as judge (``self_judge``): generation under ``no_grad``, in eval mode,
    the training mode restored afterwards. ``last_sequences`` keeps the (judge prompt ids, verdict ids) of the last
    ``generate`` call, in request order, for training the judging. ``collective``: with several processes every rank
    must call ``generate``, also with no texts (it gathers the call counts of all ranks)."""

    collective = True

    def __init__(self, max_new_tokens: int, temperature: float = 0.0, batch_size: int = 16,
                 use_chat_template: bool = True):
        self.max_new_tokens, self.temperature = max_new_tokens, temperature
        self.batch_size, self.use_chat_template = batch_size, use_chat_template
        self.trainer = None
        self.last_sequences: list[tuple[list[int], list[int]]] = []

    def bind(self, trainer) -> None:
        self.trainer = trainer

    def model_and_tokenizer(self):
        if self.trainer is None:
            raise RuntimeError("self_judge: no trainer bound (the judge is the policy being trained)")
        model = self.trainer.accelerator.unwrap_model(self.trainer.model)
        return model, self.trainer.processing_class

    def generate(self, texts: Sequence[str]) -> list[str | None]:
        model, tokenizer = self.model_and_tokenizer()
        # Ranks can hold different numbers of texts (e.g. two equal prompts merged into one group on one rank): every
        # rank makes as many generate calls as the busiest one, else a sharded policy's gathers fall out of step.
        calls = math.ceil(len(texts) / self.batch_size)
        accelerator = self.trainer.accelerator
        if accelerator.num_processes > 1:
            calls = int(accelerator.gather(torch.tensor([calls], device=accelerator.device)).max().item())
        out = generate_sequences(model, tokenizer, texts, self.max_new_tokens, self.temperature, self.batch_size,
                                 self.use_chat_template, min_calls=calls)
        self.last_sequences = [(prompt, verdict) for prompt, verdict, _ in out]
        return [text for _, _, text in out]


class EndpointJudge:
    """An OpenAI-compatible chat-completions endpoint (vLLM, SGLang, ...), standard-library HTTP.

    ``endpoint`` is the server's base URL (``http://host:8000/v1``) or the full ``.../chat/completions`` URL. Each
    judge text is one user message; requests run ``concurrency`` at a time. A timeout, connection or HTTP error, or a
    reply without ``choices[0].message.content`` yields ``None`` (the caller's fallback). The API key, if any, is
    read from the environment variable named ``api_key_env`` at call time, never stored in the recipe.
    """

    def __init__(self, endpoint: str, model: str, max_tokens: int, temperature: float = 0.0, timeout: float = 30.0,
                 concurrency: int = 8, api_key_env: str | None = None):
        url = endpoint.rstrip("/")
        self.url = url if url.endswith("/chat/completions") else url + "/chat/completions"
        self.model, self.max_tokens, self.temperature = model, max_tokens, temperature
        self.timeout, self.concurrency, self.api_key_env = timeout, concurrency, api_key_env
        self._lock = threading.Lock()

    def bind(self, trainer) -> None:  # nothing to load
        return None

    def request(self, text: str) -> str | None:
        import os

        body = json.dumps({"model": self.model, "messages": [{"role": "user", "content": text}],
                           "max_tokens": self.max_tokens, "temperature": self.temperature}).encode()
        headers = {"Content-Type": "application/json"}
        key = os.environ.get(self.api_key_env) if self.api_key_env else None
        if key:
            headers["Authorization"] = f"Bearer {key}"
        req = urllib.request.Request(self.url, data=body, headers=headers, method="POST")
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as reply:
                payload = json.loads(reply.read().decode("utf-8"))
            content = payload["choices"][0]["message"]["content"]
            return content if isinstance(content, str) else None
        except (urllib.error.URLError, TimeoutError, OSError, ValueError, KeyError, IndexError, TypeError):
            return None

    def generate(self, texts: Sequence[str]) -> list[str | None]:
        if len(texts) <= 1 or self.concurrency <= 1:
            return [self.request(t) for t in texts]
        with ThreadPoolExecutor(max_workers=min(self.concurrency, len(texts))) as pool:
            return list(pool.map(self.request, texts))


# ----------------------------------------------------------------------------------------------------------------
# Judging procedures on top of a backend
# ----------------------------------------------------------------------------------------------------------------


def judge_scores(backend, texts: Sequence[str], low: float, high: float, stats: JudgeStats,
                 samples: int = 1) -> list[float | None]:
    """Mean parsed score (on ``[low, high]``) of ``samples`` judge replies per text; ``None`` when none parsed."""
    replies = backend.generate([t for t in texts for _ in range(samples)])
    out: list[float | None] = []
    for k in range(len(texts)):
        parsed = []
        for reply in replies[k * samples:(k + 1) * samples]:
            value = parse_score(reply, low, high)
            stats.add(reply, value)
            if value is not None:
                parsed.append(value)
        out.append(sum(parsed) / len(parsed) if parsed else None)
    return out


def pair_jobs(groups: Sequence[Sequence[int]]) -> list[tuple[int, int, int]]:
    """The ordered comparisons (group, position shown as A, position shown as B) of :func:`judge_groups`, in the
    order they are sent to the backend."""
    return [(g, a, b) for g, rows in enumerate(groups) for a in range(len(rows)) for b in range(len(rows)) if a != b]


def judge_groups(backend, prompts: Sequence[str], groups: Sequence[Sequence[int]], answers: Sequence[str],
                 template: str, instruction: str, stats: JudgeStats) -> list[dict[tuple[int, int], float | None]]:
    """Per group, the ordered verdicts ``{(a, b): v}`` (positions within the group, a != b, both presentation
    orders) of the judge comparing ``answers[group[a]]`` (shown as A) with ``answers[group[b]]`` (shown as B).
    All comparisons of all groups go to the backend in one call."""
    jobs = pair_jobs(groups)
    texts = [template.format(prompt=prompts[groups[g][0]], answer_a=answers[groups[g][a]],
                             answer_b=answers[groups[g][b]], instruction=instruction) for g, a, b in jobs]
    # a collective backend (the policy judging itself) is called on every rank, also one holding no pair: during
    # evaluation TRL may split a prompt's group across ranks, leaving a rank only groups of one answer
    replies = backend.generate(texts) if texts or getattr(backend, "collective", False) else []
    out: list[dict[tuple[int, int], float | None]] = [{} for _ in groups]
    for (g, a, b), reply in zip(jobs, replies, strict=True):
        verdict = parse_preference(reply)
        stats.add(reply, verdict)
        out[g][(a, b)] = verdict
    return out
