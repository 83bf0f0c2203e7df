"""``warp``: weight-averaged rewarded policies (EMA anchor in each RL run; SLERP of task vectors; LITI to the init)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import torch
from pydantic import Field

from trl_ext import Plugin, PluginParams, hookimpl
from trl_ext_plugins.merge.math import NonFiniteWeightsError, ZeroTaskVectorError, slerp_fold_coefficients
from trl_ext_plugins.merge.refs import on_main_then_wait, resolve_source
from trl_ext_plugins.merge.streaming import stream_merge

MERGE_TRAINER = "merge"


class WarpParams(PluginParams):
    ema_rate: float = Field(0.01, gt=0.0, le=1.0, description="RL stages: mu, the anchor's EMA rate per optimizer step: "
                            "theta_ema <- (1 - mu) theta_ema + mu theta (TRL's ref_model_mixup_alpha with "
                            "ref_model_sync_steps 1)")
    beta: float = Field(0.1, gt=0.0, description="RL stages: KL coefficient towards the EMA anchor (TRL's `beta`)")
    runs: list[str] = Field(default_factory=list, description="merge stage: the M RL stages to merge (`stage:<name>`), "
                            "all trained from the merge stage's `model:` (theta_init); folded in this order when M > 2")
    slerp_t: float | None = Field(None, ge=0.0, le=1.0, description="merge stage, M = 2 only: SLERP's lambda "
                                  "(0: run 1, 1: run 2); None: uniform, 1/m at the m-th fold (0.5 for M = 2)")
    eta: float = Field(0.3, ge=0.0, le=1.0, description="merge stage: LITI, theta = (1 - eta) theta_init + "
                       "eta theta_slerp (0: the init, 1: the SLERP)")
    colinear_threshold: float = Field(0.9995, gt=0.0, lt=1.0, description="|cos Omega| above which two task vectors "
                                      "count as (anti-)parallel and are interpolated linearly (mergekit's 0.9995)")
    zero_task_vector: Literal["error", "linear"] = Field(
        "error", description="a tensor whose task vector is exactly zero in some run (a frozen tensor) has no "
        "direction: 'error' refuses naming the tensor and run; 'linear' interpolates it linearly instead")


def warp_weights(eta: float, slerp_t: float | None, colinear_threshold: float, zero_task_vector: str,
                 run_names: list[str], stats: dict[str, int]):
    """Per-tensor weights of ``[theta_init, theta_1, ..., theta_M]`` giving LITI(init, init + SLERP(deltas)).

    SLERP's result is ``sum_m c_m delta_m`` (coefficients from the task vectors' Gram matrix), so
    ``theta = theta_init + eta sum_m c_m (theta_m - theta_init)``: weights ``1 - eta sum c`` on the init and
    ``eta c_m`` on run m.
    """

    def weights(name: str, gram: torch.Tensor) -> list[float]:
        m = gram.shape[0]
        if not bool(torch.isfinite(gram).all()):
            raise NonFiniteWeightsError(f"warp: tensor {name!r} holds NaN or Inf in theta_init or a run "
                                        f"(its task vectors' Gram matrix is {gram.tolist()})")
        try:
            for i, run in enumerate(run_names):
                if gram[i, i] == 0:
                    raise ZeroTaskVectorError(f"warp: tensor {name!r} did not change in {run!r} (its task vector is "
                                              f"zero, so SLERP has no direction); set zero_task_vector: linear to "
                                              f"interpolate such tensors linearly")
            coefficients, fallbacks = slerp_fold_coefficients(gram, slerp_t, colinear_threshold)
            stats["linear_fallback_tensors"] += bool(fallbacks)
        except ZeroTaskVectorError as exc:
            if zero_task_vector == "error":
                raise ZeroTaskVectorError(str(exc) if str(exc).startswith("warp:") else f"warp: tensor {name!r}: {exc}"
                                          ) from None
            coefficients = [1.0 - slerp_t, slerp_t] if slerp_t is not None else [1.0 / m] * m
            stats["zero_task_vector_tensors"] += 1
        return [1.0 - eta * sum(coefficients)] + [eta * c for c in coefficients]

    return weights


class Warp(Plugin):
    """WARP, weight averaged rewarded policies (Ramé et al. 2024, arXiv 2406.16768).

    WARP is a recipe of stages, and this plugin serves two kinds of them (see ``configs/warp.yaml``):

    * **RL stages** (``rloo`` or ``grpo``): M runs from one initialisation theta_init, differing in seed, each
      regularised towards an EMA of its own weights, theta_ema <- (1 - mu) theta_ema + mu theta after every
      optimizer step. This is TRL's own reference sync: the plugin sets ``sync_ref_model: true``,
      ``ref_model_mixup_alpha: mu`` and ``ref_model_sync_steps: 1`` (TRL's pi_ref = alpha pi_theta + (1 - alpha)
      pi_ref every tau steps is exactly this EMA with alpha = mu, tau = 1) and ``beta``. With ``rloo`` the penalty is
      the paper's: TRL's RLOO subtracts beta * sum_t log(pi/pi_ref) (k1) from the reward, so the reward is
      r - beta log(pi/pi_ema); with ``grpo`` it is TRL's per-token k3 term in the loss instead. The anchor is saved
      with every checkpoint and restored on resume (TRL does not checkpoint the reference model; under ZeRO-3 every
      rank gathers the sharded reference for the save and the restore).
    * a **merge stage** (``trainer: merge``, ``model:`` = theta_init, ``runs:`` = the M RL stages): per tensor, the
      task vectors delta_m = theta_m - theta_init are merged by SLERP, theta_slerp = theta_init + sin((1-l) W)/sin W
      delta_1 + sin(l W)/sin W delta_2 with W the angle between delta_1 and delta_2, then LITI moves towards the
      init: theta = (1 - eta) theta_init + eta theta_slerp. The merged model is the stage's output; the next
      iteration's RL stages start from it (``model: stage:<merge>``) and the next merge uses it as theta_init.
      I iterations are I copies of (M RL stages, one merge stage) in the recipe, so a crashed run resumes like
      any recipe: finished stages are skipped.

    Defaults (the paper's): mu = 0.01, beta = 0.1, M = 2, lambda = 0.5, eta = 0.3. Conventions chosen:

    * SLERP per tensor (the paper's "per layer"), computed in float64, cast to theta_init's dtype; integer buffers
      are copied from theta_init.
    * |cos W| > 0.9995 (mergekit's threshold, ``colinear_threshold``): linear interpolation (1-l) delta_1 +
      l delta_2. For parallel vectors this is SLERP's limit; for anti-parallel ones SLERP is undefined and the linear
      rule cancels them (equal norms, l = 0.5: zero change). The stage summary counts such tensors.
    * A task vector that is exactly zero (a tensor a run did not change) has no angle: refused naming the tensor
      and the run (default), or interpolated linearly (``zero_task_vector: linear``).
    * M > 2: iterated pairwise SLERP, acc = slerp(acc, delta_m; 1/m) for m = 2..M, in the order of ``runs``
      (SLERP is not associative, so the order matters; three orthogonal unit task vectors get 0.612, 0.612, 0.5);
      an explicit ``slerp_t`` is only accepted for M = 2. When the running merge has cancelled to zero (two
      anti-parallel runs of equal norm, merged linearly as above), it has no angle, so the next run is folded in
      linearly, ``(1 - 1/m) acc + delta_m / m``, and the tensor counts as a linear fallback.
    * The merge streams tensor by tensor through safetensors (peak memory about one model, see
      ``checkpoint_average``); runs whose tensor names or shapes differ from theta_init are refused naming the tensor.
    """

    name = "warp"
    family = "merge"
    trainers = frozenset({"rloo", "grpo", MERGE_TRAINER})
    Params = WarpParams

    @hookimpl
    def trl_ext_validate_stage(self, stage, plugins):
        p, where = self.params, "plugin 'warp'"
        if stage.trainer == MERGE_TRAINER:
            errors = [] if len(p.runs) >= 2 else [f"{where}: params.runs must name the M >= 2 RL stages to merge"]
            if p.slerp_t is not None and len(p.runs) != 2:
                errors.append(f"{where}: params.slerp_t applies to M = 2 runs only (got {len(p.runs)}); leave it "
                              f"unset for the uniform 1/m folds")
            return errors
        errors = []
        if p.runs:
            errors.append(f"{where}: params.runs is for the merge stage, not the {stage.trainer} stage")
        if stage.peft is not None:
            errors.append(f"{where}: the EMA anchor needs a full reference model; TRL does not sync it under PEFT")
        return errors

    @hookimpl
    def trl_ext_configure_args(self, trainer, args):
        if trainer == MERGE_TRAINER:
            return None
        p = self.params
        return {"beta": p.beta, "sync_ref_model": True, "ref_model_mixup_alpha": p.ema_rate, "ref_model_sync_steps": 1}

    @hookimpl
    def trl_ext_trainer_created(self, trainer):
        if getattr(trainer, "ref_model", None) is None:
            return
        from trl_ext.callbacks import ReferenceModelCheckpoint

        # The EMA anchor is TRL's reference model, which checkpoints do not hold (added here, it is written before
        # the runner marks a checkpoint complete: trl_ext.callbacks.plugin_checkpoints_before_completion).
        trainer.add_callback(ReferenceModelCheckpoint(trainer))

    @hookimpl
    def trl_ext_after_stage(self, stage, output_dir, trainer):
        if stage.trainer != MERGE_TRAINER:
            return None
        p, stage_dir = self.params, Path(output_dir)
        init = resolve_source(stage.model, stage_dir, self.name)
        runs = [resolve_source(ref, stage_dir, self.name) for ref in p.runs]
        stats = {"linear_fallback_tensors": 0, "zero_task_vector_tensors": 0}
        weights = warp_weights(p.eta, p.slerp_t, p.colinear_threshold, p.zero_task_vector, list(p.runs), stats)

        counts = on_main_then_wait(lambda: stream_merge([init, *runs], stage_dir, weights, base=0, who=self.name,
                                                        gram=True)) or {}
        trainer.use_weights(stage_dir)  # a stage evaluation after the merge scores the merged model
        return {"warp": {"init": str(init), "runs": [str(r) for r in runs], "eta": p.eta, "slerp_t": p.slerp_t,
                         **counts, **stats}}
