"""``python_reward``: a plain Python reward function, named by import path, without packaging a plugin."""

from __future__ import annotations

import importlib
import importlib.util
import math
import os
import sys
from pathlib import Path
from typing import Any, Callable

from pydantic import Field, field_validator, model_validator

from trl_ext import Plugin, PluginParams, hookimpl
from trl_ext.rewards import RewardFunction


def _trl_builtin_rewards() -> dict[str, Callable[[], Callable[..., Any]]]:
    """TRL's own reward names, built exactly as ``trl grpo --reward_funcs NAME`` builds them (trl/scripts/grpo.py)."""
    from trl.rewards import accuracy_reward, get_soft_overlong_punishment, reasoning_accuracy_reward, think_format_reward

    return {
        "accuracy_reward": lambda: accuracy_reward,
        "reasoning_accuracy_reward": lambda: reasoning_accuracy_reward,
        "think_format_reward": lambda: think_format_reward,
        "get_soft_overlong_punishment": lambda: get_soft_overlong_punishment(max_completion_len=1280,
                                                                             soft_punish_cache=256),
    }


def load_reward_function(spec: str) -> Callable[..., Any]:
    """Resolve ``spec`` to a callable; raise ``ValueError`` with one line saying what is wrong.

    Three forms: a TRL built-in reward name (``accuracy_reward``); a dotted import path ``package.module.function``
    (the working directory is importable, as in TRL's CLI); a file and a name, ``path/to/rewards.py:function``.
    """
    builtins = {"accuracy_reward", "reasoning_accuracy_reward", "think_format_reward", "get_soft_overlong_punishment"}
    if spec in builtins:
        return _trl_builtin_rewards()[spec]()
    if ":" in spec:
        file_part, name = spec.rsplit(":", 1)
        path = Path(file_part)
        if not path.is_file():
            raise ValueError(f"no such file {file_part!r}")
        module_spec = importlib.util.spec_from_file_location(f"trl_ext_user_reward_{path.stem}", path)
        module = importlib.util.module_from_spec(module_spec)
        try:
            module_spec.loader.exec_module(module)
        except Exception as exc:  # user code: report what it raised, in one line
            raise ValueError(f"importing {file_part!r} raised {type(exc).__name__}: {exc}") from None
    elif "." in spec:
        module_name, name = spec.rsplit(".", 1)
        if os.getcwd() not in sys.path:
            sys.path.insert(0, os.getcwd())
        try:
            module = importlib.import_module(module_name)
        except Exception as exc:
            raise ValueError(f"cannot import module {module_name!r} ({type(exc).__name__}: {exc})") from None
    else:
        raise ValueError(f"{spec!r} is neither a TRL reward name ({', '.join(sorted(builtins))}), a dotted "
                         f"path module.function, nor file.py:function")
    function = getattr(module, name, None)
    if function is None:
        raise ValueError(f"{module.__name__!r} has no attribute {name!r}")
    if not callable(function):
        raise ValueError(f"{spec!r} is not callable")
    return function


class PythonRewardParams(PluginParams):
    functions: list[str] = Field(min_length=1, description="reward functions, each a TRL reward name, a dotted path "
                                                           "`module.function`, or `path/file.py:function`")
    weights: list[float] | None = Field(None, description="one weight per function in the weighted sum (default 1.0 "
                                                          "each)")

    @field_validator("functions", mode="before")
    @classmethod
    def _one_or_many(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value

    @field_validator("functions")
    @classmethod
    def _resolvable(cls, value: list[str]) -> list[str]:
        named: dict[str, str] = {}
        for spec in value:
            try:
                function = load_reward_function(spec)  # import errors surface at validation, before any model loads
            except ValueError as exc:
                raise ValueError(f"{spec!r}: {exc}") from None
            name = getattr(function, "__name__", spec)
            if name in named:  # TRL keys each reward's column and metrics by the function's name
                raise ValueError(f"{named[name]!r} and {spec!r} are both named {name!r}; reward columns and metrics "
                                 "are keyed by name: rename one function")
            named[name] = spec
        return value

    @field_validator("weights")
    @classmethod
    def _finite(cls, value: list[float] | None) -> list[float] | None:
        if value is not None and not all(math.isfinite(w) for w in value):
            raise ValueError("weights must be finite")
        return value

    @model_validator(mode="after")
    def _one_weight_per_function(self) -> "PythonRewardParams":
        if self.weights is not None and len(self.weights) != len(self.functions):
            raise ValueError(f"{len(self.weights)} weights for {len(self.functions)} functions")
        return self


class PythonReward(Plugin):
    """Plain Python functions as rewards, with TRL's reward-function signature (as ``trl grpo --reward_funcs``).

    Each function is called as TRL calls reward functions: ``fn(prompts=..., completions=..., completion_ids=...,
    **dataset_columns, trainer_state=...)`` and returns one float per completion (``None`` where it does not apply).
    ``functions`` takes TRL's built-in reward names (built as TRL's CLI builds them), dotted import paths (the working
    directory is importable, as in TRL's CLI) or ``file.py:function``; each becomes a reward column named after the
    function. They are imported at validation, so a typo fails before any model loads. Plugins remain the way to
    share rewards with parameters and tests; this is the way to try one.
    """

    name = "python_reward"
    aliases = ("reward_function",)
    family = "reward"
    trainers = frozenset({"grpo", "rloo"})
    Params = PythonRewardParams

    @hookimpl
    def trl_ext_reward_functions(self, stage):
        weights = self.params.weights or [1.0] * len(self.params.functions)
        out = []
        for spec, weight in zip(self.params.functions, weights):
            function = load_reward_function(spec)
            out.append(RewardFunction(getattr(function, "__name__", spec), function, weight))
        return out
