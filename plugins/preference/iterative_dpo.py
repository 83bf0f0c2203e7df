"""``iterative_dpo``: rounds of sample-K-from-the-policy, score, best-vs-worst pairs, DPO."""

from __future__ import annotations

import math
from typing import Any

from pydantic import Field, model_validator
from transformers import TrainerCallback

from trl_ext import Plugin, PluginParams, hookimpl
from trl_ext_plugins.preference import generation as gen
from trl_ext_plugins.preference.common import PreferenceDataError

ROUND_COLUMN = "round"


class IterativeDPOParams(PluginParams):
    rounds: int = Field(3, ge=1, description="Number of rounds (RLHF Workflow: 3 iterations).")
    num_samples: int = Field(8, ge=2, description="K responses sampled per prompt per round (RLHF Workflow: 8).")
    reward: str = Field("exact_match", description="Reward plugin (catalog name) scoring the samples.")
    reward_params: dict[str, Any] = Field(default_factory=dict, description="Parameters of the reward plugin.")
    reward_model: str | None = Field(None, description="A one-logit sequence-classification reward model (path, "
                                                       "`stage:` or `embedded:`); when set it replaces `reward`.")
    update_reference: bool = Field(True, description="After each round copy the policy into the reference "
                                                     "(pi_ref = pi_theta_t, RLHF Workflow); false keeps the initial "
                                                     "reference.")
    max_new_tokens: int = Field(64, gt=0, description="Generation length limit (TRL OnlineDPOConfig: 64).")
    temperature: float = Field(0.9, gt=0, description="Sampling temperature (TRL OnlineDPOConfig: 0.9).")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling mass.")
    seed: int = Field(0, description="Sampling seed; round r samples with seed + r.")
    batch_size: int = Field(64, gt=0, description="Prompts per generate() call.")

    @model_validator(mode="after")
    def _one_scorer(self):
        if self.reward_model is not None and self.reward_params:
            raise ValueError("reward_params apply to a reward plugin, not to reward_model")
        return self


class IterativeDPO(Plugin):
    """Iterative (batch-online) DPO: Xiong et al. 2023 (arXiv 2312.11456), RLHF Workflow (Dong et al. 2024,
    arXiv 2405.07863).

    Round t: sample ``num_samples`` responses per prompt from pi_theta_t, score them with a reward plugin (``reward``,
    default ``exact_match``) or a reward model, pair the best (chosen) with the worst (rejected), train DPO on the
    round's pairs, optionally set pi_ref = pi_theta_{t+1} (``update_reference``, default true). Prompts whose K scores
    all tie form no pair; a round with no pairs is skipped (logged) and the policy is not updated. Every pair carries
    its ``round`` column = the policy version that generated it; each round's pairs are saved under the stage's
    ``checkpoints/iterative_dpo/round_<t>``. Ties among the best (worst) scores go to the first sample.

    Loop design: one DPO stage whose ``trainer.train`` runs the rounds (each round is an ordinary TRL ``train()`` call
    with the stage's ``args``, so ``max_steps`` is *per round*; optimizer and LR schedule restart each round, as in the
    papers' per-iteration DPO runs). Chosen over N expanded recipe stages because it needs no change to the recipe
    schema, and over a dataloader refresh inside one ``train()`` because HF ``Trainer`` fixes the epoch length at the
    start. Consequences: round 0 is generated from the stage's starting model while the dataset is prepared (TRL
    tokenizes the dataset when the trainer is built, so round 0 must form at least one pair); checkpoints are off
    (``save_strategy: "no"``) and an interrupted stage restarts from round 0; logged rows carry
    ``iterative_dpo/round`` and each round's step count restarts at 1. Sampling defaults follow TRL's
    ``OnlineDPOConfig`` (temperature 0.9, 64 new tokens).
    """

    name = "iterative_dpo"
    family = "preference"
    trainers = frozenset({"dpo"})
    Params = IterativeDPOParams

    def __init__(self, params=None):
        super().__init__(params)
        self._prompts = None  # the train prompts (rows without chosen/rejected), kept for rounds >= 1
        self._scorer = None
        self.round_pairs: list[Any] = []  # each round's pair dataset (empty list entry for a skipped round)
        self.skipped_rounds: list[int] = []

    @hookimpl
    def trl_ext_validate_stage(self, stage, plugins):
        errors = []
        if self.params.update_reference and stage.ref_model:
            errors.append("plugins: iterative_dpo update_reference=true moves the reference to the policy each round; "
                          "remove `ref_model` or set update_reference: false")
        if self.params.update_reference and stage.peft is not None:
            errors.append("plugins: iterative_dpo update_reference=true is not supported with `peft` (the reference "
                          "is the adapter-free base model)")
        for key in ("precompute_ref_log_probs", "sync_ref_model"):
            if stage.args.get(key):
                errors.append(f"args.{key}: not supported with iterative_dpo (each round brings new pairs)")
        return errors

    @hookimpl
    def trl_ext_configure_args(self, trainer, args):
        return {"save_strategy": "no"}

    @hookimpl
    def trl_ext_prepare_dataset(self, dataset, split, stage):
        if split != "train":
            return None
        if "prompt" not in dataset.column_names:
            raise PreferenceDataError(f"iterative_dpo: train dataset lacks column 'prompt' "
                                      f"(has: {', '.join(dataset.column_names)})")
        self._prompts = dataset.remove_columns([c for c in ("chosen", "rejected", ROUND_COLUMN)
                                                if c in dataset.column_names])
        model, tokenizer = gen.load_policy(gen.resolve_model(stage.model, self.name))
        pairs = self.make_round(model, tokenizer, 0)
        if pairs is None:
            raise PreferenceDataError("iterative_dpo: round 0 formed no pairs (the K scores of every prompt tie); "
                                      "the starting policy gives the reward no signal to prefer one sample")
        return pairs

    def make_round(self, model, tokenizer, round_index: int):
        """Sample, score and pair for one round; ``None`` (logged) when every prompt's scores tie."""
        from accelerate import PartialState

        if self._scorer is None:
            self._scorer = gen.scorer(self.params.reward, self.params.reward_params, self.params.reward_model,
                                      self.name)
        pairs = None
        if PartialState().is_main_process:
            samples = gen.sample_completions(
                model, tokenizer, self._prompts["prompt"], num_samples=self.params.num_samples,
                max_new_tokens=self.params.max_new_tokens, do_sample=True, temperature=self.params.temperature,
                top_p=self.params.top_p, batch_size=self.params.batch_size, seed=self.params.seed + round_index)
            pairs = best_worst_pairs(self._prompts, samples, self._scorer, round_index)
        pairs = _broadcast(pairs)
        self.round_pairs.append(pairs if pairs is not None else [])
        if pairs is None:
            self.skipped_rounds.append(round_index)
            gen.logger.warning("iterative_dpo: round %d skipped: no pairs (all K scores tie for every prompt); "
                               "the policy is not updated this round", round_index)
        else:
            gen.logger.info("iterative_dpo: round %d: %d pairs from %d prompts", round_index, len(pairs),
                            len(self._prompts))
        return pairs

    @hookimpl
    def trl_ext_trainer_created(self, trainer):
        if not hasattr(trainer, "compute_ref_log_probs"):
            return
        # first, so the tag is in the row before the runner's metrics callback writes it
        trainer.callback_handler.callbacks.insert(0, _RoundTag(self))
        _no_last_step_checkpoint(trainer)
        first_train = trainer.train
        plugin = self

        def train_rounds(*args, **kwargs):
            kwargs.pop("resume_from_checkpoint", None)  # no checkpoints are written (save_strategy "no")
            output = None
            for round_index in range(plugin.params.rounds):
                plugin.current_round = round_index
                if round_index > 0:
                    policy = trainer.accelerator.unwrap_model(trainer.model)
                    pairs = plugin.make_round(policy, trainer.processing_class, round_index)
                    if pairs is None:
                        continue
                    trainer.train_dataset = trainer._prepare_dataset(pairs, trainer.processing_class, trainer.args,
                                                                     "train")
                    trainer.optimizer, trainer.lr_scheduler = None, None
                    _keep_logged_rows(trainer)
                _save_round(trainer, plugin.round_pairs[round_index], round_index)
                output = first_train(*args, **kwargs)
                if plugin.params.update_reference and trainer.ref_model is not None:
                    policy = trainer.accelerator.unwrap_model(trainer.model)
                    trainer.ref_model.load_state_dict(policy.state_dict())
            return output if output is not None else _no_training(trainer)

        trainer.train = train_rounds


def best_worst_pairs(prompts, samples: list[list[str]], score, round_index: int):
    """(best, worst) sample per prompt by ``score``; prompts whose scores all tie are skipped. ``None`` if no pair.

    NaN scores (unscorable samples) are left out; a prompt with fewer than two scored samples forms no pair."""
    flat_prompts = [p for p, group in zip(prompts["prompt"], samples) for _ in group]
    columns = {c: [v for v, group in zip(prompts[c], samples) for _ in group]
               for c in prompts.column_names if c != "prompt"}
    completions = [gen.as_completion(p, text) for p, group in zip(prompts["prompt"], samples) for text in group]
    scores = score(prompts=flat_prompts, completions=completions, **columns)
    keep, chosen, rejected, gaps = [], [], [], []
    offset = 0
    for row, group in enumerate(samples):
        group_scores = [float(s) for s in scores[offset:offset + len(group)]]
        offset += len(group)
        # An unscorable (NaN) sample takes no part: max/min compare NaN as neither larger nor smaller, so a NaN in
        # first place would be both best and worst and drop the prompt, and one elsewhere would be skipped silently.
        scored = [i for i, s in enumerate(group_scores) if not math.isnan(s)]
        if len(scored) < 2:
            continue
        best = max(scored, key=lambda i: group_scores[i])
        worst = min(scored, key=lambda i: group_scores[i])
        if group_scores[best] == group_scores[worst] or group[best] == group[worst]:
            continue
        keep.append(row)
        chosen.append(gen.as_completion(prompts[row]["prompt"], group[best]))
        rejected.append(gen.as_completion(prompts[row]["prompt"], group[worst]))
        gaps.append(group_scores[best] - group_scores[worst])
    if not keep:
        return None
    pairs = prompts.select(keep)
    for name, values in (("chosen", chosen), ("rejected", rejected), ("score_gap", gaps),
                         (ROUND_COLUMN, [round_index] * len(keep))):
        pairs = pairs.add_column(name, values)
    return pairs


def _broadcast(pairs):
    """The main process's pairs on every process (one generation; every rank trains on the same rows)."""
    from accelerate import PartialState

    state = PartialState()
    if state.num_processes == 1:
        return pairs
    from accelerate.utils import broadcast_object_list

    box = [pairs.to_list() if pairs is not None else None]
    broadcast_object_list(box, from_process=0)
    if box[0] is None:
        return None
    from datasets import Dataset

    return pairs if state.is_main_process else Dataset.from_list(box[0])


def _save_round(trainer, pairs, round_index: int) -> None:
    from pathlib import Path

    if trainer.accelerator.is_main_process:
        pairs.save_to_disk(str(Path(trainer.args.output_dir) / "iterative_dpo" / f"round_{round_index}"))


def _keep_logged_rows(trainer) -> None:
    """The runner's metrics file is truncated at train start unless resuming; later rounds append to it."""
    from trl_ext.callbacks import MetricsJsonlCallback

    for callback in trainer.callback_handler.callbacks:
        if isinstance(callback, MetricsJsonlCallback):
            callback.resume_step = float("inf")


def _no_last_step_checkpoint(trainer) -> None:
    """Every round's ``train()`` reaches ``max_steps``, so the runner's last-step checkpoint of round 0 looked like the
    stage's last step: a stage killed in a later round was then finished from round 0's weights. Without checkpoints
    a killed stage restarts from round 0, as documented (same seeds, so the same result)."""
    from trl_ext.callbacks import CheckpointCompletionCallback

    for callback in trainer.callback_handler.callbacks:
        if isinstance(callback, CheckpointCompletionCallback):
            callback.save_last_step = False


def _no_training(trainer):
    from transformers.trainer_utils import TrainOutput

    return TrainOutput(trainer.state.global_step, 0.0, {})


class _RoundTag(TrainerCallback):
    """Adds ``iterative_dpo/round`` to every logged row."""

    def __init__(self, plugin: IterativeDPO):
        self.plugin = plugin

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is not None:
            logs["iterative_dpo/round"] = getattr(self.plugin, "current_round", 0)
