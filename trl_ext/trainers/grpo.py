"""GRPO-family trainer: TRL's ``GRPOTrainer`` with hook calls at its generation, reward, advantage and loss seams.

With no plugin implementing a seam's hooks, each override returns TRL's own result untouched (bit-for-bit parity is
tested in tests/test_parity.py).

TRL 1.16 internals relied on (re-check when widening the TRL pin):
* ``_generate(prompts)`` returns the 8-tuple documented in ``trl_ext_generate``;
* ``_calculate_rewards(inputs, prompts, completions, completion_ids_list)`` returns gathered ``(N, F)`` rewards;
* ``_generate_and_score_completions(inputs)`` returns a dict with ``advantages`` ``(B,)``, ``completion_mask``,
  ``num_items_in_batch`` and optional ``old_per_token_logps``, ``sampling_per_token_logps``, ``ref_per_token_logps``,
  ``importance_sampling_ratio``, ``tool_mask``;
* ``_compute_loss(model, inputs)`` with ``loss_is_scaled_for_ga`` semantics (the loss handles gradient accumulation);
* ``_get_per_token_logps_and_entropies`` and ``self._metrics[mode]`` for logging.
"""

from __future__ import annotations

import contextlib

import torch
from accelerate.utils import gather
from trl import GRPOTrainer

from trl_ext import ops
from trl_ext.batches import LossInputs, RolloutBatch
from trl_ext.trainers.base import HostMixin

ROLLOUT_HOOKS = ("trl_ext_shape_rewards", "trl_ext_filter_groups", "trl_ext_compute_advantages")
LOSS_HOOKS = ("trl_ext_policy_loss", "trl_ext_token_weights", "trl_ext_aggregate_loss", "trl_ext_extra_loss")

# TRL loss types re-expressed by trl-ext's loss pipeline (used when some plugin customises only part of the loss).
# Objectives take (inputs, ratio) and return the per-token loss; aggregations take (loss, mask, inputs).
DEFAULT_OBJECTIVES = {
    "grpo": lambda li, r: ops.ppo_clip_objective(r, li.advantages, li.epsilon_low, li.epsilon_high),
    "bnpo": lambda li, r: ops.ppo_clip_objective(r, li.advantages, li.epsilon_low, li.epsilon_high),
    "dr_grpo": lambda li, r: ops.ppo_clip_objective(r, li.advantages, li.epsilon_low, li.epsilon_high),
    "dapo": lambda li, r: ops.ppo_clip_objective(r, li.advantages, li.epsilon_low, li.epsilon_high),
    "cispo": lambda li, r: ops.cispo_objective(r, li.per_token_logps, li.advantages, li.epsilon_high),
    "sapo": lambda li, r: ops.sapo_objective(r, li.advantages, li.extra["sapo_tau_pos"], li.extra["sapo_tau_neg"]),
}


def scale_per_micro_batch(loss: torch.Tensor, ctx) -> torch.Tensor:
    """TRL's GA scaling for micro-batch-normalised losses: divide by the accumulation steps in training."""
    return loss / (ctx.grad_accum_steps if ctx.training else 1.0)


def global_token_mean(per_token_loss: torch.Tensor, mask: torch.Tensor, ctx) -> torch.Tensor:
    """Token-mean over the whole generation batch on all ranks (DAPO; TRL ``dapo``/``cispo``): sum / global tokens.

    ``num_items_in_batch`` spans the generation batch of every process, so it is rescaled to one accumulation window.
    """
    normalizer = torch.as_tensor(ctx.num_items_in_batch).clamp(min=1.0) / ctx.num_processes
    if ctx.training:
        normalizer = normalizer * ctx.grad_accum_steps / ctx.steps_per_generation
    return (per_token_loss * mask).sum() / normalizer


DEFAULT_AGGREGATIONS = {
    "grpo": lambda l, m, c: scale_per_micro_batch(ops.seq_mean_token_mean(l, m), c),
    "sapo": lambda l, m, c: scale_per_micro_batch(ops.seq_mean_token_mean(l, m), c),
    "bnpo": lambda l, m, c: scale_per_micro_batch(ops.token_mean(l, m), c),
    "dr_grpo": lambda l, m, c: scale_per_micro_batch(ops.constant_normalized(l, m, c.max_completion_length), c),
    "dapo": global_token_mean,
    "cispo": global_token_mean,
}

# TRL features the trl-ext loss pipeline does not re-implement; refused at validation when a loss plugin is active.
UNSUPPORTED_WITH_LOSS_PLUGINS = {
    "off_policy_mask_threshold": None,
    "top_entropy_quantile": 1.0,
    "entropy_coef": 0.0,
    "use_adaptive_entropy": False,
    "delta": None,
}


class ExtGRPOTrainer(HostMixin, GRPOTrainer):
    """TRL's GRPOTrainer plus trl-ext seams (see the module docstring)."""

    def __init__(self, *args, plugin_host, **kwargs):
        self._init_host(plugin_host)
        self._pending_rollout: RolloutBatch | None = None
        self._loss_extra_keys: tuple[str, ...] = ()  # RolloutBatch.loss_extras keys, forwarded to LossInputs.extra
        super().__init__(*args, **kwargs)

    # -- generation -------------------------------------------------------------------------------------------------

    def _generate(self, prompts):
        if not self.plugin_host.implements("trl_ext_model_forward"):
            return self._generate_with_plugins(prompts)
        inputs = {"prompts": prompts}
        with self._forward_contexts("generate", self.model, inputs):
            inputs["output"] = self._generate_with_plugins(prompts)
        return inputs["output"]

    def _generate_with_plugins(self, prompts):
        if not self.plugin_host.implements("trl_ext_generate"):
            return super()._generate(prompts)
        result = self.plugin_host.hook.trl_ext_generate(trainer=self, prompts=prompts, generate=super()._generate)
        return super()._generate(prompts) if result is None else result

    # -- rewards and advantages -------------------------------------------------------------------------------------

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        if not any(self.plugin_host.implements(h) for h in ROLLOUT_HOOKS):
            return rewards_per_func
        device = rewards_per_func.device
        pad = self._tokenizer.pad_token_id
        width = max((len(ids) for ids in completion_ids_list), default=0)
        ids = torch.full((len(completion_ids_list), width), pad, dtype=torch.long, device=device)
        mask = torch.zeros_like(ids)
        for row, seq in enumerate(completion_ids_list):
            ids[row, : len(seq)] = torch.as_tensor(seq, device=device)
            mask[row, : len(seq)] = 1
        lengths = gather(mask.sum(-1))
        rank = self.accelerator.process_index
        batch = RolloutBatch(
            rewards_per_func=rewards_per_func,
            reward_names=list(self.reward_func_names),
            reward_weights=self.reward_weights.to(device),
            num_generations=self.num_generations if self.model.training else self.num_generations_eval,
            process_slice=slice(rank * len(prompts), (rank + 1) * len(prompts)),
            completion_ids=ids,
            completion_mask=mask,
            completion_lengths=lengths,
            prompts=prompts,
            completions=completions,
            inputs=inputs,
            trainer=self,
        )
        rewards_per_func = self.plugin_host.call_pipeline("trl_ext_shape_rewards", rewards_per_func, batch=batch)
        batch.rewards_per_func = rewards_per_func
        self._pending_rollout = batch
        return rewards_per_func

    def _generate_and_score_completions(self, inputs):
        if self.model.training and self.plugin_host.implements("trl_ext_refill_groups"):
            output = self.plugin_host.hook.trl_ext_refill_groups(trainer=self, inputs=inputs, score=self._score_round)
            if output is not None:
                return output
        return self._score_round(inputs)[0]

    def _score_round(self, inputs):
        """One generation round: TRL's generate-and-score plus the rollout hooks -> (output, gathered keep or None)."""
        self._scoring = True  # log-prob forwards from here on are the old-policy / reference passes
        try:
            output = super()._generate_and_score_completions(inputs)
        finally:
            self._scoring = False
        batch, self._pending_rollout = self._pending_rollout, None
        if batch is None:
            return output, None
        batch.completion_mask = output["completion_mask"]
        batch.completion_ids = output["completion_ids"]
        batch.old_per_token_logps = output.get("old_per_token_logps")
        batch.sampling_per_token_logps = output.get("sampling_per_token_logps")
        batch.ref_per_token_logps = output.get("ref_per_token_logps")
        batch.prompt_ids, batch.prompt_mask = output.get("prompt_ids"), output.get("prompt_mask")

        # Total reward exactly as TRL weighs it; rows no function could score stay NaN.
        rewards = (batch.rewards_per_func * batch.reward_weights.unsqueeze(0)).nansum(dim=1)
        rewards[torch.isnan(batch.rewards_per_func).all(dim=1)] = torch.nan

        keep = None
        for mask in self.plugin_host.hook.trl_ext_filter_groups(rewards=rewards, batch=batch):
            keep = mask if keep is None else keep & mask
        advantages = self.plugin_host.hook.trl_ext_compute_advantages(rewards=rewards, batch=batch)
        if advantages is not None:
            output["advantages"] = advantages.detach()
        output.update(batch.loss_extras)
        self._loss_extra_keys = tuple(batch.loss_extras)
        if keep is not None:
            local_keep = keep[batch.process_slice].to(output["completion_mask"].dtype)
            adv = output["advantages"]
            output["advantages"] = adv * (local_keep if adv.dim() == 1 else local_keep.unsqueeze(1))
            output["completion_mask"] = output["completion_mask"] * local_keep.unsqueeze(1)
            loss_mask = output["completion_mask"] * output.get("tool_mask", 1)
            output["num_items_in_batch"] = self.accelerator.gather(loss_mask.sum()).sum()
            batch.metrics["groups/kept_fraction"] = keep.float().mean().item()
        self._log_plugin_metrics(batch.metrics)
        return output, keep

    # -- loss -------------------------------------------------------------------------------------------------------

    def _compute_loss(self, model, inputs):
        with self._forward_contexts("train", model, inputs):
            if not any(self.plugin_host.implements(h) for h in LOSS_HOOKS):
                return super()._compute_loss(model, inputs)
            return self._plugin_loss(model, inputs)

    def _plugin_loss(self, model, inputs):
        """trl-ext's loss pipeline: objective -> token weights -> (+ beta * KL) -> aggregation -> + extra terms."""
        prompt_ids, prompt_mask = inputs["prompt_ids"], inputs["prompt_mask"]
        completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
        input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
        attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
        mask = completion_mask if "tool_mask" not in inputs else completion_mask * inputs["tool_mask"]
        per_token_logps, entropies, aux_loss = self._get_per_token_logps_and_entropies(
            model, input_ids, attention_mask, completion_ids.size(1), compute_entropy=True,
            compute_aux_loss=self.aux_loss_enabled,
        )
        advantages = inputs["advantages"]
        if advantages.dim() == 1:
            advantages = advantages.unsqueeze(1)
        old = inputs.get("old_per_token_logps")
        training = self.model.training
        li = LossInputs(
            num_items_in_batch=inputs["num_items_in_batch"],
            grad_accum_steps=self.current_gradient_accumulation_steps if training else 1,
            steps_per_generation=self.args.steps_per_generation,
            num_processes=self.accelerator.num_processes,
            training=training,
            loss_type=self.loss_type,
            max_completion_length=self.max_completion_length,
            per_token_logps=per_token_logps,
            old_per_token_logps=per_token_logps.detach() if old is None else old,
            advantages=advantages,
            mask=mask.to(per_token_logps.dtype),
            sampling_per_token_logps=inputs.get("sampling_per_token_logps"),
            ref_per_token_logps=inputs.get("ref_per_token_logps"),
            entropies=entropies.detach() if entropies is not None else None,
            epsilon_low=self.epsilon_low,
            epsilon_high=self.epsilon_high,
            beta=self.beta,
            extra={
                "completion_ids": completion_ids,
                "model": model,  # the (possibly DDP-wrapped) model this loss runs, for extra forward passes
                "sapo_tau_pos": self.args.sapo_temperature_pos,
                "sapo_tau_neg": self.args.sapo_temperature_neg,
                "importance_sampling_level": self.importance_sampling_level,
                **{key: inputs[key] for key in self._loss_extra_keys if key in inputs},
            },
        )
        host = self.plugin_host
        per_token_loss = host.hook.trl_ext_policy_loss(inputs=li)
        if per_token_loss is None:
            per_token_loss = DEFAULT_OBJECTIVES[self.loss_type](li, self._trl_ratio(li))

        loss_mask = li.mask
        for contribution in host.hook.trl_ext_token_weights(inputs=li):
            if contribution.weight is not None:
                per_token_loss = per_token_loss * contribution.weight.detach()
            if contribution.mask is not None:
                loss_mask = loss_mask * contribution.mask.to(loss_mask.dtype)
        if "importance_sampling_ratio" in inputs:  # TRL's vLLM correction, kept when a plugin changes the loss
            per_token_loss = per_token_loss * inputs["importance_sampling_ratio"]
        if self.beta != 0.0:
            per_token_kl = ops.kl_k3(per_token_logps, inputs["ref_per_token_logps"])
            if self.args.use_bias_correction_kl:  # TRL's default: importance-weight the KL by pi_theta/pi_old
                per_token_kl = per_token_kl * self._trl_ratio(li)
            per_token_loss = per_token_loss + self.beta * per_token_kl
            li.metrics["kl"] = self._masked_global_mean(per_token_kl, li.mask)

        loss = host.hook.trl_ext_aggregate_loss(per_token_loss=per_token_loss, mask=loss_mask, inputs=li)
        if loss is None:
            loss = DEFAULT_AGGREGATIONS[self.loss_type](per_token_loss, loss_mask, li)
        for term in host.hook.trl_ext_extra_loss(inputs=li):
            loss = loss + term
        if self.aux_loss_enabled:
            loss = loss + self.router_aux_loss_coef * aux_loss / li.grad_accum_steps

        li.metrics["entropy"] = self._masked_global_mean(entropies, li.mask)
        li.metrics["loss_mask/kept_fraction"] = (loss_mask.sum() / li.mask.sum().clamp(min=1.0)).item()
        self._log_plugin_metrics(li.metrics)
        return loss

    def _trl_ratio(self, li: LossInputs) -> torch.Tensor:
        """TRL's importance ratio: per token, or the length-normalised sequence ratio (GSPO) when so configured."""
        log_ratio = li.log_ratio
        if self.importance_sampling_level == "sequence":
            log_ratio = ((log_ratio * li.mask).sum(-1) / li.mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
        return torch.exp(log_ratio)

    # -- model forward contexts (trl_ext_model_forward) -------------------------------------------------------------

    def _forward_contexts(self, phase, model, inputs):
        """Every plugin's ``trl_ext_model_forward`` context for one pass, entered in recipe order (a no-op when no
        plugin implements the hook)."""
        with contextlib.ExitStack() as stack:
            if self.plugin_host.implements("trl_ext_model_forward"):
                for context in self.plugin_host.hook.trl_ext_model_forward(trainer=self, model=model, phase=phase,
                                                                           inputs=inputs):
                    if context is not None:
                        stack.enter_context(context)
            return stack.pop_all()

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None,
                                           **kwargs):
        if not getattr(self, "_scoring", False) or not self.plugin_host.implements("trl_ext_model_forward"):
            return super()._get_per_token_logps_and_entropies(model, input_ids, attention_mask, logits_to_keep,
                                                              batch_size, **kwargs)
        phase = "reference" if self._is_reference_pass(model) else "old_policy"
        inputs = {"input_ids": input_ids, "attention_mask": attention_mask, "logits_to_keep": logits_to_keep,
                  "batch_size": batch_size or input_ids.size(0)}
        with self._forward_contexts(phase, model, inputs):
            return super()._get_per_token_logps_and_entropies(model, input_ids, attention_mask, logits_to_keep,
                                                              batch_size, **kwargs)

    def _is_reference_pass(self, model) -> bool:
        """TRL's reference forward: the separate reference model, or the policy with its PEFT adapter disabled (new
        adapter) or its ``ref`` adapter active (re-trained adapter), as ``trl.trainer.utils.use_adapter`` sets it."""
        if self.ref_model is not None and model is self.ref_model:
            return True
        unwrapped = self.accelerator.unwrap_model(model)
        if not hasattr(unwrapped, "peft_config"):
            return False
        from peft.tuners.tuners_utils import BaseTunerLayer

        if getattr(unwrapped, "active_adapter", None) == "ref":
            return True
        layer = next((m for m in unwrapped.modules() if isinstance(m, BaseTunerLayer)), None)
        return layer is not None and layer.disable_adapters

    def _masked_global_mean(self, values: torch.Tensor, mask: torch.Tensor) -> float:
        totals = self.accelerator.reduce(torch.stack([(values * mask).sum(), mask.sum()]).detach(), reduction="sum")
        return (totals[0] / totals[1].clamp(min=1.0)).item()
