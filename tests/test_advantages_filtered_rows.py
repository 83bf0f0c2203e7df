"""Rows ``trl_ext_filter_groups`` drops are masked, not removed: batch-level advantage statistics must leave them out.

Every case: a batch whose middle group is filtered (``RolloutBatch.keep``) must give its kept rows the advantages of a
batch holding only the kept rows (verl and slime remove filtered rows before the advantages), numbers from the
formulas; and the filtered rows' rewards (e.g. partial_rollout's deferred groups, scored on unfinished text) must not
move them.
"""

import math

import pytest
import torch

import trl_ext_plugins.advantages.remax as remax_module
from trl_ext.batches import RolloutBatch
from trl_ext_plugins.advantages.group_norm import GroupNorm, GroupNormParams
from trl_ext_plugins.advantages.ppo import PPO, PPOParams
from trl_ext_plugins.advantages.reinforce_baseline import ReinforceBaseline, ReinforceBaselineParams
from trl_ext_plugins.advantages.remax import ReMax
from trl_ext_plugins.advantages.reinforce_pp import ReinforcePP, ReinforcePPBaseline, ReinforcePPParams
from trl_ext_plugins.advantages.rloo import RLOO, RLOOParams
from trl_ext_plugins.advantages.vapo import POSITIVE_TOKENS, VAPO, VAPOParams
from trl_ext_plugins.distill.bond import BOND, BONDParams

# three groups of G = 2; the middle one is filtered (a zero-variance group dynamic sampling drops)
REWARDS = [1.0, 0.0, 3.0, 3.0, 2.0, 0.0]
KEEP = [True, True, False, False, True, True]


def batch(rewards, keep, lengths=None, T=3):
    n = len(rewards)
    lengths = lengths or [1] * n
    mask = torch.tensor([[1] * k + [0] * (T - k) for k in lengths])
    return RolloutBatch(rewards_per_func=torch.tensor(rewards).unsqueeze(1), reward_names=["r"],
                        reward_weights=torch.ones(1), num_generations=2, process_slice=slice(0, n),
                        completion_ids=torch.zeros(n, T, dtype=torch.long), completion_mask=mask,
                        completion_lengths=torch.tensor(lengths), prompts=[""] * n, completions=[""] * n,
                        inputs=[{}] * n, keep=None if keep is None else torch.tensor(keep))


def advantages(plugin, rewards, keep, **kw):
    b = batch(rewards, keep, **kw)
    return plugin.trl_ext_compute_advantages(rewards=torch.tensor(rewards), batch=b), b


KEPT = torch.tensor(KEEP)
OTHER = [1.0, 0.0, 7.5, -4.0, 2.0, 0.0]  # the filtered group's rewards changed (unfinished text scored differently)


def test_reinforce_pp_whitens_over_the_kept_rows_tokens():
    # kl 0, gamma 1: G_t = R on every token; kept tokens: row 0 (2 tokens of 1), row 1 (1 token of 0), row 4 (3 tokens
    # of 2), row 5 (1 token of 0): mean 8/7, unbiased var sum((x - 8/7)^2) / 6
    lengths = [2, 1, 3, 2, 3, 1]
    out, _ = advantages(ReinforcePP(ReinforcePPParams(kl_coef=0.0)), REWARDS, KEEP, lengths=lengths)
    values = [1.0, 1.0, 0.0, 2.0, 2.0, 2.0, 0.0]
    mean = sum(values) / 7
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / 6 + 1e-8)
    assert out[0, :2].tolist() == pytest.approx([(1 - mean) / std] * 2, abs=1e-6)
    assert out[1, 0].item() == pytest.approx(-mean / std, abs=1e-6)
    assert out[4].tolist() == pytest.approx([(2 - mean) / std] * 3, abs=1e-6)
    assert out[5, 0].item() == pytest.approx(-mean / std, abs=1e-6)
    alone, _ = advantages(ReinforcePP(ReinforcePPParams(kl_coef=0.0)), [1.0, 0.0, 2.0, 0.0], None,
                          lengths=[2, 1, 3, 1])
    assert torch.allclose(out[KEPT], alone, atol=1e-6)
    moved, _ = advantages(ReinforcePP(ReinforcePPParams(kl_coef=0.0)), OTHER, KEEP, lengths=lengths)
    assert torch.allclose(moved[KEPT], out[KEPT], atol=1e-6)


def test_reinforce_pp_baseline_whitens_over_the_kept_rows():
    # group-centred: [0.5, -0.5], (filtered), [1, -1]; whitened over 4 kept tokens: mean 0, var 2.5 / 3
    out, _ = advantages(ReinforcePPBaseline(), REWARDS, KEEP)
    std = math.sqrt(2.5 / 3 + 1e-8)
    assert out[KEPT][:, 0].tolist() == pytest.approx([0.5 / std, -0.5 / std, 1 / std, -1 / std], abs=1e-6)
    moved, _ = advantages(ReinforcePPBaseline(), OTHER, KEEP)
    assert torch.allclose(moved[KEPT], out[KEPT], atol=1e-6)


def test_group_norm_batch_scale_divides_by_the_kept_rows_std():
    # kept rewards [1, 0, 2, 0]: mean 0.75, sample std sqrt(2.75 / 3); centres per group: 0.5 and 1
    out, _ = advantages(GroupNorm(GroupNormParams(scale="batch")), REWARDS, KEEP)
    s = math.sqrt(2.75 / 3) + 1e-4
    assert out[KEPT].tolist() == pytest.approx([0.5 / s, -0.5 / s, 1 / s, -1 / s], abs=1e-6)
    assert out[~KEPT].tolist() == [0.0, 0.0]
    moved, _ = advantages(GroupNorm(GroupNormParams(scale="batch")), OTHER, KEEP)
    assert torch.allclose(moved[KEPT], out[KEPT], atol=1e-6)


def test_rloo_normalize_over_the_kept_rows():
    # leave-one-out [1, -1], (filtered), [2, -2]; normalised: mean 0, sample std sqrt(10 / 3)
    out, _ = advantages(RLOO(RLOOParams(normalize=True)), REWARDS, KEEP)
    s = math.sqrt(10 / 3) + 1e-4
    assert out[KEPT].tolist() == pytest.approx([1 / s, -1 / s, 2 / s, -2 / s], abs=1e-6)


def test_reinforce_batch_mean_and_moving_average_over_the_kept_rows():
    out, _ = advantages(ReinforceBaseline(ReinforceBaselineParams(baseline="batch_mean")), REWARDS, KEEP)
    assert out[KEPT].tolist() == pytest.approx([0.25, -0.75, 1.25, -0.75])  # kept mean 0.75
    plugin = ReinforceBaseline(ReinforceBaselineParams(baseline="moving_average", decay=0.5, initial=0.2))
    advantages(plugin, REWARDS, KEEP)
    assert plugin.running_baseline == pytest.approx(0.5 * 0.2 + 0.5 * 0.75)


class ZeroCritic(torch.nn.Module):
    def forward(self, prompt_ids, prompt_mask, completion_ids, completion_mask):
        return torch.zeros(completion_ids.shape, dtype=torch.float32)


def test_ppo_whitens_and_logs_over_the_kept_rows():
    # V = 0, one token per row: GAE gives A = R; whitened over the kept rows [1, 0, 2, 0]: mean 0.75, var 2.75 / 3
    plugin = PPO(PPOParams(kl_coef=0.0))
    plugin.critic = ZeroCritic()
    b = batch(REWARDS, KEEP)
    b.prompt_ids, b.prompt_mask = torch.zeros(6, 1, dtype=torch.long), torch.ones(6, 1, dtype=torch.long)
    out = plugin.trl_ext_compute_advantages(rewards=torch.tensor(REWARDS), batch=b)
    std = math.sqrt(2.75 / 3 + 1e-8)
    assert out[KEPT][:, 0].tolist() == pytest.approx([(r - 0.75) / std for r in (1.0, 0.0, 2.0, 0.0)], abs=1e-6)
    assert b.metrics["ppo/returns_mean"] == pytest.approx(0.75)


def test_vapo_nll_denominator_counts_only_kept_positive_rows():
    # positive = reward > 0: rows 0, 4 (kept) and 2, 3 (filtered); tokens of kept positives: 2 + 3
    plugin = VAPO(VAPOParams(kl_coef=0.0))
    plugin.critic = ZeroCritic()
    b = batch(REWARDS, KEEP, lengths=[2, 1, 3, 3, 3, 1])
    b.prompt_ids, b.prompt_mask = torch.zeros(6, 1, dtype=torch.long), torch.ones(6, 1, dtype=torch.long)
    plugin.trl_ext_compute_advantages(rewards=torch.tensor(REWARDS), batch=b)
    assert b.loss_extras[POSITIVE_TOKENS][0].item() == 5.0
    assert b.metrics["vapo/positive_fraction"] == pytest.approx(2 / 4)


def test_bond_best_reward_counts_only_the_kept_groups():
    # best of each group: 1 (group 0), 3 (group 1, filtered), 2 (group 2) -> mean over the kept groups 1.5, not 2.0
    _, b = advantages(BOND(BONDParams()), REWARDS, KEEP)
    assert b.metrics["bond/best_reward"] == pytest.approx(1.5)


def test_remax_greedy_reward_counts_only_the_kept_groups(monkeypatch):
    # greedy baselines per group 0.5 / 9.0 (filtered) / 1.0 -> 0.75, not 3.5
    monkeypatch.setattr(remax_module, "greedy_rewards", lambda trainer, prompts, inputs: torch.tensor([0.5, 9.0, 1.0]))
    out, b = advantages(ReMax(), REWARDS, KEEP)
    assert b.metrics["remax/greedy_reward_mean"] == pytest.approx(0.75)
    assert out[KEPT].tolist() == pytest.approx([0.5, -0.5, 1.0, -1.0])  # R - b within each kept group


@pytest.mark.parametrize("keep", [None, KEEP])
def test_remax_on_the_second_of_two_ranks(monkeypatch, keep):
    """greedy_rewards returns every rank's baselines (TRL's scoring gathers), and the kept groups were taken from
    this rank's keep mask alone: a shape error on every multi-process run. Rank 1 of 2 holds the last group here
    (rows 4-5) and the middle group straddles nothing: each rank holds whole groups of the gathered 6 rows."""
    monkeypatch.setattr(remax_module, "greedy_rewards", lambda trainer, prompts, inputs: torch.tensor([0.5, 9.0, 1.0]))
    b = batch(REWARDS, keep)
    b.process_slice = slice(4, 6)
    b.prompts, b.inputs, b.completion_mask = [""] * 2, [{}] * 2, b.completion_mask[4:]
    out = ReMax().trl_ext_compute_advantages(rewards=torch.tensor(REWARDS), batch=b)
    assert out.tolist() == pytest.approx([1.0, -1.0])  # this rank's rows, R - b of the third group
    assert b.metrics["remax/greedy_reward_mean"] == pytest.approx(0.75 if keep else 3.5)


def test_host_hands_the_keep_mask_to_the_advantage_hook(tiny_trainer):
    """dynamic_sampling drops the zero-variance group 1; reinforce_pp_baseline whitens over group 0's tokens only."""
    from trl_ext_plugins.rollout.dynamic_sampling import DynamicSampling

    values = [1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0]

    def reward(completions, **kwargs):
        return values[: len(completions)]

    trainer = tiny_trainer("grpo", plugins=[DynamicSampling(), ReinforcePPBaseline()], reward_funcs=[reward])
    trainer.model.train()
    out = trainer._score_round([trainer.train_dataset[i // 4] for i in range(8)])[0]
    mask = out["completion_mask"].float()  # group 1's rows already zeroed by the host
    assert mask[4:].sum() == 0 and mask[:4].sum() > 0
    per_token = torch.tensor([0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0]).unsqueeze(1) * mask
    valid = mask.bool()
    expected = (per_token - per_token[valid].mean()) / torch.sqrt(per_token[valid].var() + 1e-8) * mask
    assert torch.allclose(out["advantages"], expected, atol=1e-5)


def scripted(values):
    def reward(completions, **kwargs):
        return values[: len(completions)]

    return reward


@pytest.mark.parametrize("scale, aggregation", [("batch", "sum_then_normalize"), ("group", "normalize_then_sum")])
def test_trl_advantage_formula_matches_trl_bit_for_bit(tiny_trainer, scale, aggregation):
    from trl_ext.trainers.grpo import trl_group_advantages

    a, b = [1.0, 0.0, 0.5, 1.0, 0.2, 0.2, 0.9, 0.0], [0.0, 1.0, 1.0, 0.3, 0.7, 0.1, 0.4, 0.4]
    trainer = tiny_trainer("grpo", reward_funcs=[scripted(a), scripted(b)],
                           args={"scale_rewards": scale, "multi_objective_aggregation": aggregation})
    trainer.model.train()
    out = trainer._generate_and_score_completions([trainer.train_dataset[i // 4] for i in range(8)])
    ours = trl_group_advantages(torch.tensor([a, b]).T, torch.ones(2), 4, scale, aggregation)
    assert torch.equal(out["advantages"], ours)


def test_trl_batch_scaled_advantage_leaves_filtered_groups_out_of_the_std(tiny_trainer):
    """No advantage plugin, scale_rewards=batch: dynamic_sampling drops group 1 ([1, 1, 1, 1]); the kept group's
    advantages divide by the std of its own rewards [1, 0, 0, 1] (sqrt(1/3)), as in a batch without group 1."""
    from trl_ext_plugins.rollout.dynamic_sampling import DynamicSampling

    trainer = tiny_trainer("grpo", plugins=[DynamicSampling()], args={"scale_rewards": "batch"},
                           reward_funcs=[scripted([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0])])
    trainer.model.train()
    out = trainer._score_round([trainer.train_dataset[i // 4] for i in range(8)])[0]
    s = math.sqrt(1 / 3) + 1e-4
    assert out["advantages"].tolist() == pytest.approx([0.5 / s, -0.5 / s, -0.5 / s, 0.5 / s, 0, 0, 0, 0], abs=1e-6)
