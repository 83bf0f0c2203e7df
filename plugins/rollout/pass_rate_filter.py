"""``pass_rate_filter``: drop prompts the starting policy always or never solves; order the rest as a curriculum."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator

from trl_ext import Plugin, PluginParams, hookimpl
from trl_ext_plugins.rollout.control_math import pass_rates, select_and_order


class PassRateFilterParams(PluginParams):
    k: int = Field(10, ge=1, description="Samples per prompt used to estimate its pass rate (Kimi k1.5: 10).")
    lower: float = Field(0.0, ge=0.0, le=1.0, description="Lower pass-rate bound (0: drop never-solved prompts).")
    upper: float = Field(1.0, ge=0.0, le=1.0, description="Upper pass-rate bound (1: drop always-solved prompts).")
    inclusive: bool = Field(False, description="false: keep lower < p < upper (ALGORITHMS.md item 46); true: "
                                               "lower <= p <= upper.")
    order: Literal["easy_to_hard", "hard_to_easy", "none"] = Field(
        "easy_to_hard", description="Curriculum: easy_to_hard sorts by estimated pass rate descending (the default, "
                                    "Nemotron 3 Super), hard_to_easy ascending, none keeps dataset order. Any order but "
                                    "none sets args.shuffle_dataset false so the trainer keeps it.")
    reward: str = Field("exact_match", description="Reward plugin (catalog name) that scores the samples.")
    reward_params: dict[str, Any] = Field(default_factory=dict, description="Parameters of that reward plugin.")
    success_threshold: float = Field(1.0, description="A sample counts as solved when its reward is >= this.")
    temperature: float = Field(1.0, gt=0.0, description="Sampling temperature of the estimate (full distribution, "
                                                        "top_k 0).")
    max_new_tokens: int = Field(8, ge=1, description="Tokens sampled per completion.")
    batch_size: int = Field(64, ge=1, description="Prompts per generation call.")
    seed: int = Field(0, description="Seed of the sampling RNG: the same seed, model and prompts give the same rates.")
    cache_dir: str | None = Field(None, description="Cache folder; null: <run output_dir>/_cache/pass_rate_filter.")

    @model_validator(mode="after")
    def _bounds(self):
        if self.lower > self.upper:
            raise ValueError(f"lower ({self.lower}) must not exceed upper ({self.upper})")
        if self.lower == self.upper and not self.inclusive:
            raise ValueError(f"lower == upper == {self.lower} with exclusive bounds keeps no prompt")
        return self


class PassRateFilter(Plugin):
    """Pass-rate filtering and difficulty curriculum (ALGORITHMS.md item 46; Nemotron 3 Super, arXiv 2604.12374;
    Kimi k1.5, arXiv 2501.12599).

    Before training, every train prompt ``x`` is sampled ``k`` times (default 10) from the stage's starting model and
    scored with a reward plugin (default ``exact_match``); ``p_hat(x)`` is the share of samples with reward >=
    ``success_threshold`` (default 1.0). Prompts with ``lower < p_hat < upper`` (defaults 0 and 1, exclusive: drop
    prompts never or always solved, which give GRPO zero-variance groups) are kept and ordered easy -> hard (pass rate
    descending, ties in dataset order) by default, or hard -> easy, or left in dataset order.

    Conventions chosen: only the ``train`` split is filtered; the held-out splits are untouched. Sampling draws from
    the full distribution at ``temperature`` (default 1.0, ``top_k`` 0 as TRL samples), seeded with ``seed`` in a
    forked RNG, so the same model, prompts and settings give the same keep-set. The rates are cached as JSON under
    ``cache_dir`` (default ``<run output_dir>/_cache/pass_rate_filter``), keyed by the model (file names, sizes and
    modification times of a local folder, or the hub id), the prompts and every setting that changes the estimate;
    the main process computes and writes atomically (temp file + rename), the others wait and read. With an ordered
    curriculum the plugin sets ``args.shuffle_dataset: false`` (TRL shuffles otherwise). The kept rates are added as a
    ``pass_rate`` column. Not implemented: re-estimating the rates during training.
    """

    name = "pass_rate_filter"
    family = "rollout"
    trainers = frozenset({"grpo", "rloo"})
    Params = PassRateFilterParams

    def __init__(self, params=None):
        super().__init__(params)
        self.last_rates: list[float] | None = None  # every train prompt's estimate (for reports and tests)
        self.cache_hit: bool | None = None

    @hookimpl
    def trl_ext_configure_args(self, trainer, args):
        return {"shuffle_dataset": False} if self.params.order != "none" else None

    @hookimpl
    def trl_ext_prepare_dataset(self, dataset, split, stage):
        if split != "train":
            return None
        if len(dataset) == 0:
            raise ValueError(f"plugin {self.name!r}: the train dataset has no rows")
        rates = self.estimate(dataset, stage.model)
        keep = select_and_order(rates, self.params.lower, self.params.upper, self.params.inclusive, self.params.order)
        if not keep:
            raise ValueError(f"plugin {self.name!r}: no prompt's pass rate lies within ({self.params.lower}, "
                             f"{self.params.upper}); widen the bounds or raise k")
        return dataset.select(keep).add_column("pass_rate", [rates[i] for i in keep])

    def estimate(self, dataset, model_ref: str) -> list[float]:
        """Each row's estimated pass rate, from the cache when the same model, prompts and settings were seen."""
        from accelerate import PartialState

        from trl_ext.files import write_json_atomic
        from trl_ext_plugins.preference.generation import cache_key, cache_root, model_fingerprint, resolve_model

        path = resolve_model(model_ref, self.name)
        settings = self.params.model_dump(exclude={"lower", "upper", "inclusive", "order", "cache_dir", "batch_size"})
        key = cache_key({"model": model_fingerprint(path), "prompts": dataset["prompt"], "settings": settings})
        target = Path(cache_root(self.params.cache_dir, self.name)) / f"{key}.json"
        with PartialState().main_process_first():
            if target.exists():
                self.cache_hit = True
                rates = json.loads(target.read_text())["rates"]
            else:
                self.cache_hit = False
                rates = self._sample_rates(dataset, path)
                write_json_atomic(target, {"rates": rates, "settings": settings, "model": path})
        self.last_rates = rates
        return rates

    def _sample_rates(self, dataset, path: str) -> list[float]:
        from trl_ext_plugins.preference.generation import load_policy, reward_function_from_plugin, sample_completions

        model, tokenizer = load_policy(path)
        score = reward_function_from_plugin(self.params.reward, self.params.reward_params)
        p = self.params
        prompts = dataset["prompt"]
        samples = sample_completions(model, tokenizer, prompts, num_samples=p.k, max_new_tokens=p.max_new_tokens,
                                     do_sample=True, temperature=p.temperature, batch_size=p.batch_size, seed=p.seed)
        columns = {c: dataset[c] for c in dataset.column_names if c != "prompt"}
        flat = [c for row in samples for c in row]
        repeated = {c: [v for v in values for _ in range(p.k)] for c, values in columns.items()}
        rewards = score(prompts=[x for x in prompts for _ in range(p.k)], completions=flat, **repeated)
        solved = [[r is not None and r >= p.success_threshold for r in rewards[i:i + p.k]]
                  for i in range(0, len(rewards), p.k)]
        return pass_rates(solved)
