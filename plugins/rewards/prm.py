"""``prm``: process reward model, trained on the ``prm`` trainer with per-step labels, used as a reward by product/min."""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field

from trl_ext import Plugin, PluginParams, hookimpl
from trl_ext.rewards import RewardFunction
from trl_ext_plugins.rewards import formulas
from trl_ext_plugins.rewards.scoring import STAGE_PREFIX, LazyScorer, resolve_ref

TRAINING = "prm"


class PRMParams(PluginParams):
    separator: str = Field("\n", description="step separator: appended after each step; the step's score is read at "
                           "its last token (training and scoring)")
    label_source: Literal["dataset", "mc_hard", "mc_soft"] = Field(
        "dataset", description="training: step labels from the dataset's `labels` column, or Math-Shepherd Monte-Carlo "
        "estimates from `completer` rollouts (hard: any rollout correct; soft: fraction correct)")
    completer: str | None = Field(None, description="training with mc_*: the completer policy (a folder or "
                                  "`embedded:<name>`)")
    rollouts: int = Field(8, gt=0, description="training with mc_*: N completions per step (Math-Shepherd N=8)")
    max_new_tokens: int = Field(16, gt=0, description="training with mc_*: tokens per completer rollout")
    path: str | None = Field(None, description="RL stages: the trained PRM (`stage:<name>`, `embedded:<name>` or a "
                             "folder); unset in a `prm` training stage")
    aggregation: Literal["product", "min", "last"] = Field(
        "product", description="RL stages: solution score from step probabilities (Lightman: product; min; last)")
    weight: float = Field(1.0, description="RL stages: weight of this reward in the weighted sum")
    batch_size: int = Field(32, gt=0, description="RL stages: solutions per PRM forward pass")


def load_token_classifier(path: str):
    from transformers import AutoModelForTokenClassification, AutoTokenizer

    model = AutoModelForTokenClassification.from_pretrained(path, num_labels=1)
    tok = AutoTokenizer.from_pretrained(path)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return model.eval().requires_grad_(False), tok


def split_steps(completion: str, separator: str) -> list[str]:
    """Steps of a completion: split at the separator, empty pieces dropped (a completion is at least one step)."""
    steps = [s for s in completion.split(separator) if s.strip()]
    return steps or [completion]


@torch.no_grad()
def step_probabilities(model, tokenizer, prompts: list[str], step_lists: list[list[str]], separator: str,
                       batch_size: int = 32) -> list[torch.Tensor]:
    """sigmoid(PRM logit) at each step's separator, per solution (the trainer's exact tokenization)."""
    from trl_ext.trainers.prm import tokenize_steps

    device = next(model.parameters()).device
    out = []
    for start in range(0, len(prompts), batch_size):
        encoded = [tokenize_steps(tokenizer, p, s, separator)
                   for p, s in zip(prompts[start:start + batch_size], step_lists[start:start + batch_size])]
        width = max(len(ids) for ids, _ in encoded)
        ids = torch.full((len(encoded), width), tokenizer.pad_token_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, (row, _) in enumerate(encoded):
            ids[i, :len(row)] = torch.tensor(row)
            mask[i, :len(row)] = 1
        logits = model(input_ids=ids.to(device), attention_mask=mask.to(device)).logits[..., 0].float().cpu()
        out.extend(torch.sigmoid(logits[i, pos]).double() for i, (_, pos) in enumerate(encoded))
    return out


class PRMScorer(LazyScorer):
    """Scores completions: split into steps, step probabilities, aggregated (product / min / last)."""

    def __init__(self, params: PRMParams):
        super().__init__(lambda run_dir: load_token_classifier(resolve_ref(params.path, run_dir)), params.batch_size)
        self.params = params

    def __call__(self, prompts, completions, **_kwargs) -> list[float]:
        model, tok = self.ensure_loaded()
        text = lambda x: x[-1]["content"] if isinstance(x, list) else x  # noqa: E731
        steps = [split_steps(text(c), self.params.separator) for c in completions]
        probs = step_probabilities(model, tok, [text(p) if not isinstance(p, list) else "" for p in prompts], steps,
                                   self.params.separator, self.batch_size)
        return [formulas.aggregate_step_scores(p, self.params.aggregation).item() for p in probs]


class PRM(Plugin):
    """Process reward model (Lightman et al., arXiv 2305.20050; Math-Shepherd MC labels, arXiv 2312.08935).

    **Training** (``trainer: prm``, see :mod:`trl_ext.trainers.prm`). Design choice: a token-classification head with
    one logit, trained with BCE at the last token of the separator after each step (``L = -sum_s [y_s log r(s) +
    (1 - y_s) log(1 - r(s))]``, averaged over the labelled steps of a batch), which takes hard and soft labels alike
    (Lightman's 3-class labels map to 1 for positive/neutral, 0 for negative, "neutral as positive"). Rows are
    ``prompt``, ``completions`` (steps), ``labels``. Labels: from the dataset (``label_source: dataset``, default), or
    Math-Shepherd estimates from ``rollouts`` completions of ``completer`` per step prefix (``mc_hard``: 1 if any
    reaches the gold ``answer``; ``mc_soft``: the fraction that does; default N = 8 as in the paper); the last step is
    labelled by its own final answer. Judge labels (Qwen PRM lessons, 2501.07301) are not implemented.

    **Use as a reward** (GRPO/RLOO, ``path`` set). A completion is split at ``separator`` into steps, tokenized as in
    training (``prompt + step + sep + ...``), and the step probabilities sigmoid(logit) are aggregated by
    ``aggregation``: product (Lightman, default) or min, or the last step's score. Scores lie in [0, 1].
    """

    name = "prm"
    family = "reward"
    trainers = frozenset({TRAINING, "grpo", "rloo"})
    Params = PRMParams

    def __init__(self, params=None):
        super().__init__(params)
        self.scorer = PRMScorer(self.params)

    @hookimpl
    def trl_ext_validate_stage(self, stage, plugins):
        p, errors = self.params, []
        if stage.trainer == TRAINING:
            if p.path is not None:
                errors.append(f"plugin {self.name!r}: params.path is for RL stages; a prm stage trains its model")
            if p.label_source != "dataset" and p.completer is None:
                errors.append(f"plugin {self.name!r}: params.completer is required with label_source {p.label_source!r}")
            if p.completer is not None and p.completer.startswith(STAGE_PREFIX):
                errors.append(f"plugin {self.name!r}: params.completer must be a folder or embedded:<name> (labels are "
                              "built before the stage starts)")
        elif p.path is None:
            errors.append(f"plugin {self.name!r}: params.path is required in a {stage.trainer} stage")
        return errors

    @hookimpl
    def trl_ext_configure_args(self, trainer, args):
        return {"step_separator": self.params.separator} if trainer == TRAINING else None

    @hookimpl
    def trl_ext_prepare_dataset(self, dataset, split, stage):
        p = self.params
        if stage.trainer != TRAINING or p.label_source == "dataset":
            return None
        import tempfile
        from pathlib import Path

        from trl_ext_plugins.rewards.steps import monte_carlo_step_labels, transformers_completer

        folder = resolve_ref(p.completer, Path(tempfile.mkdtemp(prefix="prm-completer-")))
        complete = transformers_completer(folder, p.max_new_tokens)
        soft = p.label_source == "mc_soft"
        return dataset.map(lambda row: {"labels": monte_carlo_step_labels(
            row["prompt"], row["completions"], row["answer"], complete, p.rollouts, p.separator, soft)})

    @hookimpl
    def trl_ext_reward_functions(self, stage):
        if stage.trainer == TRAINING:
            return None
        return [RewardFunction(self.name, self.scorer, self.params.weight)]

    @hookimpl
    def trl_ext_trainer_created(self, trainer):
        self.scorer.bind(trainer)
