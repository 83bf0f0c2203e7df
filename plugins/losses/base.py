"""Shared shape of the objective plugins: one exclusive ``objective`` slot and the TRL fields each one pins."""

from __future__ import annotations

from typing import Any, ClassVar

from trl_ext import Plugin, Slot, hookimpl


class ObjectivePlugin(Plugin):
    """Base for per-token policy objectives on the GRPO trainer.

    An objective fills only the ``objective`` slot; the aggregation stays selectable on its own (plugin
    ``aggregation``). When none is selected the trainer aggregates as TRL does for ``args.loss_type``, so each
    objective pins, through ``trl_args``, the ``loss_type`` whose aggregation its paper uses (and any other TRL field
    its paper fixes). A recipe that sets one of these fields to another value is refused, naming field and plugin.

    Every objective also pins ``args.importance_sampling_level`` (default ``token``): an objective forms its own ratio,
    so TRL's ``sequence`` level (GSPO) would otherwise be silently ignored by the loss while still changing the ratio
    of the KL bias correction. ``gspo`` sets ``sequence`` itself.
    """

    family = "loss"
    trainers = frozenset({"grpo"})
    slots = frozenset({Slot.OBJECTIVE})
    trl_args: ClassVar[dict[str, Any]] = {}
    # True for the per-token PPO clip min(r A, clip(r, 1-eps_low, 1+eps_high) A) with args.epsilon/epsilon_high as
    # deviations, where a clipped token has zero gradient (what m2po's scope ppo_active assumes).
    token_ppo_clip: ClassVar[bool] = False

    def extra_trl_args(self) -> dict[str, Any]:
        """TRL fields that depend on this instance's parameters (override where needed)."""
        return {}

    @hookimpl
    def trl_ext_configure_args(self, trainer, args):
        return {"importance_sampling_level": "token", **self.trl_args, **self.extra_trl_args()}


def off_policy_reason(num_iterations: int, steps_per_generation: int, accumulation: int) -> str | None:
    """Why TRL's batch schedule trains on batches not sampled by the current weights, or None when it is on-policy.

    A batch is reused (``num_iterations > 1``), or one generation batch spans several optimizer steps
    (``steps_per_generation > gradient_accumulation_steps``, also when ``generation_batch_size`` implies it): the
    micro-batches after the first optimizer step were sampled by an older policy (TRL then recomputes pi_old)."""
    if num_iterations > 1:
        return f"args.num_iterations {num_iterations} reuses each batch"
    if steps_per_generation > accumulation:
        return (f"args.steps_per_generation {steps_per_generation} > gradient_accumulation_steps {accumulation} (set "
                f"directly or through generation_batch_size) trains one generation batch over several optimizer steps")
    return None


def recipe_off_policy_reason(args: dict[str, Any]) -> str | None:
    """:func:`off_policy_reason` of a recipe's ``args`` (TRL's defaults where unset: one generation batch per
    optimizer step)."""
    accumulation = args.get("gradient_accumulation_steps", 1)
    return off_policy_reason(args.get("num_iterations", 1), args.get("steps_per_generation") or accumulation,
                             accumulation)


def trainer_off_policy_reason(args) -> str | None:
    """:func:`off_policy_reason` of a built trainer's arguments, where ``generation_batch_size`` is resolved."""
    return off_policy_reason(args.num_iterations, args.steps_per_generation, args.gradient_accumulation_steps)
