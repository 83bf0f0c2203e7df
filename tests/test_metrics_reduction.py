"""Logged figures cover every rank (docs/distributed.md: TRL logs rank 0's buffers): each figure computed on two
simulated ranks, whose collectives really exchange tensors (one thread per rank), equals the figure one process
computes on both ranks' data."""

from __future__ import annotations

import threading
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from trl_ext import metrics as figures
from trl_ext.trainers.base import HostMixin


class ThreadRanks:
    """``world`` accelerators whose ``reduce``/``gather`` meet at a barrier: every rank must make the same calls in
    the same order (a rank that skips one leaves the others waiting, and the test times out)."""

    def __init__(self, world: int = 2):
        self.world, self.slots, self.barrier = world, [None] * world, threading.Barrier(world, timeout=20)

    def _exchange(self, rank, t):
        self.slots[rank] = t
        self.barrier.wait()
        parts = list(self.slots)
        self.barrier.wait()
        return parts

    def accelerator(self, rank):
        return SimpleNamespace(
            num_processes=self.world, process_index=rank, is_main_process=rank == 0,
            reduce=lambda t, reduction="sum": torch.stack(self._exchange(rank, t)).sum(0) / (
                self.world if reduction == "mean" else 1),
            gather=lambda t: torch.cat(self._exchange(rank, t)))

    def run(self, fn):
        """``fn(rank, accelerator)`` on every rank concurrently -> the results by rank."""
        results, errors = [None] * self.world, []

        def body(rank):
            try:
                results[rank] = fn(rank, self.accelerator(rank))
            except BaseException as e:  # noqa: BLE001 - re-raised in the test thread
                errors.append(e)
                self.barrier.abort()

        threads = [threading.Thread(target=body, args=(r,)) for r in range(self.world)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        return results


def logged_on_every_rank(per_rank_metrics, world: int = 2) -> list[dict[str, float]]:
    """What a trl-ext trainer's ``_log_plugin_metrics`` appends on each rank, for ``per_rank_metrics(rank)``."""

    def rank_logs(rank, accelerator):
        trainer = SimpleNamespace(accelerator=accelerator, model=SimpleNamespace(training=True),
                                  _metrics={"train": defaultdict(list)})
        HostMixin._log_plugin_metrics(trainer, per_rank_metrics(rank))
        return {k: v[-1] for k, v in trainer._metrics["train"].items()}

    return ThreadRanks(world).run(rank_logs)


def one_process(metrics) -> dict[str, float]:
    return figures.reduce_figures(metrics, None)


# rank 0: 3 loss tokens, rank 1: 1 (unequal token counts, as with different completion lengths)
VALUES = [torch.tensor([[0.5, 2.0, 4.0, 9.0]]), torch.tensor([[-3.0, 7.0, 7.0, 7.0]])]
MASKS = [torch.tensor([[True, True, True, False]]), torch.tensor([[True, False, False, False]])]


def test_figures_of_two_ranks_equal_the_figures_of_one_process_on_both_ranks_data():
    def parts(values, mask):
        return {"mean": figures.masked_mean(values, mask), "std": figures.masked_std(values, mask),
                "max": figures.masked_max(values, mask), "min": figures.masked_min(values, mask), "plain": 1.5}

    both = one_process(parts(torch.cat(VALUES, 1), torch.cat(MASKS, 1)))
    assert both["mean"] == pytest.approx(3.5 / 4) and both["max"] == 4.0 and both["min"] == -3.0
    assert both["std"] == pytest.approx(torch.tensor([0.5, 2.0, 4.0, -3.0]).std().item())
    for logged in logged_on_every_rank(lambda r: parts(VALUES[r], MASKS[r])):
        assert logged == pytest.approx(both)


def test_a_rank_without_tokens_leaves_the_figures_of_the_others_and_no_tokens_anywhere_logs_nothing():
    empty = torch.zeros_like(MASKS[1])
    masks = [MASKS[0], empty]
    for logged in logged_on_every_rank(lambda r: {"mean": figures.masked_mean(VALUES[r], masks[r]),
                                                  "min": figures.masked_min(VALUES[r], masks[r])}):
        assert logged == pytest.approx({"mean": 6.5 / 3, "min": 0.5})
    for logged in logged_on_every_rank(lambda r: {"mean": figures.masked_mean(VALUES[r], empty),
                                                  "max": figures.masked_max(VALUES[r], empty)}):
        assert logged == {}


def test_correction_mismatch_statistics_cover_both_ranks_tokens():
    from trl_ext_plugins.corrections import math as cm

    # rank 0: one row with 3 loss tokens (rho 1, 2, 4: the 4 is masked); rank 1: one row with 1 token (rho 0.5)
    log_rho = torch.tensor([[0.0, 0.6931471805599453, 1.3862943611198906], [-0.6931471805599453, 0.0, 0.0]],
                           dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]], dtype=torch.float64)
    weight = torch.tensor([[1.0, 2.0, 0.0], [0.5, 0.0, 0.0]], dtype=torch.float64)
    changed = torch.tensor([[False, False, True], [False, False, False]])
    both = one_process(cm.mismatch_stats(log_rho, weight, changed, mask))
    assert both["rho/mean"] == pytest.approx(7.5 / 4) and both["rho/max"] == pytest.approx(4.0)
    assert both["weight/min"] == 0.0 and both["changed_fraction"] == pytest.approx(1 / 4)
    assert both["ess"] == pytest.approx(3.5 ** 2 / (4 * 5.25))
    assert both["changed_sequence_fraction"] == pytest.approx(1 / 2)
    logged = logged_on_every_rank(lambda r: cm.mismatch_stats(log_rho[r:r + 1], weight[r:r + 1], changed[r:r + 1],
                                                              mask[r:r + 1]))
    for metrics in logged:
        assert metrics == pytest.approx(both)


def _rank_inputs(theta, rollout, mask, rank):
    from test_losses import make_inputs

    return make_inputs(theta[rank:rank + 1], old=theta[rank:rank + 1], rollout=rollout[rank:rank + 1],
                       mask=mask[rank:rank + 1])


@pytest.mark.parametrize("plugin", ["m2po", "rollout_ratio"])
def test_m2po_and_rollout_ratio_figures_cover_both_ranks_tokens(plugin):
    from test_losses import make_inputs
    from trl_ext_plugins.corrections.m2po import M2PO
    from trl_ext_plugins.corrections.rollout_ratio import RolloutRatio

    # rank 0: 3 loss tokens, rank 1: 1 loss token with the largest log-ratio
    theta = torch.tensor([[0.5, 0.1, -0.1, 0.0], [1.5, 0.0, 0.0, 0.0]], dtype=torch.float64)
    rollout = torch.zeros(2, 4)
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0]], dtype=torch.float64)

    def figures_of(li):
        if plugin == "m2po":
            M2PO().trl_ext_token_weights(inputs=li)
        else:
            RolloutRatio().trl_ext_policy_loss(inputs=li)
        return li.metrics

    both = one_process(figures_of(make_inputs(theta, old=theta, rollout=rollout, mask=mask)))
    if plugin == "m2po":
        assert both["m2po/second_moment"] == pytest.approx((0.25 + 0.01 + 0.01 + 2.25) / 4)
    else:
        assert both["rollout_ratio/logp_diff/max"] == pytest.approx(1.5)
        assert both["rollout_ratio/logp_diff/mean"] == pytest.approx(2.2 / 4)
    for logged in logged_on_every_rank(lambda r: figures_of(_rank_inputs(theta, rollout, mask, r))):
        assert logged == pytest.approx(both)


@pytest.mark.parametrize("plugin", ["vapo", "bond"])
def test_nll_figures_are_token_means_over_both_ranks(plugin):
    """vapo/nll (positive samples' tokens) and bond/bon_nll (best-of-n tokens): rank 0 has 3 such tokens, rank 1 one."""
    from test_losses import make_inputs
    from trl_ext_plugins.advantages.vapo import POSITIVE, POSITIVE_TOKENS, VAPO, VAPOParams
    from trl_ext_plugins.distill.bond import BEST_KEY, BOND, BONDParams

    logps = torch.tensor([[-1.0, -2.0, -3.0, -9.0], [-8.0, -5.0, -5.0, -5.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
    picked = torch.tensor([1.0, 1.0], dtype=torch.float64)  # both rows positive / best of their group

    def figures_of(rows):
        if plugin == "vapo":
            extra = {POSITIVE: picked[rows], POSITIVE_TOKENS: torch.full_like(picked[rows], 4.0)}
            li = make_inputs(logps[rows], mask=mask[rows], **extra)
            VAPO(VAPOParams(nll_coef=0.1)).trl_ext_extra_loss(li)
        else:
            li = make_inputs(logps[rows], mask=mask[rows], **{BEST_KEY: picked[rows]})
            BOND(BONDParams(beta=0.5)).trl_ext_extra_loss(li)
        return li.metrics

    key = "vapo/nll" if plugin == "vapo" else "bond/bon_nll"
    both = one_process(figures_of(slice(0, 2)))
    assert both[key] == pytest.approx((1 + 2 + 3 + 8) / 4)  # not rank 0's (1 + 2 + 3) / 3
    for logged in logged_on_every_rank(lambda r: figures_of(slice(r, r + 1))):
        assert logged == pytest.approx(both)


def test_preference_plugin_figures_cover_both_ranks_pairs():
    """orpo/*, rpo/*, qrpo/* through the DPO trainer's logging; rank 0 holds two pairs with long completions, rank 1
    one pair with a short one."""
    from trl_ext.batches import PreferenceInputs
    from trl_ext_plugins.preference.orpo import ORPO
    from trl_ext_plugins.preference.qrpo import QRPO, QRPOParams
    from trl_ext_plugins.preference.rpo import RPO, RPOParams

    f64 = torch.float64
    chosen = torch.tensor([-10.0, -20.0, -1.0], dtype=f64)
    rejected = torch.tensor([-12.0, -18.0, -3.0], dtype=f64)
    lengths = torch.tensor([10.0, 10.0, 1.0], dtype=f64)
    rewards = {"chosen_reward": torch.tensor([1.0, 0.5, 0.9], dtype=f64),
               "rejected_reward": torch.tensor([0.0, 0.4, 0.1], dtype=f64),
               "ref_rewards": torch.tensor([[0.0, 0.6], [0.2, 1.0], [0.3, 0.5]], dtype=f64)}
    plugins = [ORPO(), RPO(RPOParams(chosen_reward_column="chosen_reward", rejected_reward_column="rejected_reward")),
               QRPO(QRPOParams(chosen_reward_column="chosen_reward", rejected_reward_column="rejected_reward",
                               ref_rewards_column="ref_rewards"))]

    def figures_of(rows):
        out = {}
        for plugin in plugins:
            pref = PreferenceInputs(chosen_logps=chosen[rows], rejected_logps=rejected[rows],
                                    chosen_lengths=lengths[rows], rejected_lengths=lengths[rows],
                                    ref_chosen_logps=chosen[rows] + 1, ref_rejected_logps=rejected[rows] - 1,
                                    beta=0.1, batch={k: v[rows] for k, v in rewards.items()})
            plugin.trl_ext_preference_loss(inputs=pref)
            out.update(pref.metrics)
        return out

    both = one_process(figures_of(slice(0, 3)))
    assert both["orpo/nll_loss"] == pytest.approx(31 / 21)  # token mean of the chosen tokens, not 30/20 (rank 0's)
    assert both["rpo/target_gap"] == pytest.approx(1.9 / 3)
    assert {"qrpo/chosen_quantile_reward", "rpo/policy_gap", "orpo/log_odds_ratio"} <= set(both)
    for logged in logged_on_every_rank(lambda r: figures_of(slice(0, 2) if r == 0 else slice(2, 3))):
        assert logged == pytest.approx(both)


def test_mtp_depth_figures_are_token_means_over_both_ranks():
    from trl_ext.trainers.mtp import DepthOutput, mtp_loss

    torch.manual_seed(0)
    logits, target = torch.randn(2, 4, 5), torch.randn(2, 4, 5)
    labels = target.argmax(-1)
    mask = torch.tensor([[True, True, True, False], [True, False, False, False]])  # 3 positions on rank 0, 1 on rank 1

    def figures_of(rows):
        out = DepthOutput(logits=logits[rows], target_logits=target[rows], labels=labels[rows], mask=mask[rows])
        return mtp_loss([out], "hard")[1]

    both = one_process(figures_of(slice(0, 2)))
    for logged in logged_on_every_rank(lambda r: figures_of(slice(r, r + 1))):
        assert logged == pytest.approx(both)
