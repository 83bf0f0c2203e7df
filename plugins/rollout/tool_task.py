"""An embedded multi-turn tool task (a calculator called through ``add``/``sub``/``mul``) and functional matching of
tool calls, for ``pivot_rl``.

A problem ``(12+34)*2?`` has the expert trajectory::

    user: (12+34)*2?   assistant: add(12,34)   tool: 46   assistant: mul(46,2)   tool: 92   assistant: ans(92)

Trajectories render as plain text with role tags (``U:``, ``A:``, ``T:``, one turn per line) for models without a
chat template (the embedded tokenizer has none), so an assistant turn's state is the text up to ``A:``.
"""

from __future__ import annotations

import random
import re

from datasets import Dataset

from trl_ext.embedded.splits import first_distinct_of_split
from trl_ext.embedded.tokenizer import EOS_TOKEN, SPECIAL_TOKENS

ROLE_TAGS = {"user": "U:", "assistant": "A:", "tool": "T:", "system": "S:"}
FUNCTIONS = {"add": lambda a, b: a + b, "sub": lambda a, b: a - b, "mul": lambda a, b: a * b}
SYMBOLS = {"add": "+", "sub": "-", "mul": "*"}
COMMUTATIVE = frozenset({"add", "mul"})
_CALL = re.compile(r"^\s*([A-Za-z_]\w*)\s*\((.*)\)\s*$", re.S)
_SPECIAL = re.compile("|".join(re.escape(t) for t in SPECIAL_TOKENS))


def tool_trajectory(a: int, first: str, b: int, second: str, c: int) -> list[dict[str, str]]:
    """The expert trajectory of ``(a first b) second c``: two tool calls, then the answer."""
    x = FUNCTIONS[first](a, b)
    y = FUNCTIONS[second](x, c)
    return [
        {"role": "user", "content": f"({a}{SYMBOLS[first]}{b}){SYMBOLS[second]}{c}?"},
        {"role": "assistant", "content": f"{first}({a},{b})"},
        {"role": "tool", "content": str(x)},
        {"role": "assistant", "content": f"{second}({x},{c})"},
        {"role": "tool", "content": str(y)},
        {"role": "assistant", "content": f"ans({y})"},
    ]


def calc_tool_trajectories(split: str = "train", format: str = "trajectory", seed: int = 0, size: int = 256,
                           max_operand: int = 20) -> Dataset:
    """Expert trajectories of the calculator task (``messages`` column); with ``format: turns`` one row per
    assistant turn (``prompt`` = the rendered state, ``completion`` = expert action + eos) for SFT; with ``format:
    states`` one row per assistant turn with ``prompt`` and ``expert_action`` (held-out evaluation of the
    ``pivot_rl`` reward). Problems are distinct and drawn from one stream seeded by ``seed``; a problem's split is a
    hash of its text (:func:`~trl_ext.embedded.splits.hash_split`), so no held-out problem is ever in training. (Two
    seed streams, one per split, as earlier versions drew, put 6 of configs/pivot_rl.yaml's 64 held-out problems in
    its 1024 training ones.)"""
    if format not in ("trajectory", "turns", "states"):
        raise ValueError(f"format must be 'trajectory', 'turns' or 'states', got {format!r}")
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    rows = []
    for a, first, b, second, c in _split_problems(split, seed, size, max_operand):
        messages = tool_trajectory(a, first, b, second, c)
        if format == "trajectory":
            rows.append({"messages": messages})
        elif format == "turns":
            rows += [{"prompt": prompt, "completion": action + EOS_TOKEN} for prompt, action in assistant_turns(messages)]
        else:
            rows += [{"prompt": prompt, "expert_action": action} for prompt, action in assistant_turns(messages)]
    return Dataset.from_list(rows)


def _split_problems(split: str, seed: int, size: int, max_operand: int) -> list[tuple[int, str, int, str, int]]:
    """The first ``size`` distinct problems of ``split`` in the stream seeded by ``seed``; an error naming how many
    were found when the split runs out (the problem space is ``max_operand``**3 x 9)."""
    if max_operand < 1:
        raise ValueError(f"max_operand must be at least 1, got {max_operand}")
    rng, names = random.Random(seed), list(FUNCTIONS)
    space = max_operand ** 3 * len(names) ** 2
    draws = ((rng.randrange(max_operand), rng.choice(names), rng.randrange(max_operand), rng.choice(names),
              rng.randrange(max_operand))
             for _ in range(max(64 * size, 8 * space)))  # enough draws to meet every problem of a small space
    problems = first_distinct_of_split(draws, lambda problem: tool_trajectory(*problem)[0]["content"], split, size)
    if len(problems) < size:
        raise ValueError(f"calc_tool: only {len(problems)} distinct {split} problems with max_operand={max_operand}, "
                         f"{size} asked; lower size or raise max_operand")
    return problems


def render(messages: list[dict[str, str]]) -> str:
    """Plain-text rendering: one ``<tag><content>`` line per message."""
    return "".join(f"{ROLE_TAGS[m['role']]}{m['content']}\n" for m in messages)


def assistant_turns(messages: list[dict[str, str]]) -> list[tuple[str, str]]:
    """``(state, expert action)`` for every assistant turn: the state is the rendered history plus ``A:``."""
    return [(render(messages[:i]) + ROLE_TAGS["assistant"], m["content"])
            for i, m in enumerate(messages) if m["role"] == "assistant"]


def parse_call(text: str) -> tuple[str, tuple] | None:
    """``name(arg, ...)`` -> ``(name, args)`` with numeric arguments as numbers; ``None`` when not a call."""
    match = _CALL.match(_SPECIAL.sub("", text).split("\n")[0])
    if match is None:
        return None
    args = []
    for raw in (p.strip() for p in match.group(2).split(",")) if match.group(2).strip() else ():
        try:
            args.append(float(raw) if "." in raw else int(raw))
        except ValueError:
            args.append(raw)
    return match.group(1).lower(), tuple(args)


def functional_match(action: str, expert: str, commutative: frozenset[str] = COMMUTATIVE) -> bool:
    """True when ``action`` calls the same function with equivalent arguments as ``expert``: numbers compare by value
    (``add(012, 3.0)`` matches ``add(12,3)``), whitespace is ignored, and the arguments of commutative functions are
    compared as multisets (``add(3,12)`` matches ``add(12,3)``). Text that is not a call matches by whitespace-
    normalised equality."""
    mine, theirs = parse_call(action), parse_call(expert)
    if mine is None or theirs is None:
        clean = _SPECIAL.sub("", action).split("\n")[0]
        return mine is None and theirs is None and " ".join(clean.split()) == " ".join(expert.split())
    (name, args), (expert_name, expert_args) = mine, theirs
    if name != expert_name or len(args) != len(expert_args):
        return False
    if name in commutative:
        return sorted(map(str, _normalise(args))) == sorted(map(str, _normalise(expert_args)))
    return _normalise(args) == _normalise(expert_args)


def _normalise(args: tuple) -> tuple:
    return tuple(int(a) if isinstance(a, float) and a.is_integer() else a for a in args)
