"""The base class every selectable trl-ext plugin derives from.

A plugin is a class with class-level metadata (name, family, exclusive slots, needs, parameter schema) and
``@hookimpl`` methods from :mod:`trl_ext.hookspecs`. The host instantiates it once per stage with validated
parameters; the instance is what pluggy calls.
"""

from __future__ import annotations

import inspect
from enum import Enum
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict


class Need(str, Enum):
    """Something a plugin requires from the stage; checked before any model loads."""

    REFERENCE = "reference"  # reference-policy log-probs (GRPO: args.beta != 0; DPO/KTO: a reference model)
    SAMPLING_LOGPROBS = "sampling_logprobs"  # per-token log-probs recorded by the rollout engine
    OLD_POLICY_LOGPROBS = "old_policy_logprobs"  # a forward pass of the sampling-time trainer policy
    TEACHER = "teacher"  # stage.teacher (or stage.teachers)
    VALUE_MODEL = "value_model"  # a critic
    MOE_MODEL = "moe_model"  # the policy is a mixture-of-experts model
    JUDGE = "judge"  # a judge model or endpoint
    REWARD_MODEL = "reward_model"  # a trained reward model


class Slot(str, Enum):
    """Exclusive slots: at most one selected plugin per stage may fill each."""

    OBJECTIVE = "objective"  # trl_ext_policy_loss
    AGGREGATION = "aggregation"  # trl_ext_aggregate_loss
    ADVANTAGE = "advantage"  # trl_ext_compute_advantages
    GENERATION = "generation"  # trl_ext_generate
    PREFERENCE_LOSS = "preference_loss"  # trl_ext_preference_loss
    REFILL = "refill"  # trl_ext_refill_groups
    TRAIN_SAMPLER = "train_sampler"  # trl_ext_train_sampler


# Which hook fills which slot; a plugin implementing one of these hooks must declare the slot.
SLOT_OF_HOOK = {
    "trl_ext_policy_loss": Slot.OBJECTIVE,
    "trl_ext_aggregate_loss": Slot.AGGREGATION,
    "trl_ext_compute_advantages": Slot.ADVANTAGE,
    "trl_ext_generate": Slot.GENERATION,
    "trl_ext_preference_loss": Slot.PREFERENCE_LOSS,
    "trl_ext_refill_groups": Slot.REFILL,
    "trl_ext_train_sampler": Slot.TRAIN_SAMPLER,
}


class NoParams(BaseModel):
    """Parameter schema of a plugin that takes no parameters."""

    model_config = ConfigDict(extra="forbid")


class PluginParams(BaseModel):
    """Base for plugin parameter schemas: unknown keys are errors, values are validated on assignment."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, frozen=True)


class Plugin:
    """Base class of selectable plugins.

    Subclasses set:

    * ``name`` (canonical, as in ALGORITHMS.md) and optional ``aliases``;
    * ``family`` (``"loss"``, ``"correction"``, ``"advantage"``, ``"reward"``, ``"preference"``, ``"trainer"``, ...);
    * ``trainers``: the trainer names the plugin works with (empty: any);
    * ``slots``: exclusive slots it fills (see :data:`SLOT_OF_HOOK`);
    * ``needs``: what the stage must provide; ``provides``: needs it satisfies for other plugins;
    * ``Params``: a :class:`PluginParams` subclass (defaults documented in its field descriptions).

    The class docstring is the plugin's documentation: it names the paper (arXiv id), defaults and conventions.
    """

    name: ClassVar[str]
    aliases: ClassVar[tuple[str, ...]] = ()
    family: ClassVar[str] = "misc"
    trainers: ClassVar[frozenset[str]] = frozenset()
    slots: ClassVar[frozenset[Slot]] = frozenset()
    needs: ClassVar[frozenset[Need]] = frozenset()
    provides: ClassVar[frozenset[Need]] = frozenset()
    # Optional third-party packages the plugin imports at run time, as (import name, pip requirement) pairs; a
    # missing one is a validation error naming the plugin, before any model loads.
    requires: ClassVar[tuple[tuple[str, str], ...]] = ()
    Params: ClassVar[type[BaseModel]] = NoParams

    def __init__(self, params: BaseModel | None = None):
        self.params = params if params is not None else self.Params()

    @classmethod
    def description(cls) -> str:
        """First paragraph of the class docstring."""
        doc = inspect.getdoc(cls) or ""
        return doc.split("\n\n")[0].replace("\n", " ").strip()

    @classmethod
    def implemented_hooks(cls) -> list[str]:
        """Names of the ``trl_ext_*`` hooks this class implements."""
        return sorted(n for n in dir(cls) if n.startswith("trl_ext_") and callable(getattr(cls, n)))

    @classmethod
    def parameter_table(cls) -> list[dict[str, Any]]:
        """Parameters with type, default and description, for ``trl-ext plugins show``."""
        rows = []
        for field_name, info in cls.Params.model_fields.items():
            default = None if info.is_required() else info.get_default(call_default_factory=True)
            rows.append(
                {
                    "name": field_name,
                    "type": getattr(info.annotation, "__name__", str(info.annotation)),
                    "default": default,
                    "required": info.is_required(),
                    "description": info.description or "",
                }
            )
        return rows

    def __repr__(self) -> str:
        return f"<plugin {self.name} {self.params!r}>"
