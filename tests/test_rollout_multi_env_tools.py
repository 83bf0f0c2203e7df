"""``multi_env`` with TRL tool environments (``environment_factory``): the embedded tool-calling tokenizer passes
TRL's checks and its tool calls parse; the calculator environment; a GRPO run through the trl-ext runner mixing the
arithmetic verifier environment with the calculator tool environment; bad input refused before any model loads.

Why a scripted generator in the training test: a randomly initialised tiny model emits a well-formed
``<tool_call>{json}</tool_call>`` with probability ~0 (one wrong character breaks the JSON), and an SFT warm-up that
makes it reliable costs minutes of CPU on ~1100-token prompts. The test replaces only TRL's per-turn token generator
(``GRPOTrainer._generate_single_turn``) for prompts that carry a tool schema: it writes the calls of the problem in the
model's token ids, and after the tool results arrive it answers with the number *read from the last tool result*. So
the answer is right only if TRL parsed the call, the environment executed it and the result came back; everything
else (prompt rendering with the environment's tools, parse_response, the tool loop, the per-row reset, rewards,
advantages, loss, per-environment metrics, held-out evaluation) is TRL's and trl-ext's own code. Rows of the
arithmetic environment are sampled from the real model.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from trl_ext.embedded.models import build_model
from trl_ext.embedded.tool_tokenizer import EOS_TOKEN, build_tool_tokenizer
from trl_ext_plugins.rollout.tool_envs import CalculatorEnv, NoToolEnv, calc_tool_prompts, run_tool_episode
from trl_ext_plugins.rollout.tool_task import FUNCTIONS, SYMBOLS

OPS = {symbol: name for name, symbol in SYMBOLS.items()}
_PROBLEM = re.compile(r"<\|im_start\|>user\n\((\d+)([-+*])(\d+)\)([-+*])(\d+)\?")
_RESULT = re.compile(r"<tool_response>\n(-?\d+)\n</tool_response>")


class RecordingCalculator(CalculatorEnv):
    """The calculator, recording every reset row and executed call of the process (test double of the environment's
    observers only; the tools are CalculatorEnv's)."""

    resets: list[dict] = []
    executed: list[tuple[str, int, int]] = []

    def reset(self, **row):
        RecordingCalculator.resets.append(row)
        return super().reset(**row)

    def _call(self, name, a, b):
        result = super()._call(name, a, b)
        RecordingCalculator.executed.append((name, int(a), int(b)))
        return result


def tool_call_text(name: str, a: int, b: int) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {{"a": {a}, "b": {b}}}}}\n</tool_call>{EOS_TOKEN}'


def scripted_turn(text: str) -> str | None:
    """The next assistant turn for a rendered calculator conversation, ``None`` for other prompts: first call, second
    call on the first tool result, then the last tool result as the answer."""
    if "<tools>" not in text:
        return None
    a, first, b, second, c = _PROBLEM.search(text).groups()
    results = _RESULT.findall(text)
    if not results:
        return tool_call_text(OPS[first], int(a), int(b))
    if len(results) == 1:
        return tool_call_text(OPS[second], int(results[0]), int(c))
    return results[-1] + EOS_TOKEN


# -- tokenizer and model ------------------------------------------------------------------------------------------


def test_tool_tokenizer_passes_trl_checks_and_parses_a_tool_call():
    from trl.chat_template_utils import add_response_schema, parse_response, supports_tool_calling

    tokenizer = build_tool_tokenizer()
    assert supports_tool_calling(tokenizer)
    add_response_schema(tokenizer)  # raises for a chat template TRL does not know
    env = CalculatorEnv()
    tools = [env.add, env.sub, env.mul]
    prefix = tokenizer.apply_chat_template([{"role": "user", "content": "(12+34)*2?"}], tools=tools,
                                           add_generation_prompt=True, tokenize=True, return_dict=False)
    text = tool_call_text("add", 12, 34)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    # the markers are single tokens: "<tool_call>" + 51 characters + "</tool_call>" + eos
    assert ids[0] == tokenizer.convert_tokens_to_ids("<tool_call>") and ids[-1] == tokenizer.eos_token_id
    assert len(ids) == len(text) - len("<tool_call>") - len("</tool_call>") - len(EOS_TOKEN) + 3
    parsed = parse_response(tokenizer, ids, prefix=prefix, tools=tools)
    assert parsed["tool_calls"] == [{"type": "function", "function": {"name": "add", "arguments": {"a": 12, "b": 34}}}]
    assert parsed["content"] == ""
    # plain text parses to content, as TRL needs for the final answer
    assert parse_response(tokenizer, tokenizer("92" + EOS_TOKEN)["input_ids"], prefix=prefix, tools=tools) == {
        "role": "assistant", "content": "92"}


def test_tool_model_matches_its_tokenizer_and_round_trips_through_a_folder(tmp_path):
    from transformers import AutoTokenizer

    from trl_ext.embedded.models import materialize_model
    from trl_ext.embedded.tokenizer import build_tokenizer

    tokenizer = build_tool_tokenizer()
    model = build_model("tiny-qwen3-tools")
    assert model.config.vocab_size == len(tokenizer) == 107 and model.config.eos_token_id == tokenizer.eos_token_id
    folder = materialize_model("tiny-qwen3-tools", tmp_path / "m")
    loaded = AutoTokenizer.from_pretrained(folder)
    text = "(12+34)*2?" + tool_call_text("mul", 46, 2) + ' {"x": "_|~"}'
    assert loaded(text)["input_ids"] == tokenizer(text)["input_ids"]
    assert loaded.chat_template == tokenizer.chat_template and loaded.eos_token == EOS_TOKEN
    assert len(build_tokenizer()) == 83  # the embedded tokenizer is untouched (4 special + 79 characters)


# -- the calculator environment -----------------------------------------------------------------------------------


def test_calculator_environment_follows_trl_contract():
    from transformers.utils import get_json_schema

    env = CalculatorEnv()
    assert env.reset(prompt=[{"role": "user", "content": "(1+2)*3?"}], answer="9", env="calc") is None
    assert (env.add(12, 34), env.sub(3, 10), env.mul(-4, 5)) == (46, -7, -20)
    assert env.calls == [("add", 12, 34), ("sub", 3, 10), ("mul", -4, 5)] and env.answer == "9"
    env.reset(answer=1)
    assert env.calls == []
    schema = get_json_schema(env.mul)["function"]
    assert schema["name"] == "mul" and schema["parameters"]["required"] == ["a", "b"]
    rows = calc_tool_prompts("train", size=8)
    for prompt, answer in zip(rows["prompt"], rows["answer"], strict=True):
        a, first, b, second, c = re.match(r"\((\d+)([-+*])(\d+)\)([-+*])(\d+)\?", prompt).groups()
        assert FUNCTIONS[OPS[second]](FUNCTIONS[OPS[first]](int(a), int(b)), int(c)) == int(answer)
    assert calc_tool_prompts("test", size=8)["prompt"] != rows["prompt"]


def test_one_call_problems_are_the_first_operation_of_the_two_call_ones():
    two, one = calc_tool_prompts("train", size=8), calc_tool_prompts("train", size=8, calls=1)
    for long, short, answer in zip(two["prompt"], one["prompt"], one["answer"], strict=True):
        a, op, b = re.match(r"(\d+)([-+*])(\d+)\?$", short).groups()
        assert long.startswith(f"({a}{op}{b})") and FUNCTIONS[OPS[op]](int(a), int(b)) == int(answer)
    turns = calc_tool_prompts("train", format="prompt_completion", size=1, calls=1)[0]["completion"]
    assert [t["role"] for t in turns] == ["assistant", "tool", "assistant"] and turns[1]["content"] == turns[2]["content"]
    with pytest.raises(ValueError, match="calls must be 1 or 2"):
        calc_tool_prompts("train", calls=3)


def test_warm_up_conversations_render_the_tool_calls_grpo_parses():
    """The SFT rows render (with their ``tools``) to the same prompt GRPO generates from, followed by tool calls that
    TRL's parser reads back as the expert's calls; the arithmetic rows carry no tools."""
    from trl.chat_template_utils import add_response_schema, parse_response

    tokenizer = add_response_schema(build_tool_tokenizer())
    rows = calc_tool_prompts("train", format="prompt_completion", size=3, arithmetic_rows=2)
    assert len(rows) == 5 and rows["tools"][3:] == [None, None]
    assert rows["prompt"][:3] == [[{"role": "user", "content": p}] for p in calc_tool_prompts("train", size=3)["prompt"]]
    row = rows[0]
    tools = json.loads(row["tools"])
    env = CalculatorEnv()
    prompt = tokenizer.apply_chat_template(row["prompt"], tools=tools, add_generation_prompt=True, tokenize=False)
    assert prompt == tokenizer.apply_chat_template(row["prompt"], tools=[env.add, env.mul, env.sub],
                                                   add_generation_prompt=True, tokenize=False)
    full = tokenizer.apply_chat_template(row["prompt"] + row["completion"], tools=tools, tokenize=False)
    assert full.startswith(prompt)
    first_turn = full[len(prompt):].split(EOS_TOKEN)[0] + EOS_TOKEN
    call = row["completion"][0]["tool_calls"][0]["function"]
    assert first_turn == tool_call_text(call["name"], call["arguments"]["a"], call["arguments"]["b"])
    parsed = parse_response(tokenizer, tokenizer(first_turn)["input_ids"], prefix=tokenizer(prompt)["input_ids"])
    assert parsed["tool_calls"][0]["function"] == call
    assert row["completion"][-1] == {"role": "assistant", "content": row["answer"], "tool_calls": None, "name": None}
    assert rows[3]["completion"][0]["content"] == rows[3]["answer"]


def test_warm_up_arithmetic_rows_take_their_own_operand_range():
    """``arithmetic_max_operand`` widens the tool-free rows (the embedded task's train split at that range) without
    touching the calculator problems; by default they share the calculator's ``max_operand``."""
    from trl_ext.embedded.arithmetic import arithmetic_dataset

    def plain(rows):
        return [(r["prompt"][0]["content"], r["answer"]) for r in rows if r["tools"] is None]

    narrow = calc_tool_prompts("train", format="prompt_completion", size=3, arithmetic_rows=40)
    wide = calc_tool_prompts("train", format="prompt_completion", size=3, arithmetic_rows=40, arithmetic_max_operand=50)
    assert narrow.to_list()[:3] == wide.to_list()[:3]
    for rows, max_operand in ((narrow, 20), (wide, 50)):
        want = arithmetic_dataset("train", format="prompt", max_operand=max_operand, size=40)
        assert plain(rows) == list(zip(want["prompt"], want["answer"], strict=True))
    assert max(int(n) for p, _ in plain(wide) for n in p.rstrip("=").split("+")) >= 20


def test_schema_free_warm_up_rows_are_the_same_conversations_without_tool_schemas():
    """``schema: false``: same problems and expert turns, ``tools`` empty, so the rendered prompt is the short chat
    prompt (no schema text) while the tool-call turns render exactly as in the schema rows."""
    tokenizer = build_tool_tokenizer()
    full, short = (calc_tool_prompts("train", format="prompt_completion", size=4, calls=1, schema=s)
                   for s in (True, False))
    assert short["tools"] == [None] * 4 and all(t is not None for t in full["tools"])
    assert short["prompt"] == full["prompt"] and short["completion"] == full["completion"]
    with_schema = tokenizer.apply_chat_template(full[0]["prompt"], tools=json.loads(full[0]["tools"]),
                                                add_generation_prompt=True, tokenize=False)
    without = tokenizer.apply_chat_template(short[0]["prompt"], add_generation_prompt=True, tokenize=False)
    assert '"name": "add"' in with_schema and '"name"' not in without and len(without) < len(with_schema) / 20
    assert with_schema.endswith(without)  # the schema is a system turn in front of the same user turn
    with pytest.raises(ValueError, match="schema: false needs format 'prompt_completion'"):
        calc_tool_prompts("train", schema=False)


def test_warm_up_needs_the_training_template_grpo_renders_tool_rollouts_with():
    """GRPO's tool loop renders with TRL's training template; Qwen3's own template differs in the tool-call turn (no
    think block), so only a warm-up rendered with the training template (SFT's ``assistant_only_loss: true``) has
    the prompt the loop shows before the final answer as a prefix of its training text. The shipped recipe sets it."""
    import yaml
    from trl.chat_template_utils import get_training_chat_template

    tokenizer = build_tool_tokenizer()
    row = calc_tool_prompts("train", format="prompt_completion", size=1, calls=1)[0]
    tools, conversation = json.loads(row["tools"]), row["prompt"] + row["completion"]
    training = get_training_chat_template(tokenizer)
    assert training != tokenizer.chat_template
    before_answer = tokenizer.apply_chat_template(conversation[:-1], tools=tools, chat_template=training,
                                                  add_generation_prompt=True, tokenize=False)
    warm_up_training = tokenizer.apply_chat_template(conversation, tools=tools, chat_template=training, tokenize=False)
    warm_up_own = tokenizer.apply_chat_template(conversation, tools=tools, tokenize=False)
    assert warm_up_training.startswith(before_answer)
    assert not warm_up_own.startswith(before_answer)
    recipe = yaml.safe_load((Path(__file__).parents[1] / "configs" / "multi_env_tools.yaml").read_text())
    assert all(stage["args"].get("assistant_only_loss") for stage in recipe["stages"] if stage["trainer"] == "sft")


class ScriptedModel(torch.nn.Module):
    """A stand-in for ``generate`` in held-out episodes: the scripted turn in the tokenizer's ids."""

    def __init__(self, tokenizer):
        super().__init__()
        self.tokenizer = tokenizer

    def generate(self, input_ids, **kwargs):
        turn = scripted_turn(self.tokenizer.decode(input_ids[0].tolist())) or EOS_TOKEN
        new = self.tokenizer(turn, add_special_tokens=False)["input_ids"]
        return torch.cat([input_ids, torch.tensor([new])], dim=1)


def test_held_out_tool_episode_runs_the_tools_and_scores_the_answer():
    from trl.chat_template_utils import add_response_schema

    from trl_ext.embedded.arithmetic import exact_match_reward
    from trl_ext_plugins.rollout.tool_envs import evaluate_tool_environment

    tokenizer = add_response_schema(build_tool_tokenizer())
    env = CalculatorEnv()
    row = {"prompt": [{"role": "user", "content": "(12+34)*2?"}], "answer": "92"}
    episode = run_tool_episode(ScriptedModel(tokenizer), tokenizer, env, row, max_new_tokens=80, max_tool_calls=4)
    assert [m["role"] for m in episode] == ["assistant", "tool", "assistant", "tool", "assistant"]
    assert [m["content"] for m in episode if m["role"] == "tool"] == ["46", "92"]
    assert env.calls == [("add", 12, 34), ("mul", 46, 2)] and episode[-1]["content"] == "92"

    from datasets import Dataset

    data = Dataset.from_list([row, {"prompt": [{"role": "user", "content": "(5-7)+1?"}], "answer": "-1"}])
    result = evaluate_tool_environment(ScriptedModel(tokenizer), tokenizer, data, CalculatorEnv,
                                       lambda completions, answer, **kw: exact_match_reward(completions, answer),
                                       max_new_tokens=80, max_tool_calls=4)
    assert (result["accuracy"], result["n"], result["tool_calls"]) == (1.0, 2, 2.0)
    # a reward naming TRL's keywords, as in training (trainer_state, log_metric), scores the held-out episodes too
    from types import SimpleNamespace

    from trl_ext.evaluation import training_reward_kwargs

    def trl_signature(completions, answer, trainer_state, log_metric, **kw):
        log_metric("calc/seen", 1.0)
        return [r * (trainer_state.global_step == 7) for r in exact_match_reward(completions, answer)]

    named = evaluate_tool_environment(ScriptedModel(tokenizer), tokenizer, data, CalculatorEnv, trl_signature,
                                      max_new_tokens=80, max_tool_calls=4,
                                      reward_kwargs=training_reward_kwargs(SimpleNamespace(state=SimpleNamespace(
                                          global_step=7))))
    assert named["accuracy"] == 1.0
    # no tool round allowed: the episode ends with its first turn, whose call is not executed
    short = run_tool_episode(ScriptedModel(tokenizer), tokenizer, env, row, max_new_tokens=80, max_tool_calls=0)
    assert len(short) == 1 and short[0]["tool_calls"][0]["function"]["name"] == "add" and env.calls == []


# -- validation -----------------------------------------------------------------------------------------------------


ARITH = {"source": "embedded:arithmetic", "params": {"format": "prompt", "size": 8, "max_operand": 10}}
CALC = {"source": "embedded:calc_tool_prompts", "params": {"size": 8}}


def _recipe(model="embedded:tiny-qwen3-tools", trainer="grpo", calc=None, **args):
    calc = {"name": "calc", "dataset": CALC, "rewards": ["exact_match"], "environment": "calculator", **(calc or {})}
    return {
        "seed": 0, "trainer": trainer, "model": model, "dataset": ARITH,
        "plugins": [{"multi_env": {"environments": [{"name": "arith", "rewards": ["exact_match"]}, calc]}}],
        "args": {"per_device_train_batch_size": 8, "num_generations": 4, **args},
    }


@pytest.fixture(scope="module")
def catalog():
    from trl_ext.catalog import Catalog

    return Catalog.discover()


@pytest.mark.parametrize("recipe, message", [
    (_recipe(calc={"environment": "no_such_env"}),
     "environments[1] ('calc').environment: 'no_such_env' is neither a known environment"),
    (_recipe(calc={"environment": "no.such.module:Env"}),
     "environments[1] ('calc').environment: cannot import module 'no.such.module'"),
    (_recipe(calc={"environment": "trl_ext_plugins.rollout.tool_envs:Missing"}), "has no class 'Missing'"),
    (_recipe(calc={"environment": "trl_ext_plugins.rollout.tool_task:Dataset"}), "has no reset() method"),
    (_recipe(calc={"rewards": []}), "environments[1] ('calc').environment: calculator defines no get_reward()"),
    (_recipe(trainer="rloo"), "tool environments need the 'grpo' trainer"),
    (_recipe(model="embedded:tiny-qwen2"),
     "environments[1] ('calc').environment: the model 'embedded:tiny-qwen2' has no chat template that renders and parses tool "
     "calls"),
])
def test_bad_tool_environments_are_refused_at_validation(catalog, monkeypatch, recipe, message):
    from trl_ext.errors import RecipeError
    from trl_ext.recipe import parse_recipe
    from trl_ext.stage import resolve_stage

    import trl_ext.embedded.models as models

    monkeypatch.setattr(models, "build_model", _no_model)  # validation must not build a model
    with pytest.raises(RecipeError) as err:
        spec = parse_recipe(recipe).stages[0]
        resolve_stage(spec, 0, catalog)
    text = str(err.value)
    assert message in text and "multi_env" in text


def _no_model(*args, **kwargs):
    raise AssertionError("a model was built during validation")


def test_trainer_kwargs_refuse_a_tokenizer_without_tool_calls():
    from trl_ext.embedded.tokenizer import build_tokenizer
    from trl_ext.recipe import StageSpec
    from trl_ext_plugins.rollout.multi_env import MultiEnv

    plugin = MultiEnv(MultiEnv.Params(environments=_recipe()["plugins"][0]["multi_env"]["environments"]))
    stage = StageSpec(trainer="grpo", model="some/hub-model", dataset=ARITH)
    with pytest.raises(ValueError, match="plugin 'multi_env': environments\\[1\\] \\('calc'\\).environment: the "
                                         "tokenizer of 'some/hub-model' has no chat template"):
        plugin.trl_ext_trainer_kwargs(stage=stage, tokenizer=build_tokenizer())
    kwargs = plugin.trl_ext_trainer_kwargs(stage=stage, tokenizer=build_tool_tokenizer())
    assert kwargs == {"environment_factory": {"arith": NoToolEnv, "calc": CalculatorEnv}}
    plain = MultiEnv(MultiEnv.Params(environments=[{"name": "arith", "rewards": ["exact_match"]}]))
    assert plain.trl_ext_trainer_kwargs(stage=stage, tokenizer=build_tokenizer()) is None


def test_plugin_trainer_kwargs_merge_and_refuse_a_clash():
    from trl_ext import NoParams, Plugin, hookimpl
    from trl_ext.host import PluginHost
    from trl_ext.recipe import StageSpec
    from trl_ext.trainers import plugin_trainer_kwargs

    def passing(plugin_name, kwargs):
        class Passes(Plugin):
            name = plugin_name
            Params = NoParams

            @hookimpl
            def trl_ext_trainer_kwargs(self, stage, tokenizer):
                return kwargs

        return Passes()

    stage = StageSpec(trainer="grpo", model="m", dataset=ARITH)
    host = PluginHost([passing("a", {"tools": [len]}), passing("b", None), passing("c", {"rollout_func": min})])
    assert plugin_trainer_kwargs(host, stage, None) == {"tools": [len], "rollout_func": min}
    clash = PluginHost([passing("a", {"tools": [len]}), passing("c", {"tools": []})])
    with pytest.raises(ValueError, match="plugins 'a' and 'c' both pass the trainer argument 'tools'"):
        plugin_trainer_kwargs(clash, stage, None)


def test_recipe_validates(catalog):
    from trl_ext.recipe import parse_recipe
    from trl_ext.stage import resolve_stage

    resolve_stage(parse_recipe(_recipe()).stages[0], 0, catalog)


# -- GRPO through the runner ----------------------------------------------------------------------------------------


def _scripted_generation(monkeypatch):
    from trl_ext.trainers.grpo import ExtGRPOTrainer

    real = ExtGRPOTrainer._generate_single_turn

    def generate(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        turns = [scripted_turn(self.processing_class.decode(ids)) for ids in prompt_ids]
        sampled = [i for i, t in enumerate(turns) if t is None]
        out = [None] * len(prompt_ids)
        if sampled:
            ids, _ = real(self, [prompt_ids[i] for i in sampled], images, multimodal_fields, num_generations,
                          has_tool_images)
            for i, completion in zip(sampled, ids, strict=True):
                out[i] = completion
        for i, turn in enumerate(turns):
            if turn is not None:
                out[i] = self.processing_class(turn, add_special_tokens=False)["input_ids"]
        return out, None

    monkeypatch.setattr(ExtGRPOTrainer, "_generate_single_turn", generate)


@pytest.mark.slow
def test_grpo_run_mixes_a_verifier_and_a_tool_environment(tmp_path, monkeypatch, catalog):
    from trl_ext.recipe import parse_recipe
    from trl_ext.runner import run_recipe

    _scripted_generation(monkeypatch)
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    RecordingCalculator.resets.clear()
    RecordingCalculator.executed.clear()
    recipe = _recipe(calc={"environment": f"{__name__}:RecordingCalculator",
                           "eval_dataset": {**CALC, "split": "test", "params": {"size": 2}}},
                     max_steps=2, max_completion_length=256, logging_steps=1, save_strategy="no",
                     gradient_checkpointing=False)
    envs = recipe["plugins"][0]["multi_env"]["environments"]
    envs[0]["eval_dataset"] = {**ARITH, "split": "test", "params": {**ARITH["params"], "size": 4}}
    recipe["plugins"][0]["multi_env"]["eval_tool_max_new_tokens"] = 8
    summary = run_recipe(parse_recipe(recipe), tmp_path / "run", catalog, echo=lambda m: None)
    assert summary["status"] == "complete"

    # 2 steps x 8 rollouts, half of them calculator rows: one reset per rollout, with its row's columns (TRL's
    # `environment` routing column removed), plus one per held-out episode (2 rows, before and after); two executed
    # calls per training rollout, the first on the problem's operands (the random model's 8-token held-out turns
    # cannot hold a call)
    calc_rollouts = 2 * 4
    resets = RecordingCalculator.resets
    assert len(resets) == calc_rollouts + 2 * 2
    assert all(r["env"] == "calc" and "environment" not in r and r["answer"] is not None for r in resets)
    assert len(RecordingCalculator.executed) == 2 * calc_rollouts
    for row in resets[2:2 + calc_rollouts]:  # held-out "before" episodes come first, the "after" ones last
        a, first, b = re.match(r"\((\d+)([-+*])(\d+)\)", row["prompt"][-1]["content"]).groups()
        assert (OPS[first], int(a), int(b)) in RecordingCalculator.executed

    stage_dir = tmp_path / "run" / "main"
    rows = [json.loads(line) for line in (stage_dir / "metrics.jsonl").read_text().splitlines()]
    logged = [r for r in rows if "multi_env/calc/share" in r]
    assert len(logged) == 2
    for r in logged:
        assert r["multi_env/calc/share"] == 0.5 and r["multi_env/arith/share"] == 0.5
        # the answer is read from the second tool result: 1.0 only if both calls were parsed and executed
        assert r["rewards/calc/exact_match/mean"] == 1.0 and r["multi_env/calc/reward"] == 1.0
        assert r["multi_env/calc/tool_calls"] == 2.0 and r["multi_env/arith/tool_calls"] == 0.0
        assert "rewards/arith/exact_match/mean" in r and "multi_env/arith/reward" in r
        assert r["tools/call_frequency"] == 1.0  # TRL's own count: 8 calls over 8 rollouts
    evaluation = json.loads((stage_dir / "multi_env_eval.json").read_text())
    assert evaluation["arith"]["before"]["n"] == 4 and evaluation["calc"]["after"]["n"] == 2
    assert "tool_calls" in evaluation["calc"]["after"]
