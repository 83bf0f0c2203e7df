"""``warm``: weight-averaged reward models (WARM) used as one reward."""

from __future__ import annotations

from pydantic import Field, field_validator

from trl_ext import Plugin, PluginParams, hookimpl
from trl_ext.rewards import RewardFunction
from trl_ext_plugins.merge.math import average_state_dicts
from trl_ext_plugins.rewards.scoring import (
    LazyScorer,
    check_same_architecture,
    load_sequence_classifier,
    resolve_ref,
)


class WarmParams(PluginParams):
    paths: list[str] = Field(description="the M reward models to average: `stage:<name>`, `embedded:<name>` or "
                             "folders; fine-tuned from one initialisation (same architecture and shapes)")
    coefficients: list[float] | None = Field(None, description="averaging weights (normalised to sum 1); None: "
                                             "uniform 1/M as in WARM")
    weight: float = Field(1.0, description="weight of this reward in the weighted sum of reward functions")
    batch_size: int = Field(32, gt=0, description="texts per reward-model forward pass")
    max_length: int | None = Field(None, gt=0, description="truncate scored texts to this many tokens (from the left)")
    append_eos: bool = Field(True, description="append eos before scoring, as RewardTrainer does in training")

    @field_validator("paths")
    @classmethod
    def _non_empty(cls, value):
        if not value:
            raise ValueError("give at least one reward model")
        return value


def load_warm(refs: list[str], run_dir, coefficients: list[float] | None = None):
    """Load the models, refuse mismatched architectures (naming both models), average in weight space.

    Returns the first model with the averaged weights loaded, and the first model's tokenizer.
    """
    if coefficients is not None and len(coefficients) != len(refs):
        raise ValueError(f"warm: {len(coefficients)} coefficients for {len(refs)} models")
    loaded = [load_sequence_classifier(resolve_ref(ref, run_dir)) for ref in refs]
    models = [m for m, _ in loaded]
    check_same_architecture(models, refs)
    merged = models[0]
    merged.load_state_dict(average_state_dicts([m.state_dict() for m in models], coefficients))
    return merged, loaded[0][1]


class Warm(Plugin):
    """WARM, weight-averaged reward models (Ramé et al., ICML 2024, arXiv 2401.12187).

    phi_WARM = sum_i c_i phi_i with uniform c_i = 1/M by default: every floating-point tensor of the M reward models
    is averaged (in float64, cast back to the models' dtype), and the single averaged model scores completions like
    ``reward_model`` does (``r(prompt + completion + eos)``, batched, frozen). The average is taken in *weight* space
    (one forward pass of the merged model), not over the M models' scores: for deep nets the two differ, and weight
    averaging is what WARM relies on (linear mode connectivity of models fine-tuned from one initialisation).

    Models that do not share an architecture (class, config type, num_labels, parameter names or shapes) are refused
    with an error naming both models. That the models share an *initialisation* cannot be checked from the weights;
    it is the user's responsibility (WARM's premise). M = 1 is the single model. Integer buffers are copied from the
    first model. Paths accept ``stage:<name>`` (e.g. several ``reward`` stages with different seeds or learning rates),
    ``embedded:<name>`` and folders; loading happens at the first scoring call.
    """

    name = "warm"
    family = "reward"
    trainers = frozenset({"grpo", "rloo"})
    Params = WarmParams

    def __init__(self, params=None):
        super().__init__(params)
        p = self.params
        self.scorer = LazyScorer(lambda run_dir: load_warm(p.paths, run_dir, p.coefficients), p.batch_size,
                                 p.max_length, p.append_eos)

    @hookimpl
    def trl_ext_validate_stage(self, stage, plugins):
        p = self.params
        if p.coefficients is not None and len(p.coefficients) != len(p.paths):
            return [f"plugin 'warm': params.coefficients has {len(p.coefficients)} values for {len(p.paths)} paths"]
        return None

    @hookimpl
    def trl_ext_reward_functions(self, stage):
        return [RewardFunction("warm", self.scorer, self.params.weight)]

    @hookimpl
    def trl_ext_trainer_created(self, trainer):
        self.scorer.bind(trainer)
