"""``rloo``: leave-one-out baseline on the GRPO machinery."""

from __future__ import annotations

from pydantic import Field

from trl_ext import Plugin, Slot, hookimpl
from trl_ext_plugins.advantages.math import rloo_advantages, sequence_kl_rewards
from trl_ext_plugins.advantages.rollout import (
    RewardKLHooks,
    RewardKLParams,
    gathered,
    kept_rewards,
    local,
    reward_kl,
)


class RLOOParams(RewardKLParams):
    normalize: bool = Field(False, description="Normalise advantages over the global batch afterwards, like TRL's "
                            "RLOOConfig.normalize_advantages: (A - mean) / (std + 1e-4), unbiased std, scorable rows.")
    kl_coef: float = Field(0.0, ge=0.0, description="beta of the sequence-level KL folded into the reward before the "
                           "leave-one-out baseline, R - beta * sum_t KL_t (TRL RLOOConfig.beta, 0.05 there; 0: off, "
                           "as before).")
    kl_in_loss: bool = Field(False, description="With kl_coef > 0: false (TRL RLOOTrainer) keeps the KL only in the "
                             "reward (no loss term; args.beta is set to 1.0 when the recipe leaves it 0, only so TRL "
                             "computes the reference); true also keeps the recipe's args.beta k3 loss term.")


def _num_generations(args: dict, key: str, default: int | None) -> int | None:
    value = args.get(key, default)
    return default if value is None else int(value)


class RLOO(RewardKLHooks, Plugin):
    """RLOO, REINFORCE leave-one-out (Kool et al. 2019; Ahmadian et al. 2024, arXiv 2402.14740).

    ``A_k = R_k - (1/(K-1)) * sum_{j != k} R_j = K/(K-1) * (R_k - mean_j R_j)`` per prompt, one value per sequence
    broadcast to its tokens, on top of whichever policy objective the stage selects (TRL's default or a loss plugin).

    Conventions: the estimator is TRL ``RLOOTrainer``'s (parity tested): unscorable rows (every reward function
    returned ``None``) are left out of their siblings' baselines and get advantage 0; a group with one scorable row
    gives it 0; rows ``trl_ext_filter_groups`` dropped count as unscorable (out of ``normalize``'s batch mean and
    std). ``normalize`` reproduces ``RLOOConfig.normalize_advantages`` (default off, as in TRL). Unlike TRL's
    RLOOTrainer, by default no KL is folded into the reward here: the GRPO trainer's ``args.beta`` adds k3 KL to the
    loss instead (TRL RLOO: beta 0.05, sequence-level k1 in the reward). K = ``args.num_generations`` must be >= 2
    (refused at validation); the paper used K = 2 or 4, TRL RLOOConfig defaults to 2.

    KL in the reward (off by default, ``kl_coef: 0``): ``R' = R - kl_coef * sum_t KL_t`` over the loss tokens (tool
    tokens excluded), ``KL_t`` from ``log pi_old - log pi_ref`` (``kl_estimator`` k1 default = TRL RLOOTrainer and the
    RLOO paper; k2, k3 = verl's ``mse``/``low_var_kl``; optional ``kl_clamp``, verl 10), then the leave-one-out
    baseline on ``R'`` (TRL RLOOTrainer and verl's RLOO both sum the token KL per sequence). ``kl_coef: 0.05`` with the
    defaults reproduces TRL RLOOTrainer's ``beta: 0.05``. Unscorable rows stay unscorable. Logged: ``rloo/kl``.
    """

    name = "rloo"
    family = "advantage"
    trainers = frozenset({"grpo"})
    slots = frozenset({Slot.ADVANTAGE})
    Params = RLOOParams

    def __init__(self, params=None):
        super().__init__(params)
        self.needs = self._reward_kl_needs()

    @hookimpl
    def trl_ext_validate_stage(self, stage, plugins):
        from trl import GRPOConfig

        errors = []
        for key, default in (("num_generations", GRPOConfig.num_generations), ("num_generations_eval", None)):
            value = _num_generations(stage.args, key, default)
            if value is not None and value < 2:
                errors.append(f"plugin 'rloo': args.{key} must be >= 2 for a leave-one-out baseline "
                              f"(got {value}); with one sample per prompt there is no other sample to average")
        return errors

    @hookimpl
    def trl_ext_compute_advantages(self, rewards, batch):
        p = self.params
        rewards = kept_rewards(rewards, batch)  # filtered rows stay out of normalize's batch mean and std
        if p.kl_coef > 0:
            kl = reward_kl(batch, p.kl_estimator, p.kl_clamp, "rloo/kl")
            rewards = sequence_kl_rewards(rewards, gathered(kl.sum(-1), batch), p.kl_coef)
        return local(rloo_advantages(rewards, batch.num_generations, p.normalize), batch)
