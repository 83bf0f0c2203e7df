"""What the preference-loss plugins share: dataset checks, extra columns reaching the loss, reference-free guards.

Extra columns (reward columns for ``rpo``/``qrpo``): TRL's DPO trainer tokenizes the dataset, then
``Trainer._remove_unused_columns`` drops every column outside its signature list and ``DataCollatorForPreference``
builds only ``input_ids``/``attention_mask``/``completion_mask``. A plugin that needs columns therefore
(1) sets ``remove_unused_columns=False`` through ``trl_ext_configure_args`` (visible in the resolved recipe; the
collator ignores the text columns it then receives), and (2) in ``trl_ext_trainer_created`` wraps the trainer's
collator in :class:`ColumnCollator`, which adds the named columns as float tensors, and adds their names to
``ExtDPOTrainer.preference_columns`` so the trainer hands them to ``PreferenceInputs.batch`` and never to the model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, ClassVar

import torch

from trl_ext import Need, Plugin, Slot, hookimpl
from trl_ext.errors import TrlExtError

_SHOWN_ROWS = 5


class PreferenceDataError(TrlExtError, ValueError):
    """A preference dataset cannot train the selected loss (missing column, empty or identical pair, NaN reward)."""


@dataclass(frozen=True)
class Column:
    """A dataset column a loss reads: a scalar per row, or a list of at least ``min_items`` values per row."""

    name: str
    is_list: bool = False
    min_items: int = 1


def nan_padded(rows: list[list[Any]]) -> list[list[float]]:
    """A list column as a rectangle: shorter rows padded with NaN, and None inside a row (a missing value, counted so
    by the dataset check) NaN too."""
    width = max(len(row) for row in rows)
    return [[math.nan if x is None else x for x in row] + [math.nan] * (width - len(row)) for row in rows]


@dataclass
class ColumnCollator:
    """Wraps a collator and adds ``columns`` from the examples as float32 tensors (lists NaN-padded to ``(B, n)``)."""

    base: Callable[[list[dict[str, Any]]], dict[str, Any]]
    columns: tuple[Column, ...]

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, Any]:
        out = self.base(examples)
        for column in self.columns:
            values = [example[column.name] for example in examples]
            out[column.name] = torch.tensor(nan_padded(values) if column.is_list else values, dtype=torch.float32)
        return out


def attach_columns(trainer, columns: tuple[Column, ...]) -> None:
    """Make ``columns`` reach ``PreferenceInputs.batch`` on an ``ExtDPOTrainer`` (see the module docstring)."""
    if not columns:
        return
    trainer.data_collator = ColumnCollator(trainer.data_collator, columns)
    trainer.preference_columns = frozenset(trainer.preference_columns) | {c.name for c in columns}


def _rows(indices: list[int]) -> str:
    shown = ", ".join(str(i) for i in indices[:_SHOWN_ROWS])
    return f"rows {shown}" + (f" (and {len(indices) - _SHOWN_ROWS} more)" if len(indices) > _SHOWN_ROWS else "")


def _is_empty(value: Any) -> bool:
    if value is None:
        return True
    if isinstance(value, str):
        return value.strip() == ""
    return len(value) == 0


def _is_nan(value: Any) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value))


def check_preference_dataset(dataset, plugin: str, split: str, trainer: str, columns: tuple[Column, ...] = ()) -> None:
    """Raise :class:`PreferenceDataError` naming the plugin, split, column and rows at fault.

    Paired data (DPO trainer): ``chosen`` and ``rejected`` must exist, be non-empty and differ (an identical pair has
    no learning signal, and a loss like IPO would still push its gap to ``1/(2 tau)``). Unpaired data (KTO trainer):
    ``completion`` and ``label``. Loss columns: present, no NaN/None; list columns with at least ``min_items`` values.
    """
    where = f"{plugin}: {split} dataset"
    text = ("chosen", "rejected") if trainer == "dpo" else ("completion", "label")
    missing = [name for name in (*text, *(c.name for c in columns)) if name not in dataset.column_names]
    if missing:
        raise PreferenceDataError(
            f"{where} lacks column(s) {', '.join(repr(m) for m in missing)} (has: {', '.join(dataset.column_names)})")
    if len(dataset) == 0:
        raise PreferenceDataError(f"{where} is empty")
    if trainer == "dpo":
        chosen, rejected = dataset["chosen"], dataset["rejected"]
        for name, values in (("chosen", chosen), ("rejected", rejected)):
            empty = [i for i, v in enumerate(values) if _is_empty(v)]
            if empty:
                raise PreferenceDataError(f"{where}: empty {name!r} in {_rows(empty)}")
        same = [i for i, (c, r) in enumerate(zip(chosen, rejected)) if c == r]
        if same:
            raise PreferenceDataError(f"{where}: 'chosen' equals 'rejected' in {_rows(same)}; drop these pairs")
    else:
        empty = [i for i, v in enumerate(dataset["completion"]) if _is_empty(v)]
        if empty:
            raise PreferenceDataError(f"{where}: empty 'completion' in {_rows(empty)}")
    for column in columns:
        values = dataset[column.name]
        if column.is_list:
            short = [i for i, v in enumerate(values)
                     if v is None or sum(not _is_nan(x) for x in v) < column.min_items]
            if short:
                raise PreferenceDataError(
                    f"{where}: column {column.name!r} needs at least {column.min_items} non-NaN values per row; "
                    f"{_rows(short)} have fewer")
        else:
            bad = [i for i, v in enumerate(values) if _is_nan(v)]
            if bad:
                raise PreferenceDataError(f"{where}: column {column.name!r} is NaN or missing in {_rows(bad)}")


class PreferenceLoss(Plugin):
    """Base of the preference-loss plugins (not selectable itself).

    Subclasses implement ``trl_ext_preference_loss``; this base validates the dataset, routes extra ``columns()``
    into the loss, and refuses a ``ref_model`` for reference-free losses (``needs`` without ``reference``), for which
    ``ExtDPOTrainer`` loads no reference model at all.
    """

    family = "preference"
    trainers = frozenset({"dpo"})
    slots = frozenset({Slot.PREFERENCE_LOSS})
    needs = frozenset({Need.REFERENCE})
    reference_free: ClassVar[bool] = False

    def columns(self) -> tuple[Column, ...]:
        """Dataset columns this loss reads besides prompt/chosen/rejected."""
        return ()

    @hookimpl
    def trl_ext_validate_stage(self, stage, plugins):
        errors = []
        if self.reference_free and stage.ref_model:
            errors.append(f"ref_model: plugin {self.name!r} is reference-free; remove `ref_model`")
        if self.reference_free and (stage.args.get("precompute_ref_log_probs") or stage.args.get("sync_ref_model")):
            errors.append(f"args: plugin {self.name!r} is reference-free; precompute_ref_log_probs and "
                          "sync_ref_model do not apply")
        return errors

    @hookimpl
    def trl_ext_configure_args(self, trainer, args):
        return {"remove_unused_columns": False} if self.columns() and trainer == "dpo" else None

    @hookimpl
    def trl_ext_prepare_dataset(self, dataset, split, stage):
        check_preference_dataset(dataset, self.name, split, stage.trainer,
                                 self.columns() if stage.trainer == "dpo" else ())
        return None

    @hookimpl
    def trl_ext_trainer_created(self, trainer):
        if hasattr(trainer, "preference_columns"):
            attach_columns(trainer, self.columns())
