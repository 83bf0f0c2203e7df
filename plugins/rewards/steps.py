"""Step-level data for process reward models: an embedded multi-step arithmetic task, Math-Shepherd MC labels and
judge labels.

Stepwise rows (the format the ``prm`` trainer reads): ``prompt``, ``completions`` (list of steps), ``labels`` (one
number in [0, 1] per step), ``answer`` (gold final answer).
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Sequence
from typing import Any

from datasets import Dataset

from trl_ext_plugins.rewards import formulas, judging

_INTEGER = re.compile(r"-?\d+")


def multistep_arithmetic(split: str = "train", size: int = 256, seed: int = 0, terms: int = 3, max_operand: int = 20,
                         error_rate: float = 0.5, format: str = "stepwise") -> Dataset:
    """``a+b+c=`` solved one addition per step (``a+b=s1``, ``s1+c=s2``); every step is checkable.

    With probability ``error_rate`` one step (uniform) gets a wrong sum (off by 1, 2 or 10); later steps compute
    correctly from the wrong value. Labels: 1 for steps before the error, 0 from it on (no later step can reach the
    gold answer, which is also the Math-Shepherd hard label). ``format="prompt"`` keeps ``prompt`` and ``answer`` (for
    GRPO). A problem's split is a hash of its text (one in five held out), so no test problem is ever drawn for
    training; each split's stream is seeded with ``seed`` and the split's name.
    """
    from trl_ext.embedded.splits import hash_split

    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    rng = random.Random(f"{seed}:{split}")
    rows = []
    for _ in range(size):
        for _draw in range(1000):
            operands = [rng.randrange(max_operand) for _ in range(terms)]
            if hash_split("+".join(map(str, operands))) == split:
                break
        else:
            raise ValueError(f"no {split} problem among 1000 draws of {terms} operands below {max_operand}; "
                             "raise max_operand")
        wrong_at = rng.randrange(terms - 1) if rng.random() < error_rate else None
        steps, labels, value, ok = [], [], operands[0], True
        for i, b in enumerate(operands[1:]):
            result = value + b
            if i == wrong_at:
                result += rng.choice([1, -1, 2, 10])
                ok = False
            steps.append(f"{value}+{b}={result}")
            labels.append(1.0 if ok else 0.0)
            value = result
        row = {"prompt": "+".join(map(str, operands)) + "=\n", "answer": str(sum(operands))}
        if format == "stepwise":
            row.update(completions=steps, labels=labels)
        elif format != "prompt":
            raise ValueError(f"format must be 'stepwise' or 'prompt', got {format!r}")
        rows.append(row)
    return Dataset.from_list(rows)


def final_answer(text: str) -> str | None:
    """The last integer of a solution text (the embedded task's answer convention)."""
    found = _INTEGER.findall(text)
    return found[-1] if found else None


def monte_carlo_step_labels(prompt: str, steps: list[str], gold: str, completer: Callable[[list[str], int], list[list[str]]],
                            n: int, separator: str = "\n", soft: bool = True) -> list[float]:
    """Math-Shepherd labels (arXiv 2312.08935): from each step prefix, ``n`` completer rollouts; soft = #correct/n,
    hard = 1 if any is correct (:func:`formulas.math_shepherd_labels`).

    A rollout is correct when the final answer of ``prefix + rollout`` equals ``gold``. The last step needs no
    rollouts: its label is whether the solution's own final answer is correct (both estimates agree there).
    ``completer(prefixes, n)`` returns ``n`` continuation strings per prefix.
    """
    prefixes = [prompt + "".join(s + separator for s in steps[:i + 1]) for i in range(len(steps) - 1)]
    rollouts = completer(prefixes, n) if prefixes else []
    labels = []
    for prefix, outs in zip(prefixes, rollouts, strict=True):
        correct = sum(final_answer(prefix + out) == str(gold) for out in outs)
        hard, soft_label = formulas.math_shepherd_labels(correct, len(outs))
        labels.append(soft_label if soft else hard)
    labels.append(float(final_answer(prompt + separator.join(steps)) == str(gold)))
    return labels


def transformers_completer(path: str, max_new_tokens: int = 16, temperature: float = 1.0, seed: int = 0):
    """A completer sampling from a local causal LM (stops at eos)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path).eval()
    tok = AutoTokenizer.from_pretrained(path)
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token

    @torch.no_grad()
    def complete(prefixes: list[str], n: int) -> list[list[str]]:
        torch.manual_seed(seed)
        enc = tok(prefixes, return_tensors="pt", padding=True, add_special_tokens=False)
        out = model.generate(**enc, do_sample=True, temperature=temperature, max_new_tokens=max_new_tokens,
                             num_return_sequences=n, pad_token_id=tok.pad_token_id)
        texts = tok.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
        return [texts[i * n:(i + 1) * n] for i in range(len(prefixes))]

    return complete


STEP_JUDGE_TEMPLATE = (
    "Is the latest step of this solution correct? Rate it on a scale of {low} (certainly wrong) to {high} "
    "(certainly correct).\nQuestion: {prompt}\nPrevious steps:\n{previous}\nLatest step: {step}\n{instruction}"
)


def judge_step_prompts(prompt: Any, steps: Sequence[str], low: float, high: float, template: str = STEP_JUDGE_TEMPLATE,
                       instruction: str = judging.POINTWISE_INSTRUCTION[False]) -> list[str]:
    """One judge prompt per step prefix (question + steps 1..k): fields {prompt} {previous} (steps 1..k-1, one per
    line, ``(none)`` for the first step) {step} (step k) {low} {high} {instruction}."""
    fmt = lambda x: str(int(x)) if float(x).is_integer() else str(x)  # noqa: E731
    question = judging.as_text(prompt)
    return [template.format(prompt=question, previous="\n".join(steps[:k]) or "(none)", step=steps[k],
                            low=fmt(low), high=fmt(high), instruction=instruction) for k in range(len(steps))]


def judge_step_labels(prompts: Sequence[Any], step_lists: Sequence[Sequence[str]], backend, stats: judging.JudgeStats,
                      low: float = 1.0, high: float = 10.0, soft: bool = False, threshold: float | None = None,
                      fallback: float = 0.0, template: str = STEP_JUDGE_TEMPLATE,
                      instruction: str = judging.POINTWISE_INSTRUCTION[False]) -> list[list[float]]:
    """Judge step labels: every step prefix of every solution is scored by the judge ``backend`` (one
    ``generate`` call for all of them, parsed by :func:`judging.parse_score` on ``[low, high]``) and the verdict is
    turned into a label by :func:`formulas.judge_step_label` (soft: normalised score; hard: score >= ``threshold``,
    default the scale's midpoint; unparsable or failed: ``fallback``, counted in ``stats``).
    """
    threshold = (low + high) / 2 if threshold is None else threshold
    texts, counts = [], []
    for prompt, steps in zip(prompts, step_lists, strict=True):
        texts.extend(judge_step_prompts(prompt, steps, low, high, template, instruction))
        counts.append(len(steps))
    scores = judging.judge_scores(backend, texts, low, high, stats) if texts else []
    labels = [formulas.judge_step_label(s, low, high, soft, threshold, fallback) for s in scores]
    out, start = [], 0
    for n in counts:
        out.append(labels[start:start + n])
        start += n
    return out
