"""``dynamic_sampling`` (DAPO, ALGORITHMS.md item 47): pure group functions, and on the tiny model a refilled batch
that holds only groups with reward variance, at the original size, within the ``max_rounds`` cap, with its rounds and
prompts logged; the ``trl_ext_refill_groups`` seam; the recipes validate."""

from __future__ import annotations

import pytest
import torch

from trl_ext import NoParams, Plugin, Slot, hookimpl
from trl_ext.catalog import Catalog
from trl_ext.embedded.arithmetic import arithmetic_dataset
from trl_ext.errors import RecipeError
from trl_ext.recipe import StageSpec, load_raw, parse_recipe
from trl_ext.runner import resolve_recipe
from trl_ext.stage import resolve_stage
from trl_ext_plugins.rollout.dynamic_sampling import DynamicSampling
from trl_ext_plugins.rollout.math import group_has_signal, nonzero_variance_groups, select_groups

G = 4  # completions per prompt in the trainer tests
NAN = float("nan")


# -- pure functions ------------------------------------------------------------------------------------------------


def test_only_the_group_with_reward_variance_is_kept():
    rewards = torch.tensor([[1, 1, 1, 1], [0, 0, 0, 0], [1, 0, 0, 1]], dtype=torch.float32).flatten()
    keep = nonzero_variance_groups(rewards, 4)
    assert keep.tolist() == [False, False, True]
    # the kept group's GRPO advantages are non-degenerate: (r - mean) / std with std = 0.57735 (unbiased)
    kept = rewards.view(3, 4)[keep][0].double()
    advantages = (kept - kept.mean()) / kept.std()
    assert torch.allclose(advantages, torch.tensor([0.866025, -0.866025, -0.866025, 0.866025], dtype=torch.float64),
                          atol=1e-6)


def test_nan_rewards_are_ignored_and_one_scored_row_has_no_variance():
    rewards = torch.tensor([NAN, 1, 0, NAN, NAN, 1, 1, NAN, NAN, NAN, NAN, NAN, NAN, 0.5, NAN, NAN, 1e-3, 0, 0, 0])
    assert nonzero_variance_groups(rewards, 4).tolist() == [True, False, False, False, True]


def test_group_signal_and_selection_order():
    assert group_has_signal(torch.tensor([0, 0, 1, 0, 0, 0]).bool(), 2).tolist() == [False, True, False]
    rounds = [torch.tensor([False, True, False]), torch.tensor([True, True, False])]
    assert select_groups(rounds, 3) == [(0, 1), (1, 0), (1, 1)]  # kept groups in round order, surplus ignored
    assert select_groups(rounds, 2) == [(0, 1), (1, 0)]
    # cap reached: the kept ones, then dropped groups in order to fill the batch
    assert select_groups([torch.tensor([False, True, False])], 3) == [(0, 1), (0, 0), (0, 2)]


def _batch(rewards_per_func, names):
    from trl_ext.batches import RolloutBatch

    n = rewards_per_func.shape[0]
    return RolloutBatch(rewards_per_func=rewards_per_func, reward_names=names, reward_weights=torch.ones(len(names)),
                        num_generations=2, process_slice=slice(0, n), completion_ids=torch.zeros(n, 1).long(),
                        completion_mask=torch.ones(n, 1).long(), completion_lengths=torch.ones(n), prompts=[],
                        completions=[], inputs=[])


def test_filter_on_the_total_reward_or_on_one_named_reward():
    # columns: accuracy (constant in group 0, varies in group 1) and a length term (varies in group 0 only)
    per_func = torch.tensor([[1.0, 0.1], [1.0, 0.3], [0.0, 0.2], [1.0, 0.2]])
    batch = _batch(per_func, ["exact_match", "length"])
    total = per_func.sum(1)
    assert DynamicSampling().trl_ext_filter_groups(rewards=total, batch=batch).tolist() == [True] * 4
    by_accuracy = DynamicSampling(DynamicSampling.Params(metric="exact_match"))
    assert by_accuracy.trl_ext_filter_groups(rewards=total, batch=batch).tolist() == [False, False, True, True]
    with pytest.raises(ValueError, match="'nope' is not a reward function"):
        DynamicSampling(DynamicSampling.Params(metric="nope")).trl_ext_filter_groups(rewards=total, batch=batch)


# -- on the tiny model ---------------------------------------------------------------------------------------------


def odd_sum_varies(completions, answer, **kwargs):
    """Constant (zero variance) for prompts with an even answer; completion-dependent for an odd answer."""
    return [0.0 if int(a) % 2 == 0 else float(sum(map(ord, c)) % 97) for c, a in zip(completions, answer)]


def _rows(dataset, indices):
    return [dataset[i] for i in indices for _ in range(G)]


def _prompt_sums(trainer, output):
    texts = trainer.processing_class.batch_decode(output["prompt_ids"], skip_special_tokens=True)
    return [sum(int(x) for x in t.strip().rstrip("=").split("+")) for t in texts]


def _build(tiny_trainer, dataset, **params):
    plugin = DynamicSampling(DynamicSampling.Params(**params))
    trainer = tiny_trainer("grpo", plugins=[plugin], dataset=dataset, reward_funcs=[odd_sum_varies],
                           args={"per_device_train_batch_size": 2 * G, "num_generations": G, "temperature": 1.0})
    trainer.model.train()
    return trainer, plugin


def test_refilled_batch_has_only_groups_with_variance_at_full_size(tiny_trainer):
    data = arithmetic_dataset("train", format="prompt", size=64)
    even = next(i for i in range(len(data)) if int(data[i]["answer"]) % 2 == 0)
    odd = next(i for i in range(len(data)) if int(data[i]["answer"]) % 2 == 1)
    trainer, plugin = _build(tiny_trainer, data, max_rounds=20)
    torch.manual_seed(0)
    output = trainer._generate_and_score_completions(_rows(data, [even, odd]))

    record = plugin.history[-1]
    assert record["dynamic_sampling/rounds"] >= 2  # the even prompt's group was dropped, so at least one refill
    assert record["dynamic_sampling/prompts"] == 2 * record["dynamic_sampling/rounds"]
    assert record["dynamic_sampling/kept_groups_fraction"] == 1.0 and record["dynamic_sampling/cap_hit"] == 0.0
    assert trainer._metrics["train"]["dynamic_sampling/rounds"][-1] == record["dynamic_sampling/rounds"]

    assert output["completion_ids"].shape[0] == output["prompt_ids"].shape[0] == output["advantages"].shape[0] == 2 * G
    sums = _prompt_sums(trainer, output)
    assert all(s % 2 == 1 for s in sums), sums  # only prompts whose rewards can vary
    assert sums[:G] == [sums[0]] * G and sums[G:] == [sums[G]] * G  # groups stay whole
    adv = output["advantages"].view(2, G)
    assert (adv.abs().sum(1) > 0).all() and torch.allclose(adv.sum(1), torch.zeros(2), atol=1e-4)
    mask = output["completion_mask"]
    assert (mask.sum(1) > 0).all() and int(output["num_items_in_batch"]) == int(mask.sum())
    # rows are consistent: prompt and completion still attend, and widths agree across the merged tensors
    assert output["prompt_mask"].shape == output["prompt_ids"].shape and mask.shape == output["completion_ids"].shape
    assert (output["prompt_mask"].sum(1) > 0).all()


def test_cap_on_rounds_keeps_the_batch_and_masks_the_dropped_groups(tiny_trainer):
    full = arithmetic_dataset("train", format="prompt", size=64)
    even = full.filter(lambda row: int(row["answer"]) % 2 == 0)  # every group has zero variance
    trainer, plugin = _build(tiny_trainer, even, max_rounds=3)
    torch.manual_seed(0)
    output = trainer._generate_and_score_completions(_rows(even, [0, 1]))

    assert plugin.history[-1] == {"dynamic_sampling/rounds": 3, "dynamic_sampling/prompts": 6,
                                  "dynamic_sampling/kept_groups_fraction": 0.0, "dynamic_sampling/cap_hit": 1.0}
    assert output["completion_ids"].shape[0] == 2 * G
    assert torch.equal(output["advantages"], torch.zeros(2 * G))
    assert int(output["completion_mask"].sum()) == 0 and int(output["num_items_in_batch"]) == 0


def _rows_of(output: dict, rows: torch.Tensor) -> dict:
    """``output`` restricted to ``rows``, as a batch that never held the other rows (no filter share recorded)."""
    kept = {key: value[rows] if isinstance(value, torch.Tensor) and value.dim() >= 1 else value
            for key, value in output.items() if key != "kept_row_fraction"}
    kept["num_items_in_batch"] = kept["completion_mask"].sum()
    return kept


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo"])
def test_filtered_groups_leave_the_sequence_count_of_the_loss(tiny_trainer, loss_type):
    # One round, filter only: the even prompt's group has no reward variance and is masked. The loss of the batch, and
    # its gradient, must be those of the odd prompt's group alone: a sequence mean that still counted the masked rows
    # (TRL's grpo loss on this batch) gave half of it.
    data = arithmetic_dataset("train", format="prompt", size=64)
    even = next(i for i in range(len(data)) if int(data[i]["answer"]) % 2 == 0)
    odd = next(i for i in range(len(data)) if int(data[i]["answer"]) % 2 == 1)
    plugin = DynamicSampling(DynamicSampling.Params(max_rounds=1))
    trainer = tiny_trainer("grpo", plugins=[plugin], dataset=data, reward_funcs=[odd_sum_varies],
                           args={"per_device_train_batch_size": 2 * G, "num_generations": G, "temperature": 1.0,
                                 "loss_type": loss_type, "epsilon": 1e9})
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1  # set by Trainer's training loop
    torch.manual_seed(0)
    output = trainer._generate_and_score_completions(_rows(data, [even, odd]))
    assert float(output["kept_row_fraction"]) == 0.5
    # a nonzero ratio: the loss is then a real function of the policy (with pi_old = pi it is 0 in value)
    output["old_per_token_logps"] = torch.full_like(output["completion_mask"], -1.0, dtype=torch.float32)

    def loss_and_grad(batch):
        trainer.model.zero_grad()
        loss = trainer.compute_loss(trainer.model, batch)
        loss.backward()
        return loss.item(), torch.cat([p.grad.flatten() for p in trainer.model.parameters() if p.grad is not None])

    full_loss, full_grad = loss_and_grad(output)
    kept_loss, kept_grad = loss_and_grad(_rows_of(output, torch.arange(G, 2 * G)))
    assert full_loss == pytest.approx(kept_loss, rel=1e-5) and kept_loss != 0.0
    assert kept_grad.abs().max() > 1e-4
    torch.testing.assert_close(full_grad, kept_grad, rtol=1e-4, atol=1e-7)


class NaNAtFilteredRows(Plugin):
    """An advantage plugin that leaves NaN at the rows the filter dropped (test double: a third-party plugin that
    normalises over the kept rows and writes nothing sensible elsewhere)."""

    name, family, slots, Params = "nan_at_filtered_rows", "advantage", frozenset({Slot.ADVANTAGE}), NoParams

    @hookimpl
    def trl_ext_compute_advantages(self, rewards, batch):
        centred = rewards - rewards[batch.keep].mean()
        return torch.where(batch.keep, centred, torch.full_like(centred, float("nan")))[batch.process_slice]


def test_a_nan_advantage_at_a_filtered_row_leaves_the_loss_finite(tiny_trainer):
    # The host zeroes filtered rows' advantages with where: a product (the earlier code) turned 0 * NaN into NaN, and
    # one NaN row made the whole step's loss and gradient NaN.
    data = arithmetic_dataset("train", format="prompt", size=64)
    even = next(i for i in range(len(data)) if int(data[i]["answer"]) % 2 == 0)
    odd = next(i for i in range(len(data)) if int(data[i]["answer"]) % 2 == 1)
    trainer = tiny_trainer("grpo", plugins=[DynamicSampling(DynamicSampling.Params(max_rounds=1)), NaNAtFilteredRows()],
                           dataset=data, reward_funcs=[odd_sum_varies],
                           args={"per_device_train_batch_size": 2 * G, "num_generations": G, "temperature": 1.0})
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    torch.manual_seed(0)
    output = trainer._generate_and_score_completions(_rows(data, [even, odd]))
    advantages = output["advantages"]
    assert torch.equal(advantages[:G], torch.zeros(G))  # the even prompt's group was filtered
    assert torch.isfinite(advantages).all() and advantages[G:].abs().sum() > 0
    loss = trainer.compute_loss(trainer.model, output)
    loss.backward()
    assert torch.isfinite(loss)
    assert all(torch.isfinite(p.grad).all() for p in trainer.model.parameters() if p.grad is not None)


def test_cap_with_on_cap_error_raises_as_verl(tiny_trainer):
    full = arithmetic_dataset("train", format="prompt", size=64)
    even = full.filter(lambda row: int(row["answer"]) % 2 == 0)  # every group has zero variance
    trainer, plugin = _build(tiny_trainer, even, max_rounds=2, on_cap="error")
    torch.manual_seed(0)
    with pytest.raises(RuntimeError, match=r"2 generation rounds \(4 prompts\) found 0 of the 2 groups"):
        trainer._generate_and_score_completions(_rows(even, [0, 1]))


def test_first_round_full_means_one_round_and_eval_is_untouched(tiny_trainer):
    full = arithmetic_dataset("train", format="prompt", size=64)
    odd = full.filter(lambda row: int(row["answer"]) % 2 == 1)
    trainer, plugin = _build(tiny_trainer, odd, max_rounds=5)
    torch.manual_seed(0)
    output = trainer._generate_and_score_completions(_rows(odd, [0, 1]))
    sums = _prompt_sums(trainer, output)
    assert plugin.history[-1]["dynamic_sampling/rounds"] in (1, 2)  # 2 only if sampling made a group constant
    if plugin.history[-1]["dynamic_sampling/rounds"] == 1:
        assert sums == [int(odd[0]["answer"])] * G + [int(odd[1]["answer"])] * G  # the original prompts, in order

    trainer.model.eval()
    before = len(plugin.history)
    output = trainer._generate_and_score_completions(_rows(full, [0, 1]))
    assert len(plugin.history) == before and output["completion_ids"].shape[0] == 2 * G


def test_refill_draws_the_same_prompts_for_the_same_step_and_round(tiny_trainer):
    data = arithmetic_dataset("train", format="prompt", size=64)
    trainer, plugin = _build(tiny_trainer, data)
    rows = _rows(data, [0, 1])
    first = plugin._new_rows(trainer, rows, 1)
    assert first == plugin._new_rows(trainer, rows, 1) and first != plugin._new_rows(trainer, rows, 2)
    assert len(first) == len(rows) and all(first[i] == first[i - i % G] for i in range(len(first)))  # whole groups
    assert set(first[0]) == set(rows[0])


def test_training_steps_with_dapo(tiny_trainer):
    from trl_ext_plugins.losses.dapo import DAPO

    data = arithmetic_dataset("train", format="prompt", size=64)
    plugin = DynamicSampling(DynamicSampling.Params(max_rounds=4))
    trainer = tiny_trainer("grpo", plugins=[DAPO(), plugin], dataset=data, reward_funcs=[odd_sum_varies],
                           args={"per_device_train_batch_size": 2 * G, "num_generations": G, "temperature": 1.0,
                                 "max_steps": 2})
    result = trainer.train()
    assert result.global_step == 2 and torch.isfinite(torch.tensor(result.training_loss))
    assert len(plugin.history) == 2 and all(1 <= h["dynamic_sampling/rounds"] <= 4 for h in plugin.history)
    logged = {k for entry in trainer.state.log_history for k in entry}
    assert {"dynamic_sampling/rounds", "dynamic_sampling/prompts", "dynamic_sampling/cap_hit"} <= logged


# -- validation and recipes ------------------------------------------------------------------------------------


def test_group_of_one_is_refused():
    stage = StageSpec(trainer="grpo", model="embedded:tiny-qwen2", dataset="embedded:arithmetic",
                      plugins=["dynamic_sampling", "exact_match"], args={"num_generations": 1})
    with pytest.raises(RecipeError, match="dynamic_sampling.*num_generations"):
        resolve_stage(stage, 0, Catalog.discover())


def test_a_sequence_mean_loss_with_group_filters_keeps_trls_entropy_options():
    # filtered rows leave grpo's sequence count only in trl-ext's loss pipeline; TRL's entropy bonus and adaptive
    # controller, once refused there, are applied as TRL applies them (tests/test_losses_parity.py), so they validate
    def stage(loss_type, **options):
        return StageSpec(trainer="grpo", model="embedded:tiny-qwen2", dataset="embedded:arithmetic",
                         plugins=["dynamic_sampling", "exact_match"],
                         args={"loss_type": loss_type, "entropy_coef": 0.01, **options})

    for loss_type in ("grpo", "dapo"):
        resolve_stage(stage(loss_type), 0, Catalog.discover())
        resolve_stage(stage(loss_type, use_adaptive_entropy=True), 0, Catalog.discover())


@pytest.mark.parametrize("name", ["dynamic_sampling", "dapo"])
def test_recipes_validate(name):
    resolved = resolve_recipe(parse_recipe(load_raw(f"configs/{name}.yaml")), Catalog.discover())
    assert any(p.name == "dynamic_sampling" for p in resolved[0].host.plugins)
