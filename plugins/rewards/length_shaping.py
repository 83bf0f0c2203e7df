"""``length_shaping``: length-based reward shaping (Kimi, cosine, DAPO overlong, budget, L1)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Literal

import torch
from pydantic import Field, model_validator

from trl_ext import Plugin, PluginParams, hookimpl
from trl_ext.ops import ends_with
from trl_ext.rewards import RewardFunction
from trl_ext_plugins.rewards import formulas


class LengthShapingParams(PluginParams):
    mode: Literal["kimi", "cosine", "dapo", "budget", "l1_exact", "l1_max", "none"] = Field(
        "kimi", description="shaping rule: kimi (group length reward), cosine (Yeo), dapo (soft overlong punishment), "
        "budget (-1 beyond tau*b0), l1_exact / l1_max (LCPO target length), none (only the stop penalties)")
    weight: float = Field(1.0, description="weight of the length_shaping reward column (must be non-zero)")
    correctness_reward: str = Field(
        "math_verify", description="name of the reward column that says whether a sample is correct (kimi, cosine, "
        "budget, l1_*); cosine, budget and l1_* replace that column's weighted contribution")
    correct_threshold: float = Field(0.5, description="a sample is correct when its correctness reward exceeds this; "
                                     "NaN (not applicable) counts as wrong")
    warmup_steps: int = Field(0, description="kimi: global steps before the length reward is enabled (Kimi warm-up)")
    max_length: int = Field(20480, gt=0, description="cosine and dapo: L_max in tokens (DAPO 20480)")
    cache_length: int = Field(4096, ge=0, description="dapo: overlong buffer L_cache in tokens (DAPO 4096), at "
                              "most max_length; 0 (a hard -1 beyond L_max, as TRL's soft_punish_cache 0) needs "
                              "overlong_cap")
    cosine_correct: tuple[float, float] = Field((2.0, 1.0), description="cosine: (r_0, r_L) for correct samples")
    cosine_wrong: tuple[float, float] = Field((-10.0, 0.0), description="cosine: (r_0, r_L) for wrong samples")
    cosine_exceed: float = Field(-10.0, description="cosine: reward beyond L_max (cosine_beyond_max: exceed)")
    cosine_beyond_max: Literal["exceed", "clamp", "extend", "truncated"] = Field(
        "exceed", description="cosine, L > L_max: exceed (the paper: cosine_exceed), clamp (L clamped to L_max: r_L), "
        "extend (the formula continued; open-r1's get_cosine_scaled_reward), truncated (as exceed, and cosine_exceed "
        "also for a completion that fills args.max_completion_length: the paper's released code, where L_max is the "
        "generation budget)")
    overlong_cap: bool = Field(True, description="dapo: true (the paper) caps the penalty at -factor beyond L_max; "
                               "false continues it linearly (verl DAPORewardManager)")
    overlong_penalty_factor: float = Field(1.0, gt=0.0, description="dapo: scale of the overlong penalty (verl "
                                           "overlong_buffer.penalty_factor; paper 1)")
    truncation_penalty: float = Field(0.0, description="added (any mode) to a completion that used the whole "
                                      "args.max_completion_length (cut by the limit); 0: off")
    no_stop_penalty: float = Field(0.0, description="added (any mode) to a completion whose last token is not an "
                                   "end-of-sequence token (TRL's mask_truncated_completions test); 0: off")
    length_tokens: Literal["all", "model"] = Field(
        "all", description="tokens the shaping lengths count: all completion tokens (tool/observation tokens of a "
        "multi-turn completion included; verl's response length) or model (only the model's own tokens, TRL's "
        "completion-length metric)")
    tau: float = Field(1.0, description="budget: multiple of the reference length b0 allowed")
    budget_column: str = Field("b0", description="budget / l1_*: dataset column with the per-problem reference "
                               "(budget b0) or target (L1 n_gold) length in tokens")
    l1_alpha: float = Field(3e-4, description="l1_exact / l1_max: alpha (L1 default 3e-4)")
    l1_delta: float = Field(0.5, description="l1_max: delta (L1 default 0.5)")

    @model_validator(mode="after")
    def _overlong_buffer(self) -> "LengthShapingParams":
        # The buffer starts at L_max - L_cache >= 0 (verl asserts max_resp_len >= overlong_buffer_len); without the
        # cap, the linear penalty's slope is 1 / L_cache, so L_cache 0 would give -inf rewards beyond L_max.
        if self.mode != "dapo":  # only dapo reads the buffer (cosine's L_max may be shorter than its default)
            return self
        if self.cache_length > self.max_length:
            raise ValueError(f"cache_length ({self.cache_length}) must not exceed max_length ({self.max_length})")
        if self.cache_length == 0 and not self.overlong_cap:
            raise ValueError("cache_length 0 with overlong_cap false continues a penalty of slope 1/0 beyond "
                             "max_length (-inf rewards); set overlong_cap true (hard -1) or cache_length > 0")
        return self


@dataclass
class ShapingContext:
    lengths: torch.Tensor  # (N,) completion token counts, float64
    correct: torch.Tensor  # (N,) bool
    task: torch.Tensor  # (N,) weighted contribution of the correctness column (NaN -> 0)
    column: Callable[[], torch.Tensor]  # lazily gathers the dataset column budget_column, (N,) float64
    group_size: int
    step: int
    params: LengthShapingParams
    truncated: torch.Tensor | None = None  # (N,) bool: the completion filled args.max_completion_length


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
    "dapo": Mode(lambda c: formulas.dapo_overlong_penalty(c.lengths, c.params.max_length, c.params.cache_length,
                                                          c.params.overlong_cap, c.params.overlong_penalty_factor),
                 replaces=False, needs_correctness=False),
    "cosine": Mode(lambda c: formulas.cosine_length_reward(
        c.lengths, c.correct, c.params.max_length, c.params.cosine_correct, c.params.cosine_wrong,
        c.params.cosine_exceed, c.params.cosine_beyond_max, c.truncated), replaces=True, needs_correctness=True),
    "budget": Mode(lambda c: formulas.budget_reward(c.lengths, c.task, c.column(), c.params.tau),
                   replaces=True, needs_correctness=True),
    "l1_exact": Mode(lambda c: formulas.l1_exact_reward(c.lengths, c.correct, c.column(), c.params.l1_alpha),
                     replaces=True, needs_correctness=True),
    "l1_max": Mode(lambda c: formulas.l1_max_reward(c.lengths, c.correct, c.column(), c.params.l1_alpha,
                                                    c.params.l1_delta), replaces=True, needs_correctness=True),
    "none": Mode(lambda c: torch.zeros_like(c.lengths), replaces=False, needs_correctness=False),
}


def shape_length_column(rewards_per_func: torch.Tensor, names: list[str], weights: torch.Tensor, own: str,
                        lengths: torch.Tensor, group_size: int, params: LengthShapingParams,
                        column: Callable[[], torch.Tensor], step: int = 0,
                        penalties: torch.Tensor | None = None, truncated: torch.Tensor | None = None) -> torch.Tensor:
    """Fill column ``own`` of ``rewards_per_func`` with the shaping value (pure: returns a new tensor).

    Additive modes write their term. Replacing modes write (R - w_c * c) / w_own, so that the weighted total equals
    what the formula prescribes (R in place of the correctness contribution w_c * c) while the correctness column
    itself, and its logged metric, stay untouched. ``penalties`` ``(N,)`` (the stop penalties) add to the weighted
    total in every mode (written as penalties / w_own).
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
    ctx = ShapingContext(lengths.to(torch.float64).cpu(), correct.cpu(), task.cpu(), column, group_size, step, params,
                         None if truncated is None else truncated.cpu())
    value = mode.term(ctx)
    if mode.replaces:
        value = (value - ctx.task) / w_own
    if penalties is not None:
        value = value + penalties.to(torch.float64).cpu() / w_own
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
    * ``none`` - no length rule, only the stop penalties below.

    Switches where papers and frameworks differ (defaults first): ``overlong_cap`` true (DAPO paper, -1 beyond L_max)
    / false (verl ``DAPORewardManager``: the linear penalty continues), with ``overlong_penalty_factor`` 1 (verl's
    ``penalty_factor``); ``cosine_beyond_max`` exceed (the paper's text: ``cosine_exceed`` when L > L_max) / clamp
    (L clamped to L_max) / extend (the cosine continued, open-r1) / truncated (also ``cosine_exceed`` for a completion
    that fills ``args.max_completion_length``, as the paper's released code scores a generation that reaches its
    budget; with the default exceed and L_max = max_completion_length, a cut wrong answer scores r_L = 0, the best
    wrong-answer reward); ``length_tokens`` all (every completion token, tool and observation tokens
    of a multi-turn completion included, as verl's response length) / model (the model's own tokens only, as TRL's
    completion-length metric). Stop penalties, in any mode and off by default: ``truncation_penalty`` is added when a
    completion fills ``args.max_completion_length`` (full length, whatever ``length_tokens`` says) and
    ``no_stop_penalty`` when its last token is not an EOS token (TRL's ``mask_truncated_completions`` test: also stop
    strings, tool-call limits); a completion cut at the limit gets both. Each changes the weighted total reward by
    exactly its value (written into the column divided by ``weight``).

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
        if self.params.mode == "none" and not (self.params.truncation_penalty or self.params.no_stop_penalty):
            return ["length_shaping.mode: none shapes nothing unless truncation_penalty or no_stop_penalty is set"]
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

        p, trainer = self.params, batch.trainer
        step = int(trainer.state.global_step) if trainer is not None and hasattr(trainer, "state") else 0
        lengths = batch.completion_lengths
        if p.length_tokens == "model" and batch.tool_mask is not None:
            model_tokens = (batch.completion_mask * batch.tool_mask).sum(-1)
            lengths = torch.tensor(gather_object(model_tokens.tolist()), dtype=torch.float64)
        penalties = None
        if p.truncation_penalty or p.no_stop_penalty:
            eos = getattr(trainer, "eos_token_ids", None) or [trainer.processing_class.eos_token_id]
            stopped = torch.tensor(gather_object(ends_with(batch.completion_ids, batch.completion_mask, eos).tolist()))
            penalties = formulas.stop_penalties(batch.completion_lengths, stopped, trainer.args.max_completion_length,
                                                p.truncation_penalty, p.no_stop_penalty)
        budget = getattr(getattr(trainer, "args", None), "max_completion_length", None)
        truncated = None if budget is None else batch.completion_lengths >= budget  # full length, as the penalty
        return shape_length_column(rewards_per_func, batch.reward_names, batch.reward_weights, self.name,
                                   lengths, batch.num_generations, p, column, step, penalties, truncated)
