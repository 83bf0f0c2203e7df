"""``checkpoint_average``: uniform, weighted, EMA or last-N averaging of checkpoints or of named stages' models."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from trl_ext import Plugin, PluginParams, hookimpl
from trl_ext_plugins.merge.math import ema_weights, normalized_weights
from trl_ext_plugins.merge.refs import on_main_then_wait, resolve_source
from trl_ext_plugins.merge.streaming import (
    check_sources,
    checkpoint_folders,
    load_into_model,
    step_of,
    stream_merge,
)

MERGE_TRAINER = "merge"


class CheckpointAverageParams(PluginParams):
    mode: Literal["uniform", "weighted", "ema"] = Field(
        "uniform", description="'uniform': w_k = 1/K (model soup, LAWA); 'weighted': the given `weights`, normalised "
        "to sum 1; 'ema': e_k = ema_decay * e_{k-1} + (1 - ema_decay) * theta_k over the sources, oldest first")
    weights: list[float] | None = Field(None, description="mode 'weighted': one non-negative weight per averaged "
                                        "source (after `last_n`), oldest first")
    ema_decay: float = Field(0.5, ge=0.0, le=1.0, description="mode 'ema': weight kept by the running average at "
                             "each newer checkpoint (0: newest only; 1: oldest only)")
    last_n: int | None = Field(None, gt=0, description="average only the newest N sources (LAWA); None: all")
    sources: list[str] = Field(default_factory=list, description="on a `merge` stage: the models to average, oldest "
                               "first: `stage:<name>`, `embedded:<name>` or folders sharing one architecture. On a "
                               "training stage leave empty: that stage's own checkpoints are averaged")
    include_final: bool = Field(True, description="training stage: also average the final model when its step was "
                                "not saved as a checkpoint (it is then the newest source)")

    @model_validator(mode="after")
    def _consistent(self):
        if self.mode == "weighted" and self.weights is None:
            raise ValueError("mode 'weighted' needs `weights`")
        if self.mode != "weighted" and self.weights is not None:
            raise ValueError(f"`weights` is only read in mode 'weighted' (mode is {self.mode!r})")
        if self.weights is not None:
            normalized_weights(len(self.weights), self.weights)  # finite, non-negative, not all zero
        return self


def averaging_weights(params: CheckpointAverageParams, count: int) -> list[float]:
    """The normalised weights of ``count`` sources (oldest first), after ``last_n`` selection."""
    if params.mode == "ema":
        return ema_weights(count, params.ema_decay)
    return normalized_weights(count, params.weights if params.mode == "weighted" else None)


def select_last(sources: list, last_n: int | None) -> list:
    return sources if last_n is None else sources[-last_n:]


class CheckpointAverage(Plugin):
    """Checkpoint averaging: model soups (Wortsman et al. 2022, arXiv 2203.05482) and LAWA latest-weight averaging
    (Kaddour 2022, arXiv 2209.14981): theta_avg = sum_k w_k theta_k with sum_k w_k = 1.

    Two ways to use it in a recipe:

    * on a **training stage** (any trainer, full fine-tuning): after training, the stage's own TRL checkpoints
      (``<stage>/checkpoints/checkpoint-<step>``, oldest first by step), plus the final model when its step was not
      checkpointed (``include_final``), are averaged into the stage folder, which later stages read as
      ``stage:<name>``; the trainer's in-memory model is updated in place too, so the stage's ``evaluation`` after
      training scores the average. Set ``save_steps`` so the checkpoints you want exist, and ``save_total_limit``
      (if any) at least ``last_n``. Only weights are averaged (optimizer and scheduler states are not merged);
      checkpoints of a PEFT stage hold adapters and are refused.
    * on a **merge stage** (``trainer: merge``): ``sources`` lists models (``stage:<name>`` of stages sharing an
      architecture, e.g. runs with different seeds), averaged into the stage folder; the stage's ``model:`` gives the
      config and tokenizer.

    Defaults: ``mode: uniform`` over all sources (the uniform soup; ALGORITHMS.md's default is the uniform average of
    the last K checkpoints: set ``last_n: K``). ``weighted`` takes explicit weights (normalised); ``ema`` weighs
    checkpoint k by (1 - d) d^(K-k) (the oldest by d^(K-1)), an EMA sampled at the checkpoints, not TRL's per-step
    ``BEMACallback``. Conventions: the average is computed per tensor in float64 and cast to the newest source's
    dtype; integer and bool tensors (buffers such as counters) are copied from the newest source, not averaged; the
    output has the newest source's layout (shards). Sources whose tensor names or shapes differ are refused with an
    error naming the tensor and both sources. Everything streams tensor by tensor through safetensors
    (``safe_open``), so peak memory stays near one model (``benchmarks/merge_memory.py``). Greedy soups (add a
    checkpoint only if a held-out metric improves) are not implemented.
    """

    name = "checkpoint_average"
    aliases = ("model_soup", "lawa")
    family = "merge"
    Params = CheckpointAverageParams

    @hookimpl
    def trl_ext_validate_stage(self, stage, plugins):
        p, errors = self.params, []
        where = "plugin 'checkpoint_average'"
        if stage.trainer == MERGE_TRAINER:
            if not p.sources:
                errors.append(f"{where}: params.sources must list the models to average on a merge stage")
            count = len(select_last(p.sources, p.last_n))
            if p.weights is not None and p.sources and len(p.weights) != count:
                errors.append(f"{where}: params.weights has {len(p.weights)} values for {count} sources")
            return errors
        if p.sources:
            errors.append(f"{where}: params.sources is for a merge stage; a {stage.trainer} stage averages its own "
                          f"checkpoints")
        if stage.peft is not None:
            errors.append(f"{where}: a PEFT stage's checkpoints hold adapters, not full weights; average a full "
                          f"fine-tuning stage")
        if stage.args.get("save_strategy") == "no":
            errors.append(f"{where}: args.save_strategy is 'no', so the stage writes no checkpoints to average")
        if p.weights is not None and p.last_n is None:
            errors.append(f"{where}: params.weights needs params.last_n (how many checkpoints the weights are for)")
        elif p.weights is not None and len(p.weights) != p.last_n:
            errors.append(f"{where}: params.weights has {len(p.weights)} values but params.last_n is {p.last_n}")
        limit = stage.args.get("save_total_limit")
        if limit is not None and p.last_n is not None and limit < p.last_n:
            errors.append(f"{where}: args.save_total_limit {limit} keeps fewer checkpoints than params.last_n "
                          f"{p.last_n}")
        return errors

    def training_sources(self, stage_dir: Path, final_step: int) -> list[Path]:
        """This stage's checkpoints, oldest first, and the final model if its step was not checkpointed."""
        checkpoints = checkpoint_folders(stage_dir / "checkpoints")
        if self.params.include_final and final_step not in {step_of(c) for c in checkpoints}:
            checkpoints.append(stage_dir)
        return checkpoints

    @hookimpl
    def trl_ext_after_stage(self, stage, output_dir, trainer):
        stage_dir = Path(output_dir)
        if stage.trainer == MERGE_TRAINER:
            candidates = [resolve_source(ref, stage_dir, self.name) for ref in self.params.sources]
        else:
            candidates = self.training_sources(stage_dir, trainer.state.global_step)
        sources = select_last(candidates, self.params.last_n)
        if not sources:
            raise FileNotFoundError(f"checkpoint_average: no checkpoints in {stage_dir / 'checkpoints'} (set save_steps)")
        if self.params.weights is not None and len(self.params.weights) != len(sources):
            raise ValueError(f"checkpoint_average: params.weights has {len(self.params.weights)} values but "
                             f"{len(sources)} sources were found: {[str(s) for s in sources]}")
        weights = averaging_weights(self.params, len(sources))

        def merge():
            if stage.trainer == MERGE_TRAINER:  # the stage folder (a copy of `model:`) must fit the sources too
                check_sources([sources[-1], stage_dir], self.name)
            counts = stream_merge(sources, stage_dir, lambda _name, _gram: weights, base=len(sources) - 1, who=self.name)
            return counts

        counts = on_main_then_wait(merge) or {}
        summary = {"checkpoint_average": {"sources": [str(s) for s in sources], "weights": weights, **counts}}
        if stage.trainer == MERGE_TRAINER:
            trainer.use_weights(stage_dir)  # a stage evaluation after the merge scores the merged model
        else:
            model = trainer.accelerator.unwrap_model(trainer.model)
            summary["checkpoint_average"]["trainer_model_updated"] = load_into_model(model, stage_dir)
        return summary

