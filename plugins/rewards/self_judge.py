"""``self_judge``: the policy being trained judges its own group pairwise; Copeland win rate as the reward."""

from __future__ import annotations

from pydantic import Field

from trl_ext import Plugin, PluginParams, hookimpl
from trl_ext.rewards import RewardFunction
from trl_ext_plugins.rewards import formulas, judging

CONSISTENCY = "self_judge_consistency"


class SelfJudgeParams(PluginParams):
    weight: float = Field(1.0, description="weight of the actor reward (Copeland win rate) in the weighted sum")
    consistency_weight: float = Field(
        0.0, ge=0, description="> 0 adds a reward column `self_judge_consistency` with this weight: per sample, the "
        "mean swap-consistency of the verdicts on its pairs; 0: consistency is only logged")
    reasoning: bool = Field(False, description="ask for reasoning before a final 'Verdict: A|B' line")
    template: str | None = Field(None, description="pairwise judge prompt (str.format): {prompt} {answer_a} "
                                 "{answer_b} {instruction}; None: the built-in template")
    max_new_tokens: int = Field(8, gt=0, description="tokens the policy may generate per verdict")
    temperature: float = Field(0.0, ge=0, description="judge-mode sampling temperature; 0 = greedy")
    batch_size: int = Field(16, gt=0, description="judge prompts per generate call")
    use_chat_template: bool = Field(True, description="wrap the judge prompt in the tokenizer's chat template when "
                                    "it has one")


def group_rewards(verdicts: dict[tuple[int, int], float | None], size: int) -> tuple[list[float], list[float]]:
    """(Copeland win rates, per-sample mean swap-consistency) of one group from its ordered verdicts.

    P(i > j) is order-averaged (an unparsable verdict counts as a tie); a pair's consistency is 1 when both orders
    name the same winner, 0 when the position decided (or a verdict is unparsable).
    """
    if size < 2:
        return [0.5] * size, [1.0] * size
    p, c = judging.preference_matrix(verdicts, size)
    consistency = (c.sum(dim=1) - 1.0) / (size - 1)  # drop the diagonal's 1
    return formulas.copeland_win_rates(p).tolist(), consistency.tolist()


class SelfJudge(Plugin):
    """Self-judging RL, SERL-style actor reward (Self-Examining RL, arXiv 2511.07922; origin: Self-Rewarding LMs,
    arXiv 2401.10020).

    The policy being trained (the trainer's current model, bound in ``trl_ext_trainer_created``) judges every pair of
    its own group in both orders ("Verdict: A|B"), greedy by default, under ``no_grad`` and in eval mode. With
    P(i > j) = (v(i, j) + 1 - v(j, i)) / 2, the actor reward is the Copeland win rate of sample i within its group
    (win 1, tie 1/2, loss 0, averaged over the G - 1 opponents; verdicts A>B, A>C, B>C give [1, 0.5, 0]). Groups are
    consecutive rows sharing a prompt; an unparsable verdict counts as a tie and is counted in
    ``self_judge/unparsable*``.

    Judge consistency (agreement under order swap, 1 - |v(i, j) + v(j, i) - 1| per pair) is logged as
    ``self_judge/consistency`` and, with ``consistency_weight`` > 0, added as the reward column
    ``self_judge_consistency`` (per sample, mean over its pairs).

    Not implemented: SERL's *joint training of the judging*. That needs the judge-mode generations (judge prompt +
    verdict tokens) to enter the policy-gradient batch as extra sequences with their own (consistency) advantages;
    the GRPO seam only lets a plugin reweight, mask or add loss terms for the actor completions, so the verdicts here
    shape the actor reward only and the consistency reward reaches the actor samples, not the verdict tokens.
    Cost: G (G - 1) policy generations of ``max_new_tokens`` per group per step.
    """

    name = "self_judge"
    family = "reward"
    trainers = frozenset({"grpo", "rloo"})
    Params = SelfJudgeParams

    def __init__(self, params=None):
        super().__init__(params)
        p = self.params
        self.judge = judging.PolicyJudge(p.max_new_tokens, p.temperature, p.batch_size, p.use_chat_template)
        self.stats = judging.JudgeStats(self.name)
        self._consistency: tuple[int, list[float]] | None = None

    def score(self, prompts, completions, log_metric=None, **_kwargs) -> list[float]:
        p = self.params
        self.stats.start()
        prompts_t = [judging.as_text(x) for x in prompts]
        answers = [judging.as_text(x) for x in completions]
        groups = judging.groups_of(prompts_t)
        verdicts = judging.judge_groups(self.judge, prompts_t, groups, answers,
                                        p.template or judging.PAIRWISE_TEMPLATE,
                                        judging.PAIRWISE_INSTRUCTION[p.reasoning], self.stats)
        rewards, consistency = [0.0] * len(answers), [1.0] * len(answers)
        pair_consistency: list[float] = []
        for rows, group_verdicts in zip(groups, verdicts, strict=True):
            wins, cons = group_rewards(group_verdicts, len(rows))
            _, c = judging.preference_matrix(group_verdicts, len(rows))
            pair_consistency.extend(c[i, j].item() for i in range(len(rows)) for j in range(i + 1, len(rows)))
            for k, row in enumerate(rows):
                rewards[row], consistency[row] = wins[k], cons[k]
        self._consistency = (id(completions), consistency)
        mean_c = sum(pair_consistency) / len(pair_consistency) if pair_consistency else 1.0
        self.stats.log(log_metric, {f"{self.name}/consistency": mean_c})
        return rewards

    def consistency(self, prompts, completions, **kwargs) -> list[float]:
        """The consistency column, from the actor call on the same batch (TRL calls reward functions in order)."""
        if self._consistency is None or self._consistency[0] != id(completions):
            self.score(prompts, completions, **{k: v for k, v in kwargs.items() if k == "log_metric"})
        return self._consistency[1]

    @hookimpl
    def trl_ext_reward_functions(self, stage):
        out = [RewardFunction(self.name, self.score, self.params.weight)]
        if self.params.consistency_weight > 0:
            out.append(RewardFunction(CONSISTENCY, self.consistency, self.params.consistency_weight))
        return out

    @hookimpl
    def trl_ext_trainer_created(self, trainer):
        self.judge.bind(trainer)
