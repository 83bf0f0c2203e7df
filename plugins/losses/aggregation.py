"""``aggregation``: choose how the per-token loss is reduced, independently of the objective."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

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


def _over_nonempty_rows(row_losses):
    """empty_rows: exclude. The mean over the micro-batch's rows that have a valid token; rows a group filter dropped
    have none, so no re-basing on the kept share is needed."""
    def aggregate(loss, mask, li, constant):
        return _grpo_helpers()[1](ops.nonempty_row_mean(row_losses(loss, mask), mask), li)
    return aggregate


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
# empty_rows: exclude replaces the two modes that divide by a row count
EXCLUDING_EMPTY_ROWS = {
    "seq-mean-token-mean": _over_nonempty_rows(ops.row_token_means),
    "seq-mean-token-sum": _over_nonempty_rows(ops.row_token_sums),
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
    empty_rows: Literal["count", "exclude"] = Field(
        "count", description="seq-mean-token-mean and seq-mean-token-sum: whether a row with no valid token (e.g. cut by "
        "the cap under mask_truncated_completions) counts in the mean over sequences. count: it adds 0 and counts "
        "(TRL, the default); exclude: it is left out of the count (verl's agg_loss, OpenRLHF), per micro-batch.")

    @model_validator(mode="after")
    def _empty_rows_applies(self):
        if self.empty_rows == "exclude" and self.mode not in EXCLUDING_EMPTY_ROWS:
            raise ValueError(f"empty_rows: exclude applies to {' and '.join(EXCLUDING_EMPTY_ROWS)}, not to mode "
                             f"{self.mode!r}")
        return self


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
    keep their tokens in it (convention 8). A row with no valid token at all (cut by the cap under
    ``mask_truncated_completions``, or all tool tokens) counts in the two row-count means and adds 0, as in TRL
    (``empty_rows: count``, the default). ``empty_rows: exclude`` leaves it out of the count, as verl's ``agg_loss``
    and OpenRLHF do, counted per micro-batch like every mode here (given the global batch size, verl counts over
    the whole mini-batch). Without this plugin the trainer aggregates as TRL does for
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
        table = EXCLUDING_EMPTY_ROWS if self.params.empty_rows == "exclude" else AGGREGATIONS
        return table[self.params.mode](per_token_loss, mask, inputs, self.params.constant)
