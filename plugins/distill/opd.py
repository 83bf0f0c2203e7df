"""On-policy distillation through the GRPO machinery: ``opd_reward``, ``multi_teacher_opd`` and ``stage_teachers``.

All three fill the ``advantage`` slot with per-token advantages ``(B, T)``::

    A_t = w_route(x) * coef * sg[log p_T(x)(y_t | x, y_<t) - log p_theta(y_t | x, y_<t)]  +  alpha * A_task(x, y)

and leave the objective, token weights (tis, mis, icepop, rollout_ratio, m2po ...), clipping and aggregation to the
stage's other plugins and TRL, so every correction composes with them. Conventions:

* ``log p_theta`` is the policy that sampled the batch as the trainer computes it (``old_per_token_logps``; one
  no-grad forward when TRL did not record them), at the trainer's temperature; the teacher is scored at the same
  temperature, so a teacher identical to the student gives A = 0 exactly.
* The teacher scores only the sampled tokens: one teacher forward per batch with TRL's fused LM head (see
  :mod:`trl_ext_plugins.distill.teachers`), never ``[batch, tokens, vocabulary]`` logits; or, for a teacher served
  by vLLM (``vllm:<url>``), one request per batch returning the sampled tokens' log-probabilities.
* ``A_task`` is TRL GRPO's reward advantage under the run's ``args.scale_rewards``: ``(r - group mean) / (std +
  1e-4)`` with the group's std (``group``, the default) or the whole batch's (``batch``), or no division (``none``),
  broadcast to every token; ``alpha = 0`` (default) is pure distillation, which needs no reward signal (a reward
  plugin is still required by the GRPO trainer; its rewards are then only logged). Advantages are detached.
* Routing: each row goes to exactly one teacher, chosen by its dataset columns; a row is only ever fed to its own
  teacher's forward pass.
"""

from __future__ import annotations

import gc
from typing import Any

import torch
from pydantic import Field, field_validator

from trl_ext import Plugin, PluginParams, Slot, hookimpl
from trl_ext.plugin import Need
from trl_ext.recipe import EMBEDDED_PREFIX, STAGE_PREFIX
from trl_ext_plugins.advantages.math import group_advantages
from trl_ext_plugins.advantages.rollout import kept_loss_mask, kept_rewards, rank_reduce, sampling_policy_logps
from trl_ext_plugins.distill import math as dm
from trl_ext_plugins.distill import teachers as tch


def resolve_ref(ref: str) -> str:
    """``stage:``/``embedded:`` references resolve against the run in progress; other references are paths/ids."""
    from trl_ext.runner import current_run, resolve_model_ref

    run = current_run()
    if run is None:
        if ref.startswith((STAGE_PREFIX, EMBEDDED_PREFIX)):
            raise tch.TeacherError(f"teacher {ref!r} can only be resolved inside a recipe run (trl-ext train)")
        return ref
    return resolve_model_ref(ref, run)


class TeacherPool:
    """Named teachers, loaded on first use; with ``max_resident`` > 0 at most that many stay in memory at once
    (the least recently used is released first), for teachers that do not fit together. A served teacher
    (``vllm:<url>``) is connected once and never counts as resident: its weights live in its server."""

    def __init__(self, refs: dict[str, str], max_resident: int = 0):
        self.refs = dict(refs)
        self.max_resident = max_resident
        self.loaded: dict[str, Any] = {}
        self.served: dict[str, tch.ServedTeacher] = {}
        self.loads = 0  # how many times a teacher was loaded (for tests and logs)
        self.device: Any = "cpu"
        self.temperature = 1.0
        self.student_tokenizer = None
        self.student_name = "student"

    def configure(self, trainer) -> None:
        self.device = trainer.accelerator.device
        self.temperature = float(getattr(trainer, "temperature", 1.0))
        self.student_tokenizer = trainer.processing_class
        self.student_name = getattr(trainer.model.config, "_name_or_path", "") or "student"

    def get(self, name: str):
        url = tch.served_url(self.refs[name])
        if url is not None:
            if name not in self.served:
                teacher = tch.ServedTeacher(url, self.temperature)
                teacher.connect(self.student_tokenizer, self.student_name)
                self.served[name] = teacher
            return self.served[name]
        if name in self.loaded:
            self.loaded[name] = self.loaded.pop(name)  # most recently used last
            return self.loaded[name]
        while self.max_resident and len(self.loaded) >= self.max_resident:
            self.loaded.pop(next(iter(self.loaded)))
            gc.collect()
        path = resolve_ref(self.refs[name])
        if self.student_tokenizer is not None:
            tch.check_same_tokenizer(self.student_tokenizer, tch.load_tokenizer(path), self.student_name, path)
        self.loaded[name] = tch.load_teacher(path, self.device, self.temperature)
        self.loads += 1
        return self.loaded[name]


def teacher_logps_by_route(pool: TeacherPool, routes: list[str], batch, micro_batch: int | None = None) -> torch.Tensor:
    """``(B, T)`` teacher log-probs of the sampled tokens, each row scored by the teacher its route names only."""
    out = torch.zeros(batch.completion_ids.shape, dtype=torch.float32, device=batch.completion_ids.device)
    for name in dict.fromkeys(routes):  # each teacher once, in first-seen order
        rows = torch.tensor([i for i, r in enumerate(routes) if r == name], device=out.device)
        logps = tch.score_sampled_tokens(pool.get(name), batch.prompt_ids[rows], batch.prompt_mask[rows],
                                        batch.completion_ids[rows], batch.completion_mask[rows], micro_batch)
        out[rows] = logps.to(out.device)
    return out


class OPDParams(PluginParams):
    alpha: float = Field(0.0, ge=0.0, description="Weight of the task-reward (GRPO group-normalised) advantage added "
                                                  "to the distillation advantage (MiMo MOPD's alpha; 0: pure OPD).")
    coef: float = Field(1.0, gt=0.0, description="Scale of the distillation advantage (Tinker / slime KL coefficient, "
                                                 "default 1.0).")
    micro_batch: int | None = Field(None, gt=0, description="Rows per teacher forward (None: the whole batch at once).")


class _OPDBase(Plugin):
    family = "distill"
    trainers = frozenset({"grpo"})
    slots = frozenset({Slot.ADVANTAGE})

    def __init__(self, params=None):
        super().__init__(params)
        self.pool: TeacherPool | None = None

    # subclasses: the teacher table, and each row's route and weight
    def teacher_refs(self) -> dict[str, str]:
        raise NotImplementedError

    def route(self, row: dict[str, Any]) -> tuple[str, float]:
        raise NotImplementedError

    def max_resident(self) -> int:
        return 0

    def _validate_common(self, stage) -> list[str]:
        errors = []
        for name, ref in self.teacher_refs().items():
            problem = tch.teacher_ref_problem(ref, f"teacher {name!r}")
            if problem:
                errors.append(f"plugin {self.name!r}: {problem}")
            elif tch.is_local_path(ref) and tch.is_local_path(stage.model):
                try:
                    tch.check_paths_share_tokenizer(stage.model, ref)
                except tch.TeacherError as exc:
                    errors.append(f"plugin {self.name!r}: {exc}")
        if self.params.alpha > 0 and stage.args.get("num_generations", 8) < 2:
            errors.append(f"plugin {self.name!r}: alpha > 0 needs a task-reward baseline, so args.num_generations "
                          "must be at least 2 (use alpha: 0 for pure distillation with one sample per prompt)")
        return errors

    @hookimpl
    def trl_ext_trainer_created(self, trainer):
        self.pool = TeacherPool(self.teacher_refs(), self.max_resident())
        self.pool.configure(trainer)

    @hookimpl
    def trl_ext_compute_advantages(self, rewards, batch):
        if self.pool is None:  # built outside a run (tests call the hook directly)
            self.pool = TeacherPool(self.teacher_refs(), self.max_resident())
            self.pool.configure(batch.trainer)
        routes, weights = zip(*(self.route(row) for row in batch.inputs)) if batch.inputs else ((), ())
        # the student's own tokens: tool / environment tokens inside a multi-turn completion were not sampled from
        # pi_theta, so they carry no reverse-KL sample (the loss masks them too, and the metrics must not count them);
        # nor do the rows trl_ext_filter_groups dropped
        mask = kept_loss_mask(batch)
        student = sampling_policy_logps(batch).float()
        teacher = teacher_logps_by_route(self.pool, list(routes), batch, self.params.micro_batch)
        opd = dm.weighted_by_row(dm.opd_advantages(teacher, student, mask),
                                 torch.tensor(weights, device=student.device))
        task = None
        if self.params.alpha > 0:
            # TRL's GRPO advantage under the run's own scale_rewards (group | batch | none), over the kept rows.
            scale = getattr(getattr(batch.trainer, "args", None), "scale_rewards", "group")
            kept = kept_rewards(rewards, batch).float()
            task = group_advantages(kept, batch.num_generations, scale=scale)[batch.process_slice]
        advantages = dm.combine_advantages(opd, task, self.params.alpha, self.params.coef)
        valid = mask.bool()
        gap = torch.where(valid, teacher - student, torch.zeros_like(student))
        # token means over every rank's tokens (TRL logs rank 0's metric buffers)
        totals = torch.stack([-gap.sum(), torch.where(valid, teacher, 0).sum(), valid.sum().to(teacher.dtype)])
        reduce = rank_reduce(batch)
        totals = totals if reduce is None else reduce(totals)
        batch.metrics["opd/reverse_kl"] = (totals[0] / totals[2].clamp(min=1)).item()
        batch.metrics["opd/teacher_logp"] = (totals[1] / totals[2].clamp(min=1)).item()
        return advantages


class OPDRewardParams(OPDParams):
    pass


class OPDReward(_OPDBase):
    """On-policy distillation as RL (Thinking Machines "On-Policy Distillation", 2025; Qwen3 strong-to-weak,
    arXiv 2505.09388): per-token advantage ``A_t = coef * sg[log p_T(y_t) - log p_theta(y_t)] + alpha * A_task``.

    The student samples (GRPO trainer, any ``num_generations``; one sample per prompt suffices when ``alpha = 0``);
    the stage's ``teacher:`` scores the sampled tokens in one forward (fused LM head, no full logits); the advantage
    goes through the stage's objective (``grpo`` PPO-clip by default, or ``reinforce``/``cispo`` ...) and any
    correction plugin (tis, mis, icepop ...). Discount 0 (each token's own term, the blog's choice; lower variance,
    slightly biased). Defaults: ``coef = 1`` (Tinker / slime ``--opd-kl-coef``), ``alpha = 0``. slime's convention
    ``A = A_task - coef (log p_S - log p_T)`` is ``alpha = 1``. See :mod:`trl_ext_plugins.distill.opd` for the
    conventions shared with ``multi_teacher_opd`` and ``stage_teachers``.
    """

    name = "opd_reward"
    needs = frozenset({Need.TEACHER})
    Params = OPDRewardParams

    def __init__(self, params=None, teacher: str | None = None):
        super().__init__(params)
        self.teacher = teacher  # the stage's `teacher:`, bound at validation

    def teacher_refs(self):
        if self.teacher is None:
            raise tch.TeacherError("opd_reward: no teacher bound (set the stage's `teacher:`)")
        return {"teacher": self.teacher}

    def route(self, row):
        return "teacher", 1.0

    @hookimpl
    def trl_ext_validate_stage(self, stage, plugins):
        if stage.teacher is None:
            return []  # the missing-need error names the fix
        self.teacher = stage.teacher
        return self._validate_common(stage)


class MultiTeacherParams(OPDParams):
    teachers: dict[str, str] = Field(..., min_length=1, description="Domain -> teacher model (path, hub id, "
                                                                    "`embedded:<name>`, `stage:<name>` or a vLLM "
                                                                    "server `vllm:<url>`). With "
                                                                    "`effort_column`, keys `domain@effort` name "
                                                                    "per-effort teachers (falling back to `domain`).")
    column: str = Field("domain", description="Dataset column naming each prompt's domain.")
    weights: dict[str, float] = Field(default_factory=dict, description="Domain -> weight w_i on its distillation "
                                                                        "advantage (default 1.0 for every domain).")
    effort_column: str | None = Field(None, description="Optional column naming an effort level (e.g. reasoning "
                                                        "on/off); routes to `domain@effort` when such a teacher exists.")
    max_resident_teachers: int = Field(0, ge=0, description="Teachers kept in memory at once (0: all); 1 loads them "
                                                            "one at a time, for teachers that do not fit together.")

    @field_validator("weights")
    @classmethod
    def _positive(cls, value):
        bad = {k: v for k, v in value.items() if v < 0}
        if bad:
            raise ValueError(f"weights must be >= 0, got {bad}")
        return value


class MultiTeacherOPD(_OPDBase):
    """Multi-teacher on-policy distillation, MOPD (MiMo-V2-Flash, arXiv 2601.02780 section 4.4; arXiv 2606.30406).

    Each prompt is routed by its dataset ``column`` to one domain teacher; ``A_t = w_domain * coef * sg[log
    p_domain(y_t) - log p_theta(y_t)] + alpha * A_task``. The per-domain weights ``w_i`` are what TRL's experimental
    multi-teacher path (``AsyncDistillationTrainer``, row-routed) lacks; the default 1.0 leaves the weighting to the
    data mix, as there. A row is scored only by its own teacher, so a row's advantages are identical to a run with
    that domain's teacher alone and ``coef * w_domain`` (tested). Optional per-effort teachers: with
    ``effort_column``, keys ``domain@effort`` select a teacher per effort level (unverified in the literature; the
    routing key convention is trl-ext's). ``max_resident_teachers: 1`` loads teachers one at a time per batch (slower,
    bounded memory); or serve each teacher on its own vLLM server (``vllm:<url>``, scored over HTTP; see
    :class:`~trl_ext_plugins.distill.teachers.ServedTeacher`). The MOPD IS weight
    (``pi_theta/mu_theta`` with discard outside ``[eps_low, eps_high]``) is the ``icepop`` plugin with explicit bounds.
    A row whose domain has no teacher is an error naming the value and the known domains (checked on the dataset
    before training).
    """

    name = "multi_teacher_opd"
    aliases = ("mopd",)
    Params = MultiTeacherParams

    def teacher_refs(self):
        return dict(self.params.teachers)

    def max_resident(self):
        return self.params.max_resident_teachers

    def domains(self) -> set[str]:
        return {key.split("@", 1)[0] for key in self.params.teachers}

    def route(self, row):
        domain = str(row.get(self.params.column))
        key = self.teacher_key(domain, row.get(self.params.effort_column) if self.params.effort_column else None)
        if key is None:
            effort = (f" and effort {row.get(self.params.effort_column)!r} (column {self.params.effort_column!r})"
                      if self.params.effort_column else "")
            raise ValueError(f"{self.name}: no teacher for domain {domain!r} (column {self.params.column!r}){effort}; "
                             f"teachers: {sorted(self.params.teachers)}")
        return key, self.params.weights.get(domain, 1.0)

    def teacher_key(self, domain: str, effort) -> str | None:
        """``domain@effort`` when that teacher exists, else ``domain`` when it exists, else None (no teacher)."""
        if effort is not None and f"{domain}@{effort}" in self.params.teachers:
            return f"{domain}@{effort}"
        return domain if domain in self.params.teachers else None

    @hookimpl
    def trl_ext_validate_stage(self, stage, plugins):
        errors = self._validate_common(stage)
        unknown = set(self.params.weights) - self.domains()
        if unknown:
            errors.append(f"plugin {self.name!r}: params.weights names domains without a teacher: {sorted(unknown)} "
                          f"(teachers: {sorted(self.domains())})")
        return errors

    @hookimpl
    def trl_ext_prepare_dataset(self, dataset, split, stage):
        if split != "train":
            return None
        column = self.params.column
        if column not in dataset.column_names:
            raise ValueError(f"{self.name}: the train dataset has no routing column {column!r} "
                             f"(has: {', '.join(dataset.column_names)})")
        effort_column = self.params.effort_column
        if effort_column is not None and effort_column not in dataset.column_names:
            raise ValueError(f"{self.name}: the train dataset has no effort column {effort_column!r} "
                             f"(params.effort_column; has: {', '.join(dataset.column_names)})")
        # every (domain, effort) pair must route as training will route it: a 'math@high' teacher alone does not
        # serve the rows of effort 'low', and that failed at their first batch instead of here
        efforts = dataset[effort_column] if effort_column is not None else [None] * len(dataset)
        unrouted = sorted({(str(d), str(e)) for d, e in zip(dataset[column], efforts)
                           if self.teacher_key(str(d), e) is None})
        if unrouted:
            shown = [d if effort_column is None else f"{d} (effort {e})" for d, e in unrouted[:5]]
            raise ValueError(f"{self.name}: column {column!r} names domain(s) {shown}"
                             f"{f' and {len(unrouted) - 5} more' if len(unrouted) > 5 else ''} with no teacher; "
                             f"teachers: {sorted(self.params.teachers)}")
        return None


class StageTeachersParams(MultiTeacherParams):
    teachers: dict[str, str] = Field(..., min_length=1, description="Domain -> name of an earlier stage of this "
                                                                    "recipe (`sft`, or `stage:sft`), whose final "
                                                                    "model teaches that domain's prompts.")
    column: str = Field("domain", description="Dataset column naming each prompt's domain.")

    @field_validator("teachers")
    @classmethod
    def _as_stage_refs(cls, value):
        return {k: v if v.startswith(STAGE_PREFIX) else f"{STAGE_PREFIX}{v}" for k, v in value.items()}


class StageTeachers(MultiTeacherOPD):
    """On-policy cross-stage distillation (GLM-5, arXiv 2602.15763 section 3.5): the teachers are this recipe's own
    earlier stages (e.g. SFT, reasoning RL, general RL), one per domain.

    Same advantage and routing as ``multi_teacher_opd`` (GLM-5: ``A = sg[log pi_teacher - log pi_theta]`` with the
    teacher chosen per prompt and group size 1; with ``alpha: 0`` no group statistic is used, so no std
    normalisation happens whatever ``num_generations`` is; TRL's GRPO needs ``num_generations >= 2``, so use 2);
    the teachers are stage names, resolved to those stages' output folders only when this stage starts (after they
    finished). The recipe validator refuses, before anything trains, a teacher naming this stage, a later stage, or
    no stage (every ``stage:`` reference in plugin parameters must name an earlier stage).
    """

    name = "stage_teachers"
    aliases = ()
    Params = StageTeachersParams
