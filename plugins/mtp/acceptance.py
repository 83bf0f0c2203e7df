"""Speculative-decoding acceptance of a checkpoint's MTP heads, measured with transformers' own drafting.

The checkpoint folder is loaded with ``AutoModelForCausalLM.from_pretrained`` and every prompt is decoded with
``generate(use_mtp=True)``: transformers' ``MTPCandidateGenerator`` loads the heads from the folder
(``MtpModel.from_pretrained``), drafts ``num_mtp_layers`` tokens per step and the trunk verifies them in
``_assisted_decoding``. Nothing of that path is replaced: the only addition is an observer on the candidate
generator's ``get_candidates`` (to see the step's drafts) and ``update_candidate_strategy(input_ids, scores,
num_matches)``, which ``_assisted_decoding`` calls once per verification step with the step's scores (candidate
length + 1 columns) and the number of accepted draft tokens (after transformers' own cropping at eos / max length;
drafts past such a cut are not counted as drafted, see :func:`_observe_acceptance`). The observer is attached to
this model instance only, by wrapping its ``_get_candidate_generator``; the class is untouched.

Figures (over all verification steps that had drafts, all prompts pooled):

* ``acceptance_length``: mean accepted draft tokens per step, in [0, num_mtp_layers] (the issue's definition);
* ``acceptance_rate``: accepted / drafted tokens;
* ``tokens_per_step``: ``acceptance_length + 1`` (each step also emits the trunk's own token).

All three are ``None`` (null in JSON) when no step carried a draft (every decode ended before the first verification
step could keep one, e.g. at an eos first token): undefined, not 0.0, which would read as "every draft rejected".
``steps``, ``drafted`` and ``accepted`` are 0 then. With one new token from the prefill and one from each step's
trunk, a draft can only count from ``max_new_tokens`` 3 on (``mtp_heads`` refuses less).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch


@dataclass
class Acceptance:
    acceptance_length: float | None  # None: no step had a draft (see module docstring)
    acceptance_rate: float | None
    tokens_per_step: float | None
    steps: int
    drafted: int
    accepted: int
    prompts: int

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def summarize(records: list[tuple[int, int]], prompts: int) -> Acceptance:
    """``records``: (drafted, accepted) per verification step; steps without drafts (the prefill) are skipped. The
    ratios are ``None`` when no step is left (nothing was drafted, so nothing can be said about acceptance)."""
    steps = [(d, a) for d, a in records if d > 0]
    drafted = sum(d for d, _ in steps)
    accepted = sum(a for _, a in steps)
    n = len(steps)  # every kept step has drafted >= 1, so drafted > 0 exactly when n > 0
    return Acceptance(acceptance_length=accepted / n if n else None,
                      acceptance_rate=accepted / drafted if n else None,
                      tokens_per_step=(accepted / n + 1.0) if n else None, steps=n, drafted=drafted, accepted=accepted,
                      prompts=prompts)


def _observe_acceptance(model, records: list[tuple[int, int]], limit: dict | None = None) -> None:
    """Make every candidate generator ``model.generate`` builds report (drafted, accepted) per step into ``records``.

    transformers crops a step's accepted tokens at the first eos and at ``max_length`` and then reports the last kept
    token as the trunk's own (``num_matches`` = kept - 1), so the drafts after that slot could never have been accepted:

    * ``limit["max_length"]`` (set per ``generate`` call): transformers drafts ``num_mtp_layers`` tokens even when fewer
      fit before it, so only ``budget - 1`` drafts count as drafted;
    * a step cut at a draft the trunk accepted (an eos drafted and verified: the last kept token *is* that step's draft
      at the same index) counts only the drafts before it as drafted. Without this a draft that always equals the
      trunk's choice scored 0 when its eos came as a draft (drafted 1, accepted 0)."""
    build = model._get_candidate_generator

    def build_and_observe(*args, **kwargs):
        generator = build(*args, **kwargs)
        update, get_candidates = generator.update_candidate_strategy, generator.get_candidates
        last: dict = {}

        def get_and_keep(*g_args, **g_kwargs):
            candidate_ids, candidate_logits = get_candidates(*g_args, **g_kwargs)
            last["candidates"] = candidate_ids
            return candidate_ids, candidate_logits

        def update_and_record(input_ids, scores, num_matches):
            drafted = int(scores.shape[1]) - 1
            start = int(input_ids.shape[1]) - int(num_matches) - 1  # length before this step's tokens
            max_length = (limit or {}).get("max_length")
            if max_length is not None:
                drafted = max(min(drafted, max_length - start - 1), 0)
            drafted = min(drafted, cut_at_accepted_draft(last.get("candidates"), input_ids, start))
            records.append((drafted, int(num_matches)))
            return update(input_ids, scores, num_matches)

        generator.get_candidates = get_and_keep
        generator.update_candidate_strategy = update_and_record
        return generator

    model._get_candidate_generator = build_and_observe


def cut_at_accepted_draft(candidates: torch.Tensor | None, input_ids: torch.Tensor, start: int) -> int:
    """How many of a step's drafts could have been accepted: ``kept - 1`` when the step's last kept token is its
    draft at that index (the step was cropped there: a verified draft is kept last only when transformers cut the
    step at it, at eos or max length, since otherwise the trunk's own token follows the accepted drafts), else
    unlimited. ``candidates``: the step's ``get_candidates`` ids (prefix + drafts); batch size 1."""
    if candidates is None:
        return 1 << 30
    drafts = candidates[0, start:]
    kept = input_ids[0, start:]
    last = kept.shape[0] - 1
    if 0 <= last < drafts.shape[0] and int(drafts[last]) == int(kept[last]):
        return last
    return 1 << 30


def prompt_ids(tokenizer, prompt) -> list[int]:
    """Token ids (a list of ints) of a plain-text prompt (no special tokens, as the trainers tokenize it) or of a
    conversation (chat template with the generation prompt)."""
    if isinstance(prompt, str):
        return tokenizer(prompt, add_special_tokens=False)["input_ids"]
    # transformers 5 returns a BatchEncoding from tokenize=True by default (4.x a list): ask for the dict explicitly
    # and take its ids, which works on both.
    encoded = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True, return_dict=True)
    return list(encoded["input_ids"])


@torch.no_grad()
def measure_acceptance(model_dir: str | Path, prompts: list, max_new_tokens: int = 16, do_sample: bool = False,
                       temperature: float = 1.0, seed: int = 0) -> Acceptance:
    """Decode each prompt (batch size 1, which transformers' assisted decoding requires) with
    ``generate(use_mtp=True)`` from the folder ``model_dir`` and pool the acceptance of every step."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(model_dir)).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    records: list[tuple[int, int]] = []
    limit: dict = {}
    _observe_acceptance(model, records, limit)
    sampling = {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0} if do_sample else \
        {"do_sample": False}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for prompt in prompts:
            ids = torch.tensor([prompt_ids(tokenizer, prompt)], device=model.device)
            limit["max_length"] = ids.shape[1] + max_new_tokens
            model.generate(ids, attention_mask=torch.ones_like(ids), use_mtp=True, max_new_tokens=max_new_tokens,
                           pad_token_id=tokenizer.pad_token_id, **sampling)
    return summarize(records, len(prompts))


def plot_acceptance(figures: dict[str, Acceptance], out_png: str | Path, title: str) -> Path:
    """Bar chart of acceptance length per measured checkpoint (in the given order); a checkpoint without drafted
    steps (length ``None``) gets an empty bar labelled "no drafts", not a 0 that would read as all rejected."""
    from matplotlib.figure import Figure

    from trl_ext.files import save_figure_atomic

    out_png = Path(out_png)
    figure = Figure(figsize=(6, 3.6), layout="constrained")
    axes = figure.subplots()
    names = list(figures)
    values = [figures[n].acceptance_length for n in names]
    bars = axes.bar(names, [v or 0.0 for v in values], color=[f"C{i}" for i in range(len(names))])
    for bar, value in zip(bars, values):
        label = "no drafts" if value is None else f"{value:.3f}"
        axes.annotate(label, (bar.get_x() + bar.get_width() / 2, value or 0.0), ha="center", va="bottom")
    axes.set_ylabel("mean accepted draft tokens / step")
    axes.set_title(title)
    axes.set_ylim(0, max([v for v in values if v is not None] + [1e-3]) * 1.2)
    save_figure_atomic(figure, out_png, dpi=100)
    return out_png
