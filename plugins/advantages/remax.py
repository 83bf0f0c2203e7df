"""``remax``: the reward of the greedy decode of each prompt as the baseline."""

from __future__ import annotations

import copy
from contextlib import contextmanager
from typing import Literal

import torch
from pydantic import Field
from trl import GRPOTrainer
from trl.data_utils import is_conversational

from trl_ext import Plugin, Slot, hookimpl
from trl_ext_plugins.advantages.math import remax_advantages, remax_token_advantages, sequence_kl_rewards
from trl_ext_plugins.advantages.rollout import RewardKLHooks, RewardKLParams, gathered, local, reward_kl


class ReMaxParams(RewardKLParams):
    kl_coef: float = Field(0.0, ge=0.0, description="beta of the KL folded into the sampled completions' rewards "
                           "(verl use_kl_in_reward with kl_ctrl.kl_coef, 0.001 there; 0: off, as before).")
    kl_level: Literal["token", "sequence"] = Field(
        "token", description="How the KL enters the advantage. token (verl compute_remax_outcome_advantage): "
        "A_t = sum_{s >= t} r_s - b with r_s = 1[s = last] R - beta KL_s, so each token carries its reward-to-go KL; "
        "sequence (TRL RLOOTrainer's form): A = R - beta sum_t KL_t - b on every token.")
    kl_in_loss: bool = Field(False, description="With kl_coef > 0: false (ReMax paper, verl) keeps the KL only in the "
                             "reward (no loss term; args.beta is set to 1.0 when the recipe leaves it 0, only so TRL "
                             "computes the reference); true also keeps the recipe's args.beta k3 loss term.")


@contextmanager
def greedy_decoding(trainer):
    """Switch the trainer's transformers generation to greedy decoding for the duration of the block."""
    saved = trainer.generation_config, trainer.generation_kwargs
    config = copy.deepcopy(trainer.generation_config)
    config.do_sample = False
    for name in ("temperature", "top_p", "top_k", "min_p"):
        setattr(config, name, None)
    trainer.generation_config = config
    trainer.generation_kwargs = {**trainer.generation_kwargs, "do_sample": False, "temperature": None,
                                 "top_p": None, "top_k": None, "min_p": None}
    try:
        yield
    finally:
        trainer.generation_config, trainer.generation_kwargs = saved


def greedy_rewards(trainer, prompts: list, inputs: list[dict]) -> torch.Tensor:
    """Greedy-decode ``prompts`` (one completion each) and score them with the trainer's reward functions.

    Returns the weighted total reward of every rank's prompts, gathered ``(P_global,)`` (NaN where unscorable).
    TRL's own ``_calculate_rewards`` does the scoring (and the gather); trl-ext's reward-shaping hooks are not applied.
    """
    prompt_ids, images, multimodal_fields = trainer._tokenize_prompts(prompts)
    with greedy_decoding(trainer):
        completion_ids, _ = trainer._generate_single_turn(prompt_ids, images, multimodal_fields, 1)
    if is_conversational({"prompt": prompts[0]}):
        texts = trainer.processing_class.batch_decode(completion_ids, skip_special_tokens=True)
        completions = [[{"role": "assistant", "content": text}] for text in texts]
    else:
        completions = trainer.processing_class.batch_decode(completion_ids, skip_special_tokens=True)
    per_func = GRPOTrainer._calculate_rewards(trainer, inputs, prompts, completions, completion_ids)
    totals = (per_func * trainer.reward_weights.to(per_func.device).unsqueeze(0)).nansum(dim=1)
    totals[torch.isnan(per_func).all(dim=1)] = torch.nan
    return totals


class ReMax(RewardKLHooks, Plugin):
    """ReMax (Li et al., ICML 2024, arXiv 2310.10505): ``A(x, y) = R(x, y) - R(x, y_greedy(x))``.

    Each rollout, every prompt is decoded once more *greedily* (one extra generation per prompt, not per sample),
    scored with the stage's reward functions, and that reward is the baseline of all the prompt's samples; the
    advantage is broadcast to every token. No critic.

    Conventions: the greedy completion is scored by TRL's reward computation on the raw (unshaped) rewards, with the
    same reward weights; trl-ext reward-shaping plugins apply to the sampled rewards only. Unscorable rows (sampled or
    greedy) get advantage 0. The paper uses one sample per prompt (``num_generations: 1``) with KL in the reward;
    here any ``num_generations`` works and the KL is the GRPO trainer's ``args.beta`` term in the loss. Requires each
    rank's rollout batch to hold whole prompt groups (TRL's default sampler does when the per-device generation batch
    is a multiple of ``num_generations``) and transformers generation (``use_vllm`` is refused: the greedy pass would
    need a separate vLLM sampling configuration).

    KL in the reward (off by default, ``kl_coef: 0``; the paper trains with the KL in the reward): ``KL_t`` from
    ``log pi_old - log pi_ref`` on the loss tokens (``kl_estimator`` k1 default, k2/k3; optional ``kl_clamp``), and
    ``kl_level`` says how it enters: ``token`` (default, verl's ReMax: ``A_t = G_t - b``, ``G_t`` the return-to-go
    of the KL-penalised token rewards; ``(B, T)`` advantages) or ``sequence`` (``A = R - kl_coef * sum_t KL_t - b``,
    broadcast). The greedy baseline ``b`` is the raw reward of the greedy completion, with no KL (verl's).
    Logged: ``remax/kl``.
    """

    name = "remax"
    family = "advantage"
    trainers = frozenset({"grpo"})
    slots = frozenset({Slot.ADVANTAGE})
    Params = ReMaxParams

    def __init__(self, params=None):
        super().__init__(params)
        self.needs = self._reward_kl_needs()

    @hookimpl
    def trl_ext_validate_stage(self, stage, plugins):
        if stage.args.get("use_vllm"):
            return ["plugin 'remax': args.use_vllm is not supported (the greedy baseline pass uses transformers "
                    "generation)"]
        return []

    @hookimpl
    def trl_ext_compute_advantages(self, rewards, batch):
        group = batch.num_generations
        start, stop = batch.process_slice.start, batch.process_slice.stop
        if start % group or (stop - start) % group:
            raise ValueError(f"remax: this rank's rows [{start}, {stop}) do not hold whole groups of {group}; make "
                             "the per-device generation batch a multiple of num_generations")
        rows = range(0, stop - start, group)
        baseline = greedy_rewards(batch.trainer, [batch.prompts[i] for i in rows], [batch.inputs[i] for i in rows])
        baseline = baseline.to(rewards.device)
        # baseline is every rank's (greedy_rewards gathers), so the kept groups are the gathered batch's too: this
        # rank's keep mask alone raised a shape error on every multi-process run
        kept_groups = torch.ones(baseline.numel(), dtype=torch.bool) if batch.keep is None else \
            batch.keep.cpu().view(-1, group).any(dim=1)
        # over the groups that train: a group a filter dropped (e.g. deferred by partial_rollout) leaves the figure
        batch.metrics["remax/greedy_reward_mean"] = torch.nanmean(baseline[kept_groups.to(baseline.device)]).item()
        p = self.params
        if p.kl_coef <= 0:
            return local(remax_advantages(rewards, baseline, group), batch)
        kl = reward_kl(batch, p.kl_estimator, p.kl_clamp, "remax/kl")
        if p.kl_level == "sequence":
            penalised = sequence_kl_rewards(rewards, gathered(kl.sum(-1), batch), p.kl_coef)
            return local(remax_advantages(penalised, baseline, group), batch)
        rows = local(baseline.repeat_interleave(group), batch)
        return remax_token_advantages(local(rewards, batch).float(), rows.float(), batch.loss_mask, kl, p.kl_coef)
