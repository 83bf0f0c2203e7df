"""Embedded datasets of the rollout-control plugins (registered by the family's entry point)."""

from __future__ import annotations

import re

from datasets import Dataset

from trl_ext.embedded.arithmetic import arithmetic_dataset
from trl_ext.embedded.tokenizer import EOS_TOKEN

_PROBLEM = re.compile(r"^(-?\d+[-+*])(\d+=)$")


def arithmetic_proposals(split: str = "train", format: str = "prompt", seed: int = 0, max_operand: int = 50,
                         size: int | None = None, operations: str = "+") -> Dataset:
    """Problem-proposal prompts for ``self_play``'s proposer on the embedded arithmetic task: the prompt is a first
    operand and operation (``"12+"``); ``prompt_completion`` adds the rest of a real problem (``"34=<eos>"``) to warm a
    proposer with SFT. Rows follow the arithmetic task's split, seed and operand range."""
    if format not in ("prompt", "prompt_completion"):
        raise ValueError(f"format must be 'prompt' or 'prompt_completion', got {format!r}")
    rows = []
    for problem in arithmetic_dataset(split, format="prompt", seed=seed, max_operand=max_operand, size=size,
                                      operations=operations)["prompt"]:
        head, rest = _PROBLEM.match(problem).groups()
        rows.append({"prompt": head, **({"completion": rest + EOS_TOKEN} if format == "prompt_completion" else {})})
    return Dataset.from_list(rows)


def _calc_tool(*args, **kwargs) -> Dataset:
    from trl_ext_plugins.rollout.tool_task import calc_tool_trajectories

    return calc_tool_trajectories(*args, **kwargs)


def _calc_tool_prompts(*args, **kwargs) -> Dataset:
    from trl_ext_plugins.rollout.tool_envs import calc_tool_prompts

    return calc_tool_prompts(*args, **kwargs)


def _reasoning_gym(*args, **kwargs) -> Dataset:
    from trl_ext_plugins.rollout.reasoning_gym_env import reasoning_gym_dataset

    return reasoning_gym_dataset(*args, **kwargs)


DATASETS = {"arithmetic_proposals": arithmetic_proposals, "calc_tool": _calc_tool, "calc_tool_prompts": _calc_tool_prompts,
            "reasoning_gym": _reasoning_gym}
