"""``pivot_rl`` (ALGORITHMS.md item 9): pivot selection on hand-built profiles, functional matching of tool calls,
the embedded calculator tool task, the pivot split built from (cached) profiles of the frozen tiny model, the reward,
and trajectories without assistant turns refused at validation."""

from __future__ import annotations

import json

import pytest

from trl_ext.errors import RecipeError
from trl_ext.recipe import StageSpec
from trl_ext.runner import RunContext, _CURRENT_RUN
from trl_ext.stage import resolve_stage
from trl_ext_plugins.rollout.control_math import is_pivot
from trl_ext_plugins.rollout.pivot_rl import PivotRL, expert_turn_rows
from trl_ext_plugins.rollout.tool_task import assistant_turns, calc_tool_trajectories, functional_match, tool_trajectory


def test_item_9_pivot_selection_by_hand():
    assert is_pivot([1, 0, 0, 0], max_success=0.5)  # var > 0, mean 0.25 < 0.5
    assert not is_pivot([1, 1, 1, 1], 0.5) and not is_pivot([0, 0, 0, 0], 0.5)  # no variance: zero GRPO advantage
    assert not is_pivot([1, 1, 1, 0], 0.5)  # mean 0.75: the policy already succeeds mostly
    assert is_pivot([1, 1, 1, 0], 0.8)
    assert not is_pivot([1, 1, 0, 0], 0.5)  # mean 0.5 is not below 0.5


def test_functional_match():
    assert functional_match("add(3,12)", "add(12,3)")  # commutative: argument order free
    assert not functional_match("sub(3,12)", "sub(12,3)")
    assert functional_match(" add( 12 , 3 ) ", "add(12,3)") and functional_match("mul(46,2.0)", "mul(46,2)")
    assert functional_match("add(012,3)", "add(12,3)")  # numbers by value
    assert functional_match("ans(92)<eos>", "ans(92)") and functional_match("ans(92)\nT:", "ans(92)")
    assert not functional_match("add(12,3,1)", "add(12,3)") and not functional_match("mul(12,3)", "add(12,3)")
    assert not functional_match("add(12,4)", "add(12,3)") and not functional_match("xx", "add(12,3)")


def test_tool_task_trajectory_and_turns():
    messages = tool_trajectory(12, "add", 34, "mul", 2)
    assert [m["content"] for m in messages] == ["(12+34)*2?", "add(12,34)", "46", "mul(46,2)", "92", "ans(92)"]
    turns = assistant_turns(messages)
    assert turns[1] == ("U:(12+34)*2?\nA:add(12,34)\nT:46\nA:", "mul(46,2)")
    assert len(calc_tool_trajectories(size=5)) == 5 and len(calc_tool_trajectories(size=5, format="turns")) == 15
    rows = expert_turn_rows([messages, messages[:2]])
    assert [(r["trajectory"], r["turn"]) for r in rows] == [(0, 0), (0, 1), (0, 2), (1, 0)]
    with pytest.raises(ValueError, match="trajectory 1 .* has no assistant turn"):
        expert_turn_rows([messages, [{"role": "user", "content": "hi"}]])


def test_held_out_calculator_problems_never_appear_in_training():
    """configs/pivot_rl.yaml's splits: disjoint and distinct (one seed stream per split put 6 of its 64 held-out
    problems among its 1024 training ones); the split of a problem is a hash of its text; an exhausted split is an
    error with its count."""
    from trl_ext.embedded.splits import hash_split

    def questions(split, size):
        rows = calc_tool_trajectories(split, size=size, max_operand=10)
        return [next(m["content"] for m in r["messages"] if m["role"] == "user") for r in rows]

    train, test = questions("train", 1024), questions("test", 64)
    assert len(set(train)) == 1024 and len(set(test)) == 64 and not set(train) & set(test)
    assert {hash_split(q) for q in test} == {"test"} and questions("test", 8) == test[:8]
    # max_operand 1: the 9 problems (0 o 0) o' 0, split by their hash into 8 train and 1 test
    assert len(calc_tool_trajectories("train", size=8, max_operand=1)) == 8
    with pytest.raises(ValueError, match="only 1 distinct test problems with max_operand=1, 2 asked"):
        calc_tool_trajectories("test", size=2, max_operand=1)


def test_trajectories_without_assistant_turns_are_refused_at_validation(trl_ext_catalog, register_plugin, tmp_path):
    register_plugin(PivotRL)
    path = tmp_path / "expert.jsonl"
    rows = [{"messages": tool_trajectory(1, "add", 2, "mul", 3)},
            {"messages": [{"role": "user", "content": "(1+2)*3?"}, {"role": "tool", "content": "9"}]}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    stage = StageSpec(trainer="grpo", model="no-such-model", dataset={"source": str(path)}, plugins=["pivot_rl"])
    with pytest.raises(RecipeError) as err:
        resolve_stage(stage, 0, trl_ext_catalog)
    assert "plugin 'pivot_rl'" in str(err.value) and "trajectory 1 ('messages') has no assistant turn" in str(err.value)
    stage = StageSpec(trainer="grpo", model="m", dataset={"source": "embedded:arithmetic"}, plugins=["pivot_rl"])
    with pytest.raises(RecipeError, match="has no column 'messages'"):
        resolve_stage(stage, 0, trl_ext_catalog)


def test_trajectories_with_structured_tool_calls_or_unknown_roles_are_refused_naming_the_message(
        trl_ext_catalog, register_plugin, tmp_path):
    """An assistant turn in the structured tool-call form (content None beside tool_calls) rendered as ``A:None``
    and became the expert action None: validation passed, and the functional match raised TypeError only after the
    profile had loaded the model and sampled. An unknown role raised a bare KeyError out of validation."""
    call = {"role": "assistant", "content": None,
            "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}]}
    structured = [{"role": "user", "content": "(1+2)*3?"}, call, {"role": "tool", "content": "3"},
                  {"role": "assistant", "content": "mul(3,3)"}]
    with pytest.raises(ValueError, match=r"trajectory 1 \('messages'\) message 1 \(assistant\) has no text content "
                                         r"\(structured tool_calls"):
        expert_turn_rows([tool_trajectory(1, "add", 2, "mul", 3), structured])
    with pytest.raises(ValueError, match=r"trajectory 0 \('messages'\) message 0: role 'developer' is not one of"):
        expert_turn_rows([[{"role": "developer", "content": "be brief"}, *structured[:1],
                           {"role": "assistant", "content": "add(1,2)"}]])
    with pytest.raises(ValueError, match="trajectory 0 .* is a str, not a list of messages"):
        expert_turn_rows(["U:1+2?\nA:add(1,2)"])

    register_plugin(PivotRL)
    path = tmp_path / "expert.jsonl"
    path.write_text("".join(json.dumps({"messages": m}) + "\n" for m in (tool_trajectory(1, "add", 2, "mul", 3),
                                                                          structured)))
    stage = StageSpec(trainer="grpo", model="no-such-model", dataset={"source": str(path)}, plugins=["pivot_rl"])
    with pytest.raises(RecipeError, match=r"trajectory 1 \('messages'\) message 1 \(assistant\) has no text"):
        resolve_stage(stage, 0, trl_ext_catalog)


def test_pivot_split_from_hand_built_and_sampled_profiles(tiny_model_dir, trl_ext_catalog, tmp_path):
    token = _CURRENT_RUN.set(RunContext(recipe=None, output_dir=tmp_path / "run", catalog=trl_ext_catalog))
    try:
        data = calc_tool_trajectories(size=2)  # 6 assistant turns
        stage = StageSpec(trainer="grpo", model=tiny_model_dir, dataset={"source": "embedded:calc_tool"})
        plugin = PivotRL(PivotRL.Params(k=4, max_new_tokens=6))
        with pytest.raises(ValueError, match="no pivot among 6 assistant turns"):  # the untrained model never matches
            plugin.trl_ext_prepare_dataset(dataset=data, split="train", stage=stage)
        assert plugin.profiles == [[0.0] * 4] * 6
        # a hand-built profile in place of the cached one: turns 1 and 4 are pivots
        cache = next((tmp_path / "run" / "_cache" / "pivot_rl").glob("*.json"))
        hand = [[1, 1, 1, 1], [1, 0, 0, 0], [0, 0, 0, 0], [1, 1, 1, 0], [0, 1, 0, 1], [1, 1, 0, 0]]
        cache.write_text(json.dumps({"profiles": hand}))
        pivots = PivotRL(PivotRL.Params(k=4, max_new_tokens=6, max_success=0.6)).trl_ext_prepare_dataset(
            dataset=data, split="train", stage=stage)
        turns = expert_turn_rows(data["messages"])
        assert pivots["prompt"] == [turns[i]["prompt"] for i in (1, 4, 5)]
        assert pivots["profile_mean"] == [0.25, 0.5, 0.5] and pivots["expert_action"][0] == turns[1]["expert_action"]
        # 3 pivots cannot fill a generation batch of 32 / 8 = 4 prompts (TRL would silently train zero steps)
        big_batch = StageSpec(trainer="grpo", model=tiny_model_dir, dataset={"source": "embedded:calc_tool"},
                              args={"per_device_train_batch_size": 32, "num_generations": 8})
        with pytest.raises(ValueError, match="only 3 pivot turns among 6, fewer than the 4 prompts"):
            PivotRL(PivotRL.Params(k=4, max_new_tokens=6, max_success=0.6)).trl_ext_prepare_dataset(
                dataset=data, split="train", stage=big_batch)
    finally:
        _CURRENT_RUN.reset(token)


def test_profile_scores_a_sample_as_training_rewards_it(monkeypatch, tmp_path):
    """The profile decoded samples with special tokens kept, so with a tokenizer whose eos is not the plain embedded
    one's (here the tool tokenizer's <|im_end|>) a correct action read ``add(12,3)<|im_end|>``, did not parse and scored
    0, while TRL decodes the same tokens to ``add(12,3)`` for the reward (1): pivot means were biased to 0."""
    import trl_ext_plugins.preference.generation as gen
    from tests.test_preference_generation import ScriptedModel, action_ids, tool_tokenizer

    tokenizer = tool_tokenizer()
    ids = action_ids(tokenizer, "add(12,3)")
    monkeypatch.setattr(gen, "load_policy", lambda path: (ScriptedModel(ids, tokenizer.pad_token_id), tokenizer))
    turns = [{"prompt": "U:(12+3)?\nA:", "expert_action": "add(12,3)"},
             {"prompt": "U:(12+3)?\nA:", "expert_action": "add(12,4)"}]
    profiles = PivotRL(PivotRL.Params(k=3, cache_dir=str(tmp_path))).profile(turns, "scripted-model")
    (reward,) = PivotRL().trl_ext_reward_functions(stage=None)
    trl_text = tokenizer.batch_decode([ids], skip_special_tokens=True)[0]  # what GRPO hands the reward
    assert reward.fn(completions=[trl_text] * 2, expert_action=["add(12,3)", "add(12,4)"]) == [1.0, 0.0]
    assert profiles == [[1.0] * 3, [0.0] * 3]


def test_reward_is_the_functional_match_with_the_expert_action():
    (reward,) = PivotRL().trl_ext_reward_functions(stage=None)
    assert reward.name == "pivot_rl"
    assert reward.fn(completions=["add(34,12)", "sub(34,12)", "ans(9)"],
                     expert_action=["add(12,34)", "sub(12,34)", "ans(9)"]) == [1.0, 0.0, 1.0]


@pytest.mark.slow
def test_turn_level_grpo_steps_on_pivot_rows(tiny_trainer):
    """Plumbing: GRPO trains on pivot rows (state prompt, expert action) with the functional-match reward logged."""
    from datasets import Dataset

    rows = expert_turn_rows(calc_tool_trajectories(size=8)["messages"])
    plugin = PivotRL()
    trainer = tiny_trainer("grpo", plugins=[plugin], dataset=Dataset.from_list(rows),
                           args={"max_completion_length": 8, "max_steps": 2})
    trainer.train()
    logged = {k for row in trainer.state.log_history for k in row}
    assert "rewards/pivot_rl/mean" in logged and trainer.state.global_step == 2
