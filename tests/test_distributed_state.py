"""Per-process state of plugins across ranks and resumes (docs/distributed.md is the audit these tests back).

Two ranks are simulated in one process: each rank is its own plugin instance with a fake trainer whose accelerator
answers ``process_index`` / ``num_processes`` / ``reduce`` / ``gather`` as two gloo processes would (the collectives
see both ranks' values, passed in by the test). The checkpoint-ordering test runs a real recipe on the tiny model.
"""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch

from trl_ext.batches import RolloutBatch
from trl_ext.callbacks import CHECKPOINT_COMPLETE, PLUGIN_STATE_DIR, PluginStateCheckpoint
from trl_ext_plugins.advantages.reinforce_baseline import ReinforceBaseline, ReinforceBaselineParams


def fake_trainer(rank: int, world: int = 2, training: bool = True, others: dict | None = None):
    """A trainer whose accelerator sums/gathers this rank's value with the other ranks' (``others[key]``)."""
    others = others or {}

    def reduce(t, reduction="sum"):
        total = t + sum(others.get("reduce", []), torch.zeros_like(t))
        return total / world if reduction == "mean" else total

    accelerator = SimpleNamespace(process_index=rank, num_processes=world, is_main_process=rank == 0, reduce=reduce,
                                  gather=lambda t: torch.cat([t, *others.get("gather", [])]) if rank == 0
                                  else torch.cat([*others.get("gather", []), t]))
    return SimpleNamespace(accelerator=accelerator, model=SimpleNamespace(training=training),
                           state=SimpleNamespace(global_step=0), callbacks=[],
                           add_callback=lambda cb: None)


def rollout_batch(trainer, rewards: list[float], rank: int, world: int = 2, group: int = 2) -> RolloutBatch:
    n = len(rewards)
    per_rank = n // world
    return RolloutBatch(rewards_per_func=torch.tensor(rewards).unsqueeze(1), reward_names=["r"],
                        reward_weights=torch.ones(1), num_generations=group,
                        process_slice=slice(rank * per_rank, (rank + 1) * per_rank),
                        completion_ids=torch.zeros(per_rank, 1, dtype=torch.long),
                        completion_mask=torch.ones(per_rank, 1), completion_lengths=torch.ones(n),
                        prompts=[""] * per_rank, completions=[""] * per_rank, inputs=[{}] * per_rank, trainer=trainer)


class Args(SimpleNamespace):
    pass


def saved_state(trainer, plugin):
    """The PluginStateCheckpoint the plugin registers in trl_ext_trainer_created."""
    added = []
    trainer.add_callback = added.append
    plugin.trl_ext_trainer_created(trainer=trainer)
    (callback,) = [c for c in added if isinstance(c, PluginStateCheckpoint)]
    return callback


# -- reinforce_baseline's moving average: global by design, saved by rank 0, restored on every rank -------------------

def test_moving_average_baseline_is_equal_on_both_ranks_and_resumes_on_every_rank(tmp_path):
    params = ReinforceBaselineParams(baseline="moving_average", decay=0.5, initial=0.2)
    batches = [[1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 0.0, 1.0, 1.0, math.nan, 1.0]]
    ranks = [ReinforceBaseline(params), ReinforceBaseline(params)]
    trainers = [fake_trainer(r) for r in range(2)]
    for plugin, trainer, rank in zip(ranks, trainers, range(2)):
        batch = rollout_batch(trainer, batches[0], rank)
        plugin.trl_ext_compute_advantages(rewards=batch.rewards_per_func[:, 0], batch=batch)
    # b <- 0.5 * 0.2 + 0.5 * mean(batch 0) = 0.1 + 0.25, on both ranks (the rewards are the gathered batch)
    assert [p.running_baseline for p in ranks] == [pytest.approx(0.35)] * 2

    args = Args(output_dir=str(tmp_path))
    callbacks = [saved_state(t, p) for t, p in zip(trainers, ranks)]
    callbacks[1].on_save(args, SimpleNamespace(global_step=2, is_world_process_zero=False), None)
    path = tmp_path / "checkpoint-2" / PLUGIN_STATE_DIR / "reinforce_baseline.json"
    assert not path.exists()  # rank 1 writes nothing
    callbacks[0].on_save(args, SimpleNamespace(global_step=2, is_world_process_zero=True), None)
    assert json.loads(path.read_text()) == {"running_baseline": pytest.approx(0.35)}

    # A resumed run: fresh plugins on both ranks read rank 0's file and continue as the uninterrupted run does.
    resumed = [ReinforceBaseline(params), ReinforceBaseline(params)]
    for trainer, plugin in zip(trainers, resumed):
        saved_state(trainer, plugin).on_train_begin(args, SimpleNamespace(global_step=2), None)
    assert [p.running_baseline for p in resumed] == [pytest.approx(0.35)] * 2
    for plugin, trainer, rank in zip(resumed, trainers, range(2)):
        batch = rollout_batch(trainer, batches[1], rank)
        advantages = plugin.trl_ext_compute_advantages(rewards=batch.rewards_per_func[:, 0], batch=batch)
        expected = [0.0 if math.isnan(r) else r - 0.35 for r in batches[1][rank * 4:(rank + 1) * 4]]
        torch.testing.assert_close(advantages, torch.tensor(expected))
    # mean of the 7 scorable rewards of batch 1 is 6/7
    assert [p.running_baseline for p in resumed] == [pytest.approx(0.5 * 0.35 + 0.5 * 6 / 7)] * 2


def test_moving_average_baseline_is_not_moved_by_evaluation_batches():
    plugin = ReinforceBaseline(ReinforceBaselineParams(baseline="moving_average", decay=0.5, initial=0.2))
    trainer = fake_trainer(0, world=1, training=False)
    batch = rollout_batch(trainer, [1.0, 1.0, 1.0, 1.0], 0, world=1)
    advantages = plugin.trl_ext_compute_advantages(rewards=batch.rewards_per_func[:, 0], batch=batch)
    torch.testing.assert_close(advantages, torch.full((4,), 0.8))  # evaluation uses the baseline ...
    assert plugin.running_baseline == 0.2  # ... without moving it


def test_other_baselines_keep_no_state_and_register_no_checkpoint():
    added = []
    trainer = fake_trainer(0)
    trainer.add_callback = added.append
    ReinforceBaseline(ReinforceBaselineParams(baseline="group_mean")).trl_ext_trainer_created(trainer=trainer)
    assert added == []


def test_resuming_without_the_state_file_names_the_plugin_and_the_file(tmp_path):
    plugin = ReinforceBaseline(ReinforceBaselineParams(baseline="moving_average"))
    callback = saved_state(fake_trainer(1), plugin)
    with pytest.raises(FileNotFoundError, match=r"plugin 'reinforce_baseline': resuming at step 4 .*checkpoint-4"):
        callback.on_train_begin(Args(output_dir=str(tmp_path)), SimpleNamespace(global_step=4), None)


# -- the runner: plugins' checkpoint files are written before the checkpoint is marked complete --------------------

def test_plugin_checkpoint_files_are_written_before_the_checkpoint_is_marked_complete(tmp_path):
    from trl_ext import NoParams, Plugin, hookimpl
    from trl_ext.recipe import parse_recipe
    from trl_ext.runner import run_recipe
    from trl_ext.testing import fresh_catalog
    from trl_ext_plugins.trainers.sft import SFT

    seen = []

    class Probe(Plugin):
        """Saves a state whose content is whether the checkpoint was already marked complete when it was saved."""

        name = "state_probe"
        Params = NoParams

        @hookimpl
        def trl_ext_trainer_created(self, trainer):
            def state():
                folder = tmp_path / "run" / "sft" / "checkpoints" / f"checkpoint-{trainer.state.global_step}"
                seen.append((trainer.state.global_step, (folder / CHECKPOINT_COMPLETE).exists()))
                return {"step": trainer.state.global_step}

            trainer.add_callback(PluginStateCheckpoint(self.name, state, lambda s: None))

    catalog = fresh_catalog()
    for cls in (SFT, Probe):
        catalog.add_plugin(cls)
    recipe = parse_recipe({
        "seed": 0, "trainer": "sft", "model": "embedded:tiny-qwen2", "name": "sft", "plugins": ["sft", "state_probe"],
        "keep_checkpoints": True,
        "dataset": {"source": "embedded:arithmetic", "params": {"format": "prompt_completion"}, "limit": 16},
        "args": {"max_steps": 2, "per_device_train_batch_size": 8, "max_length": 32, "save_steps": 1,
                 "logging_steps": 1},
    })
    run_recipe(recipe, tmp_path / "run", catalog, echo=lambda _m: None)
    assert seen == [(1, False), (2, False)]  # the marker came after the plugin's file, at every checkpoint
    for step in (1, 2):
        folder = tmp_path / "run" / "sft" / "checkpoints" / f"checkpoint-{step}"
        assert (folder / CHECKPOINT_COMPLETE).is_file()
        assert json.loads((folder / PLUGIN_STATE_DIR / "state_probe.json").read_text()) == {"step": step}


def test_callbacks_a_plugin_puts_first_keep_their_place_before_the_metrics_writer():
    """Only callbacks added after the completion marker's move before it; one inserted first on purpose (iterative_dpo
    tags every logged row before the metrics file is written) stays first (it was moved behind the metrics writer,
    and metrics.jsonl lost the tag)."""
    from trl_ext.callbacks import (CheckpointCompletionCallback, MetricsJsonlCallback,
                                   plugin_checkpoints_before_completion)

    metrics, completion, tag = MetricsJsonlCallback("metrics.jsonl"), CheckpointCompletionCallback(), object()
    plugin_state = PluginStateCheckpoint("p", dict, lambda s: None)
    trainer = SimpleNamespace(callback_handler=SimpleNamespace(callbacks=[metrics, completion]))
    with plugin_checkpoints_before_completion(trainer):
        trainer.callback_handler.callbacks.insert(0, tag)
        trainer.callback_handler.callbacks.append(plugin_state)
    assert trainer.callback_handler.callbacks == [tag, metrics, plugin_state, completion]


# -- metrics: TRL logs rank 0's figures, so a plugin's figure must already cover every rank -------------------------

def test_reward_kl_metric_is_the_token_mean_over_both_ranks():
    from trl_ext_plugins.advantages.rollout import reward_kl

    # k1 estimator: KL_t = log pi_old - log pi_ref. Rank 0: one loss token with KL 0.4; rank 1: three with KL 0.1.
    per_rank = {0: ([[0.4, 0.0, 0.0]], [[1.0, 0.0, 0.0]]), 1: ([[0.1, 0.1, 0.1]], [[1.0, 1.0, 1.0]])}
    logged = []
    for rank in (0, 1):
        other = per_rank[1 - rank]
        other_totals = torch.tensor([sum(other[0][0][:int(sum(other[1][0]))]), sum(other[1][0])])
        trainer = fake_trainer(rank, others={"reduce": [other_totals]})
        batch = rollout_batch(trainer, [0.0, 0.0], rank, group=1)
        kl_values, mask = per_rank[rank]
        batch.completion_mask = torch.tensor(mask)
        batch.old_per_token_logps = torch.tensor(kl_values)
        batch.ref_per_token_logps = torch.zeros(1, 3)
        reward_kl(batch, "k1", None, "ppo/kl")
        logged.append(batch.metrics["ppo/kl"])
    assert logged == [pytest.approx((0.4 + 3 * 0.1) / 4)] * 2  # one process on the same batch logs 0.175


def test_multi_env_verifier_errors_are_counted_over_both_ranks():
    from trl_ext_plugins.rollout.multi_env import MultiEnv

    envs = [{"name": "add", "dataset": {"source": "embedded:arithmetic"}, "rewards": ["exact_match"]},
            {"name": "mul", "dataset": {"source": "embedded:arithmetic"}, "rewards": ["exact_match"]}]
    errors = {0: {"add": 0, "mul": 1}, 1: {"add": 2, "mul": 3}}
    env_rows = {0: ["add", "mul"], 1: ["mul", "mul"]}
    logged = []
    for rank in (0, 1):
        plugin = MultiEnv(MultiEnv.Params(environments=envs))
        plugin.verifier_errors = dict(errors[rank])  # what this rank's routed verifiers counted
        other = 1 - rank
        trainer = fake_trainer(rank, others={
            "reduce": [torch.tensor([float(errors[other]["add"]), float(errors[other]["mul"])])],
            "gather": [torch.tensor([["add", "mul"].index(e) for e in env_rows[other]])]})
        batch = rollout_batch(trainer, [1.0, 0.0, 1.0, 0.0], rank, group=1)
        batch.inputs = [{"env": e} for e in env_rows[rank]]
        plugin.trl_ext_filter_groups(rewards=batch.rewards_per_func[:, 0], batch=batch)
        logged.append((batch.metrics["multi_env/add/verifier_errors"], batch.metrics["multi_env/mul/verifier_errors"],
                       batch.metrics["multi_env/mul/share"]))
    assert logged == [(2.0, 4.0, 0.75)] * 2  # every rank's count, on every rank


def test_partial_rollout_figures_cover_both_ranks_buffers():
    from trl_ext_plugins.rollout.partial_rollout import PartialRollout, PendingGroup, Trajectory

    def done(*versions):
        return Trajectory(ids=[1] * len(versions), logps=[0.0] * len(versions), versions=list(versions), finished=True)

    # step 3, G = 2. Rank 0: one finished group (versions {3}, {2, 3}), one group resumed, nothing left waiting,
    # 5 decoding steps. Rank 1: a finished group ({3}, {3}) and an unfinished one that waits, 7 decoding steps.
    states = {0: [done(3, 3), done(2, 3)], 1: [done(3), done(3), done(3), Trajectory(ids=[1], versions=[3])]}
    buffers = {0: [], 1: [PendingGroup([{}, {}], states[1][2:])]}
    resumed, steps = {0: 1, 1: 0}, {0: 5, 1: 7}
    # trained tokens (sampled by an older version, all): rank 0's version-2 token of 4; rank 1's 2 current tokens
    trained_tokens = {0: (1, 4), 1: (0, 2)}
    records = {}
    for rank in (0, 1):
        plugin = PartialRollout()
        plugin.buffer, plugin._last_steps = buffers[rank], steps[rank]
        plugin._trained_tokens = trained_tokens[rank]
        plugin._trained_rewards = (0.5, 0.25)  # from the gathered rewards: the same on every rank
        plugin._forced_groups, plugin._repeat_stopped = {0: (1, 2), 1: (0, 3)}[rank]
        other = 1 - rank
        # the other rank's figures: buffered groups, resumed, trained, generated, sum of distinct versions,
        # trained trajectories with tokens, staleness, decoding steps, stale trained tokens, trained tokens, groups
        # forced to finish, trajectories ended by repeat detection
        other_local = {0: [0, 1, 2, 2, 1 + 2, 2, 3 - 2, 5, 1, 4, 1, 2],
                       1: [1, 0, 2, 4, 1 + 1, 2, 0, 7, 0, 2, 0, 3]}[other]
        trainer = fake_trainer(rank, others={"gather": [torch.tensor(other_local, dtype=torch.float64)]})
        trainer.accelerator.device = "cpu"
        trainer.state.global_step = 3
        records[rank] = plugin._record(trainer, states[rank], 2, resumed[rank])
    expected = {"partial_rollout/buffer_groups": 1, "partial_rollout/resumed_trajectories": 1,
                "partial_rollout/trained_fraction": pytest.approx(4 / 6),
                "partial_rollout/versions_per_trajectory": pytest.approx((1 + 2 + 1 + 1) / 4),
                "partial_rollout/staleness_max": 1, "partial_rollout/generation_steps": 7,
                "partial_rollout/stale_token_fraction": pytest.approx(1 / 6),
                "partial_rollout/trained_reward_mean": 0.5, "partial_rollout/trained_zero_std_fraction": 0.25,
                "partial_rollout/forced_groups": 1, "partial_rollout/repeat_stopped": 5}
    assert records[0] == expected and records[1] == expected


def test_opd_figures_are_token_means_over_both_ranks(monkeypatch):
    from trl_ext_plugins.distill import opd

    class OneTeacher(opd._OPDBase):
        name = "one_teacher"
        Params = opd.OPDParams

        def teacher_refs(self):
            return {"t": "unused"}

        def route(self, row):
            return "t", 1.0

    # Rank 0: one token, teacher -1.0, student -0.5 (gap -0.5). Rank 1: two tokens, teacher -2.0, student -1.0 (gap
    # -1.0 each). One process on the same batch: reverse KL = (0.5 + 2 * 1.0) / 3, teacher log-prob = (-1 - 4) / 3.
    tensors = {0: (torch.tensor([[-1.0, 0.0]]), torch.tensor([[-0.5, 0.0]]), torch.tensor([[1.0, 0.0]])),
               1: (torch.tensor([[-2.0, -2.0]]), torch.tensor([[-1.0, -1.0]]), torch.tensor([[1.0, 1.0]]))}
    other_totals = {0: torch.tensor([0.5, -1.0, 1.0]), 1: torch.tensor([2.0, -4.0, 2.0])}
    logged = []
    for rank in (0, 1):
        teacher, student, mask = tensors[rank]
        monkeypatch.setattr(opd, "teacher_logps_by_route", lambda *a, _t=teacher, **k: _t)
        plugin = OneTeacher()
        plugin.pool = object()  # teachers are not loaded: the patched scorer answers
        trainer = fake_trainer(rank, others={"reduce": [other_totals[1 - rank]]})
        batch = rollout_batch(trainer, [0.0, 0.0], rank, group=1)
        batch.completion_mask, batch.old_per_token_logps = mask, student
        batch.completion_ids = torch.zeros(1, 2, dtype=torch.long)
        plugin.trl_ext_compute_advantages(rewards=batch.rewards_per_func[:, 0], batch=batch)
        logged.append((batch.metrics["opd/reverse_kl"], batch.metrics["opd/teacher_logp"]))
    assert logged == [(pytest.approx(2.5 / 3), pytest.approx(-5 / 3))] * 2


# -- data a plugin samples or scores before training: built on the main process, the same rows on every rank --------

class TwoRanks:
    """accelerate's PartialState and broadcast_object_list for two ranks run one after the other in this process:
    rank 0's broadcast is kept and handed to rank 1's."""

    def __init__(self, monkeypatch):
        import accelerate
        import accelerate.utils

        self.rank, self.sent = 0, None
        ranks = self
        monkeypatch.setattr(accelerate, "PartialState", lambda: SimpleNamespace(
            num_processes=2, process_index=ranks.rank, is_main_process=ranks.rank == 0))
        monkeypatch.setattr(accelerate.utils, "broadcast_object_list", self.broadcast)

    def broadcast(self, box, from_process=0):
        if self.rank == 0:
            self.sent = list(box)
        else:
            box[:] = self.sent
        return box


def test_on_main_process_builds_once_and_every_rank_gets_the_main_result(monkeypatch):
    from trl_ext_plugins.preference.generation import on_main_process

    ranks, calls = TwoRanks(monkeypatch), []

    def build():
        calls.append(ranks.rank)
        return {"rows": [1, 2, 3], "built_by": ranks.rank}

    results = []
    for rank in (0, 1):
        ranks.rank = rank
        results.append(on_main_process(build, "probe"))
    assert calls == [0] and results == [{"rows": [1, 2, 3], "built_by": 0}] * 2

    # every_rank_runs: both ranks run it (sharded models generate together), rank 0's result is kept, and a
    # failure on rank 1 alone does not stop it
    calls.clear()
    results = []
    for rank in (0, 1):
        ranks.rank = rank
        results.append(on_main_process(lambda: build() if ranks.rank == 0 else 1 / 0, "probe", every_rank_runs=True))
    assert calls == [0] and results == [{"rows": [1, 2, 3], "built_by": 0}] * 2


def test_on_main_process_failure_is_raised_on_every_rank_naming_the_plugin(monkeypatch):
    from trl_ext_plugins.preference.generation import on_main_process

    ranks = TwoRanks(monkeypatch)

    def build():
        raise ValueError("no sample accepted")

    with pytest.raises(ValueError, match="no sample accepted"):
        on_main_process(build, "rejection_sampling")
    ranks.rank = 1
    with pytest.raises(RuntimeError, match="rejection_sampling: the main process failed .*ValueError: no sample"):
        on_main_process(build, "rejection_sampling")


def test_rejection_sampling_round_one_is_sampled_on_the_main_process_and_shared(monkeypatch):
    from datasets import Dataset

    from trl_ext_plugins.distill import rejection_sampling as rs
    from trl_ext_plugins.preference import generation as gen

    ranks = TwoRanks(monkeypatch)
    prompts = Dataset.from_list([{"prompt": "1+1=", "answer": "2"}, {"prompt": "2+2=", "answer": "4"}])
    stage = SimpleNamespace(model="unused-model-path")
    kept = Dataset.from_list([{"prompt": "1+1=", "answer": "2", "completion": "2"}])
    monkeypatch.setattr(gen, "resolve_model", lambda ref, who: ref)
    monkeypatch.setattr(gen, "load_policy", lambda path: ("model", "tokenizer"))
    monkeypatch.setattr(rs.RejectionSampling, "e_step",
                        lambda self, model, tokenizer, round_index: (kept, {"round": round_index, "kept": 1}))
    main = rs.RejectionSampling().trl_ext_prepare_dataset(dataset=prompts, split="train", stage=stage)

    ranks.rank = 1
    monkeypatch.setattr(gen, "load_policy", lambda path: pytest.fail("rank 1 loaded the policy to sample"))
    other_plugin = rs.RejectionSampling()
    other = other_plugin.trl_ext_prepare_dataset(dataset=prompts, split="train", stage=stage)
    assert other.to_list() == main.to_list() == kept.to_list()
    assert other_plugin.history == [{"round": 1, "kept": 1}]


def test_self_play_solver_rows_are_sampled_on_the_main_process_and_shared(monkeypatch):
    from datasets import Dataset

    from trl_ext_plugins.rollout.self_play import SelfPlay

    ranks = TwoRanks(monkeypatch)
    prompts = Dataset.from_list([{"prompt": "3+"}])
    rows = [{"prompt": "3+4=", "answer": "7", "p_hat": 0.5}]
    record = {"self_play/generated": 4, "self_play/valid": 2, "self_play/kept": 1}
    monkeypatch.setattr(SelfPlay, "_solver_rows", lambda self, dataset, stage: (rows, record))
    params = SelfPlay.Params(role="solver", partner="unused")
    # one prompt per generation batch over the two ranks (4 x 2 / 8), so the single kept row fills one batch
    stage = SimpleNamespace(trainer="grpo", args={"per_device_train_batch_size": 4, "num_generations": 8})
    main = SelfPlay(params).trl_ext_prepare_dataset(dataset=prompts, split="train", stage=stage)
    ranks.rank = 1
    monkeypatch.setattr(SelfPlay, "_solver_rows", lambda self, dataset, stage: pytest.fail("rank 1 sampled"))
    plugin = SelfPlay(params)
    assert plugin.trl_ext_prepare_dataset(dataset=prompts, split="train", stage=stage).to_list() == main.to_list()
    assert plugin.history == [record]


def test_prm_monte_carlo_labels_are_computed_on_the_main_process_and_shared(monkeypatch):
    from datasets import Dataset

    from trl_ext_plugins.rewards import prm, steps

    ranks = TwoRanks(monkeypatch)
    data = Dataset.from_list([{"prompt": "2+2=", "completions": ["a", "b"], "answer": "4"}])
    stage = SimpleNamespace(trainer=prm.TRAINING)
    monkeypatch.setattr(prm, "resolve_ref", lambda ref, run_dir: ref)
    monkeypatch.setattr(steps, "transformers_completer", lambda folder, max_new_tokens: "completer")
    monkeypatch.setattr(steps, "monte_carlo_step_labels", lambda *args: [1.0, 0.0])
    params = prm.PRM.Params(label_source="mc_hard", completer="some-folder")
    main = prm.PRM(params).trl_ext_prepare_dataset(dataset=data, split="train", stage=stage)
    ranks.rank = 1
    monkeypatch.setattr(steps, "transformers_completer", lambda *a: pytest.fail("rank 1 ran the rollouts"))
    other = prm.PRM(params).trl_ext_prepare_dataset(dataset=data, split="train", stage=stage)
    assert other.to_list() == main.to_list() and main["labels"] == [[1.0, 0.0]]


# -- dynamic_sampling's refill prompts: the same on every rank, and the same after a resume ------------------------

def test_dynamic_sampling_refill_after_resume_draws_what_the_uninterrupted_run_drew():
    from trl_ext_plugins.rollout.dynamic_sampling import DynamicSampling

    dataset = [{"prompt": f"p{i}", "answer": str(i)} for i in range(50)]
    inputs = [dataset[0]] * 4  # this rank's generation batch: 2 prompts x G = 2

    def trainer(rank, global_step, micro_steps_this_session):
        return SimpleNamespace(train_dataset=dataset, num_generations=2, _step=micro_steps_this_session,
                               args=SimpleNamespace(seed=3, gradient_accumulation_steps=4),
                               state=SimpleNamespace(global_step=global_step),
                               accelerator=SimpleNamespace(num_processes=2, process_index=rank))

    plugin = DynamicSampling()
    for rank in (0, 1):
        # uninterrupted: optimizer step 6, second micro-step of its accumulation (TRL's _step = 6 * 4 + 1 = 25);
        # resumed from checkpoint-5: TRL's _step restarted at 0 and is 4 + 1 = 5 by then
        straight = plugin._new_rows(trainer(rank, 6, 25), inputs, 2)
        resumed = plugin._new_rows(trainer(rank, 6, 5), inputs, 2)
        assert resumed == straight
    # the two ranks hold the two halves of one draw of 4 prompts (each repeated G = 2 times)
    halves = [plugin._new_rows(trainer(rank, 6, 25), inputs, 2) for rank in (0, 1)]
    prompts = [row["prompt"] for half in halves for row in half]
    assert prompts[::2] == prompts[1::2] and len(set(prompts)) == 4
    # a different step draws other prompts
    assert plugin._new_rows(trainer(0, 7, 29), inputs, 2) != halves[0]


# -- self_judge's joint judge loss: baseline and token normaliser over every rank's verdicts ------------------------

def test_self_judge_judge_advantages_and_normaliser_span_both_ranks():
    from trl_ext_plugins.rewards.self_judge import SelfJudge, SelfJudgeParams

    # Rank 0: one group of 3, verdict rewards [1, 0, 1, 0, 0, 0] (pair (0,1) consistent, (0,2) position-decided,
    # (1,2) half unparsable), one verdict token each. Rank 1: one group of 2, pair consistent: rewards [1, 1], two
    # verdict tokens each. One process on both groups: mean reward 4 / 8 = 0.5, N = 6 + 4 = 10 verdict tokens.
    verdicts = {0: {(0, 1): 1.0, (1, 0): 0.0, (0, 2): 1.0, (2, 0): 1.0, (1, 2): None, (2, 1): 0.0},
                1: {(0, 1): 1.0, (1, 0): 0.0}}
    groups = {0: [[0, 1, 2]], 1: [[0, 1]]}
    verdict_tokens = {0: 1, 1: 2}
    totals = {0: torch.tensor([2.0, 6.0, 6.0], dtype=torch.float64), 1: torch.tensor([2.0, 2.0, 4.0],
                                                                                    dtype=torch.float64)}
    pending = {}
    for rank in (0, 1):
        plugin = SelfJudge(SelfJudgeParams(temperature=1.0, judge_loss_weight=1.0))
        trainer = fake_trainer(rank, others={"reduce": [totals[1 - rank]]})
        trainer.accelerator.device = "cpu"
        plugin.judge.trainer = trainer
        n_jobs = len(verdicts[rank])
        plugin.judge.last_sequences = [([5, 6], [7] * verdict_tokens[rank]) for _ in range(n_jobs)]
        plugin._record_judge_samples(groups[rank], [verdicts[rank]])
        pending[rank] = plugin._pending
    torch.testing.assert_close(pending[0]["advantages"], torch.tensor([0.5, -0.5, 0.5, -0.5, -0.5, -0.5],
                                                                      dtype=torch.float64))
    torch.testing.assert_close(pending[1]["advantages"], torch.tensor([0.5, 0.5], dtype=torch.float64))
    # each rank divides by N / processes: averaging the two ranks' gradients gives the one-process 1 / N
    assert pending[0]["tokens"] == pending[1]["tokens"] == 10 / 2


# -- two real processes (slow): a plugin's checkpointed state is restored on both ranks ------------------------------

@pytest.mark.slow
def test_two_processes_killed_and_resumed_continue_the_moving_average_baseline(tmp_path):
    """GRPO on 2 gloo processes (DDP, fixed completions so runs are repeatable) with reinforce_baseline's moving
    average, a checkpoint every step: killed while marking checkpoint-3, rerun from checkpoint-2. Rank 1 computes its
    own advantages from its own copy of the baseline, so a baseline restored on rank 0 only (or on none) would change
    the averaged gradient of step 3; the resumed run must end with the uninterrupted run's weights."""
    import os
    import subprocess
    import sys

    from test_distributed_backends import FIXED_ROLLOUTS, _parameters

    recipe = tmp_path / "r.yaml"
    recipe.write_text(json.dumps({
        "seed": 0, "name": "grpo", "trainer": "grpo", "model": "embedded:tiny-qwen2", "keep_checkpoints": True,
        "distributed": {"num_processes": 2, "backend": "ddp"},
        "dataset": {"source": "embedded:arithmetic", "params": {"format": "prompt"}, "limit": 64},
        "plugins": ["dapo", "fixed_rollouts", {"reinforce_baseline": {"baseline": "moving_average", "decay": 0.5}},
                    {"python_reward": {"functions": f"{FIXED_ROLLOUTS}:completion_length"}}],
        "args": {"max_steps": 3, "per_device_train_batch_size": 4, "num_generations": 4, "max_completion_length": 8,
                 "learning_rate": 0.1, "optim": "sgd", "logging_steps": 1, "save_strategy": "steps", "save_steps": 1,
                 "gradient_checkpointing": False},
    }))

    def run(out, crash_at=None):
        env = {k: v for k, v in os.environ.items() if k != "TRL_EXT_CRASH_AT"}
        env["OMP_NUM_THREADS"] = "1"
        if crash_at:
            env["TRL_EXT_CRASH_AT"] = crash_at
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29641",
                   str(FIXED_ROLLOUTS), "train", str(recipe), "--output-dir", str(out)]
        return subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)

    straight = run(tmp_path / "straight")
    assert straight.returncode == 0, straight.stderr[-3000:]
    killed = run(tmp_path / "resumed", crash_at="checkpoint:3")  # checkpoint-3's files written, not yet marked
    assert killed.returncode != 0 and not (tmp_path / "resumed" / "grpo" / "stage.json").exists()
    resumed = run(tmp_path / "resumed")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming from" in resumed.stdout and "checkpoint-2" in resumed.stdout

    def baselines(out):
        rows = [json.loads(line) for line in (out / "grpo" / "metrics.jsonl").read_text().splitlines()]
        return [row["advantages/baseline_mean"] for row in rows if "advantages/baseline_mean" in row]

    assert len(baselines(tmp_path / "straight")) == 3 and baselines(tmp_path / "straight")[2] != 0.0
    assert baselines(tmp_path / "resumed") == pytest.approx(baselines(tmp_path / "straight"), abs=1e-7)
    checkpoint = tmp_path / "resumed" / "grpo" / "checkpoints" / "checkpoint-2"
    state = checkpoint / PLUGIN_STATE_DIR / "reinforce_baseline.json"
    assert json.loads(state.read_text())["running_baseline"] == pytest.approx(baselines(tmp_path / "straight")[2])
    a, b = _parameters(tmp_path / "straight" / "grpo"), _parameters(tmp_path / "resumed" / "grpo")
    worst = max((a[k] - b[k]).abs().max().item() for k in a)
    assert worst < 1e-6, f"resumed run differs from the uninterrupted one by {worst:.3g}"


def test_routing_replay_mismatch_fractions_count_both_ranks_tokens():
    from trl_ext_plugins.moe.routing_replay import RoutingReplay

    # per layer: (own choice differs, compared, experts' input differs). Rank 0 compared 10 token-layer selections
    # per layer, rank 1 30; one process on both ranks' tokens: layer 0 (1 + 9) / 40, layer 1 (0 + 3) / 40.
    counts = {0: torch.tensor([[1, 10, 0], [0, 10, 0]]), 1: torch.tensor([[9, 30, 0], [3, 30, 0]])}
    logged = []
    for rank in (0, 1):
        trainer = fake_trainer(rank, others={"reduce": [counts[1 - rank]]})
        trainer.accelerator.device = "cpu"
        trainer._metrics = {}
        trainer._log_plugin_metrics = lambda m, _t=trainer: _t._metrics.update(m)
        routing = SimpleNamespace(begin=lambda *a, **k: None, abort=lambda: None,
                                  end=lambda mask, _c=counts[rank]: (None, _c))
        with RoutingReplay()._pass(trainer, routing, None, "train", None, replay=True):
            pass
        logged.append(trainer._metrics)
    for metrics in logged:
        assert metrics["routing_replay/mismatch"] == pytest.approx(13 / 80)
        assert metrics["routing_replay/mismatch/layer_0"] == pytest.approx(10 / 40)
        assert metrics["routing_replay/mismatch/layer_1"] == pytest.approx(3 / 40)
        assert metrics["routing_replay/replayed_mismatch"] == 0.0
