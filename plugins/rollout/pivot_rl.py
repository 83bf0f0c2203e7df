"""``pivot_rl``: turn-level GRPO on the pivot turns of offline expert trajectories."""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import Field

from trl_ext import Plugin, PluginParams, hookimpl
from trl_ext.rewards import RewardFunction
from trl_ext_plugins.rollout.control_math import is_pivot
from trl_ext_plugins.rollout.tool_task import ROLE_TAGS, assistant_turns, functional_match


class PivotRLParams(PluginParams):
    k: int = Field(8, ge=2, description="K: samples of the frozen starting policy per assistant turn (profile).")
    max_success: float = Field(0.5, gt=0.0, le=1.0, description="lambda_diff: a pivot's profile mean must be below "
                                                                "this (the paper's value is not public; 0.5 keeps "
                                                                "turns the policy fails at least half the time).")
    messages_column: str = Field("messages", description="Dataset column holding each expert trajectory (a list of "
                                                         "{role, content} messages).")
    weight: float = Field(1.0, description="Weight of the functional-match reward in the weighted sum.")
    temperature: float = Field(1.0, gt=0.0, description="Sampling temperature of the profile (top_k 0).")
    max_new_tokens: int = Field(16, ge=1, description="Tokens sampled per profiled action.")
    batch_size: int = Field(64, ge=1, description="States per generation call while profiling.")
    seed: int = Field(0, description="Seed of the profile's sampling RNG.")
    cache_dir: str | None = Field(None, description="Cache folder; null: <run output_dir>/_cache/pivot_rl.")


def expert_turn_rows(trajectories: list[list[dict]], column: str = "messages") -> list[dict]:
    """One row per assistant turn of every trajectory: ``prompt`` (rendered state), ``expert_action``, and where it
    came from. Raises naming the first trajectory without an assistant turn or with a message that cannot be rendered
    as text."""
    rows = []
    for index, messages in enumerate(trajectories):
        _check_messages(messages or [], index, column)
        turns = assistant_turns(messages or [])
        if not turns:
            raise ValueError(f"trajectory {index} ({column!r}) has no assistant turn")
        rows += [{"prompt": state, "expert_action": action, "trajectory": index, "turn": t}
                 for t, (state, action) in enumerate(turns)]
    return rows


def _check_messages(messages, index: int, column: str) -> None:
    """Every message a ``{role, content}`` dict with a known role and text content. A structured tool call (content
    None beside ``tool_calls``) would otherwise render as ``A:None`` and become the expert action ``None``, on which
    the functional match fails only once the profile has sampled."""
    if not isinstance(messages, list):
        raise ValueError(f"trajectory {index} ({column!r}) is a {type(messages).__name__}, not a list of messages")
    for position, message in enumerate(messages):
        where = f"trajectory {index} ({column!r}) message {position}"
        if not isinstance(message, dict) or message.get("role") not in ROLE_TAGS:
            role = message.get("role") if isinstance(message, dict) else None
            raise ValueError(f"{where}: role {role!r} is not one of {sorted(ROLE_TAGS)}")
        if not isinstance(message.get("content"), str):
            hint = (" (structured tool_calls are not read: write the call as text, e.g. add(12,34))"
                    if message.get("tool_calls") else "")
            raise ValueError(f"{where} ({message['role']}) has no text content{hint}")


class PivotRL(Plugin):
    """PivotRL (Yi, Mosk-Aoyama, Huang et al. 2026, arXiv 2603.21383; ALGORITHMS.md item 9).

    The train split holds offline expert multi-turn trajectories (``messages``: user / assistant / tool turns). Every
    assistant turn is a candidate state ``s`` (the history rendered as text, ``U:``/``A:``/``T:`` tags, ending at
    ``A:``) with the expert's action. The stage's starting model, frozen, samples ``k`` actions per state (default 8);
    each earns ``r(s, a) = 1[a functionally matches the expert action]``. A turn is a pivot iff the profile varies
    (``var > 0``) and its mean is below ``max_success`` (lambda_diff, default 0.5). The split becomes one row per pivot
    (``prompt``, ``expert_action``, ``profile_mean``) and GRPO trains on them turn by turn (one action per episode, no
    environment rollout), rewarded by the same functional match (reward ``pivot_rl``, weight ``weight``).

    Conventions chosen: functional match = same function name and equivalent arguments (numbers by value, whitespace
    ignored, argument order free for commutative calls such as ``add``/``mul``; the NeMo-RL SWE1 stage compares
    arguments against the reference action); an action is the first line of the completion; non-call text matches by
    normalised equality. The profile's samples are decoded as TRL decodes GRPO completions for rewards (special tokens
    skipped), so an action scores in the profile what it scores in training. Profiles are cached as JSON (atomic
    writes) keyed by the model, the trajectories and the profile settings, and are reproducible with ``seed``. Bad
    input (a trajectory without an assistant turn) is refused at validation for embedded and local datasets, before
    any model loads.
    """

    name = "pivot_rl"
    family = "rollout"
    trainers = frozenset({"grpo"})
    Params = PivotRLParams

    def __init__(self, params=None):
        super().__init__(params)
        self.profiles: list[list[float]] | None = None
        self.turns: list[dict] | None = None

    @hookimpl
    def trl_ext_validate_stage(self, stage, plugins):
        from trl_ext_plugins.rollout.multi_env import _load, _loadable_offline, current_catalog

        if not _loadable_offline(stage.dataset):
            return None
        try:
            data = _load(stage.dataset, current_catalog(), stage)
        except Exception as exc:
            return [f"plugin {self.name!r}: dataset {stage.dataset.source!r} cannot be loaded: {exc}"]
        if self.params.messages_column not in data.column_names:
            return [f"plugin {self.name!r}: dataset {stage.dataset.source!r} has no column "
                    f"{self.params.messages_column!r} of expert trajectories"]
        try:
            expert_turn_rows(data[self.params.messages_column], self.params.messages_column)
        except ValueError as exc:
            return [f"plugin {self.name!r}: dataset {stage.dataset.source!r}: {exc}"]
        return None

    @hookimpl
    def trl_ext_prepare_dataset(self, dataset, split, stage):
        if split != "train":
            return None
        from datasets import Dataset

        if self.params.messages_column not in dataset.column_names:
            raise ValueError(f"plugin {self.name!r}: the train dataset has no column {self.params.messages_column!r}")
        turns = expert_turn_rows(dataset[self.params.messages_column], self.params.messages_column)
        profiles = self.profile(turns, stage.model)
        self.turns, self.profiles = turns, profiles
        rows = [{**turn, "profile_mean": sum(p) / len(p)} for turn, p in zip(turns, profiles, strict=True)
                if is_pivot(p, self.params.max_success)]
        if not rows:
            raise ValueError(f"plugin {self.name!r}: no pivot among {len(turns)} assistant turns (none has mixed "
                             f"outcomes with success below {self.params.max_success})")
        from accelerate import PartialState

        from trl_ext_plugins.rollout.multi_env import generation_batch_prompts

        needed = generation_batch_prompts(stage.args, PartialState().num_processes, stage.trainer)
        if len(rows) < needed:  # TRL would silently train zero steps on a split smaller than one generation batch
            raise ValueError(f"plugin {self.name!r}: only {len(rows)} pivot turns among {len(turns)}, fewer than the "
                             f"{needed} prompts of one generation batch; use more trajectories, a stronger starting "
                             f"model, a larger k or max_success, or a smaller batch")
        return Dataset.from_list(rows)

    def profile(self, turns: list[dict], model_ref: str) -> list[list[float]]:
        """The K rewards of every turn's frozen-policy samples, from the cache when seen before."""
        from accelerate import PartialState

        from trl_ext.files import write_json_atomic
        from trl_ext_plugins.preference.generation import (
            cache_key,
            cache_root,
            load_policy,
            model_fingerprint,
            resolve_model,
            sample_completions,
        )

        path = resolve_model(model_ref, self.name)
        p = self.params
        settings = p.model_dump(include={"k", "temperature", "max_new_tokens", "seed", "batch_size"})
        # "decode" in the key: profiles cached before samples were decoded as TRL decodes them (special tokens kept,
        # so tokenizers whose eos is not the embedded one scored correct actions 0) are not reused.
        key = cache_key({"model": model_fingerprint(path), "turns": [(t["prompt"], t["expert_action"]) for t in turns],
                         "settings": settings, "decode": "skip_special_tokens"})
        target = Path(cache_root(p.cache_dir, self.name)) / f"{key}.json"
        with PartialState().main_process_first():
            if target.exists():
                return json.loads(target.read_text())["profiles"]
            model, tokenizer = load_policy(path)
            # Decoded as TRL decodes completions for rewards (special tokens skipped), so a sampled action earns the
            # reward it would earn in training: kept, an eos such as <|im_end|> made `add(12,3)<|im_end|>` unparsable.
            samples = sample_completions(model, tokenizer, [t["prompt"] for t in turns], num_samples=p.k,
                                         max_new_tokens=p.max_new_tokens, do_sample=True,
                                         temperature=p.temperature, batch_size=p.batch_size, seed=p.seed,
                                         skip_special_tokens=True)
            profiles = [[float(functional_match(a, t["expert_action"])) for a in actions]
                        for t, actions in zip(turns, samples, strict=True)]
            write_json_atomic(target, {"profiles": profiles, "settings": settings, "model": path})
        return profiles

    @hookimpl
    def trl_ext_reward_functions(self, stage):
        def pivot_rl(completions, expert_action, **kwargs):
            from trl_ext_plugins.preference.generation import completion_text

            return [float(functional_match(completion_text(c), e)) for c, e in
                    zip(completions, expert_action, strict=True)]

        return [RewardFunction(self.name, pivot_rl, self.params.weight)]
