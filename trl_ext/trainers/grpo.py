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
* ``_get_train_sampler(dataset)`` returns the train ``RepeatSampler`` (replaced by ``trl_ext_train_sampler``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
from accelerate.utils import gather
from trl import GRPOTrainer

from trl_ext import metrics as figures
from trl_ext import ops
from trl_ext.batches import LossInputs, RolloutBatch
from trl_ext.trainers.base import HostMixin

ROLLOUT_HOOKS = ("trl_ext_shape_rewards", "trl_ext_filter_groups", "trl_ext_compute_advantages")
LOSS_HOOKS = ("trl_ext_policy_loss", "trl_ext_token_weights", "trl_ext_aggregate_loss", "trl_ext_extra_loss")


def vespo_objective(li: LossInputs) -> torch.Tensor:
    """TRL's VESPO loss (arXiv 2602.10693): ``-phi(w) * A * log pi`` with TRL's own Gamma weights
    (``GRPOTrainer.get_gamma_weights``, detached) of the sequence ratio ``w``, which folds in TRL's vLLM importance
    ratio when the batch has one (so the pipeline does not multiply it in again)."""
    vespo = li.extra["vespo"]
    phi = GRPOTrainer.get_gamma_weights(advantages=li.advantages, log_ratio_per_token=li.log_ratio, mask=li.mask,
                                        importance_sampling_ratio=li.extra.get("importance_sampling_ratio"),
                                        k_pos=vespo["k_pos"], lambda_pos=vespo["lambda_pos"], k_neg=vespo["k_neg"],
                                        lambda_neg=vespo["lambda_neg"])
    return -phi * li.advantages * li.per_token_logps


# TRL loss types re-expressed by trl-ext's loss pipeline (used when some plugin customises only part of the loss).
# Objectives take (inputs, ratio, delta) and return the per-token loss; delta (TRL's two-sided clip) applies to TRL's
# PPO-clip types (and luspo, PPO-clip on the sequence ratio) only, as in TRL. Aggregations take (loss, mask, inputs).
DEFAULT_OBJECTIVES = {
    **{loss_type: lambda li, r, delta: ops.ppo_clip_objective(r, li.advantages, li.epsilon_low, li.epsilon_high,
                                                             ratio_cap=delta)
       for loss_type in (*ops.PPO_CLIP_LOSS_TYPES, "luspo")},
    "cispo": lambda li, r, delta: ops.cispo_objective(r, li.per_token_logps, li.advantages, li.epsilon_high),
    "sapo": lambda li, r, delta: ops.sapo_objective(r, li.advantages, li.extra["sapo_tau_pos"],
                                                    li.extra["sapo_tau_neg"]),
    "vespo": lambda li, r, delta: vespo_objective(li),
}
# TRL objectives that already contain TRL's vLLM importance ratio
OBJECTIVES_WITH_IS_RATIO = frozenset({"vespo"})


@dataclass(frozen=True)
class TrlLossOptions:
    """TRL 1.16 ``GRPOConfig`` options the loss pipeline applies where TRL's ``_compute_loss`` does, so a recipe that
    sets them keeps their meaning when a plugin routes the loss through the pipeline (parity with TRL's own code:
    tests/test_losses_parity.py). The two token filters drop tokens as TRL does: a zero loss with the tokens still in
    the aggregation's denominator (a weight of 0 in convention 8's terms, applied with ``where``, not a mask).

    * ``off_policy_mask_threshold`` (DeepSeek-V3.2's off-policy sequence mask, arXiv 2512.02556, Eq. 9): a sequence
      with a negative advantage whose mean sampled-token ``log pi_sampler - log pi_theta`` exceeds the threshold
      trains no token; TRL's own ``GRPOTrainer.get_off_policy_mask`` decides. ``pi_sampler`` is the batch's sampling
      log-probs when it carries them, else ``pi_old``'s: TRL's rule, under which only vLLM provides them; here
      ``rollout_logprobs`` and ``partial_rollout`` do too, so stale or resumed tokens count as the sampler saw them.
    * ``top_entropy_quantile`` rho < 1 ("Beyond the 80/20 Rule", arXiv 2506.01939): only tokens whose entropy reaches
      the ``1 - rho`` quantile of every rank's loss tokens train; ``high_entropy_mask`` is the trainer's own
      ``get_high_entropy_mask`` (TRL's, which gathers the entropies over ranks, so every rank must call it).
    * ``entropy_coef``: the loss minus ``entropy_coef`` x the mean entropy of the trained tokens (after the entropy
      filter) of this micro-batch, divided by the accumulation steps only, whatever the aggregation (TRL's bonus).
      ``entropy_window``, when given, receives each training micro-batch's ``[entropy sum, token count]`` over those
      tokens: the trainer's adaptive controller (TRL's ``use_adaptive_entropy``, Skywork-OR1, arXiv 2505.22312) sums
      them over the accumulation window and moves ``entropy_coef`` at the optimizer step, as TRL does.
    * ``delta`` (INTELLECT-2's two-sided clip, arXiv 2505.07291): the unclipped ratio of TRL's PPO-clip objectives is
      capped at delta. A ``trl_ext_policy_loss`` plugin computes its own objective and does not read it, so ``delta``
      is refused with one (``grpo``'s ``dual_clip: delta`` is the same loss for ``delta >= 1 + epsilon_high``).
    """

    off_policy_mask_threshold: float | None = None
    top_entropy_quantile: float = 1.0
    entropy_coef: float = 0.0
    delta: float | None = None
    high_entropy_mask: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor] | None = None
    entropy_window: Callable[[torch.Tensor], None] | None = None


def scale_per_micro_batch(loss: torch.Tensor, ctx) -> torch.Tensor:
    """TRL's GA scaling for micro-batch-normalised losses: divide by the accumulation steps in training."""
    return loss / (ctx.grad_accum_steps if ctx.training else 1.0)


def per_kept_row(loss: torch.Tensor, ctx) -> torch.Tensor:
    """A micro-batch loss normalised by its row count, re-based on the rows ``trl_ext_filter_groups`` kept.

    Filtered rows (a group without reward variance, a group ``partial_rollout`` defers) keep their place in the
    micro-batch with a zero mask, so a mean over sequences still counted them, each adding 0: at a kept share ``f``
    the step was ``f`` times the one the kept rows alone give, which verl and slime (which remove such rows) and
    token-mean (whose count drops their tokens) do not do. Dividing by ``f`` (the generation batch's kept share,
    ``AggregationContext.kept_row_fraction``) makes the sum over micro-batches and ranks the mean over kept rows.
    """
    fraction = float(ctx.kept_row_fraction)
    return loss / fraction if fraction > 0 else loss  # nothing kept: every row is masked and the loss is 0 anyway


def global_token_mean(per_token_loss: torch.Tensor, mask: torch.Tensor, ctx) -> torch.Tensor:
    """Token-mean over the whole generation batch on all ranks (DAPO; TRL ``dapo``/``cispo``): sum / global tokens.

    ``num_items_in_batch`` spans the generation batch of every process, so it is rescaled to one accumulation window.
    In the loss pipeline it is the count *after* token masks (see :func:`compose_loss`), so tokens a correction masks
    leave the denominator.
    """
    normalizer = torch.as_tensor(ctx.num_items_in_batch).clamp(min=1.0) / ctx.num_processes
    if ctx.training:
        normalizer = normalizer * ctx.grad_accum_steps / ctx.steps_per_generation
    return ops.where_mask(per_token_loss, mask).sum() / normalizer


DEFAULT_AGGREGATIONS = {
    "grpo": lambda l, m, c: scale_per_micro_batch(per_kept_row(ops.seq_mean_token_mean(l, m), c), c),
    "sapo": lambda l, m, c: scale_per_micro_batch(per_kept_row(ops.seq_mean_token_mean(l, m), c), c),
    "bnpo": lambda l, m, c: scale_per_micro_batch(ops.token_mean(l, m), c),
    "dr_grpo": lambda l, m, c: scale_per_micro_batch(
        per_kept_row(ops.constant_normalized(l, m, c.max_completion_length), c), c),
    "dapo": global_token_mean,
    "cispo": global_token_mean,
    "vespo": global_token_mean,
    # LUSPO (arXiv 2602.05261): each sequence's loss is its token sum (scaled by its length), mean over sequences
    "luspo": lambda l, m, c: scale_per_micro_batch(per_kept_row(ops.seq_mean_token_sum(l, m), c), c),
}
# TRL loss types whose aggregation divides by the row count; TRL's own loss cannot leave filtered rows out of it, so a
# batch with filtered rows trains them through the pipeline (``ExtGRPOTrainer._compute_loss``).
ROW_NORMALIZED_LOSS_TYPES = frozenset({"grpo", "sapo", "dr_grpo", "luspo"})
KEPT_ROW_FRACTION = "kept_row_fraction"  # rollout dict key: the generation batch's kept share of rows (0-dim tensor)


def trl_group_advantages(rewards_per_func: torch.Tensor, reward_weights: torch.Tensor, num_generations: int,
                         scale_rewards: str, aggregation: str) -> torch.Tensor:
    """TRL 1.16's GRPO advantage (``GRPOTrainer._generate_and_score_completions``), gathered ``(N,)``, recomputed from
    the gathered ``(N, F)`` rewards; used when no plugin computes advantages but ``trl_ext_filter_groups`` dropped rows.

    The formula and the order of operations are TRL's (``nanmean``, TRL's ``nanstd``, ``+ 1e-4``), so kept rows get
    TRL's numbers bit for bit: ``sum_then_normalize``: ``(R - group mean) / (std + 1e-4)`` with the std per group
    (``scale_rewards="group"``), over the batch (``"batch"``) or none (``"none"``); ``normalize_then_sum``: each
    function normalised per group, the weighted sum then normalised over the batch. A row whose rewards are all NaN
    is unscorable: out of every mean and std, advantage 0 (TRL's rule, which the host uses for filtered rows).
    """
    from trl.trainer.utils import nanstd

    unscorable = torch.isnan(rewards_per_func).all(dim=1)
    weights = reward_weights.to(rewards_per_func.device).unsqueeze(0)
    if aggregation == "sum_then_normalize":
        rewards = (rewards_per_func * weights).nansum(dim=1)
        rewards[unscorable] = torch.nan
        centre = torch.nanmean(rewards.view(-1, num_generations), dim=1).repeat_interleave(num_generations, dim=0)
        if scale_rewards == "batch":
            std = nanstd(rewards).expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
        elif num_generations > 1:
            std = nanstd(rewards.view(-1, num_generations), dim=1).repeat_interleave(num_generations, dim=0)
        else:
            std = torch.zeros_like(rewards)
        advantages = rewards - centre
        if scale_rewards != "none":
            advantages = advantages / (std + 1e-4)
    elif aggregation == "normalize_then_sum":
        grouped = rewards_per_func.view(-1, num_generations, rewards_per_func.shape[1])
        mean_k = torch.nanmean(grouped, dim=1, keepdim=True)
        std_k = nanstd(grouped, dim=1, keepdim=True) if num_generations > 1 else torch.zeros_like(mean_k)
        rewards = (((grouped - mean_k) / (std_k + 1e-4)).view(-1, rewards_per_func.shape[1]) * weights).nansum(dim=1)
        rewards[unscorable] = torch.nan
        std = nanstd(rewards).expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
        advantages = (rewards - torch.nanmean(rewards)) / (std + 1e-4)
    else:
        raise ValueError(f"unknown multi_objective_aggregation {aggregation!r}")
    return torch.nan_to_num(advantages, nan=0.0)


def trl_ratio(li: LossInputs, importance_sampling_level: str = "token") -> torch.Tensor:
    """TRL's importance ratio pi_theta/pi_old: per token, or the length-normalised sequence ratio (GSPO) when
    ``importance_sampling_level == "sequence"``. Unlike TRL's unclamped ``exp``, the log-ratio is clamped to +-20
    (:func:`trl_ext.ops.safe_ratio`; values agree with TRL within the clamp) so an extreme token cannot overflow."""
    log_ratio = li.log_ratio
    if importance_sampling_level == "sequence":
        log_ratio = (ops.where_mask(log_ratio, li.mask).sum(-1) / li.mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    return ops.safe_ratio(log_ratio)


def mask_aware_token_count(num_items_in_batch, loss_mask: torch.Tensor, mask: torch.Tensor, reduce=None):
    """The global loss-token count after token masks: ``num_items_in_batch * kept / counted``, where ``kept`` and
    ``counted`` are this micro-batch's tokens after and before the masks, summed over all processes (``reduce``).

    Semantics (defect 1 of issue 10): masks come from the current policy, so they exist only per micro-batch; the
    exact kept count of a whole generation batch is unknown while its first micro-batch is being differentiated.
    The count is therefore the generation batch's count scaled by the kept fraction of the micro-batch being reduced
    (over all ranks). It is exact when one accumulation window is one micro-batch per process, or when every
    micro-batch keeps the same fraction; with no mask it is ``num_items_in_batch`` itself (TRL's semantics), and the
    scaling to one accumulation window and across processes stays :func:`global_token_mean`'s, as in TRL.
    """
    counts = torch.stack([loss_mask.sum(), mask.sum()]).detach().float()
    if reduce is not None:
        counts = reduce(counts)
    fraction = counts[0] / counts[1].clamp(min=1.0)
    total = torch.as_tensor(num_items_in_batch, device=counts.device)
    return total.float() * fraction


def compose_loss(host, li: LossInputs, *, loss_type: str, kl: ops.KLTerm, importance_sampling_level: str = "token",
                 importance_sampling_ratio: torch.Tensor | None = None, reduce=None,
                 trl_options: TrlLossOptions = TrlLossOptions(), entropies: torch.Tensor | None = None):
    """trl-ext's GRPO-family loss pipeline on one micro-batch, after the forward pass.

    Order: sanitise -> objective (``trl_ext_policy_loss`` or TRL's ``loss_type`` objective) -> token weights and masks
    (``trl_ext_token_weights``: weights multiply, masks AND) -> TRL's off-policy sequence mask and entropy filter
    (``trl_options``) -> TRL's vLLM ratio if given -> ``+ coef * KL`` (``kl``; coef = ``kl.coef``, else ``args.beta``)
    -> aggregation (``trl_ext_aggregate_loss`` or TRL's for ``loss_type``) -> ``- entropy_coef * entropy`` (TRL's
    bonus; ``entropies`` are the forward pass's, with their gradient) -> ``+`` extra terms. This is TRL's order.

    Conventions:

    * *Sanitising*: log-prob tensors are replaced by 0 outside ``li.mask`` with ``torch.where`` before any plugin sees
      them, so -inf or NaN at padding, tool or filtered positions cannot reach a loss or gradient.
    * *Which tokens count* (ALGORITHMS.md convention 8): a ``TokenWeights.mask`` removes tokens from the loss and from
      every denominator; a ``weight`` of 0 keeps them in it. Per aggregation: token-mean over the generation batch
      (TRL ``dapo``/``cispo``) divides by the mask-aware global count of :func:`mask_aware_token_count`, written back
      to ``li.num_items_in_batch`` for any aggregation (third-party ones too); per-micro-batch token-mean (``bnpo``)
      and seq-mean-token-mean (``grpo``, ``sapo``) divide by the kept tokens of the micro-batch or sequence; the
      constant-normalised ones (``dr_grpo``, token-sum, seq-mean-token-sum) have no token count.
    * ``reduce``: a cross-process sum (``None`` on one process); it is called only when some plugin returns a mask,
      which every rank then does (masks are a plugin's static behaviour), so the collective is matched.

    Returns ``(loss, loss_mask, per_token_kl or None)``.
    """
    mask = li.mask
    li.per_token_logps = ops.where_mask(li.per_token_logps, mask)
    li.old_per_token_logps = ops.where_mask(li.old_per_token_logps, mask)
    if li.ref_per_token_logps is not None:
        li.ref_per_token_logps = ops.where_mask(li.ref_per_token_logps, mask)
    if li.sampling_per_token_logps is not None:  # NaN on loss tokens means "not recorded" and is kept for the plugin
        li.sampling_per_token_logps = ops.where_mask(li.sampling_per_token_logps, mask)

    per_token_loss = host.hook.trl_ext_policy_loss(inputs=li)
    trl_objective = per_token_loss is None
    if trl_objective:
        li.extra["importance_sampling_ratio"] = importance_sampling_ratio
        per_token_loss = DEFAULT_OBJECTIVES[loss_type](li, trl_ratio(li, importance_sampling_level), trl_options.delta)

    loss_mask, masked = mask, False
    for contribution in host.hook.trl_ext_token_weights(inputs=li):
        if contribution.weight is not None:
            per_token_loss = per_token_loss * contribution.weight.detach()
        if contribution.mask is not None:
            loss_mask = ops.where_mask(loss_mask, contribution.mask)
            masked = True
    per_token_loss, entropy_kept = trl_token_filters(per_token_loss, li, trl_options)
    if importance_sampling_ratio is not None and not (trl_objective and loss_type in OBJECTIVES_WITH_IS_RATIO):
        per_token_loss = per_token_loss * importance_sampling_ratio  # TRL's vLLM correction, kept with plugins
    per_token_kl = None
    if kl.weight(li.beta) != 0.0:
        per_token_kl = kl.per_token(li.per_token_logps, li.ref_per_token_logps, trl_ratio(li, importance_sampling_level))
        per_token_loss = per_token_loss + kl.weight(li.beta) * per_token_kl
    if masked:
        li.num_items_in_batch = mask_aware_token_count(li.num_items_in_batch, loss_mask, mask, reduce)

    loss = host.hook.trl_ext_aggregate_loss(per_token_loss=per_token_loss, mask=loss_mask, inputs=li)
    if loss is None:
        loss = DEFAULT_AGGREGATIONS[loss_type](per_token_loss, loss_mask, li)
    if trl_options.entropy_coef != 0.0 or trl_options.entropy_window is not None:
        if entropies is None:
            raise ValueError("entropy_coef needs the forward pass's entropies")
        trained = mask if entropy_kept is None else ops.where_mask(mask, entropy_kept)
        entropy_sum = ops.where_mask(entropies, trained).sum()
        loss = loss - trl_options.entropy_coef * entropy_sum / trained.sum().clamp(min=1.0) / li.grad_accum_steps
        if trl_options.entropy_window is not None:
            trl_options.entropy_window(torch.stack([entropy_sum, trained.sum()]).detach())
    for term in host.hook.trl_ext_extra_loss(inputs=li):
        loss = loss + term
    return loss, loss_mask, per_token_kl


def trl_token_filters(per_token_loss: torch.Tensor, li: LossInputs,
                      options: TrlLossOptions) -> tuple[torch.Tensor, torch.Tensor | None]:
    """TRL's off-policy sequence mask and high-entropy filter (:class:`TrlLossOptions`) on ``per_token_loss``: dropped
    tokens get a zero loss and stay in the denominator, as in TRL. Returns the loss and the entropy filter's kept
    tokens (``None`` when off), which TRL's entropy bonus also averages over."""
    if options.off_policy_mask_threshold is not None:
        sampler = li.old_per_token_logps if li.sampling_per_token_logps is None else li.sampling_per_token_logps
        keep = GRPOTrainer.get_off_policy_mask(advantages=li.advantages, per_token_logps=li.per_token_logps,
                                               sampling_per_token_logps=sampler, mask=li.mask,
                                               off_policy_threshold=options.off_policy_mask_threshold)
        per_token_loss = torch.where(keep.bool(), per_token_loss, torch.zeros_like(per_token_loss))
        dropped = (keep == 0).sum()  # over every rank's sequences
        li.metrics["off_policy_mask/dropped_fraction"] = figures.mean(dropped, torch.as_tensor(keep.numel()))
    entropy_kept = None
    if options.top_entropy_quantile < 1.0:
        if options.high_entropy_mask is None or li.entropies is None:
            raise ValueError("top_entropy_quantile needs the entropies and the trainer's get_high_entropy_mask")
        entropy_kept = options.high_entropy_mask(li.entropies, li.mask, 1 - options.top_entropy_quantile)
        per_token_loss = torch.where(entropy_kept, per_token_loss, torch.zeros_like(per_token_loss))
    return per_token_loss, entropy_kept


# TRL options the pipeline re-expresses for TRL's own objectives only (TrlLossOptions holds every other GRPOConfig
# option of TRL 1.16 it once refused): refused when a trl_ext_policy_loss plugin computes the objective, with their
# neutral value and what to use instead
UNSUPPORTED_WITH_OBJECTIVE_PLUGINS = {
    "delta": (None, "the grpo plugin's dual_clip set to delta is the same loss for delta >= 1 + epsilon_high"),
}


def loss_pipeline_conflicts(args: dict, where: str, active: list[str], objectives: list[str] = ()) -> list[str]:
    """The TRL options in ``args`` that trl-ext's loss pipeline would silently ignore (or, for ``loss_type``, could not
    run), one message per field naming the plugins that route the loss through the pipeline (``active``) or compute
    the objective (``objectives``)."""
    errors = [f"{where}.args.{key}: applies to TRL's own objective only, not to plugin(s) {list(objectives)}; {instead}"
              for key, (neutral, instead) in UNSUPPORTED_WITH_OBJECTIVE_PLUGINS.items()
              if objectives and key in args and args[key] != neutral]
    loss_type = args.get("loss_type", "dapo")
    if loss_type not in DEFAULT_AGGREGATIONS:
        errors.append(f"{where}.args.loss_type: {loss_type!r} cannot be combined with loss plugin(s) {active}; "
                      f"use one of {sorted(DEFAULT_AGGREGATIONS)}")
    return errors


def routes_loss_through_pipeline(plugin, args: dict) -> bool:
    """Whether ``plugin`` makes the trainer run trl-ext's loss pipeline instead of TRL's ``_compute_loss``: it
    implements a loss hook, or it replaces the KL term (``uses_loss_pipeline(args)``, e.g. a KL folded into the reward
    drops the loss KL), which :meth:`ExtGRPOTrainer._compute_loss` also routes to the pipeline."""
    if any(h in plugin.implemented_hooks() for h in LOSS_HOOKS):
        return True
    if "trl_ext_filter_groups" in plugin.implemented_hooks() and args.get("loss_type", "dapo") in \
            ROW_NORMALIZED_LOSS_TYPES:
        return True  # filtered rows must leave the row count (per_kept_row), which TRL's loss does not do
    uses = getattr(plugin, "uses_loss_pipeline", None)
    return bool(uses(args)) if callable(uses) else False


def check_stage(host, stage, args: dict, where: str) -> list[str]:
    """GRPO's own validation (TrainerKind.check): the trl-ext loss pipeline re-expresses only some TRL options, so the
    others are refused up front when a plugin routes the loss through it."""
    active = [p.name for p in host.plugins if routes_loss_through_pipeline(p, args)]
    return loss_pipeline_conflicts(args, where, active, objective_plugins(host)) if active else []


def objective_plugins(host) -> list[str]:
    """The plugins that compute the per-token objective themselves (``trl_ext_policy_loss``)."""
    return [p.name for p in host.plugins if "trl_ext_policy_loss" in p.implemented_hooks()]


class ExtGRPOTrainer(HostMixin, GRPOTrainer):
    """TRL's GRPOTrainer plus trl-ext seams (see the module docstring)."""

    def __init__(self, *args, plugin_host, **kwargs):
        self._init_host(plugin_host)
        self._pending_rollout: RolloutBatch | None = None
        self._loss_extra_keys: tuple[str, ...] = ()  # RolloutBatch.loss_extras keys, forwarded to LossInputs.extra
        super().__init__(*args, **kwargs)
        # The loss pipeline's KL term (used when args.beta != 0): TRL's k3 with TRL's bias correction unless a plugin
        # (e.g. ``grpo`` with ``kl_estimator``) replaces it in ``trl_ext_trainer_created``.
        self.kl_term = ops.KLTerm("k3", bias_correction=bool(self.args.use_bias_correction_kl))

    # -- data -------------------------------------------------------------------------------------------------------

    def _get_train_sampler(self, dataset=None):
        return self._plugin_train_sampler(dataset, lambda: super(ExtGRPOTrainer, self)._get_train_sampler(dataset))

    # -- generation -------------------------------------------------------------------------------------------------

    def _generate(self, prompts):
        if not self.plugin_host.implements("trl_ext_model_forward"):
            output = self._generate_with_plugins(prompts)
        else:
            inputs = {"prompts": prompts}
            with self._forward_contexts("generate", self.model, inputs):
                inputs["output"] = self._generate_with_plugins(prompts)
            output = inputs["output"]
        # TRL builds the tool mask only after scoring; keep its per-row lists so reward shaping sees tool tokens too
        self._rollout_tool_mask = output[2]
        return output

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
        tool_mask = None
        tool_rows = getattr(self, "_rollout_tool_mask", None)
        if tool_rows is not None and len(tool_rows) == len(completion_ids_list):
            tool_mask = torch.ones_like(ids)  # TRL pads the tool mask with 1
            for row, values in enumerate(tool_rows):
                tool_mask[row, : len(values)] = torch.as_tensor(values, device=device)
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
            tool_mask=tool_mask,
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
        batch.tool_mask = output.get("tool_mask")
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
        batch.keep = keep  # batch-level advantage statistics must leave the filtered rows out (hook spec)
        advantages = self.plugin_host.hook.trl_ext_compute_advantages(rewards=rewards, batch=batch)
        if advantages is not None:
            output["advantages"] = advantages.detach()
        elif keep is not None and not bool(keep.all()):
            output["advantages"] = self._trl_advantages_of_kept_rows(batch, keep)
        output.update(batch.loss_extras)
        # Every key any round has produced (a key absent from a micro-batch is skipped in _plugin_loss): a training
        # generation batch is consumed over several optimizer steps (steps_per_generation, num_iterations), and an
        # evaluation in between must not drop the extras of the batch still being trained (partial_rollout's stale
        # mask silently stopped applying after an eval step).
        self._loss_extra_keys = tuple(dict.fromkeys((*self._loss_extra_keys, *batch.loss_extras)))
        if keep is not None:
            # where, not a product: an advantage plugin may leave NaN or inf at a filtered row, and 0 * NaN is NaN
            local_keep = keep[batch.process_slice].to(output["completion_mask"].device).bool()
            adv = output["advantages"]
            kept = local_keep if adv.dim() == 1 else local_keep.unsqueeze(1)
            output["advantages"] = torch.where(kept.to(adv.device), adv, torch.zeros_like(adv))
            mask = output["completion_mask"]
            output["completion_mask"] = torch.where(local_keep.unsqueeze(1), mask, torch.zeros_like(mask))
            loss_mask = output["completion_mask"] * output.get("tool_mask", 1)
            output["num_items_in_batch"] = self.accelerator.gather(loss_mask.sum()).sum()
            output[KEPT_ROW_FRACTION] = keep.float().mean()
            batch.metrics["groups/kept_fraction"] = output[KEPT_ROW_FRACTION].item()
        self._log_plugin_metrics(batch.metrics)
        return output, keep

    def _trl_advantages_of_kept_rows(self, batch: RolloutBatch, keep: torch.Tensor) -> torch.Tensor:
        """TRL's own advantage (no advantage plugin) of this rank's rows, as if the filtered rows had been removed.

        TRL computes it inside ``_generate_and_score_completions``, before the filters run, so the filtered rows were
        in its batch-level statistics (the std of ``scale_rewards="batch"``, ``normalize_then_sum``'s batch mean and
        std) and a row-level filter's rows in their group's. Recomputed with them unscorable; with nothing filtered
        TRL's tensor is kept untouched (parity)."""
        dropped = torch.full_like(batch.rewards_per_func, torch.nan)
        per_func = torch.where(keep.to(dropped.device).unsqueeze(1), batch.rewards_per_func, dropped)
        advantages = trl_group_advantages(per_func, batch.reward_weights, batch.num_generations, self.scale_rewards,
                                          self.multi_objective_aggregation)
        return advantages[batch.process_slice]

    # -- loss -------------------------------------------------------------------------------------------------------

    def _compute_loss(self, model, inputs):
        with self._forward_contexts("train", model, inputs):
            rows_filtered = float(inputs.get(KEPT_ROW_FRACTION, 1.0)) < 1.0
            if (self.kl_term.is_trl() and not any(self.plugin_host.implements(h) for h in LOSS_HOOKS)
                    and not (rows_filtered and self.loss_type in ROW_NORMALIZED_LOSS_TYPES)):
                return super()._compute_loss(model, inputs)
            self._check_loss_pipeline_args()
            return self._plugin_loss(model, inputs)

    def _check_loss_pipeline_args(self) -> None:
        """Refuse TRL options the loss pipeline does not implement, for whatever routed the loss here (validation
        refuses the known cases first; a KL term replaced in ``trl_ext_trainer_created`` is only known now)."""
        args = {key: getattr(self.args, key) for key in UNSUPPORTED_WITH_OBJECTIVE_PLUGINS}
        args["loss_type"] = self.loss_type
        reason = [p.name for p in self.plugin_host.plugins if any(h in p.implemented_hooks() for h in LOSS_HOOKS)]
        errors = loss_pipeline_conflicts(args, "args", reason or [f"kl_term={self.kl_term!r}"],
                                         objective_plugins(self.plugin_host))
        if errors:
            raise ValueError("; ".join(errors))

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
            kept_row_fraction=float(inputs.get(KEPT_ROW_FRACTION, 1.0)),
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
                # for extra forward passes of the sequences (e.g. pi_old on the sampler's support, corrections)
                "prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_mask": completion_mask,
                "sampling_params": {"temperature": self.temperature, "top_k": self.args.top_k,
                                    "top_p": self.args.top_p, "min_p": self.args.min_p},
                "model": model,  # the (possibly DDP-wrapped) model this loss runs, for extra forward passes
                "sapo_tau_pos": self.args.sapo_temperature_pos,
                "sapo_tau_neg": self.args.sapo_temperature_neg,
                "vespo": {"k_pos": self.args.vespo_k_pos, "lambda_pos": self.args.vespo_lambda_pos,
                          "k_neg": self.args.vespo_k_neg, "lambda_neg": self.args.vespo_lambda_neg},
                "importance_sampling_level": self.importance_sampling_level,
                **{key: inputs[key] for key in self._loss_extra_keys if key in inputs},
            },
        )
        reduce = None
        if self.accelerator.num_processes > 1:
            reduce = lambda t: self.accelerator.reduce(t, reduction="sum")  # noqa: E731
        loss, loss_mask, per_token_kl = compose_loss(
            self.plugin_host, li, loss_type=self.loss_type, kl=self.kl_term,
            importance_sampling_level=self.importance_sampling_level,
            importance_sampling_ratio=inputs.get("importance_sampling_ratio"), reduce=reduce,
            trl_options=TrlLossOptions(
                off_policy_mask_threshold=self.off_policy_mask_threshold,
                top_entropy_quantile=self.top_entropy_quantile, entropy_coef=self._applied_entropy_coef(),
                delta=self.args.delta, high_entropy_mask=self.get_high_entropy_mask,
                entropy_window=self._adaptive_entropy_window if self.use_adaptive_entropy and training else None),
            entropies=entropies,
        )
        if per_token_kl is not None:
            li.metrics["kl"] = self._masked_global_mean(per_token_kl, li.mask)
        if self._entropy_bonus_enabled and training and self.accelerator.sync_gradients:
            li.metrics["entropy_coef"] = self.entropy_coef  # as TRL logs it: after the step's adaptive update
        if self.aux_loss_enabled:
            loss = loss + self.router_aux_loss_coef * aux_loss / li.grad_accum_steps

        if self._objective_is_ppo_clip():
            li.metrics.update(self._clip_ratio_metrics(trl_ratio(li, self.importance_sampling_level).detach(),
                                                       li.advantages, li.mask))
        li.metrics["entropy"] = self._masked_global_mean(entropies, li.mask)
        # kept tokens over every rank's tokens (TRL logs rank 0's buffer; ranks hold different token counts)
        li.metrics["loss_mask/kept_fraction"] = figures.mean(loss_mask.sum(), li.mask.sum())
        self._log_plugin_metrics(li.metrics)
        return loss

    def _applied_entropy_coef(self) -> float:
        """TRL's entropy coefficient for this micro-batch: the static one, or under the adaptive controller the current
        one while the last optimizer step's entropy was at or below ``entropy_target`` and 0 above it."""
        if self.use_adaptive_entropy and self._last_world_entropy > self.args.entropy_target:
            return 0.0
        return self.entropy_coef

    def _adaptive_entropy_window(self, stats: torch.Tensor) -> None:
        """TRL's adaptive entropy controller (Skywork-OR1): sum ``[entropy sum, token count]`` over the accumulation
        window; at the optimizer step, over every rank, move ``entropy_coef`` by ``entropy_coef_delta`` up (entropy at
        or below ``entropy_target``) or down, within ``[entropy_coef_min, entropy_coef_max]``. The state is TRL's
        (``entropy_coef``, ``_last_world_entropy``), which TRL's own checkpoint code saves and restores."""
        self._entropy_window_stats = stats if self._entropy_window_stats is None else self._entropy_window_stats + stats
        if not self.accelerator.sync_gradients:
            return
        window = self.accelerator.reduce(self._entropy_window_stats, reduction="sum")
        world_entropy = (window[0] / window[1].clamp(min=1.0)).item()
        a = self.args
        if world_entropy <= a.entropy_target:
            self.entropy_coef = min(self.entropy_coef + a.entropy_coef_delta, a.entropy_coef_max)
        else:
            self.entropy_coef = max(self.entropy_coef - a.entropy_coef_delta, a.entropy_coef_min)
        self._last_world_entropy = world_entropy
        self._entropy_window_stats = None

    def _objective_is_ppo_clip(self) -> bool:
        """Whether the per-token objective is the PPO clip TRL's ``clip_ratio/*`` metrics describe: TRL's own for a
        PPO-clip ``loss_type``, or every ``trl_ext_policy_loss`` plugin declaring ``token_ppo_clip``."""
        objectives = [p for p in self.plugin_host.plugins if "trl_ext_policy_loss" in p.implemented_hooks()]
        if objectives:
            return all(getattr(p, "token_ppo_clip", False) for p in objectives)
        return self.loss_type in ops.PPO_CLIP_LOSS_TYPES

    def _clip_ratio_metrics(self, ratio: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor) -> dict:
        """TRL's ``clip_ratio/*`` metrics with TRL's definitions: a token is low-clipped when ``r < 1 - eps_low`` and
        ``A < 0``, high-clipped when ``r > 1 + eps_high`` and ``A > 0``; the ``*_mean`` are over the loss tokens of all
        ranks (over sequences for a ``(B, 1)`` sequence ratio), ``low_min``/``high_max`` the extremes of the
        per-sequence fractions (sequences without tokens skipped)."""
        low = ((ratio < 1 - self.epsilon_low) & (advantages < 0)).to(mask.dtype)
        high = ((ratio > 1 + self.epsilon_high) & (advantages > 0)).to(mask.dtype)
        sequence_level = low.shape[-1] == 1
        count_mask = torch.ones_like(low) if sequence_level else mask

        def per_sequence(x):
            return x.squeeze(-1) if sequence_level else ops.where_mask(x, mask).sum(-1) / mask.sum(-1)

        metrics = {f"clip_ratio/{name}_mean": self._masked_global_mean(x, count_mask)
                   for name, x in (("low", low), ("high", high), ("region", torch.maximum(low, high)))}
        low_seq, high_seq = self.accelerator.gather(per_sequence(low)), self.accelerator.gather(per_sequence(high))
        low_seq, high_seq = low_seq[~low_seq.isnan()], high_seq[~high_seq.isnan()]
        metrics["clip_ratio/low_min"] = low_seq.min().item() if low_seq.numel() else float("nan")
        metrics["clip_ratio/high_max"] = high_seq.max().item() if high_seq.numel() else float("nan")
        return metrics

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
        totals = self.accelerator.reduce(torch.stack([ops.where_mask(values, mask).sum(), mask.sum()]).detach(),
                                         reduction="sum")
        return (totals[0] / totals[1].clamp(min=1.0)).item()
