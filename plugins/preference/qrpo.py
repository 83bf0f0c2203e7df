"""``qrpo``: Quantile Reward Policy Optimization, pointwise regression onto a quantile reward with exact log Z."""

from __future__ import annotations

from typing import Any, Literal

import torch
from pydantic import Field

from trl_ext import PluginParams, hookimpl
from trl_ext import metrics as figures
from trl_ext_plugins.preference.common import Column, PreferenceLoss, nan_padded
from trl_ext_plugins.preference.math import (
    qrpo_log_partition,
    qrpo_loss,
    quantile_reward,
    reference_reward_std,
    transformed_quantile_reward,
)


class QRPOParams(PluginParams):
    transform: Literal["identity", "log", "normal_icdf", "scaled_normal_icdf"] = Field(
        "identity", description="The reward regressed onto: identity, r_q (the paper's main form, ALGORITHMS.md item "
        "25); log, log max(r_q, 1/n) with log Z = log(beta / (1 + beta)) (the reference implementation's default, "
        "train-qrpo.yaml); normal_icdf, the standard normal quantile of r_q clamped to [1/n, (n-1)/n], log Z = 1 / (2 "
        "beta^2); scaled_normal_icdf, that quantile times s = (the row's reference-reward standard deviation) / (its "
        "mean over the train split's rows), log Z = s^2 / (2 beta^2) (the repository's scaled-normal-icdf). Each log "
        "Z is exact for a uniform r_q.")
    exact_log_partition: bool = Field(
        True, description="transform identity: log Z = log(beta (e^{1/beta} - 1)) (exact for a uniform quantile "
                          "reward); false uses the reference implementation's log beta + 1/beta.")
    chosen_reward_column: str = Field("chosen_reward", description="Dataset column with r(x, y_w).")
    rejected_reward_column: str = Field("rejected_reward", description="Dataset column with r(x, y_l).")
    ref_rewards_column: str = Field(
        "ref_rewards", description="Dataset column with the rewards of n >= 2 reference-policy completions of the "
                                   "prompt (a list per row).")
    ref_completions: int | None = Field(
        None, ge=2, description="Generate this many (n >= 2) reference completions per prompt and score them, filling "
                                "`ref_rewards` (and missing chosen/rejected reward columns); None reads the columns.")
    reference: str | None = Field(None, description="Model sampling the reference completions (path, `stage:`, "
                                                    "`embedded:`); default the stage's ref_model, else its model.")
    reward: str = Field("exact_match", description="Reward plugin (catalog name) scoring generated completions.")
    reward_params: dict[str, Any] = Field(default_factory=dict, description="Parameters of the reward plugin.")
    reward_model: str | None = Field(None, description="A one-logit reward model replacing `reward` when set.")
    max_new_tokens: int = Field(64, gt=0, description="Length limit of the reference completions.")
    temperature: float = Field(1.0, gt=0, description="Sampling temperature of the reference completions (1.0: "
                                                      "samples of pi_ref itself, which the quantile needs).")
    seed: int = Field(0, description="Sampling seed of the reference completions.")
    cache_dir: str | None = Field(None, description="Cache of the reference rewards; default "
                                                    "`<run output_dir>/_cache/qrpo`.")


class QRPO(PreferenceLoss):
    """QRPO (Matrenok, Moalla, Gulcehre 2025, arXiv 2507.08068).

    Quantile reward ``r_q(x, y) = P_{y'~pi_ref}[r(x, y') <= r(x, y)]``, estimated from the ``n`` reference rewards in
    the ``ref_rewards`` column; under pi_ref it is U(0, 1), so ``Z = beta (e^{1/beta} - 1)`` exactly. Pointwise loss
    ``(r_q - beta log Z - beta log pi/pi_ref(y))**2`` on each completion; on a preference row both the chosen and the
    rejected completion are such points (each with its own reward column) and the per-row loss is their mean. The
    log-ratio is summed over completion tokens; ``beta`` is TRL's ``args.beta``. Rows need at least 2 reference
    rewards (checked before training). The reference rewards are read from the dataset, or, with
    ``ref_completions: n``, generated: n completions per prompt sampled from the reference (temperature 1 by default,
    so they are draws of pi_ref), scored by a reward plugin or a reward model, together with the chosen/rejected
    completions when their reward columns are absent. The result is cached as a dataset keyed by a hash of the
    reference model, rows and settings, so reruns and other runs with the same inputs reuse it.

    ``transform`` (default ``identity``, the paper's main form) regresses a transformed quantile reward instead, with
    its own exact log Z: ``log`` (``log max(r_q, 1/n)``, ``Z = beta / (1 + beta)``; the reference implementation's
    default config), ``normal_icdf`` (the normal quantile, ``log Z = 1 / (2 beta^2)``) or ``scaled_normal_icdf`` (the
    repository's ``scaled-normal-icdf``: the normal quantile times ``s``, the row's reference-reward standard deviation,
    ``n - 1`` in the denominator, over its mean across the train split's rows, measured when the train split is
    prepared; ``log Z = s^2 / (2 beta^2)``; a train split whose reference rewards are all constant is refused).
    """

    name = "qrpo"
    Params = QRPOParams

    def __init__(self, params=None):
        super().__init__(params)
        self.mean_reference_std: float | None = None  # scaled_normal_icdf: the train split's mean row std

    @hookimpl
    def trl_ext_prepare_dataset(self, dataset, split, stage):
        generate = self.params.ref_completions is not None and stage.trainer == "dpo" and "prompt" in dataset.column_names
        out = self._with_reference_rewards(dataset, stage) if generate else None
        data = out if generate else dataset
        super().trl_ext_prepare_dataset(dataset=data, split=split, stage=stage)
        if self.params.transform == "scaled_normal_icdf" and stage.trainer == "dpo":
            row_stds = self._reference_stds(data, split)
            if split == "train":
                self.mean_reference_std = self._mean_reference_std(row_stds)
        return out

    def _reference_stds(self, dataset, split: str) -> torch.Tensor:
        """Each row's reference-reward standard deviation; an infinite reward is refused (its row's scale would be
        inf, and in the train split it would make every other row's scale 0, finite / inf)."""
        padded = torch.tensor(nan_padded(dataset[self.params.ref_rewards_column]), dtype=torch.float64)
        if torch.isinf(padded).any():
            raise ValueError(f"plugin {self.name!r}: transform scaled_normal_icdf needs finite "
                             f"{self.params.ref_rewards_column!r} values; the {split} split has an infinite one")
        return reference_reward_std(padded)

    def _mean_reference_std(self, row_stds: torch.Tensor) -> float:
        """The train split's mean over rows of their reference-reward standard deviation (scaled_normal_icdf's
        denominator, the repository's ``mean_std_ref_rewards``)."""
        mean = row_stds.mean().item()
        if not mean > 0:
            raise ValueError(f"plugin {self.name!r}: transform scaled_normal_icdf divides by the mean standard "
                             f"deviation of the train rows' {self.params.ref_rewards_column!r}, which is 0 (every "
                             f"row's reference rewards are equal); use transform normal_icdf")
        return mean

    def _with_reference_rewards(self, dataset, stage):
        from trl_ext_plugins.preference import generation as gen

        p = self.params
        reference = gen.resolve_model(p.reference or stage.ref_model or stage.model, self.name)
        key = gen.cache_key({"reference": gen.model_fingerprint(reference), "rows": dataset.to_list(),
                             "settings": p.model_dump(exclude={"cache_dir", "exact_log_partition"})})

        def build():
            score = gen.scorer(p.reward, p.reward_params, p.reward_model, self.name)
            model, tokenizer = gen.load_policy(reference)
            prompts = dataset["prompt"]
            samples = gen.sample_completions(model, tokenizer, prompts, num_samples=p.ref_completions,
                                             max_new_tokens=p.max_new_tokens, do_sample=True,
                                             temperature=p.temperature, seed=p.seed)
            others = {c: dataset[c] for c in dataset.column_names if c not in ("prompt", "chosen", "rejected")}

            def rewards(completions, repeat):
                return score(prompts=[x for x in prompts for _ in range(repeat)], completions=completions,
                             **{c: [x for x in v for _ in range(repeat)] for c, v in others.items()})

            flat = rewards([gen.as_completion(pr, t) for pr, group in zip(prompts, samples) for t in group],
                           p.ref_completions)
            n = p.ref_completions
            out = dataset.remove_columns([c for c in (p.ref_rewards_column,) if c in dataset.column_names])
            out = out.add_column(p.ref_rewards_column, [flat[i * n:(i + 1) * n] for i in range(len(dataset))])
            for side in ("chosen", "rejected"):
                column = getattr(p, f"{side}_reward_column")
                if column not in dataset.column_names:
                    out = out.add_column(column, [float(r) for r in rewards(dataset[side], 1)])
            return out

        data, hit = gen.cached_dataset(gen.cache_root(p.cache_dir, self.name), key, build)
        gen.logger.info("qrpo: reference rewards for %d prompts (%s)", len(data), "cache hit" if hit else "generated")
        return data

    def columns(self):
        return (Column(self.params.chosen_reward_column), Column(self.params.rejected_reward_column),
                Column(self.params.ref_rewards_column, is_list=True, min_items=2))

    @hookimpl
    def trl_ext_preference_loss(self, inputs):
        p = self.params
        log_z = qrpo_log_partition(inputs.beta, exact=p.exact_log_partition, transform=p.transform)
        ref_rewards = inputs.batch[p.ref_rewards_column].to(inputs.chosen_logps)
        counts = (~torch.isnan(ref_rewards)).sum(-1)
        scale = None
        if p.transform == "scaled_normal_icdf":
            if self.mean_reference_std is None:
                raise ValueError(f"plugin {self.name!r}: transform scaled_normal_icdf needs the train split's "
                                 "reference-reward statistic, measured when the train split is prepared")
            scale = reference_reward_std(ref_rewards) / self.mean_reference_std
            log_z = scale * scale * log_z
        losses = []
        for side, logps, ref_logps in (("chosen", inputs.chosen_logps, inputs.ref_chosen_logps),
                                       ("rejected", inputs.rejected_logps, inputs.ref_rejected_logps)):
            reward = inputs.batch[getattr(self.params, f"{side}_reward_column")].to(logps)
            r_q = quantile_reward(reward, ref_rewards)
            # the mean over every rank's pairs (figure parts the trainer reduces)
            inputs.metrics[f"qrpo/{side}_quantile_reward"] = figures.mean(r_q.sum(), r_q.numel())
            target = transformed_quantile_reward(r_q, counts, p.transform)
            if scale is not None:
                target = scale * target
            losses.append(qrpo_loss(target, logps - ref_logps, inputs.beta, log_z))
        return (losses[0] + losses[1]) / 2
