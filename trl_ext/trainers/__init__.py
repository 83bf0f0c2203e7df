"""The trainer table: recipe trainer names -> TRL config class, trl-ext subclass, and how to build it.

A table, not an if/elif chain: each :class:`TrainerKind` knows its config class, its constructor call and what it can
provide to plugins (its capabilities). TRL internals each subclass depends on are listed in its module docstring; the
TRL pin in pyproject.toml (``trl>=1.16,<1.17``) is the range these were checked against.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from trl import DistillationConfig, DPOConfig, GRPOConfig, KTOConfig, RewardConfig, RLOOConfig, SFTConfig

from trl_ext.plugin import Need
from trl_ext.trainers.merge import MergeConfig
from trl_ext.trainers.mtp import MtpConfig
from trl_ext.trainers.prm import PRMConfig


@dataclass
class BuildContext:
    """Everything needed to construct a trainer for one stage (models as paths, datasets loaded)."""

    model: str
    ref_model: str | None
    teacher: str | None
    config: Any
    train_dataset: Any
    eval_dataset: Any
    tokenizer: Any
    peft_config: Any
    callbacks: list
    host: Any
    reward_funcs: list
    reward_weights: list[float]
    # Plugins' extra constructor arguments (``trl_ext_trainer_kwargs``, merged by :func:`plugin_trainer_kwargs`).
    trainer_kwargs: dict[str, Any] = field(default_factory=dict)


def plugin_trainer_kwargs(host, stage, tokenizer) -> dict[str, Any]:
    """Every plugin's ``trl_ext_trainer_kwargs``, merged; one argument from two plugins is an error naming both."""
    merged: dict[str, Any] = {}
    given_by: dict[str, str] = {}
    for impl in reversed(host.pm.hook.trl_ext_trainer_kwargs.get_hookimpls()):  # recipe order
        for key, value in (impl.function(stage=stage, tokenizer=tokenizer) or {}).items():
            if key in given_by:
                raise ValueError(f"plugins {given_by[key]!r} and {impl.plugin.name!r} both pass the trainer argument "
                                 f"{key!r}")
            merged[key], given_by[key] = value, impl.plugin.name
    return merged


def _common(ctx: BuildContext) -> dict[str, Any]:
    return dict(args=ctx.config, train_dataset=ctx.train_dataset, eval_dataset=ctx.eval_dataset,
                processing_class=ctx.tokenizer, callbacks=ctx.callbacks, peft_config=ctx.peft_config,
                plugin_host=ctx.host, **ctx.trainer_kwargs)


def _load_ref(path: str | None):
    if path is None:
        return None
    from trl.trainer.utils import create_model_from_path

    return create_model_from_path(path)


def _build_sft(ctx):
    from trl_ext.trainers.sft import ExtSFTTrainer

    return ExtSFTTrainer(model=ctx.model, **_common(ctx))


def _build_grpo(ctx):
    from trl_ext.trainers.grpo import ExtGRPOTrainer

    return ExtGRPOTrainer(model=ctx.model, reward_funcs=ctx.reward_funcs, **_common(ctx))


def _build_rloo(ctx):
    from trl_ext.trainers.others import ExtRLOOTrainer

    return ExtRLOOTrainer(model=ctx.model, reward_funcs=ctx.reward_funcs, **_common(ctx))


def _build_dpo(ctx):
    from trl_ext.trainers.dpo import ExtDPOTrainer

    return ExtDPOTrainer(model=ctx.model, ref_model=_load_ref(ctx.ref_model), **_common(ctx))


def _build_kto(ctx):
    from trl_ext.trainers.dpo import ExtKTOTrainer

    return ExtKTOTrainer(model=ctx.model, ref_model=_load_ref(ctx.ref_model), **_common(ctx))


def _build_reward(ctx):
    from trl_ext.trainers.others import ExtRewardTrainer

    return ExtRewardTrainer(model=ctx.model, **_common(ctx))


def _build_prm(ctx):
    from trl_ext.trainers.prm import ExtPRMTrainer

    return ExtPRMTrainer(model=ctx.model, **_common(ctx))


def _build_merge(ctx):
    from trl_ext.trainers.merge import ExtMergeTrainer

    return ExtMergeTrainer(model=ctx.model, args=ctx.config, processing_class=ctx.tokenizer, plugin_host=ctx.host)


def _check_merge(host, stage, args, where):
    from trl_ext.trainers.merge import check_stage

    return check_stage(host, stage, args, where)


def _build_mtp(ctx):
    from trl_ext.trainers.mtp import ExtMtpTrainer

    return ExtMtpTrainer(model=ctx.model, **_common(ctx))


def _check_mtp(host, stage, args, where):
    from trl_ext.trainers.mtp import check_stage

    return check_stage(stage, args, where)


def _build_distillation(ctx):
    from trl_ext.trainers.others import ExtDistillationTrainer

    return ExtDistillationTrainer(model=ctx.model, teacher_model=ctx.teacher, **_common(ctx))


def _rl_capabilities(stage, args: dict[str, Any], default_beta: float) -> set[Need]:
    caps = {Need.OLD_POLICY_LOGPROBS}
    if args.get("beta", default_beta) != 0:
        caps.add(Need.REFERENCE)
    if args.get("use_vllm", False):
        caps.add(Need.SAMPLING_LOGPROBS)
    return caps


def _no_checks(host, stage, args: dict[str, Any], where: str) -> list[str]:
    return []


def _check_sft(host, stage, args, where):
    from trl_ext.trainers.sft import check_stage

    return check_stage(host, stage, args, where)


def _check_grpo(host, stage, args, where):
    from trl_ext.trainers.grpo import check_stage

    return check_stage(host, stage, args, where)


def _check_dpo(host, stage, args, where):
    from trl_ext.trainers.dpo import check_dpo_stage

    return check_dpo_stage(host, stage, args, where)


@dataclass(frozen=True)
class TrainerKind:
    """One recipe trainer name. Everything trainer-specific the core needs lives here, so adding a trainer kind touches
    this package only."""

    name: str
    config_cls: type
    build: Callable[[BuildContext], Any]
    capabilities: Callable[[Any, dict[str, Any]], set[Need]]
    uses_rewards: bool = False  # RL trainers take reward functions from plugins
    reads_ref_model: bool = False  # `ref_model:` is meaningful for this trainer
    reads_teacher: bool = False
    # The trainer's own validation: (host, stage spec, merged args, field path prefix) -> one message per problem.
    check: Callable[[Any, Any, dict[str, Any], str], list[str]] = _no_checks
    # Dataset columns the trainer reads: any one of these column sets must be present (checked for local files
    # before loading, when no plugin prepares the dataset); empty = not checked.
    columns: tuple[frozenset[str], ...] = ()
    reads_dataset: bool = True  # False: the stage builds its model from other models (merge) and takes no `dataset:`


def _teacher_caps(stage, args):
    return {Need.TEACHER} if stage.teacher else set()


TRAINER_KINDS: dict[str, TrainerKind] = {
    kind.name: kind
    for kind in [
        TrainerKind("sft", SFTConfig, _build_sft, lambda s, a: set(), check=_check_sft,
                    columns=(frozenset({"text"}), frozenset({"messages"}), frozenset({"prompt", "completion"}))),
        TrainerKind("grpo", GRPOConfig, _build_grpo, lambda s, a: _rl_capabilities(s, a, 0.0) | _teacher_caps(s, a),
                    uses_rewards=True, check=_check_grpo, columns=(frozenset({"prompt"}),)),
        TrainerKind("rloo", RLOOConfig, _build_rloo, lambda s, a: _rl_capabilities(s, a, 0.05), uses_rewards=True,
                    columns=(frozenset({"prompt"}),)),
        TrainerKind("dpo", DPOConfig, _build_dpo, lambda s, a: {Need.REFERENCE}, reads_ref_model=True,
                    check=_check_dpo, columns=(frozenset({"chosen", "rejected"}),)),
        TrainerKind("kto", KTOConfig, _build_kto, lambda s, a: {Need.REFERENCE}, reads_ref_model=True,
                    columns=(frozenset({"prompt", "completion", "label"}),)),
        TrainerKind("reward", RewardConfig, _build_reward, lambda s, a: set(),
                    columns=(frozenset({"chosen", "rejected"}),)),
        TrainerKind("prm", PRMConfig, _build_prm, lambda s, a: set(),
                    columns=(frozenset({"prompt", "completions", "labels"}),)),
        TrainerKind("distillation", DistillationConfig, _build_distillation, _teacher_caps, reads_teacher=True),
        TrainerKind("merge", MergeConfig, _build_merge, lambda s, a: set(), check=_check_merge,
                    reads_dataset=False),  # plugins merge
        TrainerKind("mtp", MtpConfig, _build_mtp, lambda s, a: set(), check=_check_mtp,
                    columns=(frozenset({"prompt", "completion"}), frozenset({"prompt_ids", "completion_ids"}))),
    ]
}


def stage_arg(args: dict[str, Any], trainer: str, name: str) -> Any:
    """A TRL config field as a stage will run with it: the recipe's value, else the trainer config's own default
    (GRPOConfig draws 8 generations per prompt, RLOOConfig 2)."""
    import dataclasses

    if args.get(name) is not None:
        return args[name]
    fields = {f.name: f.default for f in dataclasses.fields(TRAINER_KINDS[trainer].config_cls)}
    return fields.get(name)
