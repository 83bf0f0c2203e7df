"""``gkd``: generalised knowledge distillation on TRL's stable ``DistillationTrainer``."""

from __future__ import annotations

import random
from typing import Literal

from pydantic import Field, model_validator

from trl_ext import Plugin, PluginParams, Slot, hookimpl
from trl_ext.plugin import Need
from trl_ext_plugins.distill import teachers as tch
from trl_ext_plugins.distill.math import FORWARD_KL_BETA, REVERSE_KL_BETA


class GKDParams(PluginParams):
    divergence: Literal["reverse_kl", "forward_kl", "jsd"] = Field(
        "reverse_kl", description="Token-level divergence D(p_T || p_S): `reverse_kl` KL(p_S||p_T) (mode seeking; "
                                  "TRL DistillationConfig's default, beta=1), `forward_kl` KL(p_T||p_S) (beta=0), or "
                                  "`jsd` (generalised JSD with `beta`).")
    beta: float = Field(0.5, gt=0.0, lt=1.0, description="JSD interpolation (only with divergence: jsd): mixture "
                                                          "M = beta p_T + (1 - beta) p_S, TRL's convention.")
    lmbda: float = Field(1.0, ge=0.0, le=1.0, description="Probability that a generation batch is the student's own "
                                                           "samples (on-policy); otherwise the dataset's `completion` "
                                                           "column is used (off-policy). Paper: 1.0 best in general.")

    @model_validator(mode="after")
    def _beta_only_for_jsd(self):
        if self.divergence != "jsd" and "beta" in self.model_fields_set:
            raise ValueError(f"beta applies only to divergence 'jsd' (got divergence {self.divergence!r})")
        return self

    @property
    def trl_beta(self) -> float:
        return {"reverse_kl": REVERSE_KL_BETA, "forward_kl": FORWARD_KL_BETA, "jsd": self.beta}[self.divergence]


class GKD(Plugin):
    """GKD, on-policy distillation (Agarwal et al., ICLR 2024, arXiv 2306.13649), driving TRL's DistillationTrainer.

    Loss ``(1 - lambda) E_{(x,y)~data} D(y|x) + lambda E_{x, y~p_S} D(y|x)`` with
    ``D(y|x) = (1/|y|) sum_t D(p_T(.|y_<t,x) || p_S(.|y_<t,x))`` over the full vocabulary. The divergence is TRL's:
    ``divergence`` sets ``DistillationConfig.beta`` (``forward_kl`` -> 0, ``reverse_kl`` -> 1, ``jsd`` -> ``beta``), and
    the loss is TRL's chunked kernel (``_chunked_divergence_loss``), which projects hidden states to the vocabulary in
    tiles, so no ``[batch, tokens, vocabulary]`` tensor exists for either model. Temperature is TRL's ``temperature``
    (applied to both models, default 1.0). Token normalisation is TRL's: sum over the generation batch's completion
    tokens divided by their global count (a token mean, where the paper writes a per-sequence mean).

    ``lmbda`` (GKD's on/off-policy mix; TRL's stable trainer is always on-policy, ``lmbda = 1``): for each generation
    batch a coin with ``P(on-policy) = lmbda`` is drawn from ``(seed, global_step)``, so every rank draws the same
    side. Off-policy batches take the completions from the dataset's ``completion`` column (string, or a list of
    messages whose last content is used), tokenised without special tokens, with ``eos`` appended and cut at
    ``max_completion_length``. Defaults: ``reverse_kl`` (TRL stable's default), ``lmbda = 1`` (the paper's best
    setting); TRL's experimental GKDConfig defaults are ``beta = 0.5, lmbda = 0.5``.

    Teacher: the stage's ``teacher:`` (a folder, ``embedded:``, or ``stage:<earlier stage>``), which must share the
    student's tokenizer (checked at validation for local folders, and again when the trainer is built).
    """

    name = "gkd"
    family = "distill"
    trainers = frozenset({"distillation"})
    slots = frozenset({Slot.GENERATION})
    needs = frozenset({Need.TEACHER})
    Params = GKDParams

    @hookimpl
    def trl_ext_validate_stage(self, stage, plugins):
        errors = []
        problem = tch.teacher_ref_problem(stage.teacher, "teacher") if stage.teacher else None
        if problem:
            errors.append(f"plugin 'gkd': {problem}")
        elif stage.teacher and tch.is_local_path(stage.teacher) and tch.is_local_path(stage.model):
            try:
                tch.check_paths_share_tokenizer(stage.model, stage.teacher)
            except tch.TeacherError as exc:
                errors.append(f"plugin 'gkd': {exc}")
        if self.params.lmbda < 1.0 and stage.args.get("use_vllm"):
            errors.append("plugin 'gkd': lmbda < 1 with args.use_vllm is not supported (off-policy batches bypass "
                          "generation)")
        return errors

    @hookimpl
    def trl_ext_configure_args(self, trainer, args):
        return {"beta": self.params.trl_beta}

    @hookimpl
    def trl_ext_prepare_dataset(self, dataset, split, stage):
        if self.params.lmbda < 1.0 and split == "train" and "completion" not in dataset.column_names:
            raise ValueError(f"gkd: lmbda={self.params.lmbda} needs off-policy completions, but the train dataset has "
                             f"no 'completion' column (has: {', '.join(dataset.column_names)})")
        return None

    @hookimpl
    def trl_ext_trainer_created(self, trainer):
        teacher = getattr(trainer, "teacher_model", None)
        if teacher is None:
            return
        path = getattr(trainer.accelerator.unwrap_model(teacher).config, "_name_or_path", "")
        if path:
            tch.check_same_tokenizer(trainer.processing_class, tch.load_tokenizer(path),
                                     trainer.model.config._name_or_path or "student", path)

    @hookimpl
    def trl_ext_generate(self, trainer, prompts, generate):
        if self.params.lmbda >= 1.0 or not trainer.model.training:
            return None
        if on_policy_draw(trainer.args.seed, trainer.state.global_step, self.params.lmbda):
            trainer._metrics["train"]["gkd/on_policy"].append(1.0)
            return None
        trainer._metrics["train"]["gkd/on_policy"].append(0.0)
        return dataset_completions(trainer, prompts, trainer.generation_rows)


def on_policy_draw(seed: int, step: int, lmbda: float) -> bool:
    """The GKD coin for one generation batch: the same on every rank (seeded by seed and step)."""
    return random.Random(f"gkd:{seed}:{step}").random() < lmbda


def dataset_completions(trainer, prompts, rows):
    """TRL's generation result, but with the dataset's completions instead of samples (GKD's off-policy side)."""
    tokenizer = trainer._tokenizer
    prompt_ids, _, _ = trainer._tokenize_prompts(prompts)
    completion_ids = []
    for row in rows:
        completion = row["completion"]
        text = completion[-1]["content"] if isinstance(completion, list) else completion
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if not ids or ids[-1] != tokenizer.eos_token_id:
            ids = ids + [tokenizer.eos_token_id]
        completion_ids.append(ids[: trainer.max_completion_length])
    return prompt_ids, completion_ids, None, None, []
