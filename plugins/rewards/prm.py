"""``prm``: process reward model, trained on the ``prm`` trainer with per-step labels, used as a reward by product/min."""

from __future__ import annotations

import logging
from typing import Literal

import torch
from pydantic import Field

from trl_ext import Plugin, PluginParams, hookimpl
from trl_ext.rewards import RewardFunction
from trl_ext_plugins.rewards import formulas
from trl_ext_plugins.rewards.judging import as_text
from trl_ext_plugins.rewards.llm_judge import JudgeBackendParams
from trl_ext_plugins.rewards.scoring import STAGE_PREFIX, LazyScorer, resolve_ref

TRAINING = "prm"
logger = logging.getLogger("trl_ext.rewards.prm")


class PRMJudgeParams(JudgeBackendParams):
    """The judge of ``label_source: judge`` (the ``judge:`` mapping of the prm plugin's params)."""

    labels: Literal["hard", "soft"] = Field("hard", description="hard: 1 if score >= threshold else 0; soft: the "
                                            "score normalised to [0, 1]")
    scale_min: float = Field(1.0, description="lowest score the judge may give")
    scale_max: float = Field(10.0, description="highest score the judge may give")
    threshold: float | None = Field(None, description="hard labels: a step is correct when its score >= threshold "
                                    "(on the judge's scale); None: the midpoint (scale_min + scale_max) / 2")
    fallback: float = Field(0.0, ge=0.0, le=1.0, description="label of a step whose verdict could not be parsed (or "
                            "whose request failed): 0 treats it as wrong; counted in the judge stats")
    template: str | None = Field(None, description="judge prompt (str.format) with {prompt} {previous} {step} {low} "
                                 "{high} {instruction}; None: the built-in step template")
    weight: float = Field(1.0, description="unused here (the shared judge schema's reward weight; the prm reward's "
                          "weight is the plugin's own `weight`)")


class PRMParams(PluginParams):
    separator: str = Field("\n", description="step separator: appended after each step; the step's score is read at "
                           "its last token (training and scoring)")
    label_source: Literal["dataset", "mc_hard", "mc_soft", "judge"] = Field(
        "dataset", description="training: step labels from the dataset's `labels` column, Math-Shepherd Monte-Carlo "
        "estimates from `completer` rollouts (hard: any rollout correct; soft: fraction correct), or a judge's "
        "verdict on each step prefix (`judge`)")
    completer: str | None = Field(None, description="training with mc_*: the completer policy (a folder or "
                                  "`embedded:<name>`)")
    rollouts: int = Field(8, gt=0, description="training with mc_*: N completions per step (Math-Shepherd N=8)")
    max_new_tokens: int = Field(16, gt=0, description="training with mc_*: tokens per completer rollout")
    judge: PRMJudgeParams | None = Field(None, description="training with label_source judge: the judge (path or "
                                         "endpoint + model, labels hard/soft, scale, threshold, fallback, ...)")
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


def _local_model(ref: str) -> str:
    """A local folder for the completer's or judge's model reference. Inside a run an ``embedded:`` model is the run's
    own copy (``<output_dir>/_embedded/<name>``, the run's seed), so labelling writes nothing outside the output
    directory; outside a run, as :func:`~trl_ext_plugins.rewards.scoring.resolve_ref` resolves it."""
    from trl_ext.runner import current_run, resolve_model_ref

    ctx = current_run()
    return resolve_model_ref(ref, ctx) if ctx is not None else resolve_ref(ref, None)


class PRMScorer(LazyScorer):
    """Scores completions: split into steps, step probabilities, aggregated (product / min / last)."""

    def __init__(self, params: PRMParams, split: bool = True):
        super().__init__(lambda run_dir: load_token_classifier(resolve_ref(params.path, run_dir)), params.batch_size)
        self.params = params
        self.split = split  # False (ORM): the whole completion is one step, exactly as in training

    def __call__(self, prompts, completions, **_kwargs) -> list[float]:
        model, tok = self.ensure_loaded()
        steps = [split_steps(as_text(c), self.params.separator) if self.split else [as_text(c)] for c in completions]
        # a conversational prompt is scored with its question text (as_text: the last message), not dropped
        probs = step_probabilities(model, tok, [as_text(p) for p in prompts], steps, self.params.separator,
                                   self.batch_size)
        return [formulas.aggregate_step_scores(p, self.params.aggregation).item() for p in probs]


class PRM(Plugin):
    """Process reward model (Lightman et al., arXiv 2305.20050; Math-Shepherd MC labels, arXiv 2312.08935).

    **Training** (``trainer: prm``, see :mod:`trl_ext.trainers.prm`). Design choice: a token-classification head with
    one logit, trained with BCE at the last token of the separator after each step (``L = -sum_s [y_s log r(s) +
    (1 - y_s) log(1 - r(s))]``, averaged over the labelled steps of a batch), which takes hard and soft labels alike
    (Lightman's 3-class labels map to 1 for positive/neutral, 0 for negative, "neutral as positive"). Rows are
    ``prompt``, ``completions`` (steps), ``labels``. Label sources (``label_source``):

    * ``dataset`` (default): the dataset's ``labels`` column.
    * ``mc_hard`` / ``mc_soft``: Math-Shepherd estimates from ``rollouts`` completions of ``completer`` per step prefix
      (hard: 1 if any reaches the gold ``answer``; soft: the fraction that does; default N = 8 as in the paper); the
      last step is labelled by its own final answer.
    * ``judge``: LLM-as-judge labels (Qwen "lessons of developing PRMs", arXiv 2501.07301). Every step prefix
      (question + steps 1..k, the last step included) is shown to the judge (``judge.path``: a local transformers
      model, folder or ``embedded:<name>``; or ``judge.endpoint`` + ``judge.model``: an OpenAI-compatible server; the
      backends and the verdict parser of ``llm_judge``), which rates whether step k is correct on
      ``[judge.scale_min, judge.scale_max]`` (default 1-10, "Score: n", greedy). ``judge.labels: hard`` (default): 1
      if score >= ``judge.threshold`` (default the scale's midpoint, 5.5: scores 6-10 are correct), else 0; ``soft``:
      (s - min) / (max - min). Conventions: no gold answer is shown (the judge checks the step, as in the paper's
      critic setting); an unparsable verdict or failed request gets ``judge.fallback`` (default 0: an unjudged step
      counts as wrong, the conservative side for a PRM) and is counted: ``judge_summary`` holds
      ``prm/judge/unparsable``, ``prm/judge/request_errors``, ``prm/judge/verdicts`` and a warning is logged. Cost: one
      judge call per step. A ``stage:`` judge is refused (labels are built before the stage starts).

    ``mc_*`` and ``judge`` labels are built on the main process only and handed to every rank (rollouts and verdicts
    need not agree across ranks).

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
        self.judge_stats = None  # label_source judge: counts of the last labelling (verdicts, unparsable, errors)
        self.judge_summary: dict[str, float] = {}

    @hookimpl
    def trl_ext_validate_stage(self, stage, plugins):
        p, errors = self.params, []
        if stage.trainer == TRAINING:
            if p.path is not None:
                errors.append(f"plugin {self.name!r}: params.path is for RL stages; a prm stage trains its model")
            if p.label_source.startswith("mc_") and p.completer is None:
                errors.append(f"plugin {self.name!r}: params.completer is required with label_source {p.label_source!r}")
            errors.extend(self._judge_errors())
            if p.completer is not None and p.completer.startswith(STAGE_PREFIX):
                errors.append(f"plugin {self.name!r}: params.completer must be a folder or embedded:<name> (labels are "
                              "built before the stage starts)")
        elif p.path is None:
            errors.append(f"plugin {self.name!r}: params.path is required in a {stage.trainer} stage")
        return errors

    def _judge_errors(self) -> list[str]:
        from trl_ext_plugins.rewards.llm_judge import backend_errors

        p, j, name = self.params, self.params.judge, f"plugin {self.name!r}"
        if p.label_source != "judge":
            return [f"{name}: params.judge is only read with label_source 'judge'"] if j is not None else []
        if j is None:
            return [f"{name}: params.judge is required with label_source 'judge' (set judge.path to a local model or "
                    "judge.endpoint + judge.model for an OpenAI-compatible server)"]
        errors = [e.replace("params.", "params.judge.") for e in backend_errors(self.name, j)]
        if j.path is not None and j.path.startswith(STAGE_PREFIX):
            errors.append(f"{name}: params.judge.path must be a folder or embedded:<name> (labels are built before "
                          "the stage starts)")
        if j.scale_max <= j.scale_min:
            errors.append(f"{name}: params.judge.scale_max must exceed params.judge.scale_min")
        elif j.threshold is not None and not j.scale_min <= j.threshold <= j.scale_max:
            errors.append(f"{name}: params.judge.threshold ({j.threshold}) must lie in [scale_min, scale_max] = "
                          f"[{j.scale_min}, {j.scale_max}]")
        return errors

    @hookimpl
    def trl_ext_configure_args(self, trainer, args):
        return {"step_separator": self.params.separator} if trainer == TRAINING else None

    @hookimpl
    def trl_ext_prepare_dataset(self, dataset, split, stage):
        p = self.params
        if stage.trainer != TRAINING or p.label_source == "dataset":
            return None
        from trl_ext_plugins.rewards.steps import monte_carlo_step_labels, transformers_completer

        from trl_ext_plugins.preference.generation import on_main_process

        # Labelled on the main process only; every rank trains on its labels (rollouts and judge verdicts need not
        # agree across ranks, and each rank would pay for its own). The judge's counts come along to every rank.
        if p.label_source == "judge":
            labelled, self.judge_summary = on_main_process(
                lambda: (self._judge_labels(dataset), self.judge_summary), self.name)
            return labelled

        def monte_carlo():
            folder = _local_model(p.completer)
            complete = transformers_completer(folder, p.max_new_tokens)
            soft = p.label_source == "mc_soft"
            return dataset.map(lambda row: {"labels": monte_carlo_step_labels(
                row["prompt"], row["completions"], row["answer"], complete, p.rollouts, p.separator, soft)})

        return on_main_process(monte_carlo, self.name)

    def _judge_labels(self, dataset):
        """``labels`` of every row from the judge (see :func:`steps.judge_step_labels`); the counts of verdicts,
        unparsable verdicts and failed requests are kept in ``self.judge_stats`` and logged."""
        from trl_ext_plugins.rewards import judging
        from trl_ext_plugins.rewards.llm_judge import make_backend
        from trl_ext_plugins.rewards.steps import STEP_JUDGE_TEMPLATE, judge_step_labels

        j = self.params.judge
        if j is None or self._judge_errors():
            raise ValueError("; ".join(self._judge_errors()))
        if j.path is not None:
            j = j.model_copy(update={"path": _local_model(j.path)})
        backend = make_backend(j)
        stats = self.judge_stats = judging.JudgeStats(f"{self.name}/judge")
        stats.start()

        def label(batch):
            return {"labels": judge_step_labels(
                batch["prompt"], batch["completions"], backend, stats, j.scale_min, j.scale_max, j.labels == "soft",
                j.threshold, j.fallback, j.template or STEP_JUDGE_TEMPLATE, judging.POINTWISE_INSTRUCTION[j.reasoning])}

        out = dataset.map(label, batched=True, batch_size=max(j.batch_size, 64), load_from_cache_file=False)
        summary = stats.metrics()
        (logger.warning if stats.unparsable else logger.info)(
            "prm judge labels: %d verdicts, %d unparsable (label %s), %d failed requests", stats.verdicts,
            stats.unparsable, j.fallback, stats.errors)
        self.judge_summary = {**summary, f"{self.name}/judge/verdicts": float(stats.verdicts)}
        return out

    @hookimpl
    def trl_ext_reward_functions(self, stage):
        if stage.trainer == TRAINING:
            return None
        return [RewardFunction(self.name, self.scorer, self.params.weight)]

    @hookimpl
    def trl_ext_trainer_created(self, trainer):
        self.scorer.bind(trainer)
