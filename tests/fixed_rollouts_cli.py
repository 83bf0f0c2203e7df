"""trl-ext's CLI plus one test plugin, ``fixed_rollouts``, for the multi-process GRPO parity tests.

Sampling makes a 2-process GRPO run draw other completions than a 1-process run on the same prompts (each rank samples
its own slice from the same seed), so their losses cannot be compared. ``fixed_rollouts`` takes the place of TRL's
generation (slot ``generation``) and returns, for the k-th copy of a prompt in a generation call, completion tokens
and sampling log-probs that are a fixed function of (prompt, k). With groups that never straddle two ranks (the
per-device batch a multiple of ``num_generations``) every configuration trains on the same completions, rewards and
sampling log-probs, and only the loss, the reductions and the optimizer remain to compare.

Run as a script (``python tests/fixed_rollouts_cli.py train RECIPE`` or under ``torchrun``); the reward
``completion_length`` is used through ``python_reward`` as ``tests/fixed_rollouts_cli.py:completion_length``.
"""

from __future__ import annotations

import sys
from collections import Counter

from trl_ext import Need, Plugin, Slot, hookimpl


def fixed_completion(prompt: list[int], copy: int, eos: int) -> tuple[list[int], list[float]]:
    """Tokens 3..52 (ordinary characters of the embedded tokenizer) then EOS; lengths 3 to 5 by copy."""
    seed = sum(prompt)
    length = 2 + (seed + copy) % 3
    tokens = [3 + (7 * seed + 13 * copy + 5 * j) % 50 for j in range(length)] + [eos]
    return tokens, [-4.0 - 0.1 * j + 0.2 * copy for j in range(len(tokens))]  # near the tiny model's own


def completion_length(completions, **_kwargs):
    """Reward: characters in the completion / 10 (differs within a group, so advantages are not all zero)."""
    return [len(text if isinstance(text, str) else text[-1]["content"]) / 10 for text in completions]


class FixedRollouts(Plugin):
    """Deterministic completions and sampling log-probs in place of generation (see the module docstring)."""

    name = "fixed_rollouts"
    family = "rollout"
    trainers = frozenset({"grpo"})
    slots = frozenset({Slot.GENERATION})
    provides = frozenset({Need.SAMPLING_LOGPROBS})

    @hookimpl
    def trl_ext_generate(self, trainer, prompts, generate):
        from trl_ext_plugins.rollout.rollout_logprobs import generate_single_turns_with

        def single_turn(prompt_ids, _images, _fields):
            copies = Counter()
            ids, logprobs = [], []
            for prompt in prompt_ids:
                key = tuple(prompt)
                tokens, lps = fixed_completion(list(prompt), copies[key], trainer.eos_token_ids[0])
                copies[key] += 1
                ids.append(tokens)
                logprobs.append(lps)
            return ids, logprobs

        return generate_single_turns_with(trainer, prompts, generate, self.name, single_turn)


def main() -> int:
    from trl_ext.catalog import Catalog
    from trl_ext.cli import main as cli_main

    discover = Catalog.discover.__func__

    def with_fixed_rollouts(cls, *args, **kwargs):
        catalog = discover(cls, *args, **kwargs)
        catalog.add_plugin(FixedRollouts)
        return catalog

    Catalog.discover = classmethod(with_fixed_rollouts)
    return cli_main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
