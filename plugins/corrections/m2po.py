"""``m2po``: second-moment masking of importance weights under high staleness."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from trl_ext import Plugin, PluginParams, Slot, hookimpl, ops
from trl_ext import metrics as figures
from trl_ext.batches import TokenWeights
from trl_ext_plugins.corrections import math


class M2POParams(PluginParams):
    threshold: float = Field(0.04, gt=0, description="tau_M2: largest allowed mean of (log r)^2 over kept tokens.")
    scope: Literal["all", "ppo_active"] = Field(
        "all", description="Tokens the second moment is taken over and masked among. all: every loss token (the "
        "paper, AReaL). ppo_active: only the tokens the PPO clip leaves active (ratio pi_theta/pi_old inside the "
        "clip on the side of the advantage's sign, args.epsilon/epsilon_high); clipped tokens, whose gradient the clip "
        "already removes, are never masked and do not count in M2.")
    policy: Literal["current", "old"] = Field(
        "current", description="The policy r compares with the behaviour policy: current (pi_theta, detached; the "
        "paper's r) or old (pi_old, the policy that started the step: AReaL's proximal policy). They differ only once "
        "pi_theta has moved within a generation batch (num_iterations > 1, or steps_per_generation > "
        "gradient_accumulation_steps).")


class M2PO(Plugin):
    """M2PO (Zheng, Zhao, Chen 2025, "Prosperity before Collapse", arXiv 2510.01161).

    ``M2 = (1/N) sum (log r)^2`` with ``r = pi_theta / pi_behaviour`` (``policy: old``: ``pi_old / pi_behaviour``,
    AReaL's proximal policy, the same until pi_theta moves within a generation batch) over the micro-batch's loss
    tokens; the tokens with
    the largest (log r)^2 are masked until the mean of the rest is <= tau_M2 (default 0.04, AReaL's ``m2_threshold``).
    pi_behaviour is the rollout engine's log-probs when recorded (vLLM or ``rollout_logprobs``), else pi_old. The mask
    removes tokens from the loss *and* from the aggregation denominator (convention 8; AReaL masks the loss mask).
    Conventions: the second moment is taken per micro-batch on this rank, not over the global batch; the paper's
    objective ``M * r * A`` without PPO clipping is obtained with an objective such as ``cispo`` or ``grpo`` with a wide
    clip, since this plugin only masks. AReaL's M2PO recipe (``gsm8k_m2po.yaml``) sets ``eps_clip: 0``, the narrowest
    clip (r clamped to [1, 1]), not a wide one: ``args.epsilon: 0`` and ``args.epsilon_high: 0`` reproduce it
    (checked against AReaL's loss, gradient included).
    ``scope`` (default ``all``, the paper's): ``ppo_active`` restricts both the statistic and the masking to the tokens
    the PPO clip leaves active (not ``A > 0, r > 1 + eps_high`` nor ``A < 0, r < 1 - eps_low``, ``r = pi_theta /
    pi_old``; issue 10's variant for clipped objectives): the M2 budget is then spent only on tokens that still move
    the policy. It is refused unless the objective is that clip (``grpo``, ``dr_grpo``, ``dapo``, ``clip_higher``, or
    no objective plugin with a PPO-clip ``loss_type`` at token level): with GSPO's sequence clip, GMPO's log-space
    bounds, CE-GPPO's kept gradients or an unclipped objective (CISPO, SAPO, REINFORCE, rollout_ratio) the per-token
    test would leave exactly the outlier tokens that still have a gradient out of the statistic and unmasked.
    """

    name = "m2po"
    family = "correction"
    trainers = frozenset({"grpo"})
    Params = M2POParams

    @hookimpl
    def trl_ext_validate_stage(self, stage, plugins):
        if self.params.scope != "ppo_active":
            return None
        objectives = [p for p in plugins if Slot.OBJECTIVE in p.slots]
        if objectives:
            bad = [repr(p.name) for p in objectives if not getattr(p, "token_ppo_clip", False)]
        else:
            loss_type = stage.args.get("loss_type", "dapo")
            token = stage.args.get("importance_sampling_level", "token") == "token"
            bad = [] if loss_type in ops.PPO_CLIP_LOSS_TYPES and token else [f"loss_type {loss_type!r}" + (
                "" if token else " at importance_sampling_level 'sequence'")]
        return [f"plugins.{self.name}.scope: 'ppo_active' assumes the per-token PPO clip (grpo, dr_grpo, dapo, "
                f"clip_higher), but the objective is {name}; use scope 'all'" for name in bad] or None

    @hookimpl
    def trl_ext_token_weights(self, inputs):
        behaviour = inputs.sampling_per_token_logps
        if behaviour is None:
            behaviour = inputs.old_per_token_logps
        policy = inputs.per_token_logps.detach() if self.params.policy == "current" else inputs.old_per_token_logps
        log_ratio = math.masked_log_ratio(policy, behaviour, inputs.mask)
        valid = inputs.mask.bool()
        scope = valid
        if self.params.scope == "ppo_active":
            scope = valid & math.ppo_clip_active(inputs.log_ratio, inputs.advantages, inputs.epsilon_low,
                                                 inputs.epsilon_high)
        keep = math.m2_keep_mask(log_ratio, scope.to(inputs.mask.dtype), self.params.threshold) | (valid & ~scope)
        # token means over every rank's tokens (figure parts the trainer reduces; every rank emits both keys)
        inputs.metrics[f"{self.name}/second_moment"] = figures.masked_mean(log_ratio.detach() ** 2, scope)
        inputs.metrics[f"{self.name}/changed_fraction"] = figures.mean((~keep & valid).sum(), valid.sum())
        return TokenWeights(mask=keep)
