"""Process (and outcome) reward-model training: per-step BCE read at a step-separator token.

TRL 1.16 has no PRM trainer (its experimental PRMTrainer was removed), so this is a small ``transformers.Trainer``
subclass. It depends on no TRL internals; on transformers it uses ``Trainer.compute_loss`` and
``_set_signature_columns_if_needed`` (as TRL's RewardTrainer does).

Dataset (stepwise, the format of TRL's former PRMTrainer): ``prompt`` (str), ``completions`` (list of step strings),
``labels`` (one number in [0, 1] per step: 1/0 hard labels, or Math-Shepherd soft labels). The text is
``prompt + step_1 + sep + step_2 + sep + ...``; the label of step i sits at the *last* token of the separator after
step i. The model is ``AutoModelForTokenClassification`` with one label (a causal-LM folder gets a fresh head, seeded
by ``args.seed``); the loss is the mean, over all labelled separator positions of the batch, of
``BCE(sigmoid(logit), label)``. An ORM is the one-step case (label at the separator after the whole solution).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import AutoModelForTokenClassification, Trainer, TrainingArguments

from trl_ext.trainers.base import HostMixin

IGNORE = -100.0


@dataclass
class PRMConfig(TrainingArguments):
    """``TrainingArguments`` plus the PRM fields."""

    step_separator: str = field(default="\n", metadata={"help": "text appended after every step; labels sit at its "
                                                                 "last token"})
    max_length: int | None = field(default=512, metadata={"help": "drop examples longer than this many tokens"})
    model_init_kwargs: dict[str, Any] | None = field(default=None, metadata={"help": "kwargs for from_pretrained"})


def tokenize_steps(tokenizer, prompt: str, steps: list[str], separator: str) -> tuple[list[int], list[int]]:
    """Token ids of ``prompt + step_1 + sep + ...`` and the index of each step's separator's last token."""
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"] if prompt else []
    sep = tokenizer(separator, add_special_tokens=False)["input_ids"]
    if not sep:
        raise ValueError(f"step separator {separator!r} tokenizes to nothing")
    positions = []
    for step in steps:
        ids = ids + tokenizer(step, add_special_tokens=False)["input_ids"] + sep
        positions.append(len(ids) - 1)
    return ids, positions


def step_bce_loss(logits: torch.Tensor, step_labels: torch.Tensor) -> torch.Tensor:
    """Mean BCE-with-logits over positions whose label is not ``IGNORE`` (``logits``/``step_labels``: (B, T))."""
    mask = step_labels != IGNORE
    if not bool(mask.any()):  # no labelled step in the micro-batch: 0 with a (zero) gradient, not mean([]) = NaN
        return logits[mask].sum()
    return torch.nn.functional.binary_cross_entropy_with_logits(logits[mask], step_labels[mask].to(logits.dtype))


def check_step_labels(labels) -> list[float]:
    """The labels as floats, refusing anything outside [0, 1] (or missing / NaN).

    BCE is a loss only for targets in [0, 1]: with a target of -1 (PRM800K's rating of a negative step) it is
    ``softplus(x) + x``, unbounded below, so training would drive that logit to -inf instead of failing. Three-class
    ratings must be mapped first (Lightman's "neutral as positive": 1, 0 -> 1 and -1 -> 0).
    """
    bad = [x for x in labels if x is None or not 0.0 <= float(x) <= 1.0]  # NaN fails the comparison too
    if bad:
        raise ValueError(f"step labels must be numbers in [0, 1] (1/0 or soft Math-Shepherd labels); got {bad} in "
                         f"{list(labels)}. Map 3-class ratings (PRM800K -1/0/1) to 0/1 first (neutral as positive)")
    return [float(x) for x in labels]


class _Collator:
    def __init__(self, pad_id: int):
        self.pad_id = pad_id

    def __call__(self, rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        width = max(len(r["input_ids"]) for r in rows)
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        attention = torch.zeros((len(rows), width), dtype=torch.long)
        labels = torch.full((len(rows), width), IGNORE, dtype=torch.float32)
        for i, row in enumerate(rows):  # right padding
            n = len(row["input_ids"])
            ids[i, :n] = torch.tensor(row["input_ids"])
            attention[i, :n] = 1
            labels[i, row["step_positions"]] = torch.tensor(row["step_labels"], dtype=torch.float32)
        return {"input_ids": ids, "attention_mask": attention, "step_labels": labels}


class ExtPRMTrainer(HostMixin, Trainer):
    def __init__(self, model, args: PRMConfig, train_dataset, processing_class, eval_dataset=None, callbacks=None,
                 peft_config=None, *, plugin_host):
        self._init_host(plugin_host)
        if isinstance(model, str):
            torch.manual_seed(args.seed)  # the fresh head
            model = AutoModelForTokenClassification.from_pretrained(model, num_labels=1,
                                                                    **(args.model_init_kwargs or {}))
        if model.config.pad_token_id is None:
            model.config.pad_token_id = processing_class.pad_token_id
        if peft_config is not None:
            from peft import get_peft_model

            model = get_peft_model(model, peft_config)
        prepare = lambda d: None if d is None else self._tokenize(d, processing_class, args)  # noqa: E731
        super().__init__(model=model, args=args, train_dataset=prepare(train_dataset),
                         eval_dataset=prepare(eval_dataset), processing_class=processing_class,
                         data_collator=_Collator(processing_class.pad_token_id), callbacks=callbacks)
        self.model_accepts_loss_kwargs = False  # the loss is a per-micro-batch mean: let Trainer scale it for GA

    @staticmethod
    def _tokenize(dataset, tokenizer, args: PRMConfig):
        for column in ("prompt", "completions", "labels"):
            if column not in dataset.column_names:
                raise ValueError(f"PRM training needs columns prompt, completions (steps), labels; missing {column!r}"
                                 f" (columns: {dataset.column_names})")

        def encode(row):
            if len(row["completions"]) != len(row["labels"]):
                raise ValueError(f"{len(row['completions'])} steps but {len(row['labels'])} labels in {row}")
            ids, positions = tokenize_steps(tokenizer, row["prompt"], row["completions"], args.step_separator)
            return {"input_ids": ids, "step_positions": positions, "step_labels": check_step_labels(row["labels"])}

        dataset = dataset.map(encode, remove_columns=dataset.column_names)
        dataset = dataset.filter(lambda row: len(row["step_positions"]) > 0)  # a row without steps trains nothing
        if args.max_length is not None:
            dataset = dataset.filter(lambda row: len(row["input_ids"]) <= args.max_length)
        return dataset

    def _set_signature_columns_if_needed(self):
        if self._signature_columns is None:
            self._signature_columns = ["input_ids", "step_positions", "step_labels"]

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        labels = inputs.pop("step_labels")
        outputs = model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"])
        loss = step_bce_loss(outputs.logits.squeeze(-1), labels)
        return (loss, outputs) if return_outputs else loss
