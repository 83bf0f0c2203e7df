"""``pass_rate_filter`` with ``reestimate_every`` (issue 16): the lazy curriculum sampler keeps TRL's RepeatSampler
stream when nothing changes, a queue change mid-epoch reaches only chunks not yet drawn, the queue survives a
checkpoint (replaying the epoch's drawn chunks), bad input is refused at validation, and on the tiny model a real GRPO
run re-estimates with the current weights, logs the figures and resumes to the uninterrupted run's batches."""

from __future__ import annotations

import copy
import json

import pytest
from trl.trainer.utils import RepeatSampler

from trl_ext.embedded.arithmetic import arithmetic_dataset
from trl_ext.errors import RecipeError
from trl_ext.recipe import StageSpec
from trl_ext.runner import RunContext, _CURRENT_RUN
from trl_ext.stage import resolve_stage
from trl_ext_plugins.rollout.control_math import within_bounds
from trl_ext_plugins.rollout.curriculum_sampler import CurriculumQueue, CurriculumSampler
from trl_ext_plugins.rollout.pass_rate_filter import PassRateFilter


def _queue(rates, order="none", shuffle=False, seed=0, lower=0.0, upper=1.0, inclusive=False):
    return CurriculumQueue(rates, lower=lower, upper=upper, inclusive=inclusive, order=order, shuffle=shuffle,
                           seed=seed)


@pytest.mark.parametrize("shuffle", [True, False])
def test_stream_equals_repeat_sampler_when_nothing_changes(shuffle):
    n, mini, batch, repeat = 23, 3, 4, 2  # 23 rows: 5 whole chunks of 4, the last 3 rows skipped as TRL skips them
    ours = CurriculumSampler(_queue([0.5] * n, shuffle=shuffle, seed=7), mini_repeat_count=mini, batch_size=batch,
                             repeat_count=repeat, num_chunks=n // batch)
    trl = RepeatSampler(list(range(n)), mini_repeat_count=mini, batch_size=batch, repeat_count=repeat,
                        shuffle=shuffle, seed=7)
    assert len(ours) == len(trl) == 5 * 4 * 3 * 2
    for _epoch in range(3):  # a new pass per epoch, from the same generator, as RepeatSampler reshuffles
        assert list(ours) == list(trl)


def test_repeat_structure_by_hand():
    # rates: rows 1 and 3 out of (0, 1); easy -> hard: 2 (0.9), 0 (0.5), 4 (0.2)
    sampler = CurriculumSampler(_queue([0.5, 1.0, 0.9, 0.0, 0.2], order="easy_to_hard"), mini_repeat_count=2,
                                batch_size=1, repeat_count=2, num_chunks=3)
    assert list(sampler) == [2, 2, 2, 2, 0, 0, 0, 0, 4, 4, 4, 4]


RATES = [0.5, 0.9, 0.2, 0.0, 0.7, 1.0, 0.4, 0.6]  # kept (0, 1) easy -> hard: 1, 4, 7, 0, 6, 2


def _sampler():
    return CurriculumSampler(_queue(RATES, order="easy_to_hard"), mini_repeat_count=2, batch_size=2, repeat_count=1,
                             num_chunks=3)


def _take(iterator, count):
    return [next(iterator) for _ in range(count)]


def test_queue_change_reaches_only_chunks_not_yet_drawn():
    # After chunk 0 is handed out completely, chunk 1 is not drawn yet: the change decides it.
    sampler = _sampler()
    stream = iter(sampler)
    assert _take(stream, 4) == [1, 1, 4, 4]
    queue = sampler.queue
    assert queue.undrawn() == [0, 2, 3, 5, 6, 7]
    # new rates of the undrawn rows: 3 rises into the band (re-enters), 7 is mastered (leaves), 0 gets harder
    figures = queue.update([0, 2, 3, 5, 6, 7], [0.3, 0.2, 0.8, 1.0, 0.4, 1.0])
    assert figures == {"kept": 4.0, "entered": 1.0, "left": 1.0,
                       "mean_kept": pytest.approx((0.8 + 0.4 + 0.3 + 0.2) / 4)}
    # easy -> hard among the undrawn rows: 3 (0.8), 6 (0.4), 0 (0.3), 2 (0.2)
    assert list(stream) == [3, 3, 6, 6, 0, 0, 2, 2]

    # Once chunk 1's first index is out, chunk 1 is fixed ([7, 0] under the old rates); only chunk 2 follows the change.
    sampler = _sampler()
    stream = iter(sampler)
    assert _take(stream, 5) == [1, 1, 4, 4, 7]
    assert sampler.queue.undrawn() == [2, 3, 5, 6]
    sampler.queue.update([2, 3, 5, 6], [0.2, 0.8, 0.4, 1.0])  # 5 re-enters, 6 leaves
    assert list(stream) == [7, 0, 0, 3, 3, 5, 5]
    assert sampler.queue.pending == [2]


def test_new_pass_uses_every_rows_newest_rate():
    sampler = CurriculumSampler(_queue(RATES, order="easy_to_hard"), mini_repeat_count=1, batch_size=2,
                                repeat_count=1, num_chunks=3)
    assert list(sampler) == [1, 4, 7, 0, 6, 2]
    queue = sampler.queue
    queue.rates[1] = 1.0  # drawn rows keep their rate until the next pass; say row 1 was re-estimated as mastered
    queue.rates[3] = 0.95
    assert list(sampler) == [3, 4, 7, 0, 6, 2]  # the next epoch's pass: 1 left, 3 entered first (easiest)
    assert queue.pass_index == 1


def test_too_few_prompts_in_the_band_is_a_clear_error():
    sampler = CurriculumSampler(_queue([0.5, 0.5, 0.5]), mini_repeat_count=1, batch_size=2, repeat_count=1,
                                num_chunks=1)
    assert list(sampler) == [0, 1]
    sampler.queue.rates[:] = [1.0, 1.0, 0.5]
    with pytest.raises(RuntimeError, match=r"only 1 prompts .* fewer than one generation batch \(2 prompts\)"):
        list(sampler)


@pytest.mark.parametrize("shuffle", [True, False])
def test_state_round_trip_replays_the_epochs_chunks(shuffle):
    """A sampler restored from a JSON checkpoint taken mid-epoch (after a change) yields what the original yields:
    first the epoch's drawn chunks (the trainer skips the ones it trained), then the changed queue, then new passes
    from the saved generator."""
    def build():
        return CurriculumSampler(_queue(RATES, order="none", shuffle=shuffle, seed=3), mini_repeat_count=2,
                                 batch_size=2, repeat_count=2, num_chunks=3)

    original = build()
    stream = iter(original)
    drawn = _take(stream, 9)  # chunk 0 (8 indices) and the first index of chunk 1
    undrawn = original.queue.undrawn()
    original.queue.update(undrawn, [0.5] * len(undrawn))  # every undrawn row enters the band
    state = json.loads(json.dumps(original.state_dict()))
    rest = list(stream) + list(original) + list(original)

    restored = build()
    restored.load_state_dict(state)
    assert list(restored)[:9] == drawn  # replayed: chunk 0 and chunk 1 as drawn before the checkpoint
    assert list(restored) + list(restored) == rest[-2 * len(restored):]

    finished = build()
    list(finished)
    again = build()
    again.load_state_dict(json.loads(json.dumps(finished.state_dict())))
    assert again.replay == []  # a finished epoch is not replayed: the trainer starts the next one
    assert list(again) == list(finished)


def test_bad_reestimate_every_is_refused_at_validation(trl_ext_catalog, register_plugin):
    register_plugin(PassRateFilter)
    from trl_ext_plugins.rewards.exact_match import ExactMatch

    register_plugin(ExactMatch)
    for value in (0, -2):
        stage = StageSpec(trainer="grpo", model="no-such-model", dataset={"source": "embedded:arithmetic"},
                          plugins=[{"pass_rate_filter": {"reestimate_every": value}}, "exact_match"])
        with pytest.raises(RecipeError) as err:
            resolve_stage(stage, 0, trl_ext_catalog)
        text = str(err.value)
        assert "stages[0].plugins[0].params" in text and "reestimate_every" in text
        assert "greater than or equal to 1" in text


def test_reestimation_without_the_plugins_sampler_is_refused_at_train_begin():
    from trl_ext_plugins.rollout.curriculum_sampler import ReestimateCallback

    plugin = PassRateFilter(PassRateFilter.Params(reestimate_every=2))  # no sampler: e.g. an iterable dataset
    with pytest.raises(ValueError, match="pass_rate_filter.*map-style train dataset"):
        ReestimateCallback(plugin, trainer=None).on_train_begin(None, None, None)


# -- on the tiny model -----------------------------------------------------------------------------------------------


def digit_reward(completions, answer, **kwargs):
    """answer % 3 == 0: always solved, == 1: never, == 2: solved when the completion starts with a digit (the untrained
    tiny model does that sometimes, and GRPO on this reward teaches it to)."""
    table = {0: lambda c: 1.0, 1: lambda c: 0.0, 2: lambda c: float(c[:1].isdigit())}
    return [table[int(a) % 3](c) for c, a in zip(completions, answer, strict=True)]


@pytest.fixture
def digit_run(trl_ext_catalog, register_plugin, tmp_path):
    from trl_ext import Plugin, hookimpl
    from trl_ext.rewards import RewardFunction

    class Digits(Plugin):
        """Test reward: :func:`digit_reward`."""

        name = "digit_reward"
        family = "reward"

        @hookimpl
        def trl_ext_reward_functions(self, stage):
            return [RewardFunction(self.name, digit_reward)]

    register_plugin(Digits)
    token = _CURRENT_RUN.set(RunContext(recipe=None, output_dir=tmp_path / "run", catalog=trl_ext_catalog))
    try:
        yield
    finally:
        _CURRENT_RUN.reset(token)


ARGS = {"per_device_train_batch_size": 8, "num_generations": 4, "max_completion_length": 2, "temperature": 2.0,
        "learning_rate": 0.05, "logging_steps": 1, "beta": 0.0}


def _filtered_trainer(tiny_trainer, tiny_model_dir, args, seen=None):
    plugin = PassRateFilter(PassRateFilter.Params(reward="digit_reward", k=6, max_new_tokens=2, temperature=2.0,
                                                  reestimate_every=2, seed=1))
    data = arithmetic_dataset("train", format="prompt", size=48)
    stage = StageSpec(trainer="grpo", model=tiny_model_dir, dataset={"source": "embedded:arithmetic"})
    assert plugin.trl_ext_prepare_dataset(dataset=data, split="train", stage=stage) is None  # every row stays

    def reward(prompts, completions, answer, **kwargs):
        if seen is not None:
            seen.append(tuple(prompts))
        return digit_reward(completions, answer)

    trainer = tiny_trainer("grpo", plugins=[plugin], dataset=data, args={**ARGS, **args}, reward_funcs=[reward])
    return trainer, plugin, data


@pytest.mark.slow
def test_grpo_reestimates_with_the_current_weights(tiny_trainer, tiny_model_dir, digit_run):
    from transformers import TrainerCallback

    from trl_ext_plugins.preference.generation import load_policy

    trainer, plugin, data = _filtered_trainer(tiny_trainer, tiny_model_dir, {"max_steps": 5})
    initial = list(plugin.last_rates)
    start, tokenizer = load_policy(tiny_model_dir)
    checks = {}

    class Recompute(TrainerCallback):
        """Added after the plugin's callback: right after each re-estimation, recompute its rows' rates from a copy
        of the current weights and from the starting model (same seed, same moment)."""

        def on_step_end(self, args, state, control, **kwargs):
            if plugin.reestimations and plugin.reestimations[-1]["step"] == state.global_step:
                rows = data.select(plugin.reestimations[-1]["rows"])
                seed = plugin.params.seed + state.global_step
                current = copy.deepcopy(trainer.model)
                checks[state.global_step] = (plugin._rates_of(current, tokenizer, rows, seed=seed),
                                             plugin._rates_of(start, tokenizer, rows, seed=seed))

    trainer.add_callback(Recompute())
    trainer.train()

    assert [r["step"] for r in plugin.reestimations] == [2, 4]  # every 2 steps, not after the last (5)
    for record in plugin.reestimations:
        assert record["rates"] == checks[record["step"]][0]  # the weights of the step it ran after
    assert plugin.reestimations[-1]["rates"] != checks[4][1]  # after 4 updates: not the starting policy's rates
    last = plugin.reestimations[-1]
    assert all(within_bounds(plugin.sampler.queue.rates[i], 0.0, 1.0, False) for i in plugin.sampler.queue.pending)

    # trained toward digit-first completions: the answer % 3 == 2 prompts' pass rate rose
    learnable = [i for i in last["rows"] if int(data[i]["answer"]) % 3 == 2]
    before = sum(initial[i] for i in learnable) / len(learnable)
    after = sum(plugin.sampler.queue.rates[i] for i in learnable) / len(learnable)
    figures = [{k: r[k] for k in ("step", "kept", "entered", "left", "mean_kept")} for r in plugin.reestimations]
    print(f"pass rate of the learnable prompts: start {before:.3f}, after 4 steps {after:.3f}; "
          f"re-estimations: {figures}")
    assert after > before

    logged = [row for row in trainer.state.log_history if "pass_rate/kept" in row]
    assert [row["step"] for row in logged] == [2, 4]
    for row, record in zip(logged, plugin.reestimations):
        for key in ("kept", "mean_kept", "entered", "left", "reestimated", "mean_reestimated"):
            assert row[f"pass_rate/{key}"] == pytest.approx(record[key])


@pytest.mark.slow
def test_resume_restores_the_queue_and_the_batches(tiny_trainer, tiny_model_dir, digit_run, tmp_path):
    from transformers import TrainerCallback

    args = {"max_steps": 4, "save_strategy": "steps", "save_steps": 2}
    seen_full: list = []
    full, full_plugin, _ = _filtered_trainer(tiny_trainer, tiny_model_dir, args, seen_full)
    full.train()
    checkpoint = tmp_path / "out" / "checkpoint-2"
    saved = json.loads((checkpoint / "trl_ext_plugin_state" / "pass_rate_filter.json").read_text())
    assert [r["step"] for r in full_plugin.reestimations] == [2]
    assert saved["queue"]["rates"] != full_plugin.last_rates  # the re-estimated rates are in the checkpoint

    class SeeQueue(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            self.seen = plugin.sampler.state_dict()

    seen_resumed: list = []
    resumed, plugin, _ = _filtered_trainer(tiny_trainer, tiny_model_dir, args, seen_resumed)
    probe = SeeQueue()
    resumed.add_callback(probe)  # after the plugin's state callback, which restores on train begin
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert probe.seen["queue"] == saved["queue"]
    assert plugin.reestimations == []  # step 2's re-estimation was restored, not rerun; 4 is the last step
    # steps 3 and 4 trained the same prompts as the uninterrupted run (step 3's chunk was fetched before the
    # re-estimation and is replayed; step 4's comes from the re-estimated queue)
    assert seen_resumed == seen_full[-len(seen_resumed):] and len(seen_resumed) == 2
    assert plugin.sampler.state_dict() == full_plugin.sampler.state_dict()


# -- two processes -----------------------------------------------------------------------------------------------------

WORKER = '''
import json, os, sys
from pathlib import Path
import torch.distributed as dist
from transformers import AutoTokenizer
from trl import GRPOConfig
from trl_ext import Plugin, hookimpl
from trl_ext.embedded.arithmetic import arithmetic_dataset
from trl_ext.host import PluginHost
from trl_ext.recipe import StageSpec
from trl_ext.rewards import RewardFunction
from trl_ext.runner import RunContext, _CURRENT_RUN
from trl_ext.testing import fresh_catalog
from trl_ext.trainers.grpo import ExtGRPOTrainer
from trl_ext_plugins.rollout.pass_rate_filter import PassRateFilter

def digit_reward(completions, answer, **kwargs):
    table = {0: lambda c: 1.0, 1: lambda c: 0.0, 2: lambda c: float(c[:1].isdigit())}
    return [table[int(a) % 3](c) for c, a in zip(completions, answer)]

class Digits(Plugin):
    """Test reward."""
    name = "digit_reward"
    family = "reward"

    @hookimpl
    def trl_ext_reward_functions(self, stage):
        return [RewardFunction(self.name, digit_reward)]

model_dir, out_dir = sys.argv[1], sys.argv[2]
catalog = fresh_catalog()
catalog.add_plugin(Digits)
_CURRENT_RUN.set(RunContext(recipe=None, output_dir=Path(out_dir), catalog=catalog))
plugin = PassRateFilter(PassRateFilter.Params(reward="digit_reward", k=6, max_new_tokens=2, temperature=2.0,
                                              reestimate_every=1, seed=1, batch_size=8))
data = arithmetic_dataset("train", format="prompt", size=45)  # 45 rows: shares of 23 and 22, the last one padded
stage = StageSpec(trainer="grpo", model=model_dir, dataset={"source": "embedded:arithmetic"})
assert plugin.trl_ext_prepare_dataset(dataset=data, split="train", stage=stage) is None
seen = []

def reward(prompts, completions, answer, **kwargs):
    seen.append(list(prompts))
    return digit_reward(completions, answer)

args = GRPOConfig(output_dir=out_dir, per_device_train_batch_size=4, num_generations=4, max_completion_length=2,
                  max_steps=3, bf16=False, use_cpu=True, report_to="none", gradient_checkpointing=False,
                  temperature=2.0, learning_rate=0.05, beta=0.0, logging_steps=1, save_strategy="no", seed=0)
trainer = ExtGRPOTrainer(model=model_dir, reward_funcs=[reward], args=args, train_dataset=data,
                         processing_class=AutoTokenizer.from_pretrained(model_dir), plugin_host=PluginHost([plugin]))
plugin.trl_ext_trainer_created(trainer=trainer)
result = trainer.train()
parts = [None] * dist.get_world_size()
dist.all_gather_object(parts, {"seen": seen, "reestimations": plugin.reestimations,
                               "state": plugin.sampler.state_dict(), "step": result.global_step,
                               "prompts": list(data["prompt"])})
if dist.get_rank() == 0:
    print(json.dumps(parts), flush=True)
dist.barrier()
sys.stderr.flush()
os._exit(0)  # as in the other 2-process tests: skip a teardown that intermittently aborts after all work is done
'''


@pytest.mark.slow
def test_two_processes_share_one_queue(tmp_path):
    """torchrun, 2 CPU processes (gloo): every rank re-estimates its share of the rows, the gathered rates give both
    ranks the same queue, and every generation batch is one chunk of the queue split across the ranks."""
    import os
    import socket
    import subprocess
    import sys

    from trl_ext.embedded.models import materialize_model

    model_dir = materialize_model("tiny-qwen2", tmp_path / "model", seed=0)
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                           str(port), str(script), str(model_dir), str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=400, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = json.loads([line for line in done.stdout.splitlines() if line.startswith("[")][-1])

    assert [r["step"] for r in ranks] == [3, 3]
    assert ranks[0]["reestimations"] == ranks[1]["reestimations"]  # gathered: the same rows and rates on both
    assert ranks[0]["state"] == ranks[1]["state"]
    records = ranks[0]["reestimations"]
    assert [r["step"] for r in records] == [1, 2]
    for record in records:
        assert len(record["rates"]) == len(record["rows"]) == record["reestimated"]
    queue = ranks[0]["state"]["queue"]
    assert all(0.0 < queue["rates"][i] < 1.0 for i in queue["pending"])
    # each generation batch: 2 prompts x 4 generations over 2 ranks of 4 rows; chunk = the drawn rows in order
    prompts = ranks[0]["prompts"]
    chunks = ranks[0]["state"]["iteration_chunks"]
    for step in range(3):
        rows = ranks[0]["seen"][step] + ranks[1]["seen"][step]
        assert rows == [prompts[i] for i in chunks[step] for _ in range(4)]


@pytest.mark.slow
def test_recipe_run_logs_the_figures_and_checkpoints_the_queue(tmp_path):
    """The whole pipeline (run_recipe): the dataset keeps every row, the figures reach metrics.jsonl at the
    re-estimation step, and the checkpoint holds the queue next to its completion marker."""
    from trl_ext import Plugin, hookimpl
    from trl_ext.recipe import parse_recipe
    from trl_ext.rewards import RewardFunction
    from trl_ext.runner import run_recipe
    from trl_ext.testing import fresh_catalog

    class Digits(Plugin):
        """Test reward: :func:`digit_reward`."""

        name = "digit_reward"
        family = "reward"

        @hookimpl
        def trl_ext_reward_functions(self, stage):
            return [RewardFunction(self.name, digit_reward)]

    catalog = fresh_catalog()
    for cls in (PassRateFilter, Digits):
        catalog.add_plugin(cls)
    recipe = parse_recipe({
        "seed": 0, "keep_checkpoints": True, "name": "curriculum", "trainer": "grpo", "model": "embedded:tiny-qwen2",
        "dataset": {"source": "embedded:arithmetic", "params": {"format": "prompt"}, "limit": 48},
        "plugins": [{"pass_rate_filter": {"reward": "digit_reward", "k": 6, "max_new_tokens": 2, "temperature": 2.0,
                                          "reestimate_every": 2}}, "digit_reward"],
        "args": {**ARGS, "max_steps": 3, "save_steps": 2, "gradient_checkpointing": False},
    })
    info = run_recipe(recipe, tmp_path, catalog, echo=lambda _m: None)
    assert info["status"] == "complete"
    rows = [json.loads(line) for line in (tmp_path / "curriculum" / "metrics.jsonl").read_text().splitlines()]
    logged = [row for row in rows if "pass_rate/kept" in row]
    assert [row["step"] for row in logged] == [2]
    row = logged[0]
    assert row["pass_rate/reestimated"] > 0 and 0.0 < row["pass_rate/mean_kept"] < 1.0
    assert row["pass_rate/kept"] >= 2  # at least one generation chunk of 2 prompts stays in the band
    checkpoint = tmp_path / "curriculum" / "checkpoints" / "checkpoint-2"
    state = json.loads((checkpoint / "trl_ext_plugin_state" / "pass_rate_filter.json").read_text())
    assert len(state["queue"]["rates"]) == 48  # every train row is in the sampler's reach
    assert (checkpoint / "trl_ext_complete.json").exists()


@pytest.mark.parametrize("kind", ["grpo", "rloo"])
def test_trainers_take_the_plugins_sampler(tiny_trainer, tiny_model_dir, digit_run, kind):
    """Both RL trainers build their train dataloader on the plugin's sampler (the trl_ext_train_sampler seam); with
    re-estimation off they keep TRL's RepeatSampler."""
    from trl.trainer.utils import RepeatSampler as TRLRepeatSampler

    plugin = PassRateFilter(PassRateFilter.Params(reward="digit_reward", k=6, max_new_tokens=2, temperature=2.0,
                                                  reestimate_every=3, seed=1))
    data = arithmetic_dataset("train", format="prompt", size=48)
    stage = StageSpec(trainer=kind, model=tiny_model_dir, dataset={"source": "embedded:arithmetic"})
    plugin.trl_ext_prepare_dataset(dataset=data, split="train", stage=stage)
    trainer = tiny_trainer(kind, plugins=[plugin], dataset=data, args={**ARGS, "max_steps": 1},
                           reward_funcs=[digit_reward])
    sampler = trainer._get_train_sampler()
    assert sampler is plugin.sampler and isinstance(sampler, CurriculumSampler)
    assert (sampler.batch_size, sampler.mini_repeat_count) == (2, 4)  # 8 rows per generation batch, groups of 4
    kept = [i for i, r in enumerate(plugin.last_rates) if 0.0 < r < 1.0]
    assert sampler.num_chunks == len(kept) // 2
    first = list(sampler)[:8]
    assert first[::4] == sorted(kept, key=lambda i: -plugin.last_rates[i])[:2]  # easy -> hard, whole groups

    off = PassRateFilter(PassRateFilter.Params(reward="digit_reward", k=6, max_new_tokens=2, temperature=2.0, seed=1))
    plain = tiny_trainer(kind, plugins=[off], dataset=data, args={**ARGS, "max_steps": 1}, reward_funcs=[digit_reward])
    assert isinstance(plain._get_train_sampler(), TRLRepeatSampler)
