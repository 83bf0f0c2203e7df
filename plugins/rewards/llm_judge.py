"""``llm_judge``: a judge model's pointwise score or order-averaged pairwise preference as the reward."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from trl_ext import Plugin, PluginParams, hookimpl
from trl_ext.rewards import RewardFunction
from trl_ext_plugins.rewards import formulas, judging


class JudgeBackendParams(PluginParams):
    """Where the judge runs and how it decodes (shared by ``llm_judge`` and ``checklist_judge``)."""

    path: str | None = Field(None, description="local judge: a transformers causal LM (`stage:<name>`, "
                             "`embedded:<name>` or a folder); exclusive with `endpoint`")
    endpoint: str | None = Field(None, description="remote judge: base URL of an OpenAI-compatible server "
                                 "(`http://host:8000/v1`) or its `/chat/completions` URL; exclusive with `path`")
    model: str | None = Field(None, description="remote judge: the `model` field of each chat-completions request")
    api_key_env: str | None = Field(None, description="remote judge: environment variable holding a bearer key "
                                    "(read at call time); None: no Authorization header")
    timeout: float = Field(30.0, gt=0, description="remote judge: seconds per request; a timeout is a fallback")
    concurrency: int = Field(8, gt=0, description="remote judge: requests in flight at once")
    reasoning: bool = Field(False, description="ask for reasoning before a final verdict line (the parser reads the "
                            "last verdict); give max_new_tokens room for it")
    max_new_tokens: int = Field(16, gt=0, description="tokens the judge may generate per verdict")
    temperature: float = Field(0.0, ge=0, description="judge sampling temperature; 0 = greedy")
    batch_size: int = Field(16, gt=0, description="local judge: judge prompts per generate call")
    use_chat_template: bool = Field(True, description="local judge: wrap the judge prompt in the tokenizer's chat "
                                    "template when it has one")
    weight: float = Field(1.0, description="weight of this reward in the weighted sum of reward functions")


class LLMJudgeParams(JudgeBackendParams):
    mode: Literal["pointwise", "pairwise"] = Field(
        "pointwise", description="pointwise: each completion scored alone on [scale_min, scale_max], normalised to "
        "[0, 1]; pairwise: the completions of a group compared two by two, both orders averaged")
    template: str | None = Field(
        None, description="judge prompt (str.format). Pointwise fields: {prompt} {completion} {low} {high} "
        "{instruction}; pairwise: {prompt} {answer_a} {answer_b} {instruction}. None: the built-in template")
    scale_min: float = Field(1.0, description="pointwise: lowest score the judge may give")
    scale_max: float = Field(10.0, description="pointwise: highest score the judge may give")
    fallback: float = Field(0.0, description="reward of a completion whose verdict(s) could not be parsed (or whose "
                            "request failed); counted in the `llm_judge/unparsable` metrics")
    pairwise_aggregation: Literal["mean", "copeland"] = Field(
        "mean", description="pairwise: reward = mean P(i > j) over the group (mean) or Copeland win rate")


def backend_errors(plugin: str, p) -> list[str]:
    """Validation messages for the judge-source parameters."""
    errors = []
    if (p.path is None) == (p.endpoint is None):
        errors.append(f"plugin '{plugin}': set exactly one of params.path (local judge model) and "
                      "params.endpoint (OpenAI-compatible server)")
    if p.endpoint is not None and p.model is None:
        errors.append(f"plugin '{plugin}': params.model is required with params.endpoint")
    return errors


def make_backend(p) -> object:
    """The judge backend the parameters name (``path`` -> local model, ``endpoint`` -> HTTP)."""
    if p.endpoint is not None:
        return judging.EndpointJudge(p.endpoint, p.model, p.max_new_tokens, p.temperature, p.timeout, p.concurrency,
                                     p.api_key_env)
    return judging.LocalJudge(p.path, p.max_new_tokens, p.temperature, p.batch_size, p.use_chat_template)


def pairwise_rewards(verdicts: dict[tuple[int, int], float | None], size: int, aggregation: str,
                     fallback: float) -> list[float]:
    """Rewards of one group from its ordered verdicts: mean order-averaged win probability (or Copeland win rate);
    a sample none of whose verdicts parsed gets ``fallback`` (as does a group of one)."""
    if size < 2:
        return [fallback] * size
    p, _ = judging.preference_matrix(verdicts, size)
    values = (judging.mean_win_probability(p) if aggregation == "mean" else formulas.copeland_win_rates(p)).tolist()
    informed = [any(verdicts.get((i, j)) is not None or verdicts.get((j, i)) is not None
                    for j in range(size) if j != i) for i in range(size)]
    return [v if ok else fallback for v, ok in zip(values, informed)]


class JudgeReward(Plugin):
    """Shared base of the judge-scored reward plugins (not selectable): builds the judge backend once from the
    validated parameters (none when they are incomplete; validation then names the problem) and its counters."""

    family = "reward"
    trainers = frozenset({"grpo", "rloo"})

    def __init__(self, params=None):
        super().__init__(params)
        self.backend = None if backend_errors(self.name, self.params) else make_backend(self.params)
        self.stats = judging.JudgeStats(self.name)


class LLMJudge(JudgeReward):
    """LLM-as-a-judge reward (Zheng et al., arXiv 2306.05685; generative verifiers, GenRM arXiv 2408.15240).

    **Judge.** A local transformers causal LM (``path``: ``stage:``/``embedded:``/folder, loaded lazily and frozen on
    the trainer's device) or an OpenAI-compatible chat-completions server (``endpoint`` + ``model``, e.g. vLLM),
    greedy by default (``temperature`` 0), ``max_new_tokens`` per verdict.

    **Pointwise** (default): r = (s - scale_min) / (scale_max - scale_min), s the judge's 1-10 score ("Score: 7").
    Conventions: the verdict score, not GenRM's P("Yes") (a generative judge behind an API exposes text, not logits);
    the last verdict in the reply counts (``reasoning: true`` asks for a rationale first, as CoT judges do).

    **Pairwise**: within each group (consecutive rows sharing a prompt) every pair is judged in *both* orders and
    P(i > j) = (v(i, j) + 1 - v(j, i)) / 2 (v = 1 when the first-shown answer wins), which removes position bias and
    makes P(i > j) + P(j > i) = 1; the reward is the mean of P(i > j) over the other G - 1 samples (or the Copeland
    win rate). An unparsable single verdict counts as a tie. Cost: G (G - 1) judge calls per group.

    **Fallback.** A verdict that does not parse (see :mod:`trl_ext_plugins.rewards.judging` for the grammar: out of
    range, several bare numbers, no number, empty) or a failed request gives the completion ``fallback`` (0.0); the
    counts are logged through TRL's ``log_metric`` as ``llm_judge/unparsable_frac``, ``llm_judge/unparsable``,
    ``llm_judge/request_errors`` and the running ``llm_judge/unparsable_total``.
    """

    name = "llm_judge"
    Params = LLMJudgeParams

    @hookimpl
    def trl_ext_validate_stage(self, stage, plugins):
        p = self.params
        errors = backend_errors(self.name, p)
        if p.scale_max <= p.scale_min:
            errors.append("plugin 'llm_judge': params.scale_max must exceed params.scale_min")
        split = judging.split_group_error(stage, self.name) if p.mode == "pairwise" else None
        return errors + ([split] if split else [])

    def template(self) -> str:
        if self.params.template is not None:
            return self.params.template
        return judging.POINTWISE_TEMPLATE if self.params.mode == "pointwise" else judging.PAIRWISE_TEMPLATE

    def score(self, prompts, completions, log_metric=None, **_kwargs) -> list[float]:
        p = self.params
        if self.backend is None:
            raise ValueError("llm_judge: no judge configured (set params.path or params.endpoint + params.model)")
        self.stats.start()
        prompts_t = [judging.as_text(x) for x in prompts]
        answers = [judging.as_text(x) for x in completions]
        if p.mode == "pointwise":
            instruction = judging.POINTWISE_INSTRUCTION[p.reasoning]
            texts = [self.template().format(prompt=q, completion=a, low=_fmt(p.scale_min), high=_fmt(p.scale_max),
                                            instruction=instruction) for q, a in zip(prompts_t, answers, strict=True)]
            scores = judging.judge_scores(self.backend, texts, p.scale_min, p.scale_max, self.stats)
            rewards = [p.fallback if s is None else judging.normalise_score(s, p.scale_min, p.scale_max)
                       for s in scores]
        else:
            groups = judging.groups_of(prompts_t)
            verdicts = judging.judge_groups(self.backend, prompts_t, groups, answers, self.template(),
                                            judging.PAIRWISE_INSTRUCTION[p.reasoning], self.stats)
            rewards = [0.0] * len(answers)
            for rows, group_verdicts in zip(groups, verdicts, strict=True):
                for row, value in zip(rows, pairwise_rewards(group_verdicts, len(rows), p.pairwise_aggregation,
                                                             p.fallback)):
                    rewards[row] = value
        self.stats.log(log_metric)
        return rewards

    @hookimpl
    def trl_ext_reward_functions(self, stage):
        return [RewardFunction(self.name, self.score, self.params.weight)]

    @hookimpl
    def trl_ext_trainer_created(self, trainer):
        if self.backend is not None:
            self.backend.bind(trainer)


def _fmt(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)

