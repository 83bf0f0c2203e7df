"""``self_judge``: the policy being trained judges its own group pairwise; Copeland win rate as the reward, and its
judging is trained jointly (REINFORCE on the verdict tokens with a swap-consistency reward)."""

from __future__ import annotations

import math

import torch
from pydantic import Field, model_validator
from trl.trainer.utils import selective_log_softmax

from trl_ext import metrics as figures
from trl_ext import Plugin, PluginParams, hookimpl, ops
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
    temperature: float = Field(1.0, ge=0, description="judge-mode sampling temperature; 0 = greedy (only with "
                               "judge_loss_weight 0: the judge policy gradient needs sampled verdicts)")
    judge_loss_weight: float = Field(1.0, ge=0, description="weight of the judge REINFORCE term added to the GRPO "
                                     "loss (joint training of the judging); 0 disables joint training")
    batch_size: int = Field(16, gt=0, description="judge prompts per generate call")
    use_chat_template: bool = Field(True, description="wrap the judge prompt in the tokenizer's chat template when "
                                    "it has one")

    @model_validator(mode="after")
    def _sampled_verdicts(self):
        if self.judge_loss_weight > 0 and self.temperature <= 0:
            raise ValueError("judge_loss_weight > 0 trains the judging by policy gradient and needs sampled verdicts: "
                             "set temperature > 0, or judge_loss_weight: 0 for a greedy, untrained judge")
        return self


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


def verdict_rewards(verdicts: dict[tuple[int, int], float | None], jobs: list[tuple[int, int]]) -> list[float]:
    """Consistency reward of each ordered verdict ``(a, b)`` in ``jobs``: the swap consistency of the pair
    ``1 - |v(a, b) + v(b, a) - 1|`` (1 = same winner in both orders), 0 when either order is unparsable. Both
    verdicts of a pair get the same reward."""
    out = []
    for a, b in jobs:
        v_ab, v_ba = verdicts.get((a, b)), verdicts.get((b, a))
        out.append(0.0 if v_ab is None or v_ba is None else judging.swap_consistency(v_ab, v_ba))
    return out


def judge_advantages(rewards: torch.Tensor, mean: float | None = None) -> torch.Tensor:
    """Baseline-subtracted advantages over the judge samples of one generation batch: r - mean(r) (no std scaling,
    so an all-consistent or all-inconsistent batch gives exactly zero). ``mean``: the batch mean when ``rewards`` is
    one rank's share of it."""
    if not rewards.numel():
        return rewards
    return rewards - (rewards.mean() if mean is None else mean)


def pack_judge_sequences(prompts: list[list[int]], verdicts: list[list[int]], pad_id: int
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask, verdict_ids, verdict_mask): prompts left-padded to a common length and verdicts
    right-padded after them, so the verdict tokens are the last ``V`` positions (TRL's completion layout)."""
    width_p = max(len(p) for p in prompts)
    width_v = max(max(len(v) for v in verdicts), 1)
    rows, masks, v_ids, v_mask = [], [], [], []
    for prompt, verdict in zip(prompts, verdicts, strict=True):
        lp, lv = width_p - len(prompt), width_v - len(verdict)
        rows.append([pad_id] * lp + prompt + verdict + [pad_id] * lv)
        masks.append([0] * lp + [1] * (len(prompt) + len(verdict)) + [0] * lv)
        v_ids.append(verdict + [pad_id] * lv)
        v_mask.append([1] * len(verdict) + [0] * lv)
    return (torch.tensor(rows), torch.tensor(masks), torch.tensor(v_ids), torch.tensor(v_mask))


def verdict_logps(model, prompts: list[list[int]], verdicts: list[list[int]], pad_id: int,
                  temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(per-token log pi_theta(verdict token | judge prompt, earlier verdict tokens) ``(B, V)``, mask ``(B, V)``),
    with the logits divided by the sampling ``temperature`` (TRL's convention for sampled completions) and position
    ids counted over real tokens only, as ``generate`` does for left-padded prompts."""
    ids, mask, v_ids, v_mask = pack_judge_sequences(prompts, verdicts, pad_id)
    device = next(model.parameters()).device
    ids, mask, v_ids, v_mask = ids.to(device), mask.to(device), v_ids.to(device), v_mask.to(device)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    width_v = v_ids.shape[1]
    logits = model(input_ids=ids, attention_mask=mask, position_ids=positions, logits_to_keep=width_v + 1).logits
    logits = logits[:, :-1, :] / temperature
    return selective_log_softmax(logits, v_ids), v_mask


def judge_policy_loss(logps: torch.Tensor, mask: torch.Tensor, advantages: torch.Tensor,
                      normalizer: float) -> torch.Tensor:
    """REINFORCE on verdict tokens: -(1 / normalizer) * sum_i A_i * sum_t log pi(verdict_i,t)."""
    # torch.where, not a product with the mask: a -inf log-prob at a padded verdict position would make the loss (and
    # its gradient) NaN through 0 * inf.
    return -(advantages.to(logps.dtype).unsqueeze(1) * ops.where_mask(logps, mask)).sum() / normalizer


class SelfJudge(Plugin):
    """Self-judging RL, SERL-style (Self-Examining RL, arXiv 2511.07922; origin: Self-Rewarding LMs, arXiv
    2401.10020): the policy judges its own groups, the actor reward is its pairwise win rate, and the judging itself
    is trained jointly with a swap-consistency reward.

    Actor side. The policy being trained (the trainer's current model, bound in ``trl_ext_trainer_created``) judges
    every ordered pair of its own group ("Verdict: A|B"), under ``no_grad`` and in eval mode, sampled at
    ``temperature`` (default 1.0; pure sampling, top-p 1, top-k off). With P(i > j) = (v(i, j) + 1 - v(j, i)) / 2,
    the actor reward is the Copeland win rate of sample i within its group (win 1, tie 1/2, loss 0, averaged over the
    G - 1 opponents; verdicts A>B, A>C, B>C give [1, 0.5, 0]). Groups are consecutive rows sharing a prompt; an
    unparsable verdict counts as a tie and is counted in ``self_judge/unparsable*``. Judge consistency (agreement
    under order swap, 1 - |v(i, j) + v(j, i) - 1| per pair) is logged as ``self_judge/consistency`` and, with
    ``consistency_weight`` > 0, also added as an actor reward column ``self_judge_consistency`` (per sample, mean
    over its pairs).

    Judge side (joint training, ``judge_loss_weight`` > 0, GRPO trainer only). Each verdict is an action of the same
    policy: sequence = judge prompt (exactly the ids fed to ``generate``, chat template included) + sampled verdict
    tokens (up to and including the first EOS). Its reward is the swap consistency of its pair (1 when both orders
    name the same winner, 0 when the position decided or either order is unparsable; both verdicts of a pair share
    it), its advantage ``A = r - mean(r)`` over all judge samples of the generation batch, every rank's (baseline
    only, no std scaling). The term added to the loss, through ``trl_ext_extra_loss``, is plain REINFORCE

        L_judge = -judge_loss_weight * (1 / N) * sum_i A_i * sum_t log pi_theta(verdict_i,t | prompt_i, verdict_i,<t)

    with N the verdict tokens of the generation batch on every rank (token mean, as DAPO) and log pi computed with the
    logits divided by ``temperature`` (the distribution the verdicts were sampled from, TRL's convention for
    completions) and position ids counted over real tokens (as ``generate`` does). Gradient accumulation: the judge
    samples are split in order into ``steps_per_generation`` chunks, one per training micro-batch of the generation
    batch, and chunk k contributes ``-(sum over chunk k) / (N * grad_accum_steps / steps_per_generation)``, so one
    optimizer step of a generation batch adds exactly L_judge (the core's ``global_token_mean`` scaling). Each chunk is
    used once: with ``num_iterations`` > 1 only the first pass over a generation batch trains the judging (no importance
    ratio or clipping here, so later passes would be off-policy). The forward runs the ``model`` the GRPO loss runs
    (``LossInputs.extra["model"]``, the DDP/DeepSpeed-wrapped module), so gradient synchronisation covers the term;
    ``trainer.model`` (unwrapped) is only a fallback for hosts that do not pass it. Logged: ``self_judge/judge_loss``
    (token-mean REINFORCE loss of the chunk, unweighted), ``self_judge/judge_tokens``, ``self_judge/judge_reward`` (mean
    verdict reward of the batch). ``judge_loss_weight`` 0 leaves the GRPO loss untouched.

    Limits / not protected: a degenerate judge that always names the same *answer content* regardless of quality is
    rewarded as consistent (consistency is no correctness signal; SERL relies on it only as a self-consistency
    regulariser); the judge sequences are forwarded in one batch per micro-batch (memory ~ G (G - 1) / steps per
    generation sequences of judge-prompt length); with several processes each rank trains on its own judge samples,
    with the batch-wide mean and N (N / processes per rank, as gradients are averaged), and ranks holding different
    numbers of verdicts (equal prompts merged into one group) still make the same number of judge generate calls and
    forwards, padded with placeholder ones whose output is dropped, since a ZeRO-3 or FSDP policy runs them
    collectively; the RLOO trainer has no loss seam, so joint training is refused there (use ``judge_loss_weight:
    0``); greedy judging (``temperature`` 0) is only allowed without joint training.
    Cost: G (G - 1) policy generations of ``max_new_tokens`` per group per step, plus one forward/backward of those
    sequences when the judging is trained.
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
        self._pending: dict | None = None  # judge samples of the last training generation batch, for the loss

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
        extra = {f"{self.name}/consistency": mean_c}
        judge_rewards = self._record_judge_samples(groups, verdicts)
        if judge_rewards:
            extra[f"{self.name}/judge_reward"] = sum(judge_rewards) / len(judge_rewards)
        self.stats.log(log_metric, extra)
        return rewards

    def _record_judge_samples(self, groups, verdicts) -> list[float]:
        """Keep (judge prompt ids, verdict ids, advantage) of each verdict of a training batch for the loss hook."""
        trainer = getattr(self.judge, "trainer", None)
        sequences = getattr(self.judge, "last_sequences", None)
        jobs = judging.pair_jobs(groups)
        if self.params.judge_loss_weight <= 0 or trainer is None or not trainer.model.training:
            return []
        usable = bool(sequences) and len(sequences) == len(jobs)
        judge_rewards = [r for g, a, b in jobs for r in verdict_rewards(verdicts[g], [(a, b)])] if usable else []
        # The baseline and the token normaliser span every rank's verdicts, as one process computes them on the same
        # global batch (gradients are then averaged over ranks, hence tokens / processes). Every rank reaches this
        # once per training generation batch, so the reduction is collective even for a rank with nothing usable.
        totals = torch.tensor([sum(judge_rewards), len(judge_rewards),
                               sum(len(s[1]) for s in sequences) if usable else 0], dtype=torch.float64)
        accelerator = getattr(trainer, "accelerator", None)
        world = accelerator.num_processes if accelerator is not None else 1
        if world > 1:
            totals = accelerator.reduce(totals.to(accelerator.device), reduction="sum").cpu()
        if not usable:  # an empty share: on several processes the loss hook still forwards in step (see there)
            sequences, judge_rewards = [], []
        self._pending = {
            "prompts": [s[0] for s in sequences], "verdicts": [s[1] for s in sequences],
            "advantages": judge_advantages(torch.tensor(judge_rewards, dtype=torch.float64),
                                           totals[0].item() / max(totals[1].item(), 1.0)),
            "tokens": totals[2].item() / world, "cursor": 0, "calls": 0,
        }
        return judge_rewards

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
    def trl_ext_validate_stage(self, stage, plugins):
        errors = []
        if self.params.judge_loss_weight > 0 and stage.trainer != "grpo":
            errors.append(f"plugin {self.name!r}: judge_loss_weight > 0 (joint training of the judging) needs the "
                          f"grpo trainer's loss seam; on {stage.trainer!r} set judge_loss_weight: 0")
        split = judging.split_group_error(stage, self.name)
        return errors + ([split] if split else []) or None

    @hookimpl
    def trl_ext_trainer_created(self, trainer):
        self.judge.bind(trainer)

    @hookimpl
    def trl_ext_extra_loss(self, inputs):
        pending = self._pending
        if self.params.judge_loss_weight <= 0 or not inputs.training or pending is None:
            return None
        n, steps = len(pending["verdicts"]), max(inputs.steps_per_generation, 1)
        start = pending["cursor"]
        if inputs.num_processes > 1:
            # Every rank forwards on each micro-batch of the first pass, a rank whose share is used up on a one-token
            # placeholder weighted 0 (figures zeros, the same keys on every rank): ranks can hold different numbers of
            # verdicts, and a ZeRO-3 or FSDP model's forward and backward are collective.
            if pending["calls"] >= steps:  # a later pass over the generation batch (num_iterations > 1)
                return None
            pending["calls"] += 1
        elif start >= n:
            return None
        stop = min(n, start + math.ceil(n / steps))
        pending["cursor"] = stop
        trainer = self.judge.trainer
        model = inputs.extra["model"] if inputs.extra.get("model") is not None else trainer.model
        pad = trainer.processing_class.pad_token_id
        prompts, verdicts = ((pending["prompts"][start:stop], pending["verdicts"][start:stop]) if stop > start
                             else ([[pad]], [[pad]]))
        logps, mask = verdict_logps(model, prompts, verdicts, pad, self.params.temperature)
        if stop == start:
            mask = torch.zeros_like(mask)
        advantages = (pending["advantages"][start:stop] if stop > start
                      else torch.zeros(1, dtype=torch.float64)).to(logps.device)
        normalizer = pending["tokens"] * inputs.grad_accum_steps / inputs.steps_per_generation
        loss = judge_policy_loss(logps, mask, advantages, normalizer or 1.0)  # 0 tokens on every rank: a 0 term
        # over every rank's verdict tokens (a plain float logged rank 0's chunk only)
        inputs.metrics[f"{self.name}/judge_loss"] = figures.mean(
            judge_policy_loss(logps.detach(), mask, advantages, 1.0), mask.sum())
        inputs.metrics[f"{self.name}/judge_tokens"] = figures.Summed((mask.sum(),), float)
        return self.params.judge_loss_weight * loss
