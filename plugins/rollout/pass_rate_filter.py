"""``pass_rate_filter``: drop prompts the starting policy always or never solves; order the rest as a curriculum;
optionally re-estimate the rates with the current policy every N steps."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator

from trl_ext import Plugin, PluginParams, Slot, hookimpl
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
    reestimate_every: int | None = Field(
        None, ge=1, description="Re-estimate every N optimizer steps with the current policy (null: estimate once). "
                                "The rows not yet drawn in the current pass over the prompts are re-sampled (k each, "
                                "seed + step) and the rest of the pass is re-filtered and re-ordered by their new "
                                "rates, so dropped prompts can re-enter and mastered ones leave; each new pass uses "
                                "every prompt's newest rate. The trainer keeps every train row and the plugin's "
                                "sampler selects (the batch already fetched when it runs is not changed).")

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
    forked RNG, so the same model, prompts and settings give the same keep-set. The samples are decoded as TRL decodes
    completions for rewards (up to the eos, special tokens skipped). A ``reward`` that is not a reward plugin, or bad
    ``reward_params``, is refused at validation, before any model loads. The rates are cached as JSON under
    ``cache_dir`` (default ``<run output_dir>/_cache/pass_rate_filter``), keyed by the model (file names, sizes and
    modification times of a local folder, or the hub id), the prompts and every setting that changes the estimate;
    the main process computes and writes atomically (temp file + rename), the others wait and read. With an ordered
    curriculum the plugin sets ``args.shuffle_dataset: false`` (TRL shuffles otherwise). The kept rates are added as a
    ``pass_rate`` column. Fewer kept prompts than one generation batch is an error naming the counts (TRL's sampler
    drops an incomplete batch, so the stage would train zero steps).

    Re-estimation (``reestimate_every: N``, default null = off). The train dataset keeps every row (no ``pass_rate``
    column, whose values would go stale) and the plugin supplies the train sampler (``trl_ext_train_sampler``, slot
    ``train_sampler``): :class:`~trl_ext_plugins.rollout.curriculum_sampler.CurriculumSampler`, with TRL's
    RepeatSampler structure, draws each generation chunk from the head of an ordered queue when the chunk's first
    index is requested. The queue runs in *passes*: a pass's base order is every row in dataset order (ordered
    curricula) or a ``torch.randperm`` from a generator seeded with ``args.seed`` (``order: none`` with TRL's
    shuffling), and its queue is the rows whose newest rate lies within the bounds, sorted by ``order``; with every
    row kept and no change it is exactly RepeatSampler's stream. Every N optimizer steps (``on_step_end`` of steps N,
    2N, ..., not after the last step) every row *not yet drawn in the current pass*, including rows the filter
    dropped, is sampled ``k`` times with the trainer's current weights (TRL's ``unwrap_model_for_generation``, so
    ZeRO-3/FSDP models generate too), ``temperature`` and ``max_new_tokens`` as above, seeded with ``seed + step``;
    their rates replace the old ones and the rest of the pass is re-filtered and re-ordered. Rows already drawn in the
    pass keep their last rate until the next pass, which is built from every row's newest rate. The trainer's epoch
    length stays the first estimate's (``len`` of the sampler is fixed); passes run on across epochs. On several
    processes each rank samples a contiguous share of the rows (padded so every rank makes the same generate calls)
    and the rates are gathered, so every rank rebuilds the same queue; the sampled completions therefore depend on the
    number of processes. Which batches a re-estimation reaches: the dataloader has already fetched one batch beyond
    the step just finished, so with defaults (``steps_per_generation == gradient_accumulation_steps``,
    ``num_iterations`` 1, ``dataloader_num_workers`` 0) the re-estimation after step ``t`` changes the prompts of
    steps ``t + 2`` onward (step ``t + 1``'s chunk is drawn); workers prefetch ``prefetch_factor`` more batches each.
    When fewer prompts than one generation chunk remain within the bounds at the start of a pass, training stops with
    an error naming the counts. Logged each time (TRL's metrics): ``pass_rate/reestimated`` (rows re-sampled),
    ``pass_rate/mean_reestimated``, ``pass_rate/kept`` (prompts left in the pass's queue), ``pass_rate/mean_kept``,
    ``pass_rate/entered`` and ``pass_rate/left`` (prompts that joined or left the queue). The queue, the rates, the
    pass's base order and generator, and the chunks drawn in the current epoch are saved with every checkpoint
    (``trl_ext_plugin_state/pass_rate_filter.json``, written atomically) and restored on resume, where the epoch's
    chunks are replayed so the batches the trainer skips are the ones it trained. Cost: each re-estimation samples
    ``k`` completions for up to every train row, so it suits datasets of thousands of prompts, not millions.
    """

    name = "pass_rate_filter"
    family = "rollout"
    trainers = frozenset({"grpo", "rloo"})
    slots = frozenset({Slot.TRAIN_SAMPLER})  # only used with reestimate_every; otherwise TRL's sampler
    Params = PassRateFilterParams

    def __init__(self, params=None):
        super().__init__(params)
        self.last_rates: list[float] | None = None  # every train prompt's estimate (for reports and tests)
        self.cache_hit: bool | None = None
        self.train_rows = None  # the train dataset the sampler indexes (reestimate_every)
        self.sampler = None
        self.reestimations: list[dict[str, Any]] = []  # step, rows, rates and figures of each re-estimation

    @hookimpl
    def trl_ext_validate_stage(self, stage, plugins):
        error = self._reward_error()
        return [error] if error else None

    def _reward_error(self) -> str | None:
        """``reward``/``reward_params`` checked with the helper multi_env checks its environments' rewards with (a
        known plugin, a reward plugin, valid params): a bad selection otherwise failed only once the model had
        loaded."""
        from trl_ext.recipe import PluginSelection
        from trl_ext_plugins.rollout.multi_env import current_catalog, reward_plugin

        try:
            reward_plugin(current_catalog(), PluginSelection(name=self.params.reward, params=self.params.reward_params))
        except Exception as exc:  # unknown plugin, not a reward plugin, bad params
            message = str(exc).removeprefix("plugins: ")  # the catalog's own field name, not this plugin's
            if message.startswith("params."):  # a bad parameter, named relative to the reward plugin
                return f"plugin {self.name!r}: params.reward_{message}"
            return f"plugin {self.name!r}: params.reward: {message}"
        return None

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
        if self.params.reestimate_every is not None:
            self.train_rows = dataset  # every row stays: the sampler selects, and re-estimation can bring rows back
            return None
        from accelerate import PartialState

        from trl_ext_plugins.rollout.multi_env import generation_batch_prompts

        needed = generation_batch_prompts(stage.args, PartialState().num_processes, stage.trainer)
        if len(keep) < needed:  # TRL's sampler drops the incomplete batch: the stage would train zero steps, silently
            raise ValueError(f"plugin {self.name!r}: only {len(keep)} of {len(rates)} prompts have a pass rate within "
                             f"the bounds, fewer than the {needed} prompts of one generation batch; widen the bounds, "
                             f"raise k, or shrink the batch")
        return dataset.select(keep).add_column("pass_rate", [rates[i] for i in keep])

    # -- re-estimation during training (reestimate_every) -------------------------------------------------------------

    @hookimpl
    def trl_ext_train_sampler(self, trainer, dataset):
        if self.params.reestimate_every is None:
            return None
        from trl_ext_plugins.rollout.curriculum_sampler import CurriculumQueue, CurriculumSampler

        estimated = self.train_rows
        if estimated is None or len(dataset) != len(estimated) or list(dataset["prompt"]) != list(estimated["prompt"]):
            raise ValueError(f"plugin {self.name!r}: the trainer's train rows are not the rows the plugin estimated "
                             "(a later plugin in the recipe filtered or re-ordered them); list pass_rate_filter last")
        p = self.params
        queue = CurriculumQueue(self.last_rates, lower=p.lower, upper=p.upper, inclusive=p.inclusive, order=p.order,
                                shuffle=bool(trainer.shuffle_dataset), seed=trainer.args.seed)
        chunk = trainer.args.generation_batch_size // trainer.num_generations
        kept = len(select_and_order(self.last_rates, p.lower, p.upper, p.inclusive, "none"))
        if kept < chunk:
            raise ValueError(f"plugin {self.name!r}: {kept} prompts lie within the bounds, fewer than one generation "
                             f"batch ({chunk} prompts); widen the bounds or shrink the batch")
        self.sampler = CurriculumSampler(queue, mini_repeat_count=trainer.num_generations, batch_size=chunk,
                                         repeat_count=trainer.num_iterations * trainer.args.steps_per_generation,
                                         num_chunks=kept // chunk)
        return self.sampler

    @hookimpl
    def trl_ext_trainer_created(self, trainer):
        if self.params.reestimate_every is None:
            return
        from trl_ext.callbacks import PluginStateCheckpoint
        from trl_ext_plugins.rollout.curriculum_sampler import ReestimateCallback

        trainer.add_callback(ReestimateCallback(self, trainer))
        replay = not trainer.args.ignore_data_skip  # the trainer skips the trained batches of the resumed epoch
        trainer.add_callback(PluginStateCheckpoint(self.name, lambda: self.sampler.state_dict(),
                                                   lambda state: self.sampler.load_state_dict(state, replay=replay)))

    def reestimate(self, trainer, step: int) -> dict[str, float]:
        """Re-sample the rows not yet drawn in the current pass with the trainer's current weights, update the queue
        and log the figures (every rank, same result)."""
        from accelerate.utils import gather_object
        from trl.models import unwrap_model_for_generation

        rows = self.sampler.queue.undrawn()
        world, rank = trainer.accelerator.num_processes, trainer.accelerator.process_index
        share = -(-len(rows) // world)  # every rank makes the same generate calls (sharded models need all ranks)
        mine = rows[rank * share:(rank + 1) * share]
        padded = mine + rows[:1] * (share - len(mine))
        tokenizer = getattr(trainer.processing_class, "tokenizer", trainer.processing_class)
        # as TRL's own generation: ZeRO-3 parameters gathered, FSDP root parameters summoned
        backend = getattr(trainer, "_dist", None)
        full = backend.summon_full_params(trainer.model_wrapped, recurse=False) if backend else contextlib.nullcontext()
        with unwrap_model_for_generation(trainer.model_wrapped, trainer.accelerator,
                                         gather_deepspeed3_params=trainer.args.ds3_gather_for_generation) as model, full:
            local = self._rates_of(model, tokenizer, self.train_rows.select(padded), seed=self.params.seed + step)
        rates = list(gather_object(local[:len(mine)])) if world > 1 else local[:len(mine)]
        figures = self.sampler.queue.update(rows, rates)
        figures.update(reestimated=float(len(rows)), mean_reestimated=sum(rates) / len(rates) if rates else 0.0)
        self.reestimations.append({"step": step, "rows": rows, "rates": rates, **figures})
        trainer._log_plugin_metrics({f"pass_rate/{k}": v for k, v in figures.items()})
        return figures

    def estimate(self, dataset, model_ref: str) -> list[float]:
        """Each row's estimated pass rate, from the cache when the same model, prompts and settings were seen."""
        from accelerate import PartialState

        from trl_ext.files import write_json_atomic
        from trl_ext_plugins.preference.generation import cache_key, cache_root, model_fingerprint, resolve_model

        path = resolve_model(model_ref, self.name)
        # batch_size stays in: the seeded samples depend on how prompts are batched. The other columns stay in: the
        # reward scores against them (e.g. `answer`).
        settings = self.params.model_dump(exclude={"lower", "upper", "inclusive", "order", "cache_dir",
                                                "reestimate_every"})
        columns = {c: dataset[c] for c in dataset.column_names if c != "prompt"}
        # "decode" in the key: rates cached before samples were decoded as TRL decodes them (special tokens kept) are
        # not reused.
        key = cache_key({"model": model_fingerprint(path), "prompts": dataset["prompt"], "columns": columns,
                         "settings": settings, "decode": "skip_special_tokens"})
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
        from trl_ext_plugins.preference.generation import load_policy, reward_function_from_plugin

        # The reward before the model: a bad reward selection fails without paying for the load.
        score = reward_function_from_plugin(self.params.reward, self.params.reward_params)
        model, tokenizer = load_policy(path)
        return self._rates_of(model, tokenizer, dataset, seed=self.params.seed, score=score)

    def _rates_of(self, model, tokenizer, dataset, seed: int, score=None) -> list[float]:
        """``p_hat`` of each row of ``dataset``: ``k`` seeded samples from ``model``, scored by the reward plugin
        (``score``, built from ``reward``/``reward_params`` when not given)."""
        from trl_ext_plugins.preference.generation import reward_function_from_plugin, sample_completions

        if len(dataset) == 0:
            return []
        if score is None:
            score = reward_function_from_plugin(self.params.reward, self.params.reward_params)
        p = self.params
        prompts = dataset["prompt"]
        # Decoded as TRL decodes completions for rewards (special tokens skipped), so a sample is solved here exactly
        # when the same tokens would earn the reward in training.
        samples = sample_completions(model, tokenizer, prompts, num_samples=p.k, max_new_tokens=p.max_new_tokens,
                                     do_sample=True, temperature=p.temperature, batch_size=p.batch_size, seed=seed,
                                     skip_special_tokens=True)
        columns = {c: dataset[c] for c in dataset.column_names if c != "prompt"}
        flat = [c for row in samples for c in row]
        repeated = {c: [v for v in values for _ in range(p.k)] for c, values in columns.items()}
        rewards = score(prompts=[x for x in prompts for _ in range(p.k)], completions=flat, **repeated)
        solved = [[r is not None and r >= p.success_threshold for r in rewards[i:i + p.k]]
                  for i in range(0, len(rewards), p.k)]
        return pass_rates(solved)

