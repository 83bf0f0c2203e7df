"""Data-building preference plugins: delta_pairs (strong vs weak pairs, cached) and iterative_dpo (rounds of
sample / score / best-vs-worst / DPO)."""

import json
import logging
from pathlib import Path

import pytest
import torch
from datasets import Dataset

from trl_ext.embedded.arithmetic import arithmetic_dataset
from trl_ext.recipe import StageSpec
from trl_ext_plugins.preference import generation as gen
from trl_ext_plugins.preference.common import PreferenceDataError
from trl_ext_plugins.preference.delta_pairs import DeltaPairs, build_pairs
from trl_ext_plugins.preference.iterative_dpo import IterativeDPO, best_worst_pairs


def _stage(model="m"):
    return StageSpec(trainer="dpo", model=model, dataset={"source": "embedded:arithmetic"})


def _greedy_one(path, prompt, max_new_tokens):
    """Independent oracle: one unpadded greedy generate() per prompt, cut after the first eos."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer, model = AutoTokenizer.from_pretrained(path), AutoModelForCausalLM.from_pretrained(path).eval()
    ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)[0, ids.shape[1]:].tolist()
    if tokenizer.eos_token_id in out:
        out = out[:out.index(tokenizer.eos_token_id) + 1]
    return tokenizer.decode(out)


def _noisy_model(name, directory, seed):
    """An embedded model with large random weight noise, so greedy outputs vary from prompt to prompt and model to
    model (freshly initialised tiny models all answer the same constant string)."""
    from trl_ext.embedded.models import build_model
    from trl_ext.embedded.tokenizer import build_tokenizer

    model = build_model(name, seed)
    gen_ = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen_) * 0.5)
    model.save_pretrained(directory)
    build_tokenizer().save_pretrained(directory)
    return str(directory)


@pytest.fixture(scope="module")
def strong_model_dir(tmp_path_factory):
    return _noisy_model("tiny-qwen2", tmp_path_factory.mktemp("strong") / "strong", seed=1)


@pytest.fixture(scope="module")
def weak_model_dir(tmp_path_factory):
    return _noisy_model("tiny-qwen2-small", tmp_path_factory.mktemp("weak") / "weak", seed=3)


# ---------------------------------------------------------------------------------------------------------------------
# delta_pairs


def test_delta_pairs_come_from_the_right_models_and_are_cached(strong_model_dir, weak_model_dir, tmp_path,
                                                               monkeypatch):
    prompts = arithmetic_dataset("train", format="prompt", size=6)
    params = dict(strong=strong_model_dir, weak=weak_model_dir, max_new_tokens=4, cache_dir=str(tmp_path / "cache"))
    pairs = DeltaPairs(DeltaPairs.Params(**params)).trl_ext_prepare_dataset(dataset=prompts, split="train",
                                                                            stage=_stage())
    assert 0 < len(pairs) <= 6 and {"prompt", "answer", "chosen", "rejected"} <= set(pairs.column_names)
    for row in pairs:
        assert row["chosen"] == _greedy_one(strong_model_dir, row["prompt"], 4)
        assert row["rejected"] == _greedy_one(weak_model_dir, row["prompt"], 4)
        assert row["chosen"] != row["rejected"]
    assert len(list((tmp_path / "cache").iterdir())) == 1

    def no_generation(*_a, **_k):
        raise AssertionError("generated again instead of reading the cache")

    monkeypatch.setattr(gen, "sample_completions", no_generation)
    again = DeltaPairs(DeltaPairs.Params(**params)).trl_ext_prepare_dataset(dataset=prompts, split="train",
                                                                            stage=_stage())
    assert again.to_list() == pairs.to_list()
    # the key covers the generation settings: another length is another cache entry
    with pytest.raises(AssertionError, match="generated again"):
        DeltaPairs(DeltaPairs.Params(**{**params, "max_new_tokens": 5})).trl_ext_prepare_dataset(
            dataset=prompts, split="train", stage=_stage())
    # eval split untouched unless listed
    assert DeltaPairs(DeltaPairs.Params(**params)).trl_ext_prepare_dataset(dataset=prompts, split="eval",
                                                                           stage=_stage()) is None


def test_identical_pairs_dropped_with_count_logged(caplog):
    data = Dataset.from_list([{"prompt": f"{i}+0=", "answer": str(i)} for i in range(3)])
    with caplog.at_level(logging.WARNING, logger="trl_ext.preference"):
        pairs = build_pairs(data, ["1<eos>", "2<eos>", "3<eos>"], ["7<eos>", "2<eos>", "9<eos>"])
    assert pairs["prompt"] == ["0+0=", "2+0="] and pairs["rejected"] == ["7<eos>", "9<eos>"]
    assert "dropped 1 of 3 pairs" in caplog.text
    with pytest.raises(PreferenceDataError, match="all 3 pairs have identical"):
        build_pairs(data, ["1", "2", "3"], ["1", "2", "3"])


def test_same_model_on_both_sides_is_refused(strong_model_dir, tmp_path):
    plugin = DeltaPairs(DeltaPairs.Params(strong=strong_model_dir, weak=strong_model_dir, max_new_tokens=3,
                                          cache_dir=str(tmp_path)))
    with pytest.raises(PreferenceDataError, match="all 4 pairs have identical"):
        plugin.trl_ext_prepare_dataset(dataset=arithmetic_dataset("train", format="prompt", size=4), split="train",
                                       stage=_stage())


def test_model_refs_resolve_through_the_current_run(tmp_path):
    from trl_ext.runner import _CURRENT_RUN, RunContext

    with pytest.raises(ValueError, match="only be resolved inside a recipe run"):
        gen.resolve_model("stage:strong", "delta_pairs")
    with pytest.raises(ValueError, match="set `cache_dir`"):
        gen.cache_root(None, "delta_pairs")
    token = _CURRENT_RUN.set(RunContext(recipe=None, output_dir=tmp_path, catalog=None))
    try:
        assert gen.resolve_model("stage:strong", "delta_pairs") == str(tmp_path / "strong")
        assert gen.cache_root(None, "delta_pairs") == tmp_path / "_cache" / "delta_pairs"
    finally:
        _CURRENT_RUN.reset(token)


# ---------------------------------------------------------------------------------------------------------------------
# iterative_dpo


def test_best_worst_pairs_skip_ties():
    prompts = Dataset.from_list([{"prompt": p, "answer": "0"} for p in ("a", "b", "c")])
    table = {"a1": 1.0, "a2": 3.0, "a3": 2.0, "b1": 5.0, "b2": 5.0, "c1": 0.0, "c2": 1.0}
    score = lambda prompts, completions, answer: [table[c] for c in completions]  # noqa: E731
    pairs = best_worst_pairs(prompts, [["a1", "a2", "a3"], ["b1", "b2"], ["c1", "c2"]], score, 4)
    assert pairs.to_list() == [
        {"prompt": "a", "answer": "0", "chosen": "a2", "rejected": "a1", "score_gap": 2.0, "round": 4},
        {"prompt": "c", "answer": "0", "chosen": "c2", "rejected": "c1", "score_gap": 1.0, "round": 4}]
    assert best_worst_pairs(prompts, [["b1", "b2"]] * 3, score, 0) is None


def test_best_worst_pairs_leave_unscorable_samples_out():
    """A NaN score is neither best nor worst: the prompt pairs its scored samples (was dropped when the NaN came
    first, since max/min never move off a NaN)."""
    nan = float("nan")
    prompts = Dataset.from_list([{"prompt": p} for p in ("a", "b", "c")])
    table = {"a1": nan, "a2": 0.0, "a3": 1.0, "b1": 2.0, "b2": nan, "b3": 0.5, "c1": nan, "c2": 1.0}
    score = lambda prompts, completions: [table[c] for c in completions]  # noqa: E731
    pairs = best_worst_pairs(prompts, [["a1", "a2", "a3"], ["b1", "b2", "b3"], ["c1", "c2"]], score, 0)
    assert pairs.to_list() == [
        {"prompt": "a", "chosen": "a3", "rejected": "a2", "score_gap": 1.0, "round": 0},
        {"prompt": "b", "chosen": "b1", "rejected": "b3", "score_gap": 1.5, "round": 0}]


def test_reward_plugin_by_name_scores_samples():
    score = gen.reward_function_from_plugin("exact_match")
    assert score(prompts=["1+1=", "1+1="], completions=["2<eos>", "3<eos>"], answer=["2", "2"]) == [1.0, 0.0]


def _checksum(model):
    return sum(p.detach().double().sum().item() for p in model.parameters())


def _varied_score(prompts, completions, **_):
    return [float(sum(map(ord, c)) % 7) for c in completions]


def _run_rounds(tiny_model_dir, tiny_trainer, scorer, rounds=2, **params):
    from transformers import TrainerCallback

    plugin = IterativeDPO(IterativeDPO.Params(rounds=rounds, num_samples=4, max_new_tokens=3, temperature=1.5,
                                              batch_size=16, **params))
    plugin._scorer = scorer
    seen = []  # (round, checksum of the policy that generated the round, the policy's weights)
    original = plugin.make_round

    def spy(model, tokenizer, round_index):
        seen.append((round_index, _checksum(model)))
        return original(model, tokenizer, round_index)

    plugin.make_round = spy
    prompts = arithmetic_dataset("train", format="prompt", size=16)
    pairs = plugin.trl_ext_prepare_dataset(dataset=prompts, split="train", stage=_stage(tiny_model_dir))
    trainer = tiny_trainer("dpo", [plugin], dataset=pairs, args={"max_steps": 1, "learning_rate": 1e-2})
    after_round = []

    class Snapshot(TrainerCallback):
        def on_train_end(self, args, state, control, model=None, **kwargs):
            after_round.append(({k: v.detach().clone() for k, v in trainer.model.state_dict().items()},
                                _checksum(trainer.model)))

    trainer.add_callback(Snapshot())
    trainer.train()
    return plugin, trainer, seen, after_round


def test_iterative_dpo_rounds_use_the_current_policy(tiny_model_dir, tiny_trainer, tmp_path):
    plugin, trainer, seen, after_round = _run_rounds(tiny_model_dir, tiny_trainer, _varied_score)
    assert [r for r, _ in seen] == [0, 1] and len(after_round) == 2 and plugin.skipped_rounds == []
    assert set(plugin.round_pairs[0]["round"]) == {0} and set(plugin.round_pairs[1]["round"]) == {1}
    # round 1 was generated by the policy as it was after round 0's training, not by the starting policy
    round0_policy, round0_checksum = after_round[0]
    assert seen[1][1] == pytest.approx(round0_checksum, rel=1e-12)
    assert seen[1][1] != pytest.approx(seen[0][1], rel=1e-9)
    # ... and reproducibly so: the same sampling from that policy gives back every chosen/rejected of round 1
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    model.load_state_dict(round0_policy)
    samples = gen.sample_completions(model, trainer.processing_class, plugin._prompts["prompt"], num_samples=4,
                                     max_new_tokens=3, do_sample=True, temperature=1.5, batch_size=16, seed=1)
    by_prompt = dict(zip(plugin._prompts["prompt"], samples))
    for row in plugin.round_pairs[1]:
        assert row["chosen"] in by_prompt[row["prompt"]] and row["rejected"] in by_prompt[row["prompt"]]
    # update_reference: the reference now equals the final policy
    for (name, p), r in zip(trainer.model.named_parameters(), trainer.ref_model.parameters()):
        assert torch.equal(p, r), name
    saved = Path(trainer.args.output_dir) / "iterative_dpo"
    assert sorted(p.name for p in saved.iterdir()) == ["round_0", "round_1"]


def test_all_tie_round_is_skipped_without_update(tiny_model_dir, tiny_trainer, caplog):
    calls = []

    def ties_after_round_0(prompts, completions, **kw):
        calls.append(1)
        return _varied_score(prompts, completions) if len(calls) == 1 else [0.5] * len(completions)

    with caplog.at_level(logging.WARNING, logger="trl_ext.preference"):
        plugin, trainer, _seen, after_round = _run_rounds(tiny_model_dir, tiny_trainer, ties_after_round_0,
                                                          update_reference=False)
    assert plugin.skipped_rounds == [1] and len(after_round) == 1  # round 1 trained nothing
    assert "round 1 skipped" in caplog.text
    for name, value in trainer.model.state_dict().items():
        assert torch.equal(value, after_round[0][0][name]), name


def test_round_zero_without_pairs_is_an_error(tiny_model_dir):
    plugin = IterativeDPO(IterativeDPO.Params(rounds=2, num_samples=2, max_new_tokens=2))
    plugin._scorer = lambda prompts, completions, **kw: [1.0] * len(completions)
    with pytest.raises(PreferenceDataError, match="round 0 formed no pairs"):
        plugin.trl_ext_prepare_dataset(dataset=arithmetic_dataset("train", format="prompt", size=4), split="train",
                                       stage=_stage(tiny_model_dir))


def test_iterative_dpo_validation():
    stage = StageSpec(trainer="dpo", model="m", ref_model="r", dataset={"source": "x"},
                      args={"precompute_ref_log_probs": True})
    errors = IterativeDPO().trl_ext_validate_stage(stage=stage, plugins=[])
    assert any("remove `ref_model`" in e for e in errors) and any("precompute_ref_log_probs" in e for e in errors)
    assert IterativeDPO(IterativeDPO.Params(update_reference=False)).trl_ext_validate_stage(
        stage=stage.model_copy(update={"args": {}}), plugins=[]) == []


# ---------------------------------------------------------------------------------------------------------------------
# qrpo: reference completions generated, scored and cached


def test_qrpo_generates_scores_and_caches_reference_rewards(tiny_model_dir, tmp_path, monkeypatch):
    from pydantic import ValidationError
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trl_ext_plugins.preference import QRPO

    with pytest.raises(ValidationError, match="greater than or equal to 2"):
        QRPO.Params(ref_completions=1)
    length = lambda prompts, completions, **kw: [float(len(gen.completion_text(c))) for c in completions]  # noqa: E731
    monkeypatch.setattr(gen, "scorer", lambda *a: length)
    data = arithmetic_dataset("train", format="preference", size=5)
    params = QRPO.Params(ref_completions=3, max_new_tokens=4, cache_dir=str(tmp_path), seed=7)
    out = QRPO(params).trl_ext_prepare_dataset(dataset=data, split="train", stage=_stage(tiny_model_dir))
    samples = gen.sample_completions(AutoModelForCausalLM.from_pretrained(tiny_model_dir),
                                     AutoTokenizer.from_pretrained(tiny_model_dir), data["prompt"], num_samples=3,
                                     max_new_tokens=4, do_sample=True, seed=7)
    assert out["ref_rewards"] == [[float(len(s)) for s in group] for group in samples]
    assert out["chosen_reward"] == [float(len(c)) for c in data["chosen"]]
    assert out["rejected_reward"] == [float(len(r)) for r in data["rejected"]]
    monkeypatch.setattr(gen, "sample_completions", lambda *a, **k: pytest.fail("cache not used"))
    again = QRPO(params).trl_ext_prepare_dataset(dataset=data, split="train", stage=_stage(tiny_model_dir))
    assert again.to_list() == out.to_list()


def test_iterative_dpo_killed_in_a_later_round_reruns_every_round(tmp_path):
    """Each round's train() reaches max_steps; the stage must not be finished from round 0's last step when a later
    round was interrupted (it was: the runner's last-step checkpoint of round 0 made the rerun skip the other rounds
    and mark the stage complete with round 0's weights)."""
    from safetensors.torch import load_file
    from transformers import TrainerCallback

    from trl_ext.catalog import Catalog
    from trl_ext.recipe import parse_recipe
    from trl_ext.testing import Interrupted, straight_and_resumed

    (tmp_path / "varied.py").write_text("def reward(completions, **kwargs):\n"
                                        "    return [float(sum(map(ord, str(c))) % 7) for c in completions]\n")

    def recipe():
        return parse_recipe({
            "seed": 0, "name": "dpo", "trainer": "dpo", "model": "embedded:tiny-qwen2-small",
            "dataset": {"source": "embedded:arithmetic", "params": {"format": "prompt"}, "limit": 16},
            "plugins": [{"iterative_dpo": {"rounds": 2, "num_samples": 2, "max_new_tokens": 4, "temperature": 1.0,
                                           "reward": "python_reward",
                                           "reward_params": {"functions": [f"{tmp_path / 'varied.py'}:reward"]}}},
                        "dpo"],
            "args": {"max_steps": 2, "per_device_train_batch_size": 4, "learning_rate": 1e-3, "beta": 0.1,
                     "logging_steps": 1, "max_length": 32},
        })

    class KilledInRoundOne(TrainerCallback):
        rounds_begun = 0

        def on_train_begin(self, args, state, control, **kwargs):
            self.rounds_begun += 1

        def on_step_end(self, args, state, control, **kwargs):
            if self.rounds_begun == 2:
                raise Interrupted()

    catalog = Catalog.discover()
    straight, resumed, messages = straight_and_resumed(recipe, catalog, tmp_path, KilledInRoundOne())
    assert not any("finishing the stage" in m or "resuming from" in m for m in messages), messages
    a, b = load_file(str(straight / "dpo" / "model.safetensors")), load_file(str(resumed / "dpo" / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    rows = [json.loads(line) for line in (resumed / "dpo" / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows if "loss" in row] == [1, 2, 1, 2]  # both rounds, each once
    assert [row.get("iterative_dpo/round") for row in rows if "loss" in row] == [0, 0, 1, 1]
