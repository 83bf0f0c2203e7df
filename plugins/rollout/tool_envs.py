"""Tool environments for TRL's ``environment_factory`` (GRPO), usable as ``multi_env`` environments.

TRL's contract (trl 1.16, ``GRPOTrainer(environment_factory=...)``): a class constructed with no arguments; ``reset(
**row)`` is called once per rollout with the dataset row (minus the ``environment`` routing column) and may return
text appended to the last user message; every other public method is a tool the model can call (its JSON schema comes
from the type hints and the Google-style docstring); an optional no-argument ``get_reward()`` makes the environment
own a reward. Instances are pooled and reset per rollout.

* :class:`CalculatorEnv`: the calculator task of :mod:`trl_ext_plugins.rollout.tool_task` (``(12+34)*2?``), with the
  tools ``add``, ``sub`` and ``mul``; the final answer is the last assistant message, scored by a reward plugin
  against the row's ``answer`` (e.g. ``exact_match``). It records the calls of the current rollout (``calls``).
* :class:`NoToolEnv`: no tools and no observation, for the rows of non-tool environments in a run that has tool ones
  (TRL's dict ``environment_factory`` needs a factory for every row's ``environment``).

``multi_env`` names them ``calculator`` and ``none`` (:data:`TOOL_ENVIRONMENTS`); any other class is named by its
import path, ``"package.module:ClassName"``.
"""

from __future__ import annotations

import importlib
import inspect
import json
import random

from datasets import Dataset
from transformers.utils import get_json_schema

from trl_ext_plugins.rollout.tool_task import FUNCTIONS, SYMBOLS


class CalculatorEnv:
    """Integer calculator with ``add``, ``sub`` and ``mul`` tools; the answer is checked by the stage's rewards."""

    def __init__(self):
        self.answer: str | None = None
        self.calls: list[tuple[str, int, int]] = []

    def reset(self, answer=None, **row) -> None:
        """Start a rollout of a row (its ``answer`` column is kept for inspection; other columns are ignored)."""
        self.answer = None if answer is None else str(answer)
        self.calls = []
        return None

    def add(self, a: int, b: int) -> int:
        """Add two integers.

        Args:
            a: The first integer.
            b: The second integer.
        """
        return self._call("add", a, b)

    def sub(self, a: int, b: int) -> int:
        """Subtract the second integer from the first.

        Args:
            a: The first integer.
            b: The integer to subtract.
        """
        return self._call("sub", a, b)

    def mul(self, a: int, b: int) -> int:
        """Multiply two integers.

        Args:
            a: The first integer.
            b: The second integer.
        """
        return self._call("mul", a, b)

    def _call(self, name: str, a, b) -> int:
        a, b = int(a), int(b)  # TRL types arguments by the schema; a model may still send "12"
        self.calls.append((name, a, b))
        return FUNCTIONS[name](a, b)


class NoToolEnv:
    """The environment of rows that use no tools: no tool methods, ``reset`` adds nothing to the prompt."""

    def reset(self, **row) -> None:
        return None


TOOL_ENVIRONMENTS: dict[str, type] = {"calculator": CalculatorEnv, "none": NoToolEnv}


def resolve_environment(ref: str) -> type:
    """``"calculator"`` / ``"none"`` or ``"package.module:ClassName"`` -> the class; a one-line error otherwise."""
    if ref in TOOL_ENVIRONMENTS:
        return TOOL_ENVIRONMENTS[ref]
    module_name, sep, attribute = ref.partition(":")
    if not sep or not module_name or not attribute:
        raise ValueError(f"{ref!r} is neither a known environment ({', '.join(sorted(TOOL_ENVIRONMENTS))}) nor "
                         f"'package.module:ClassName'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"cannot import module {module_name!r}: {exc}") from None
    cls = getattr(module, attribute, None)
    if not inspect.isclass(cls):
        raise ValueError(f"module {module_name!r} has no class {attribute!r}")
    if not callable(getattr(cls, "reset", None)):
        raise ValueError(f"{ref} has no reset() method (TRL's environment_factory needs one)")
    return cls


def environment_tools(cls: type) -> list[str]:
    """The tool names TRL exposes for an environment class: its public functions other than reset/get_reward."""
    return [name for name, _ in inspect.getmembers(cls, predicate=inspect.isfunction)
            if name not in ("reset", "get_reward") and not name.startswith("_")]


def calc_tool_prompts(split: str = "train", format: str = "prompt", seed: int = 0, size: int = 64,
                      max_operand: int = 20, arithmetic_rows: int = 0, calls: int = 2,
                      schema: bool = True, arithmetic_max_operand: int | None = None) -> Dataset:
    """The calculator task for :class:`CalculatorEnv`. ``format: prompt`` (GRPO): ``prompt`` (``"(12+34)*2?"``) and
    the gold ``answer``. ``format: prompt_completion`` (an SFT warm-up with a tool-calling chat template): the
    ``prompt`` as one user message, the expert ``completion`` as messages (an assistant tool call per operation with
    its tool result, then the answer), ``tools`` (the environment's tool schemas as JSON, which TRL's SFT renders into
    the prompt as GRPO does) and ``answer``; ``arithmetic_rows`` more rows of the embedded arithmetic task (addition,
    operands below ``max_operand``, same split) as tool-free conversations (``"12+34="`` -> ``"46"``) follow, so one
    warm-up serves a ``multi_env`` run that mixes both. The problems are those of ``calc_tool`` (same split
    streams); ``calls: 1`` keeps only their first operation (``"12+7?"``, one tool call, then the answer), an easier
    task for a small model. ``schema: false`` (``prompt_completion`` only) leaves ``tools`` empty, so the SFT prompt
    carries no tool schemas (about 20 tokens instead of about 1300 with TRL's Qwen3 template): a first warm-up stage
    where a small model learns the call format and to copy the operands into the call, before a stage on the long
    prompts GRPO's tool loop renders (a 2-layer model trained only on the long prompts did not learn to copy)."""
    if calls not in (1, 2):
        raise ValueError(f"calls must be 1 or 2, got {calls!r}")
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    if format not in ("prompt", "prompt_completion"):
        raise ValueError(f"format must be 'prompt' or 'prompt_completion', got {format!r}")
    if not schema and format != "prompt_completion":
        raise ValueError("schema: false needs format 'prompt_completion' (GRPO's tool loop always renders the tools)")
    rng = random.Random(f"{seed}:{split}")
    names = list(FUNCTIONS)
    tools = json.dumps([get_json_schema(method) for method in tool_methods(CalculatorEnv())])
    rows = []
    for _ in range(size):
        a, first, b, second, c = (rng.randrange(max_operand), rng.choice(names), rng.randrange(max_operand),
                                  rng.choice(names), rng.randrange(max_operand))
        x = FUNCTIONS[first](a, b)
        answer = FUNCTIONS[second](x, c) if calls == 2 else x
        question = f"({a}{SYMBOLS[first]}{b}){SYMBOLS[second]}{c}?" if calls == 2 else f"{a}{SYMBOLS[first]}{b}?"
        row = {"prompt": question, "answer": str(answer)}
        if format == "prompt_completion":
            turns = [_tool_call_message(first, a, b), {"role": "tool", "name": first, "content": str(x)}]
            if calls == 2:
                turns += [_tool_call_message(second, x, c), {"role": "tool", "name": second, "content": str(answer)}]
            row = {"prompt": [{"role": "user", "content": question}],
                   "completion": [*turns, {"role": "assistant", "content": str(answer)}],
                   "tools": tools if schema else None, "answer": str(answer)}
        rows.append(row)
    if arithmetic_rows:
        if format != "prompt_completion":
            raise ValueError("arithmetic_rows needs format 'prompt_completion'")
        from trl_ext.embedded.arithmetic import arithmetic_dataset

        plain = arithmetic_dataset(split, format="prompt", seed=seed, size=arithmetic_rows,
                                   max_operand=arithmetic_max_operand or max_operand)
        rows += [{"prompt": [{"role": "user", "content": p}], "completion": [{"role": "assistant", "content": a}],
                  "tools": None, "answer": a} for p, a in zip(plain["prompt"], plain["answer"], strict=True)]
    return Dataset.from_list(rows)


def _tool_call_message(name: str, a: int, b: int) -> dict:
    return {"role": "assistant", "content": "",
            "tool_calls": [{"type": "function", "function": {"name": name, "arguments": {"a": a, "b": b}}}]}


def tool_methods(env) -> list:
    """The bound tool methods of an environment instance, as TRL exposes them."""
    return [getattr(env, name) for name in environment_tools(type(env))]


def run_tool_episode(model, tokenizer, env, row: dict, *, max_new_tokens: int, max_tool_calls: int,
                     chat_template: str | None = None) -> list[dict]:
    """One greedy multi-turn episode the way TRL's GRPO tool loop runs it: reset the environment with the row, render
    the conversation with the environment's tools, generate, parse with ``trl.chat_template_utils.parse_response``,
    execute the tool calls on the environment (an exception becomes ``{"error": ...}``, as in TRL), append the tool
    messages and generate again, until a turn has no tool call or ``max_tool_calls`` rounds ran. Returns the completion
    messages (assistant and tool turns), as TRL passes them to reward functions."""
    import torch
    from trl.chat_template_utils import parse_response

    observation = env.reset(**{k: v for k, v in row.items() if k != "environment"})  # what TRL passes
    prompt = list(row["prompt"])
    if isinstance(observation, str):
        prompt[-1] = {**prompt[-1], "content": prompt[-1]["content"] + observation}
    tools = tool_methods(env)
    completion: list[dict] = []
    device = getattr(model, "device", torch.device("cpu"))
    for round_index in range(max_tool_calls + 1):
        ids = tokenizer.apply_chat_template(prompt + completion, tools=tools or None, chat_template=chat_template,
                                            add_generation_prompt=True, tokenize=True, return_dict=False)
        inputs = torch.tensor([ids], device=device)
        output = model.generate(inputs, attention_mask=torch.ones_like(inputs), max_new_tokens=max_new_tokens,
                                do_sample=False, pad_token_id=tokenizer.pad_token_id,
                                eos_token_id=tokenizer.eos_token_id)
        new = output[0, len(ids):].tolist()
        if tokenizer.eos_token_id in new:
            new = new[: new.index(tokenizer.eos_token_id) + 1]
        message = parse_response(tokenizer, new, prefix=ids, tools=tools) if new else {"role": "assistant",
                                                                                       "content": ""}
        completion.append(message)
        calls = message.get("tool_calls")
        if not calls or round_index == max_tool_calls:
            break
        for call in calls:
            function = call.get("function", {})
            name = function.get("name")
            try:
                result = getattr(env, name)(**function.get("arguments", {})) if name in environment_tools(
                    type(env)) else {"error": f"Tool {name} not found."}
            except Exception as exc:  # a bad call is the model's mistake, reported back to it as TRL does
                result = {"error": str(exc)}
            completion.append({"role": "tool", "name": name, "content": str(result)})
    return completion


def evaluate_tool_environment(model, tokenizer, dataset, factory, score, *, max_new_tokens: int,
                              max_tool_calls: int, chat_template: str | None = None,
                              reward_kwargs: dict | None = None) -> dict:
    """Held-out score of a tool environment: one greedy episode per row (:func:`run_tool_episode`), scored by
    ``score`` like a TRL reward function, with ``reward_kwargs`` (TRL's ``trainer_state``, ``log_metric``, ...:
    :func:`trl_ext.evaluation.training_reward_kwargs`); no ``completion_ids``, as an episode's messages are re-rendered
    rather than kept as tokens. Returns ``evaluate_generation``'s keys plus ``tool_calls`` (mean tool calls per
    episode)."""
    from trl.chat_template_utils import add_response_schema

    if getattr(tokenizer, "response_template", None) is None and getattr(tokenizer, "response_schema", None) is None:
        add_response_schema(tokenizer)
    was_training = model.training
    model.eval()
    env = factory()
    owns_reward = callable(getattr(env, "get_reward", None))
    episodes, own = [], []
    try:
        for row in dataset:
            episodes.append(run_tool_episode(model, tokenizer, env, row, max_new_tokens=max_new_tokens,
                                             max_tool_calls=max_tool_calls, chat_template=chat_template))
            # The instance is reused (reset per row), so its own reward is read right after its episode.
            own.append(float(env.get_reward()) if owns_reward else 0.0)
    finally:
        model.train(was_training)
    from trl_ext.evaluation import TRL_SUPPLIED_COLUMNS, reward_summary

    columns = {name: dataset[name] for name in dataset.column_names if name not in TRL_SUPPLIED_COLUMNS}
    columns.update(reward_kwargs or {})
    rewards = score(prompts=dataset["prompt"], completions=episodes, **columns) if episodes else []
    # get_reward counts with weight 1, as in TRL; a row the reward function did not score stays unscored
    rewards = [None if r is None else r + o for r, o in zip(rewards, own, strict=True)]
    n = len(rewards)
    calls = [sum(m["role"] == "tool" for m in episode) for episode in episodes]
    return {
        **reward_summary(rewards),
        "tool_calls": sum(calls) / n if n else 0.0,
        "samples": [{"prompt": p[-1]["content"], "completion": e, "reward": r}
                    for p, e, r in zip(dataset["prompt"][:5], episodes[:5], rewards[:5])],
    }
