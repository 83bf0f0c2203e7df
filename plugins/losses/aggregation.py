"""``aggregation``: choose how the per-token loss is reduced, independently of the objective."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from trl_ext import Plugin, PluginParams, Slot, hookimpl, ops


def _grpo_helpers():
    # The trainer module imports TRL's GRPOTrainer; import it only when a loss is computed, not at catalog discovery.
    from trl_ext.trainers import grpo

    return grpo.global_token_mean, grpo.scale_per_micro_batch, grpo.per_kept_row


def _per_row(loss, li):
    """Micro-batch scaling for an aggregation that divides by the row count: over the rows group filters kept."""
    _, scale, per_kept_row = _grpo_helpers()
    return scale(per_kept_row(loss, li), li)


def _token_mean(loss, mask, li, constant):
    return _grpo_helpers()[0](loss, mask, li)


def _batch_token_mean(loss, mask, li, constant):
    return _grpo_helpers()[1](ops.token_mean(loss, mask), li)


def _token_sum(loss, mask, li, constant):
    return _grpo_helpers()[1](ops.token_sum(loss, mask), li)


def _seq_mean_token_mean(loss, mask, li, constant):
    return _per_row(ops.seq_mean_token_mean(loss, mask), li)


def _seq_mean_token_sum(loss, mask, li, constant):
    return _per_row(ops.seq_mean_token_sum(loss, mask), li)


def _seq_mean_token_sum_norm(loss, mask, li, constant):
    return _per_row(ops.constant_normalized(loss, mask, constant or li.max_completion_length), li)


# mode -> (per_token_loss, mask, inputs, constant) -> scalar, already scaled for gradient accumulation
AGGREGATIONS = {
    "token-mean": _token_mean,
    "batch-token-mean": _batch_token_mean,
    "token-sum": _token_sum,
    "seq-mean-token-mean": _seq_mean_token_mean,
    "seq-mean-token-sum": _seq_mean_token_sum,
    "seq-mean-token-sum-norm": _seq_mean_token_sum_norm,
}


class AggregationParams(PluginParams):
    mode: Literal["token-mean", "batch-token-mean", "token-sum", "seq-mean-token-mean", "seq-mean-token-sum",
                  "seq-mean-token-sum-norm"] = Field(
        "token-mean", description="token-mean: sum over all tokens / token count of the global generation batch "
        "(DAPO; TRL 'dapo'; verl 'token-mean'); batch-token-mean: per micro-batch (TRL 'bnpo'); token-sum: plain sum "
        "over the micro-batch's tokens (verl/NeMo-RL 'token-sum'); seq-mean-token-mean: per-sequence mean, then mean "
        "over sequences (GRPO, GSPO, SAPO; TRL 'grpo'); seq-mean-token-sum: per-sequence sum, then mean over "
        "sequences (verl 'seq-mean-token-sum'); seq-mean-token-sum-norm: sum / (B * L) with a constant L (Dr. GRPO; "
        "TRL 'dr_grpo').")
    constant: int | None = Field(None, gt=0, description="L for seq-mean-token-sum-norm; None = args.max_completion_length.")


class Aggregation(Plugin):
    """Loss aggregation modes (ALGORITHMS.md convention 2; verl ``loss_agg_mode`` names, TRL ``loss_type`` equivalents).

    One plugin with a ``mode`` parameter, filling the exclusive ``aggregation`` slot, so any objective combines with any
    mode: ``token-mean`` (DAPO, arXiv 2503.14476: ``sum_i sum_t l / sum_i |o_i|`` over the *global* generation batch,
    gradient-accumulation aware, TRL ``dapo``), ``batch-token-mean`` (the micro-batch's own token count, TRL ``bnpo``),
    ``token-sum`` (``sum_i sum_t l``, no normalisation; verl/NeMo-RL), ``seq-mean-token-mean`` (GRPO arXiv 2402.03300,
    GSPO, SAPO; TRL ``grpo``), ``seq-mean-token-sum`` (``(1/B) sum_i sum_t l``; verl) and ``seq-mean-token-sum-norm``
    (Dr. GRPO arXiv 2503.20783: ``(1/B) sum_i sum_t l / L`` with constant L, default ``args.max_completion_length``;
    TRL ``dr_grpo``; verl's variant lacks 1/B). All but ``token-mean`` are per micro-batch and divided by the gradient
    accumulation steps (TRL's scaling). The three ``seq-mean-*`` modes divide by the micro-batch's rows that group
    filters kept (``trl_ext_filter_groups``: dynamic sampling, deferred partial rollouts), as if filtered rows had been
    removed from the batch, as verl and slime remove them. Masked tokens (completion padding, tool tokens, and token masks from corrections
    such as ``m2po``) count in no denominator: for ``token-mean`` the global count is the mask-aware one the loss
    pipeline computes (``trl_ext.trainers.grpo.mask_aware_token_count``); zero *weights* (``icepop``, ``tis``, ``mis``)
    keep their tokens in it (convention 8). Without this plugin the trainer aggregates as TRL does for
    ``args.loss_type``, which each objective plugin sets to its paper's choice. Default ``token-mean``.
    """

    name = "aggregation"
    aliases = ("loss_aggregation",)
    family = "loss"
    trainers = frozenset({"grpo"})
    slots = frozenset({Slot.AGGREGATION})
    Params = AggregationParams

    @hookimpl
    def trl_ext_aggregate_loss(self, per_token_loss, mask, inputs):
        return AGGREGATIONS[self.params.mode](per_token_loss, mask, inputs, self.params.constant)
