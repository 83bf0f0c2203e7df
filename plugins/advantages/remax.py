"""``remax``: the reward of the greedy decode of each prompt as the baseline."""

from __future__ import annotations

import copy
from contextlib import contextmanager

import torch
from trl import GRPOTrainer
from trl.data_utils import is_conversational

from trl_ext import NoParams, Plugin, Slot, hookimpl
from trl_ext_plugins.advantages.math import remax_advantages
from trl_ext_plugins.advantages.rollout import local


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


class ReMax(Plugin):
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
    """

    name = "remax"
    family = "advantage"
    trainers = frozenset({"grpo"})
    slots = frozenset({Slot.ADVANTAGE})
    Params = NoParams

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
        advantages = remax_advantages(rewards, baseline.to(rewards.device), group)
        batch.metrics["remax/greedy_reward_mean"] = torch.nanmean(baseline).item()
        return local(advantages, batch)
