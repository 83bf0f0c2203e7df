"""``length_shaping``: length-based reward shaping (Kimi, cosine, DAPO overlong, budget, L1)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Literal

import torch
from pydantic import Field

from trl_ext import Plugin, PluginParams, hookimpl
from trl_ext.rewards import RewardFunction
from trl_ext_plugins.rewards import formulas


class LengthShapingParams(PluginParams):
    mode: Literal["kimi", "cosine", "dapo", "budget", "l1_exact", "l1_max"] = Field(
        "kimi", description="shaping rule: kimi (group length reward), cosine (Yeo), dapo (soft overlong punishment), "
        "budget (-1 beyond tau*b0), l1_exact / l1_max (LCPO target length)")
    weight: float = Field(1.0, description="weight of the length_shaping reward column (must be non-zero)")
    correctness_reward: str = Field(
        "math_verify", description="name of the reward column that says whether a sample is correct (kimi, cosine, "
        "budget, l1_*); cosine, budget and l1_* replace that column's weighted contribution")
    correct_threshold: float = Field(0.5, description="a sample is correct when its correctness reward exceeds this; "
                                     "NaN (not applicable) counts as wrong")
    warmup_steps: int = Field(0, description="kimi: global steps before the length reward is enabled (Kimi warm-up)")
    max_length: int = Field(20480, description="cosine and dapo: L_max in tokens (DAPO 20480)")
    cache_length: int = Field(4096, description="dapo: overlong buffer L_cache in tokens (DAPO 4096)")
    cosine_correct: tuple[float, float] = Field((2.0, 1.0), description="cosine: (r_0, r_L) for correct samples")
    cosine_wrong: tuple[float, float] = Field((-10.0, 0.0), description="cosine: (r_0, r_L) for wrong samples")
    cosine_exceed: float = Field(-10.0, description="cosine: reward beyond L_max")
    tau: float = Field(1.0, description="budget: multiple of the reference length b0 allowed")
    budget_column: str = Field("b0", description="budget / l1_*: dataset column with the per-problem reference "
                               "(budget b0) or target (L1 n_gold) length in tokens")
    l1_alpha: float = Field(3e-4, description="l1_exact / l1_max: alpha (L1 default 3e-4)")
    l1_delta: float = Field(0.5, description="l1_max: delta (L1 default 0.5)")


@dataclass
class ShapingContext:
    lengths: torch.Tensor  # (N,) completion token counts, float64
    correct: torch.Tensor  # (N,) bool
    task: torch.Tensor  # (N,) weighted contribution of the correctness column (NaN -> 0)
    column: Callable[[], torch.Tensor]  # lazily gathers the dataset column budget_column, (N,) float64
    group_size: int
    step: int
    params: LengthShapingParams


@dataclass(frozen=True)
class Mode:
    """``term`` returns the shaping value; ``replaces`` says whether it is the whole reward that replaces the
    correctness column's contribution (cosine, budget, L1) or a bonus added on top (kimi, dapo)."""

    term: Callable[[ShapingContext], torch.Tensor]
    replaces: bool
    needs_correctness: bool


def _kimi(c: ShapingContext) -> torch.Tensor:
    if c.step < c.params.warmup_steps:
        return torch.zeros_like(c.lengths)
    return formulas.kimi_length_reward(c.lengths, c.correct, c.group_size)


MODES: dict[str, Mode] = {
    "kimi": Mode(_kimi, replaces=False, needs_correctness=True),
    "dapo": Mode(lambda c: formulas.dapo_overlong_penalty(c.lengths, c.params.max_length, c.params.cache_length),
                 replaces=False, needs_correctness=False),
    "cosine": Mode(lambda c: formulas.cosine_length_reward(
        c.lengths, c.correct, c.params.max_length, c.params.cosine_correct, c.params.cosine_wrong,
        c.params.cosine_exceed), replaces=True, needs_correctness=True),
    "budget": Mode(lambda c: formulas.budget_reward(c.lengths, c.task, c.column(), c.params.tau),
                   replaces=True, needs_correctness=True),
    "l1_exact": Mode(lambda c: formulas.l1_exact_reward(c.lengths, c.correct, c.column(), c.params.l1_alpha),
                     replaces=True, needs_correctness=True),
    "l1_max": Mode(lambda c: formulas.l1_max_reward(c.lengths, c.correct, c.column(), c.params.l1_alpha,
                                                    c.params.l1_delta), replaces=True, needs_correctness=True),
}


def shape_length_column(rewards_per_func: torch.Tensor, names: list[str], weights: torch.Tensor, own: str,
                        lengths: torch.Tensor, group_size: int, params: LengthShapingParams,
                        column: Callable[[], torch.Tensor], step: int = 0) -> torch.Tensor:
    """Fill column ``own`` of ``rewards_per_func`` with the shaping value (pure: returns a new tensor).

    Additive modes write their term. Replacing modes write (R - w_c * c) / w_own, so that the weighted total equals
    what the formula prescribes (R in place of the correctness contribution w_c * c) while the correctness column
    itself, and its logged metric, stay untouched.
    """
    mode = MODES[params.mode]
    out = rewards_per_func.clone()
    own_idx = names.index(own)
    w_own = float(weights[own_idx])
    if mode.needs_correctness:
        if params.correctness_reward not in names:
            raise ValueError(f"length_shaping: correctness_reward {params.correctness_reward!r} is not a reward "
                             f"column of this stage (columns: {names})")
        c_idx = names.index(params.correctness_reward)
        raw = rewards_per_func[:, c_idx].to(torch.float64)
        correct = torch.nan_to_num(raw, nan=float("-inf")) > params.correct_threshold
        task = float(weights[c_idx]) * torch.nan_to_num(raw, nan=0.0)
    else:
        correct = torch.zeros(len(lengths), dtype=torch.bool)
        task = torch.zeros(len(lengths), dtype=torch.float64)
    ctx = ShapingContext(lengths.to(torch.float64).cpu(), correct.cpu(), task.cpu(), column, group_size, step, params)
    value = mode.term(ctx)
    if mode.replaces:
        value = (value - ctx.task) / w_own
    out[:, own_idx] = value.to(out.dtype).to(out.device)
    return out


class LengthShaping(Plugin):
    """Length-based reward shaping, ALGORITHMS.md item 17, as its own reward column filled after scoring.

    Modes (``mode``):

    * ``kimi`` - Kimi k1.5 (arXiv 2501.12599): per group lambda = 0.5 - (len - min)/(max - min); correct -> lambda,
      wrong -> min(0, lambda); added to the task reward (range [-0.5, 0.5]); optional warm-up (``warmup_steps``).
      A group with a single length gets 0.
    * ``cosine`` - Yeo et al. (arXiv 2502.03373): R(L) = r_L + (r_0 - r_L)(1 + cos(pi L/L_max))/2 with
      (r_0, r_L) = (2, 1) correct, (-10, 0) wrong, -10 beyond L_max; it *replaces* the correctness reward.
    * ``dapo`` - DAPO soft overlong punishment (arXiv 2503.14476): 0 up to L_max - L_cache, linear to -1 at L_max,
      -1 beyond; added to the correctness reward. Defaults L_max = 20480, L_cache = 4096.
    * ``budget`` - hard -1 when |y| > tau * b0 (b0 per problem, from dataset column ``budget_column``), else the task
      reward (source of this rule not identified, ALGORITHMS.md marks it low confidence); replaces the correctness
      contribution.
    * ``l1_exact`` / ``l1_max`` - LCPO (arXiv 2503.04697), target length from ``budget_column``; alpha 3e-4,
      delta 0.5; replace the correctness contribution.

    Conventions: the plugin contributes a reward function named ``length_shaping`` (weight ``weight``) that TRL scores
    as 0 and that ``trl_ext_shape_rewards`` then fills, so the shaping is logged as its own reward column. Lengths are
    completion token counts (including EOS, as TRL counts them). "Correct" means the ``correctness_reward`` column
    exceeds ``correct_threshold`` (NaN = not correct). Replacing modes write (R - w_c c) / w_own so the weighted total
    equals R while the correctness column is left as scored. Groups are consecutive runs of ``num_generations`` rows.
    """

    name = "length_shaping"
    family = "reward"
    trainers = frozenset({"grpo", "rloo"})
    Params = LengthShapingParams

    @hookimpl
    def trl_ext_validate_stage(self, stage, plugins):
        if self.params.weight == 0:
            return ["length_shaping.weight must be non-zero (the shaping is carried by its own reward column)"]
        return None

    @hookimpl
    def trl_ext_reward_functions(self, stage):
        def length_shaping(completions, **kwargs):
            return [0.0] * len(completions)  # filled by trl_ext_shape_rewards once all rewards are known

        return [RewardFunction(self.name, length_shaping, self.params.weight)]

    @hookimpl
    def trl_ext_shape_rewards(self, rewards_per_func, batch):
        from accelerate.utils import gather_object

        def column() -> torch.Tensor:
            values = gather_object([float(row[self.params.budget_column]) for row in batch.inputs])
            return torch.tensor(values, dtype=torch.float64)

        trainer = batch.trainer
        step = int(trainer.state.global_step) if trainer is not None and hasattr(trainer, "state") else 0
        return shape_length_column(rewards_per_func, batch.reward_names, batch.reward_weights, self.name,
                                   batch.completion_lengths, batch.num_generations, self.params, column, step)
