"""``partial_rollout`` (ALGORITHMS.md item 44): the stop rule stops after the ceil(lambda * N)-th trajectory finishes
(lambda 0.75 with 16 trajectories: the 12th), or with stop_unit: groups after the ceil(lambda * P)-th of P groups
completes; on the tiny model resumed prefixes keep their tokens byte-identical and their old sampling log-probs,
unfinished groups are masked, stale tokens get zero loss weight with mask_offpolicy; the buffer goes into checkpoints
and comes back on resume, and a run resumed from a checkpoint holding deferred groups trains the uninterrupted run bit
for bit; lambda outside (0, 1] is refused at validation."""

from __future__ import annotations

import pytest
import torch

from trl_ext.batches import LossInputs
from trl_ext.embedded.arithmetic import arithmetic_dataset
from trl_ext.errors import RecipeError
from trl_ext.recipe import StageSpec
from trl_ext.stage import resolve_stage
from trl_ext_plugins.rollout.control_math import finish_target, stale_token_mask, versions_per_trajectory
from trl_ext_plugins.rollout.math import trained_group_rewards
from trl_ext_plugins.rollout.partial_rollout import STALE_KEY, PartialRollout, StopWhenEnoughFinished

EOS = 99


def test_finish_target_and_staleness_helpers():
    assert finish_target(16, 0.75) == 12
    assert finish_target(10, 0.75) == 8  # ceil(7.5)
    assert finish_target(16, 1.0) == 16 and finish_target(16, 0.01) == 1
    assert versions_per_trajectory([[3, 3, 4, 5], [5, 5], []]) == [3, 1, 0]
    assert stale_token_mask([3, 3, 4, 5], current=5) == [True, True, True, False]


def test_stop_rule_stops_in_the_step_the_12th_of_16_trajectories_finishes():
    # trajectory i emits EOS at decoding step finish_step[i]; steps 1..8
    finish_step = [1, 1, 2, 2, 2, 3, 3, 4, 4, 5, 5, 5, 6, 7, 8, 8]  # the 12th finisher ends at step 5
    stop = StopWhenEnoughFinished(prompt_width=3, budgets=[8] * 16, eos_ids=[EOS], target=finish_target(16, 0.75))
    ids = torch.zeros(16, 3, dtype=torch.long)
    for step in range(1, 9):
        token = torch.tensor([EOS if f == step else 7 for f in finish_step]).unsqueeze(1)
        ids = torch.cat([ids, token], dim=1)
        result = stop(ids, scores=None)
        if result.all():
            break
    assert step == 5 and int(stop.done.sum()) == 12
    # before the global stop, rows are stopped one by one (EOS or their own budget)
    stop = StopWhenEnoughFinished(prompt_width=0, budgets=[1, 3], eos_ids=[EOS], target=2)
    assert stop(torch.tensor([[7], [7]]), None).tolist() == [True, False]


def _first_all_stop_step(stop, finish_step, prompt_width=0):
    ids = torch.zeros(len(finish_step), prompt_width, dtype=torch.long)
    for step in range(1, max(finish_step) + 1):
        token = torch.tensor([EOS if f == step else 7 for f in finish_step]).unsqueeze(1)
        ids = torch.cat([ids, token], dim=1)
        if stop(ids, scores=None).all():
            return step
    return None


def test_group_stop_unit_waits_for_the_third_of_four_groups_to_complete():
    # four groups of 4; a group completes when its last member finishes: groups 0, 2, 3, 1 at steps 2, 5, 7, 8
    finish_step = [1, 1, 2, 2,  2, 3, 3, 8,  4, 4, 5, 5,  1, 2, 6, 7]
    groups = [g for g in range(4) for _ in range(4)]
    by_group = StopWhenEnoughFinished(0, [8] * 16, [EOS], target=finish_target(4, 0.75), groups=groups)
    assert _first_all_stop_step(by_group, finish_step) == 7 and by_group.finished_units() == 3
    # the trajectory rule on the same lengths stops at the 12th finisher, step 5, with only groups 0 and 2 complete
    by_row = StopWhenEnoughFinished(0, [8] * 16, [EOS], target=finish_target(16, 0.75))
    assert _first_all_stop_step(by_row, finish_step) == 5
    # a resumed group brings only its unfinished members: group ids need not be contiguous or start at 0
    partial = StopWhenEnoughFinished(0, [8] * 5, [EOS], target=2, groups=[3, 3, 7, 9, 9])
    assert _first_all_stop_step(partial, [2, 4, 6, 1, 3]) == 4  # group 9 at step 3, group 3 at step 4


def test_required_rows_hold_the_call_open_past_the_target():
    # the 2nd of 4 rows finishes at step 2 (target 2), but row 3 (a group at the deferral bound) runs to step 6
    finish_step = [1, 2, 4, 6]
    free = StopWhenEnoughFinished(0, [8] * 4, [EOS], target=2)
    assert _first_all_stop_step(free, finish_step) == 2
    bound = StopWhenEnoughFinished(0, [8] * 4, [EOS], target=2, required=[False, False, False, True])
    assert _first_all_stop_step(bound, finish_step) == 6
    # a required row ended by its own budget counts as done (the cap finishes a trajectory)
    capped_row = StopWhenEnoughFinished(0, [8, 8, 8, 3], [EOS], target=2, required=[False, False, False, True])
    assert _first_all_stop_step(capped_row, finish_step) == 3
    # the target still holds once the required rows are done: row 0 required, the 3rd finisher at step 4
    early = StopWhenEnoughFinished(0, [8] * 4, [EOS], target=3, required=[True, False, False, False])
    assert _first_all_stop_step(early, finish_step) == 4


def test_trained_group_rewards_count_only_the_groups_that_train():
    nan = float("nan")
    rewards = torch.tensor([1, 0, 1, 1,  0, 0, 0, 0,  1, 1, 1, 1,  nan, 1, 0, 0])
    trained = torch.tensor([True] * 4 + [False] * 4 + [True] * 8)
    mean, zero_std = trained_group_rewards(rewards, trained, 4)
    assert mean == pytest.approx(8 / 11)  # (3 + 4 + 1) over the 11 scorable rewards of groups 0, 2 and 3
    assert zero_std == pytest.approx(1 / 3)  # group 2 agrees; the deferred all-zero group 1 does not count
    # a trained group with no scored row has no mean and no variance (as in TRL's frac_reward_zero_std)
    assert trained_group_rewards(torch.tensor([nan, nan]), torch.tensor([True, True]), 2) == pytest.approx(
        (nan, 1.0), nan_ok=True)
    assert trained_group_rewards(torch.tensor([1.0, 0.0]), torch.tensor([False, False]), 2) == pytest.approx(
        (nan, nan), nan_ok=True)


@pytest.mark.parametrize("value", [0.0, -0.5, 1.5])
def test_lambda_outside_0_1_is_refused_before_loading(trl_ext_catalog, register_plugin, value):
    register_plugin(PartialRollout)
    from trl_ext_plugins.rewards.exact_match import ExactMatch

    register_plugin(ExactMatch)
    stage = StageSpec(trainer="grpo", model="no-such-model", dataset={"source": "embedded:arithmetic"},
                      plugins=[{"partial_rollout": {"finish_fraction": value}}, "exact_match"])
    with pytest.raises(RecipeError, match=r"stages\[0\]\.plugins\[0\]\.params\.finish_fraction: .*partial_rollout"):
        resolve_stage(stage, 0, trl_ext_catalog)


def test_negative_max_deferrals_is_refused_before_loading(trl_ext_catalog, register_plugin):
    register_plugin(PartialRollout)
    from trl_ext_plugins.rewards.exact_match import ExactMatch

    register_plugin(ExactMatch)
    stage = StageSpec(trainer="grpo", model="no-such-model", dataset={"source": "embedded:arithmetic"},
                      plugins=[{"partial_rollout": {"max_deferrals": -1}}, "exact_match"])
    with pytest.raises(RecipeError, match=r"plugins\[0\]\.params\.max_deferrals: .*greater than or equal to 0"):
        resolve_stage(stage, 0, trl_ext_catalog)


def test_unknown_stop_unit_is_refused_before_loading(trl_ext_catalog, register_plugin):
    register_plugin(PartialRollout)
    from trl_ext_plugins.rewards.exact_match import ExactMatch

    register_plugin(ExactMatch)
    stage = StageSpec(trainer="grpo", model="no-such-model", dataset={"source": "embedded:arithmetic"},
                      plugins=[{"partial_rollout": {"stop_unit": "tokens"}}, "exact_match"])
    with pytest.raises(RecipeError, match=r"plugins\[0\]\.params\.stop_unit: .*'trajectories' or 'groups'"):
        resolve_stage(stage, 0, trl_ext_catalog)


# -- on the tiny model ---------------------------------------------------------------------------------------------


def eos_bias(trainer, bias: float = 4.0):
    """Make EOS likely at every step (a geometric, long-tailed completion length) on the untrained tiny model."""
    eos = trainer.eos_token_ids[0]

    def add(module, args, output):
        output = output.clone()
        output[..., eos] += bias
        return output

    return trainer.model.lm_head.register_forward_hook(add)


def _trainer(tiny_trainer, **params):
    plugin = PartialRollout(PartialRollout.Params(**params))
    data = arithmetic_dataset("train", format="prompt", size=64)
    trainer = tiny_trainer("grpo", plugins=[plugin], dataset=data,
                           args={"per_device_train_batch_size": 16, "num_generations": 4,
                                 "max_completion_length": 12, "temperature": 1.0})
    trainer.model.train()
    eos_bias(trainer)
    return trainer, plugin, data


def _rows(data, start):
    return [data[i] for i in range(start, start + 4) for _ in range(4)]


def test_stop_resume_byte_identical_prefixes_and_old_logprobs(tiny_trainer):
    trainer, plugin, data = _trainer(tiny_trainer, finish_fraction=0.75, mask_offpolicy=True)
    torch.manual_seed(1)
    first = trainer._generate_and_score_completions(_rows(data, 0))
    record = plugin.history[-1]
    lengths = first["completion_mask"].sum(1)  # masked groups are zeroed: use the plugin's own view
    pending = [s for g in plugin.buffer for s in g.samples]
    assert plugin.buffer, "expected some group to be unfinished at lambda = 0.75 (seeded)"
    unfinished = [s for s in pending if not s.finished]
    finished_count = 16 - len(unfinished)
    assert finished_count >= 12
    # it stopped in the decoding step in which the 12th trajectory finished: the unfinished prefixes have the length
    # of the last step, and fewer than 12 trajectories had finished before that step
    stop_step = record["partial_rollout/generation_steps"]
    assert all(len(s.ids) == stop_step for s in unfinished)
    eos = trainer.eos_token_ids[0]
    all_states = pending + []  # finished ones in complete groups are not buffered; count them from the batch
    ended_before = sum(1 for s in pending if s.finished and len(s.ids) < stop_step)
    complete_rows = [r for r in range(16) if lengths[r] > 0]
    ended_before += sum(1 for r in complete_rows if lengths[r] < stop_step)
    assert ended_before < 12
    # unfinished groups are out of this step's loss; complete groups are in
    groups_pending = len(plugin.buffer)
    assert record["partial_rollout/trained_fraction"] == (4 - groups_pending) / 4
    assert (record["partial_rollout/trained_zero_std_fraction"] >= 0) == (groups_pending < 4)  # NaN when none trains
    assert int((lengths > 0).sum()) == 16 - 4 * groups_pending
    assert all(s.ids[-1] == eos or len(s.ids) == 12 for s in pending if s.finished)
    assert len(all_states) == 4 * groups_pending

    # the policy moves on one version; the buffered groups take the first slots of the next batch
    saved = [(list(s.ids), list(s.logps), s.finished) for s in pending]
    trainer.state.global_step += 1
    second = trainer._generate_and_score_completions(_rows(data, 4))
    texts = trainer.processing_class.batch_decode(second["prompt_ids"], skip_special_tokens=True)
    first_texts = trainer.processing_class.batch_decode(first["prompt_ids"], skip_special_tokens=True)
    buffered_prompts = {t.strip() for g in range(4) for t in first_texts[4 * g:4 * g + 1]}
    assert all(t.strip() in buffered_prompts for t in texts[: 4 * groups_pending])
    ids, logps = second["completion_ids"], second["sampling_per_token_logps"]
    stale = second[STALE_KEY]
    for row, (old_ids, old_logps, was_finished) in enumerate(saved):
        n = len(old_ids)
        if second["completion_mask"][row].sum() == 0:  # still unfinished: its state is in the buffer again
            continue
        assert ids[row, :n].tolist() == old_ids  # byte-identical prefix
        assert torch.equal(logps[row, :n], torch.tensor(old_logps, dtype=logps.dtype))  # old sampling log-probs
        assert stale[row, :n].tolist() == [1.0] * n  # sampled by version 0 < 1
        assert stale[row, n:int(second["completion_mask"][row].sum())].sum() == 0  # the new segment is current
        if was_finished:
            assert int(second["completion_mask"][row].sum()) == n  # finished members wait unchanged
    assert plugin.history[-1]["partial_rollout/resumed_trajectories"] == len(unfinished)
    # the logged stale share counts the trained rows' tokens only (a fresh first round has none)
    lengths = second["completion_mask"].sum(1)
    trained = lengths > 0
    assert record["partial_rollout/stale_token_fraction"] == 0.0
    assert 0.0 < plugin.history[-1]["partial_rollout/stale_token_fraction"] < 1.0  # resumed groups trained
    assert plugin.history[-1]["partial_rollout/stale_token_fraction"] == pytest.approx(
        float(stale[trained].sum() / lengths[trained].sum()))

    # mask_offpolicy: the stale segment has zero loss weight
    li = _loss_inputs(second)
    weights = plugin.trl_ext_token_weights(inputs=li)
    assert torch.equal(weights.mask, stale == 0)
    plain = PartialRollout(PartialRollout.Params(mask_offpolicy=False))
    assert plain.trl_ext_token_weights(inputs=li) is None


def _loss_inputs(output):
    mask = output["completion_mask"].float()
    zeros = torch.zeros_like(mask)
    return LossInputs(num_items_in_batch=mask.sum(), grad_accum_steps=1, steps_per_generation=1, num_processes=1,
                      training=True, loss_type="dapo", max_completion_length=12, per_token_logps=zeros,
                      old_per_token_logps=zeros, advantages=zeros[:, :1], mask=mask, sampling_per_token_logps=None,
                      ref_per_token_logps=None, entropies=None, epsilon_low=0.2, epsilon_high=0.2, beta=0.0,
                      extra={STALE_KEY: output[STALE_KEY]})


def test_group_stop_unit_trains_at_least_lambda_of_the_groups(tiny_trainer):
    trainer, plugin, data = _trainer(tiny_trainer, finish_fraction=0.5, stop_unit="groups")
    torch.manual_seed(2)
    output = trainer._generate_and_score_completions(_rows(data, 0))
    record = plugin.history[-1]
    # ceil(0.5 * 4) = 2 of the 4 groups complete: it stopped in the step the second group completed
    assert record["partial_rollout/trained_fraction"] >= 0.5 and len(plugin.buffer) <= 2
    # the deferred groups leave the loss's row count too (sequence-mean aggregations divide by the trained rows)
    assert float(output["kept_row_fraction"]) == record["partial_rollout/trained_fraction"] < 1.0
    unfinished = [s for g in plugin.buffer for s in g.samples if not s.finished]
    assert all(len(s.ids) == record["partial_rollout/generation_steps"] for s in unfinished)
    # the same seed under the trajectory rule (ceil(0.5 * 16) = 8 rows): two complete groups hold 8 finished rows, so
    # it stops no later, and here earlier, with fewer groups complete
    rows_trainer, rows_plugin, _ = _trainer(tiny_trainer, finish_fraction=0.5)
    torch.manual_seed(2)
    rows_trainer._generate_and_score_completions(_rows(data, 0))
    by_rows = rows_plugin.history[-1]
    assert by_rows["partial_rollout/generation_steps"] < record["partial_rollout/generation_steps"]
    assert by_rows["partial_rollout/trained_fraction"] < 0.5


def test_lambda_one_is_plain_generation_and_eval_is_untouched(tiny_trainer):
    trainer, plugin, data = _trainer(tiny_trainer, finish_fraction=1.0)
    torch.manual_seed(0)
    out = trainer._generate_and_score_completions(_rows(data, 0))
    assert plugin.buffer == [] and plugin.history[-1]["partial_rollout/trained_fraction"] == 1.0
    assert (out["completion_mask"].sum(1) > 0).all()
    trainer.model.eval()
    calls = len(plugin.history)
    trainer._generate_and_score_completions(_rows(data, 0))
    assert len(plugin.history) == calls and plugin.buffer == []


def test_an_evaluation_between_micro_steps_keeps_the_stale_mask(tiny_trainer):
    """A generation batch trains over several optimizer steps (steps_per_generation, num_iterations); an evaluation
    between them must not drop the stale-token mask of the batch still being trained (it did: the host forwarded only
    the loss extras of the last scoring round, the evaluation's, so mask_offpolicy silently stopped applying)."""
    from trl_ext_plugins.rollout.partial_rollout import PendingGroup, Trajectory

    trainer, plugin, data = _trainer(tiny_trainer, finish_fraction=1.0, mask_offpolicy=True)
    # one resumed group whose 6-token prefixes version 0 sampled; the batch is generated at version 1
    plugin.buffer = [PendingGroup([data[0]] * 4, [Trajectory([5] * 6, [-1.0] * 6, [0] * 6) for _ in range(4)])]
    trainer.state.global_step = 1
    torch.manual_seed(0)
    batch = trainer._generate_and_score_completions(_rows(data, 4))
    mask = batch["completion_mask"].bool()
    fresh = mask & (batch[STALE_KEY] == 0)
    assert 0 < int(fresh.sum()) < int(mask.sum())
    trainer.model.eval()
    trainer._generate_and_score_completions(_rows(data, 8))  # an evaluation round
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1  # what Trainer sets at each accumulation window
    trainer._plugin_loss(trainer.model, batch)
    kept = trainer._metrics["train"]["loss_mask/kept_fraction"][-1]
    assert kept == pytest.approx(int(fresh.sum()) / int(mask.sum()))


def test_a_restored_prefix_longer_than_the_cap_is_cut_not_extended(tiny_trainer):
    """A buffer saved with max_completion_length 12 and resumed with 8: a 10-token prefix has budget -2; it used to
    receive ids[:-2] of the call's new tokens (16 tokens in all, twice the cap). It is cut at the cap and finished;
    a 3-token prefix still continues to at most the cap."""
    from trl_ext_plugins.rollout.partial_rollout import PendingGroup, Trajectory, capped

    assert capped(Trajectory([1, 2, 3], [-1.0, -2.0, -3.0], [0, 0, 1]), 2) == Trajectory([1, 2], [-1.0, -2.0], [0, 0],
                                                                                          True)
    assert capped(Trajectory([1, 2], [-1.0, -2.0], [0, 0]), 3) == Trajectory([1, 2], [-1.0, -2.0], [0, 0], False)
    plugin = PartialRollout(PartialRollout.Params(finish_fraction=1.0))
    data = arithmetic_dataset("train", format="prompt", size=64)
    trainer = tiny_trainer("grpo", plugins=[plugin], dataset=data,
                           args={"per_device_train_batch_size": 8, "num_generations": 4, "max_completion_length": 8,
                                 "temperature": 1.0})
    trainer.model.train()
    long, short = (Trajectory([5] * 10, [-1.0] * 10, [0] * 10), Trajectory([5] * 3, [-1.0] * 3, [0] * 3))
    plugin.buffer = [PendingGroup([data[0]] * 4, [long, long, short, short])]
    trainer.state.global_step = 1
    torch.manual_seed(0)
    out = trainer._generate_and_score_completions([data[1]] * 8)
    lengths = out["completion_mask"].sum(1).tolist()
    assert lengths[:2] == [8, 8] and all(3 < n <= 8 for n in lengths[2:4]) and max(lengths) <= 8
    assert out["completion_ids"][0, :8].tolist() == [5] * 8 and out[STALE_KEY][0, :8].tolist() == [1.0] * 8


def test_a_restored_buffer_of_another_group_size_is_refused(tiny_trainer):
    """Groups of 4 restored into a run with num_generations 2 used to fail deep in TRL ("Sizes of tensors must
    match"): the resumed rows no longer added up to the generation batch."""
    from trl_ext_plugins.rollout.partial_rollout import PendingGroup, Trajectory

    plugin = PartialRollout(PartialRollout.Params())
    data = arithmetic_dataset("train", format="prompt", size=64)
    trainer = tiny_trainer("grpo", plugins=[plugin], dataset=data,
                           args={"per_device_train_batch_size": 8, "num_generations": 2, "max_completion_length": 8})
    trainer.model.train()
    plugin.buffer = [PendingGroup([data[0]] * 4, [Trajectory([5] * 3, [-1.0] * 3, [0] * 3) for _ in range(4)])]
    with pytest.raises(ValueError, match=r"groups of \[4\] trajectories, but num_generations is 2"):
        trainer._generate_and_score_completions([data[1]] * 8)


def test_stale_token_fraction_counts_the_tokens_the_loss_sees(tiny_trainer):
    """With mask_truncated_completions, TRL zeroes the mask of trajectories cut by the cap; the logged stale share
    counted their tokens anyway (0.4 here, where the loss sees 7 stale tokens of 9: 0.778)."""
    from trl_ext_plugins.rollout.partial_rollout import PendingGroup, Trajectory

    plugin = PartialRollout(PartialRollout.Params(finish_fraction=1.0))
    data = arithmetic_dataset("train", format="prompt", size=64)
    trainer = tiny_trainer("grpo", plugins=[plugin], dataset=data,
                           args={"per_device_train_batch_size": 8, "num_generations": 4, "max_completion_length": 12,
                                 "temperature": 1.0, "mask_truncated_completions": True})
    trainer.model.train()
    eos = trainer.eos_token_ids[0]
    plugin.buffer = [PendingGroup([data[0]] * 4, [Trajectory([5, 5, eos], [-1.0] * 3, [0] * 3, True),
                                                  Trajectory([5] * 11, [-1.0] * 11, [0] * 11),
                                                  Trajectory([5, eos], [-1.0] * 2, [0] * 2, True),
                                                  Trajectory([5, eos], [-1.0] * 2, [0] * 2, True)])]
    trainer.state.global_step = 1
    torch.manual_seed(0)
    out = trainer._generate_and_score_completions(_rows(data, 4)[:8])
    mask = out["completion_mask"].bool()
    assert int(mask[1].sum()) == 0  # the 11-token prefix was cut by the cap (seeded): TRL masks it
    expected = float((out[STALE_KEY].bool() & mask).sum() / mask.sum())
    assert plugin.history[-1]["partial_rollout/stale_token_fraction"] == pytest.approx(expected)
    assert expected == pytest.approx(7 / 9)


def test_buffer_survives_checkpoint_and_resume(tiny_trainer, tmp_path):
    trainer, plugin, data = _trainer(tiny_trainer, finish_fraction=0.5)
    torch.manual_seed(2)
    trainer._generate_and_score_completions(_rows(data, 0))
    assert plugin.buffer
    state = plugin.buffer_state()
    # what the Trainer does at a save step: on_save after the checkpoint folder is written
    from trl_ext_plugins.rollout.partial_rollout import PartialRolloutCheckpoint

    callback = next(c for c in trainer.callback_handler.callbacks if isinstance(c, PartialRolloutCheckpoint))
    trainer.state.global_step = 3
    callback.on_save(trainer.args, trainer.state, trainer.control)
    saved = tmp_path / "out" / "checkpoint-3" / "partial_rollout_rank0.json"
    assert saved.exists()

    fresh = PartialRollout(PartialRollout.Params(finish_fraction=0.5))
    restore = PartialRolloutCheckpoint(fresh, 0)
    restore.on_train_begin(trainer.args, trainer.state, trainer.control)
    assert fresh.buffer_state() == state and fresh.buffer
    assert [s.ids for g in fresh.buffer for s in g.samples] == [s.ids for g in plugin.buffer for s in g.samples]


@pytest.mark.slow
def test_training_checkpoint_mid_iteration_resumes_the_buffer(tiny_trainer, tmp_path):
    """Real training: a checkpoint at step 1 holds the unfinished groups; a new trainer resuming from it continues them
    (its first rollout resumes exactly the saved trajectories, prefixes byte-identical)."""
    from transformers import TrainerCallback

    args = {"per_device_train_batch_size": 16, "num_generations": 4, "max_completion_length": 12,
            "temperature": 1.0, "max_steps": 1, "save_strategy": "steps", "save_steps": 1, "seed": 3}
    data = arithmetic_dataset("train", format="prompt", size=64)
    first = PartialRollout(PartialRollout.Params(finish_fraction=0.5))
    trainer = tiny_trainer("grpo", plugins=[first], dataset=data, args=args)
    eos_bias(trainer)
    trainer.train()
    checkpoint = tmp_path / "out" / "checkpoint-1"
    assert (checkpoint / "partial_rollout_rank0.json").exists()
    saved = first.buffer_state()
    assert saved, "expected unfinished groups at lambda 0.5 (seeded)"

    class SeeBuffer(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            self.seen = second.buffer_state()

    second = PartialRollout(PartialRollout.Params(finish_fraction=0.5))
    resumed = tiny_trainer("grpo", plugins=[second], dataset=data, args={**args, "max_steps": 2})
    eos_bias(resumed)
    probe = SeeBuffer()
    resumed.add_callback(probe)  # after the plugin's callback, which restores the buffer on train begin
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert probe.seen == saved
    unfinished = sum(not s["finished"] for g in saved for s in g["samples"])
    assert second.history[0]["partial_rollout/resumed_trajectories"] == unfinished


def _saved_group(tag: int) -> dict:
    return {"rows": [{"prompt": f"{tag}+1=", "answer": str(tag + 1)}],
            "samples": [{"ids": [tag, tag], "logps": [-0.5, -0.25], "versions": [tag, tag], "finished": False}]}


@pytest.mark.parametrize("world", [1, 2, 3])
def test_resume_on_a_different_number_of_processes_deals_every_group_once(tmp_path, world):
    """A checkpoint written by 2 ranks (3 and 2 groups) resumed on `world` ranks: same world reads its own file;
    otherwise the 5 groups are dealt round-robin in rank order, none lost, none duplicated."""
    import json
    from types import SimpleNamespace

    from trl_ext_plugins.rollout.partial_rollout import PartialRolloutCheckpoint

    checkpoint = tmp_path / "checkpoint-5"
    checkpoint.mkdir()
    written = {0: [_saved_group(t) for t in (0, 1, 2)], 1: [_saved_group(t) for t in (10, 11)]}
    for rank, groups in written.items():
        (checkpoint / f"partial_rollout_rank{rank}.json").write_text(json.dumps(groups))
    args, state = SimpleNamespace(output_dir=str(tmp_path)), SimpleNamespace(global_step=5)
    restored = []
    for rank in range(world):
        plugin = PartialRollout(PartialRollout.Params())
        PartialRolloutCheckpoint(plugin, rank, world).on_train_begin(args, state, None)
        restored.append([g["rows"][0]["prompt"] for g in plugin.buffer_state()])
    expected = {1: [["0+1=", "1+1=", "2+1=", "10+1=", "11+1="]],
                2: [["0+1=", "1+1=", "2+1="], ["10+1=", "11+1="]],
                3: [["0+1=", "10+1="], ["1+1=", "11+1="], ["2+1="]]}[world]
    assert restored == expected
    plugin = PartialRollout(PartialRollout.Params())
    PartialRolloutCheckpoint(plugin, 0, world).on_train_begin(args, state, None)
    assert plugin.buffer[0].samples[0].ids == [0, 0] and plugin.buffer[0].samples[0].logps == [-0.5, -0.25]


def _varied_reward(completions, **kwargs):
    """Differs between samples of a group, so every step has nonzero advantages and moves the weights."""
    return [float(sum(map(ord, str(c))) % 7) for c in completions]


def test_a_run_resumed_mid_deferral_trains_the_uninterrupted_run_bit_for_bit(tiny_trainer, tmp_path):
    """Four steps straight against two steps, a checkpoint holding deferred groups, then a new trainer resuming from it:
    same weights (torch.equal) and same per-step figures. Deferred groups resume under the restored RNG and optimizer,
    so nothing the buffer carries (prefixes, sampling log-probs, policy versions) may be lost or rounded."""
    args = {"per_device_train_batch_size": 16, "num_generations": 4, "max_completion_length": 12, "temperature": 1.0,
            "max_steps": 4, "save_strategy": "steps", "save_steps": 2, "seed": 3, "learning_rate": 1e-3,
            "lr_scheduler_type": "linear"}
    data = arithmetic_dataset("train", format="prompt", size=64)

    def run(resume_from=None):
        plugin = PartialRollout(PartialRollout.Params(finish_fraction=0.5))
        trainer = tiny_trainer("grpo", plugins=[plugin], dataset=data, args=args, reward_funcs=[_varied_reward])
        eos_bias(trainer)
        trainer.train(resume_from_checkpoint=resume_from)
        return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}, plugin.history

    straight, straight_history = run()
    checkpoint = tmp_path / "out" / "checkpoint-2"
    import json

    saved = json.loads((checkpoint / "partial_rollout_rank0.json").read_text())
    assert saved, "expected groups deferred at step 2 (lambda 0.5, seeded)"
    resumed, resumed_history = run(str(checkpoint))
    assert resumed_history == straight_history[2:]  # steps 3 and 4: buffer sizes, staleness, trained fractions
    assert resumed_history[0]["partial_rollout/resumed_trajectories"] == sum(
        not s["finished"] for g in saved for s in g["samples"])
    assert straight.keys() == resumed.keys()
    changed = [k for k in straight if not torch.equal(straight[k], resumed[k])]
    assert not changed, f"weights differ after resuming: {changed[:5]}"


@pytest.mark.parametrize("limit", [0, 1, 2])
def test_max_deferrals_bounds_how_long_a_group_waits(tiny_trainer, limit):
    """At lambda 0.25 most groups are deferred every round; with max_deferrals k no group is deferred more than k
    times, a group at the bound trains in that round, and no trained token is more than k rounds old."""
    trainer, plugin, data = _trainer(tiny_trainer, finish_fraction=0.25, max_deferrals=limit)
    unbounded_trainer, unbounded, _ = _trainer(tiny_trainer, finish_fraction=0.25)
    waits = []
    for steps in (plugin, unbounded):
        torch.manual_seed(4)
        model = trainer if steps is plugin else unbounded_trainer
        for round_ in range(6):
            model.state.global_step = round_
            at_bound = sum(g.deferrals >= limit for g in steps.buffer[:4])
            model._generate_and_score_completions(_rows(data, 4 * round_))
            record = steps.history[-1]
            if steps is plugin:
                assert all(g.deferrals <= limit for g in steps.buffer) and (limit > 0 or not steps.buffer)
                assert record["partial_rollout/forced_groups"] == (4 if limit == 0 else at_bound)
                assert record["partial_rollout/staleness_max"] <= limit
        waits.append(max(r["partial_rollout/staleness_max"] for r in steps.history))
    assert waits[1] > limit, "expected the unbounded run to let some group wait longer (seeded)"


def test_deferral_counts_survive_the_checkpoint(tiny_trainer):
    from trl_ext_plugins.rollout.partial_rollout import PendingGroup, Trajectory

    plugin = PartialRollout(PartialRollout.Params(max_deferrals=2))
    plugin.buffer = [PendingGroup([{"prompt": "1+1="}], [Trajectory([5], [-1.0], [0])], deferrals=2)]
    state = plugin.buffer_state()
    restored = PartialRollout(PartialRollout.Params(max_deferrals=2))
    restored.load_buffer_state(state)
    assert restored.buffer[0].deferrals == 2
    # a buffer written before the count existed: each of its groups was deferred once at least
    del state[0]["deferrals"]
    restored.load_buffer_state(state)
    assert restored.buffer[0].deferrals == 1


def test_periodic_tails_finds_a_block_repeated_to_the_end():
    from trl_ext_plugins.rollout.partial_rollout import periodic_tails

    ids = torch.tensor([[9, 1, 2, 1, 2, 1, 2],    # period 2 over the last 6
                        [9, 1, 2, 3, 1, 2, 4],    # no period
                        [9, 1, 2, 3, 1, 2, 3],    # period 3
                        [9, 5, 5, 5, 5, 5, 5],    # period 1 (and 2, 3)
                        [1, 2, 1, 2, 1, 2, 5]])   # periodic before its last token only
    assert periodic_tails(ids, window=6, max_period=3).tolist() == [True, False, True, True, False]
    assert periodic_tails(ids, window=6, max_period=2).tolist() == [True, False, False, True, False]
    assert periodic_tails(ids, window=8, max_period=3).tolist() == [False] * 5  # rows shorter than the window


def test_repeat_detection_counts_the_resumed_prefix_and_cuts_the_row():
    # row 0 resumes a 3-token prefix "7 7 7" and emits 7s: with window 4 it is cut at its first new token; row 1 emits
    # "1 2 1 2 ..." from nothing and is cut at step 4; row 2 varies and runs to its budget
    # left-padded inputs, prompt then prefix; row 2's prompt ends "1 1 1" and its first new token is 1: a periodic
    # window only if the prompt counted, which it does not (the window must lie inside the completion)
    ids = torch.tensor([[8, 8, 7, 7, 7], [0, 0, 0, 7, 7], [0, 0, 1, 1, 1]])
    stop = StopWhenEnoughFinished(prompt_width=5, budgets=[6, 6, 6], eos_ids=[EOS], target=3, repeat=(4, 2),
                                  prefix_lengths=[3, 0, 0])
    streams = [[7] * 6, [1, 2, 1, 2, 1, 2], [1, 2, 3, 4, 5, 6]]
    for step in range(6):
        ids = torch.cat([ids, torch.tensor([[s[step]] for s in streams])], dim=1)
        if stop(ids, None).all():
            break
    assert stop.repeat_cut.tolist() == [1, 4, -1] and step == 5


def test_repeat_detection_ends_repetitive_trajectories_in_training(tiny_trainer):
    """A model that repeats one token: with repeat_window 4 every trajectory ends after 4 tokens, finished without
    EOS, and the round trains them; without it they run to the 12-token cap."""
    from trl_ext_plugins.rollout.partial_rollout import PartialRollout as Plugin

    lengths = {}
    for window in (None, 4):
        trainer, plugin, data = _trainer(tiny_trainer, finish_fraction=1.0, repeat_window=window, repeat_max_period=2)
        token = 5

        def repeat_one(module, args, output):
            output = output.clone()
            output[..., token] += 100.0
            return output

        trainer.model.lm_head.register_forward_hook(repeat_one)
        torch.manual_seed(0)
        out = trainer._generate_and_score_completions(_rows(data, 0))
        lengths[window] = out["completion_mask"].sum(1).tolist()
        record = plugin.history[-1]
        assert isinstance(plugin, Plugin) and record["partial_rollout/trained_fraction"] == 1.0
        assert record["partial_rollout/repeat_stopped"] == (16 if window else 0)
        assert (out["completion_ids"][:, : lengths[window][0]] == token).all()
    assert lengths[None] == [12] * 16 and lengths[4] == [4] * 16


def test_repeat_period_longer_than_half_the_window_is_refused(trl_ext_catalog, register_plugin):
    register_plugin(PartialRollout)
    from trl_ext_plugins.rewards.exact_match import ExactMatch

    register_plugin(ExactMatch)
    stage = StageSpec(trainer="grpo", model="no-such-model", dataset={"source": "embedded:arithmetic"},
                      plugins=[{"partial_rollout": {"repeat_window": 8, "repeat_max_period": 5}}, "exact_match"])
    with pytest.raises(RecipeError, match=r"plugins\[0\]\.params.*repeat_max_period \(5\) must be at most half of "
                                          r"repeat_window \(8\)"):
        resolve_stage(stage, 0, trl_ext_catalog)


def test_an_overfull_buffer_resumes_the_most_deferred_groups_first(tiny_trainer):
    """After a resume on fewer processes a rank can hold more groups than one round takes: the groups at the deferral
    bound go first (and are finished), and the groups left waiting count the round as a deferral."""
    from trl_ext_plugins.rollout.partial_rollout import PendingGroup, Trajectory

    plugin = PartialRollout(PartialRollout.Params(finish_fraction=0.25, max_deferrals=2))
    data = arithmetic_dataset("train", format="prompt", size=64)
    trainer = tiny_trainer("grpo", plugins=[plugin], dataset=data,
                           args={"per_device_train_batch_size": 8, "num_generations": 4, "max_completion_length": 12,
                                 "temperature": 1.0})
    trainer.model.train()
    eos_bias(trainer, bias=-4.0)  # EOS unlikely: nothing finishes unless forced
    plugin.buffer = [PendingGroup([data[i]] * 4, [Trajectory([5], [-1.0], [0]) for _ in range(4)], deferrals=d)
                     for i, d in enumerate([1, 2, 0, 2])]
    trainer.state.global_step = 1
    torch.manual_seed(0)
    out = trainer._generate_and_score_completions(_rows(data, 8)[:8])
    record = plugin.history[-1]
    assert record["partial_rollout/forced_groups"] == 2  # the two groups at the bound took the two slots
    assert (out["completion_mask"].sum(1) > 0).all()  # and finished, so both train
    assert sorted(g.deferrals for g in plugin.buffer) == [1, 2]  # the other two waited a round: 0 -> 1, 1 -> 2
