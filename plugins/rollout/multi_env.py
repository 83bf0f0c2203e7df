"""``multi_env``: several environments (datasets with their own verifiers) trained jointly in one GRPO run."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from trl_ext import Plugin, PluginParams, hookimpl
from trl_ext.errors import validation_message
from trl_ext.recipe import DatasetSpec, PluginSelection
from trl_ext.rewards import RewardFunction, await_rewards
from trl_ext_plugins.rollout.control_math import interleave_environments, mixture_counts

logger = logging.getLogger("trl_ext.multi_env")
ENV_COLUMN = "env"
# TRL's multi-environment routing column (a dict ``environment_factory`` reads each row's factory name from it).
TRL_ENV_COLUMN = "environment"
NO_TOOL_ENVIRONMENT = "none"


def _selections(value: Any) -> Any:
    """``[exact_match, {math_verify: {...}}]`` -> ``[{"name": ..., "params": ...}]`` (the recipe's plugin forms)."""
    if not isinstance(value, list):
        return value
    out = []
    for item in value:
        if isinstance(item, str):
            out.append({"name": item})
        elif isinstance(item, dict) and "name" not in item and len(item) == 1:
            (name, params), = item.items()
            out.append({"name": name, "params": params or {}})
        else:
            out.append(item)
    return out


class EnvironmentSpec(BaseModel):
    """One environment: its prompts, its verifier reward plugins, its mixing weight and its held-out split."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    name: str = Field(min_length=1, description="Environment name (metrics: multi_env/<name>/..., rewards/<name>/...)")
    weight: float = Field(1.0, gt=0.0, description="Mixing weight: its share of every generation batch's prompts.")
    dataset: DatasetSpec | None = Field(None, description="Train prompts; null: the stage's dataset.")
    eval_dataset: DatasetSpec | None = Field(None, description="Held-out prompts scored before and after the stage.")
    rewards: list[PluginSelection] = Field(default_factory=list,
                                           description="Reward plugins that score this environment (at least one, "
                                                       "unless its `environment` class defines get_reward()).")
    environment: str | None = Field(None, description="A TRL tool environment for its rows (GRPO's "
                                                      "environment_factory): 'calculator' or 'package.module:Class'.")

    @model_validator(mode="after")
    def _scored(self):
        if not self.rewards and self.environment is None:
            raise ValueError("rewards: at least one reward plugin is needed (or a tool `environment` whose class "
                             "defines get_reward())")
        return self

    @field_validator("dataset", "eval_dataset", mode="before")
    @classmethod
    def _dataset_shorthand(cls, value: Any) -> Any:
        return {"source": value} if isinstance(value, str) else value

    @field_validator("rewards", mode="before")
    @classmethod
    def _reward_shorthands(cls, value: Any) -> Any:
        return _selections(value)


class MultiEnvParams(PluginParams):
    environments: list[EnvironmentSpec] = Field(min_length=1, description="The environments (at least one).")
    seed: int = Field(0, description="Seed of the mixture's row order.")
    eval_max_new_tokens: int = Field(8, ge=1, description="Tokens decoded per held-out prompt (greedy).")
    eval_batch_size: int = Field(64, ge=1, description="Prompts per held-out generation call.")
    eval_tool_max_new_tokens: int = Field(96, ge=1, description="Tokens per turn in held-out tool episodes (greedy).")
    eval_max_tool_calls: int = Field(4, ge=0, description="Tool-call rounds per held-out tool episode.")
    eval_mean_at_k: int | None = Field(None, ge=1, description="Also sample this many answers per held-out prompt of "
                                       "every text environment and report their mean accuracy and reward "
                                       "(sampled_accuracy, sampled_reward_mean: the sampled pass@1 of RL papers), "
                                       "beside the greedy score. Tool environments are scored greedy only.")
    eval_temperature: float | None = Field(None, gt=0.0, description="Sampling temperature of eval_mean_at_k "
                                           "(default 1.0, TRL's GRPO default); set it with eval_mean_at_k.")

    @property
    def uses_tools(self) -> bool:
        return any(e.environment is not None for e in self.environments)

    @model_validator(mode="after")
    def _unique_names(self):
        names = [e.name for e in self.environments]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"environment names must be unique; repeated: {', '.join(duplicates)}")
        if self.eval_temperature is not None and self.eval_mean_at_k is None:
            raise ValueError("eval_temperature is the sampling temperature of eval_mean_at_k; set eval_mean_at_k")
        return self


def generation_batch_prompts(args: dict[str, Any], num_processes: int, trainer: str = "grpo") -> int:
    """Prompts per TRL generation batch from a stage's args, with the trainer config's own defaults where unset."""
    from trl_ext.trainers import stage_arg

    batch = stage_arg(args, trainer, "generation_batch_size")
    if batch is None:
        steps = stage_arg(args, trainer, "steps_per_generation") or stage_arg(args, trainer,
                                                                               "gradient_accumulation_steps")
        batch = stage_arg(args, trainer, "per_device_train_batch_size") * num_processes * steps
    return max(1, batch // stage_arg(args, trainer, "num_generations"))


class MultiEnv(Plugin):
    """Multi-environment joint RL (ALGORITHMS.md item 49; Nemotron 3 Super, arXiv 2604.12374 section 3.2.1; NeMo-Gym
    multi-environment training).

    Maximises ``J = sum_e w_e E_{x ~ D_e}[R_e(x, y)]`` in one run: each environment has its own prompts (``dataset``,
    default the stage's), its own verifier reward plugins and a mixing weight ``w_e``. The train split is rebuilt as a
    mixture in which the TRL generation batches hold each environment's prompts in the proportion ``w_e / sum w``:
    each batch within one prompt of ``w_e / sum w`` of its size, the rounding carried from batch to batch so the
    run's share is exact (an environment whose share is under one prompt per batch appears in that fraction of the
    batches), rows shuffled within the batch and drawn per
    environment by a seeded permutation (re-shuffled when an environment is used up); one epoch is the smallest number
    of batches that shows every environment all its rows. The plugin sets ``args.shuffle_dataset: false`` so TRL's
    sampler keeps the batches as built; an ``env`` column names each row's environment.

    Conventions chosen:

    * rewards are routed: every environment's reward function is registered as ``<env>/<reward>`` and returns ``None``
      (TRL: "does not apply") on other environments' rows, so TRL logs ``rewards/<env>/<reward>/mean`` per
      environment and advantages stay GRPO group-normalised (groups never mix environments, so reward scales need not
      match). The mixing weight sets the sampling share, not a reward multiplier; a reward plugin's own ``weight``
      stays its weight in the sum;
    * a verifier that raises is retried row by row; rows that still raise get ``None`` (no reward), are masked out of
      the loss through ``trl_ext_filter_groups`` and counted in ``multi_env/<env>/verifier_errors`` (rows of every
      rank since this process started: a resumed run counts from 0 again); the rest of the batch trains normally.
      A reward sees only its environment's own columns (the mixture fills other environments' columns with None),
      so one that reads a column its environment's dataset lacks stops the run with an error naming both, rather
      than scoring None as the gold value;
    * per generation batch it logs ``multi_env/<env>/share`` and ``multi_env/<env>/reward`` (mean total reward of the
      environment's scored rows, all ranks); held-out evaluation (greedy, each environment with its own rewards, main
      process; with ``eval_mean_at_k`` also the mean over k sampled answers per prompt of each text environment, drawn
      at ``eval_temperature`` from a forked RNG seeded by the stage's seed, so it changes no training sample) runs
      before and after the stage: ``multi_env_eval.json`` and a per-environment reward-curve plot
      ``multi_env.png`` in the stage folder, and ``multi_env_eval`` in the run summary.

    Environments can be any dataset with a verifier: the embedded arithmetic task per operation, reasoning-gym task
    families (``embedded:reasoning_gym`` with the ``reasoning_gym`` reward, extra ``trl-ext[reasoning-gym]``), local
    files or hub datasets.

    Tool environments (GRPO only): an environment with ``environment: calculator`` (the embedded
    :class:`~trl_ext_plugins.rollout.tool_envs.CalculatorEnv`) or ``environment: "package.module:ClassName"`` (any
    class following TRL's ``environment_factory`` contract: no-argument constructor, ``reset(**row)``, public methods
    as tools, optional ``get_reward()``) has its rows rolled out through TRL's tool-calling loop. With at least one
    tool environment the plugin

    * passes TRL the dict form ``environment_factory={<env name>: <class>}`` through ``trl_ext_trainer_kwargs``, and
      writes each row's environment name into TRL's routing column ``environment`` (besides ``env``); environments
      without a class get :class:`~trl_ext_plugins.rollout.tool_envs.NoToolEnv` (no tools, ``reset`` adds nothing),
      because TRL refuses a row whose ``environment`` names no factory. Only a tool environment's own tools are shown
      in its rows' prompts;
    * turns plain-text prompts into one user message (``[{"role": "user", "content": prompt}]``, train and held-out
      rows of every environment), since TRL's tool loop parses conversational completions only and decides the
      prompt format per batch;
    * needs a model whose chat template renders tool calls and that TRL can parse (``supports_tool_calling`` and
      ``add_response_schema``; e.g. ``embedded:tiny-qwen3-tools``); a tool environment's reward plugins see the
      completion as messages (assistant turns, tool results), ``exact_match`` scores the last assistant message;
    * logs ``multi_env/<env>/tool_calls`` (mean tool results per rollout) and scores held-out tool environments with
      greedy episodes of the same loop (``eval_tool_max_new_tokens`` tokens per turn, at most ``eval_max_tool_calls``
      rounds; ``tool_calls`` in ``multi_env_eval.json``). The stage-level ``eval_dataset`` is not routed: use each
      environment's ``eval_dataset``;
    * renders rollouts and held-out episodes, as TRL's tool loop does, with TRL's *training* chat template
      (``trl.chat_template_utils.get_training_chat_template``), not the tokenizer's own. For Qwen3 they differ: the
      training template writes the empty think block in every assistant turn, Qwen3's in the last one only. An SFT
      warm-up on tool conversations should set ``assistant_only_loss: true`` (TRL's SFTTrainer then renders with the
      same training template); measured on configs/multi_env_tools.yaml, a warm-up on Qwen3's own template made right
      tool calls but answered with noise after the tool result under GRPO's template (held-out 0/64, against 0.33 under
      its own template).

    Bad input (refused at validation, before any model loads): repeated environment names, a reward selection that is
    not a reward plugin, an environment whose embedded or local dataset has no rows, an environment with no reward
    (no reward plugin and no ``get_reward``), an ``environment`` that cannot be imported or has no ``reset``, a tool
    environment under a trainer other than ``grpo`` (TRL's RLOO has no ``environment_factory``) or with a model whose
    chat template cannot render tool calls (checked at validation for embedded models and local folders, otherwise
    when the tokenizer loads, still before the model).
    """

    name = "multi_env"
    family = "rollout"
    trainers = frozenset({"grpo", "rloo"})
    Params = MultiEnvParams

    def __init__(self, params=None):
        super().__init__(params)
        self.verifier_errors: dict[str, int] = {e.name: 0 for e in self.params.environments}
        self.before: dict[str, dict] = {}
        self.mixture_counts: list[int] | None = None
        # per environment: the mixture's columns its own dataset lacks (None-filled in its rows), hidden from its rewards
        self.foreign_columns: dict[str, frozenset[str]] = {}

    # -- validation -------------------------------------------------------------------------------------------------

    @hookimpl
    def trl_ext_validate_stage(self, stage, plugins):
        catalog = current_catalog()
        errors = self._tool_errors(stage)
        for i, env in enumerate(self.params.environments):
            where = f"plugin {self.name!r}: environments[{i}] ({env.name!r})"
            for j, selection in enumerate(env.rewards):
                try:
                    reward_plugin(catalog, selection)
                except Exception as exc:  # unknown plugin, bad params, not a reward plugin
                    errors.append(f"{where}.rewards[{j}]: {exc}")
            for field_name in ("dataset", "eval_dataset"):
                spec = getattr(env, field_name) if field_name == "eval_dataset" else (env.dataset or stage.dataset)
                if spec is None or not _loadable_offline(spec):
                    continue
                try:
                    rows = len(_load(spec, catalog, stage))
                except Exception as exc:
                    errors.append(f"{where}.{field_name}: cannot be loaded: {exc}")
                    continue
                if rows == 0:
                    errors.append(f"{where}.{field_name}: the environment has no rows ({spec.source})")
        return errors or None

    def _tool_errors(self, stage) -> list[str]:
        """Problems of the tool environments: unimportable class, no reward, wrong trainer, tokenizer without tools."""
        from trl_ext_plugins.rollout.tool_envs import resolve_environment

        errors = []
        for i, env in enumerate(self.params.environments):
            if env.environment is None:
                continue
            where = f"plugin {self.name!r}: environments[{i}] ({env.name!r}).environment"
            try:
                cls = resolve_environment(env.environment)
            except ValueError as exc:
                errors.append(f"{where}: {exc}")
                continue
            if not env.rewards and not callable(getattr(cls, "get_reward", None)):
                errors.append(f"{where}: {env.environment} defines no get_reward() and the environment lists no "
                              f"rewards")
            if stage.trainer != "grpo":
                errors.append(f"{where}: tool environments need the 'grpo' trainer (TRL's {stage.trainer!r} trainer "
                              f"has no environment_factory)")
        if self.params.uses_tools and not errors:
            tokenizer = _offline_tokenizer(stage.model)
            if tokenizer is not None and not _renders_tool_calls(tokenizer):
                errors.append(self._no_tool_template(f"the model {stage.model!r}"))
        return errors

    def _no_tool_template(self, what: str) -> str:
        first = next(i for i, e in enumerate(self.params.environments) if e.environment is not None)
        return (f"plugin {self.name!r}: environments[{first}] ({self.params.environments[first].name!r}).environment: "
                f"{what} has no chat template that renders and parses tool calls (use e.g. embedded:tiny-qwen3-tools)")

    @hookimpl
    def trl_ext_configure_args(self, trainer, args):
        return {"shuffle_dataset": False}

    # -- data -------------------------------------------------------------------------------------------------------

    @hookimpl
    def trl_ext_prepare_dataset(self, dataset, split, stage):
        if split != "train":
            return None
        from accelerate import PartialState
        from datasets import Dataset

        catalog = current_catalog()
        sources = [dataset if env.dataset is None else _load(env.dataset, catalog, stage)
                   for env in self.params.environments]
        for env, data in zip(self.params.environments, sources, strict=True):
            if len(data) == 0:
                raise ValueError(f"plugin {self.name!r}: environment {env.name!r} has no rows")
        weights = [env.weight for env in self.params.environments]
        batch_prompts = generation_batch_prompts(stage.args, PartialState().num_processes, stage.trainer)
        self.mixture_counts = mixture_counts(weights, batch_prompts)  # the first batch's
        # one epoch: enough batches that every environment, at its share, shows all its rows
        share = [w / sum(weights) * batch_prompts for w in weights]
        num_batches = max(math.ceil(len(d) / s - 1e-9) for d, s in zip(sources, share, strict=True))
        order = interleave_environments([len(d) for d in sources], weights, batch_prompts, num_batches,
                                        self.params.seed)
        columns = sorted({c for d in sources for c in d.column_names} - {ENV_COLUMN})
        self.foreign_columns = {env.name: frozenset(columns) - set(d.column_names)
                                for env, d in zip(self.params.environments, sources, strict=True)}
        rows = []
        for env_index, row_index in order:
            row = sources[env_index][row_index]
            rows.append(self._routed_row({**{c: row.get(c) for c in columns},
                                          ENV_COLUMN: self.params.environments[env_index].name}))
        return Dataset.from_list(rows)

    def _routed_row(self, row: dict) -> dict:
        """With tool environments: TRL's routing column and a conversational prompt (see the class docstring)."""
        if not self.params.uses_tools:
            return row
        prompt = row.get("prompt")
        if isinstance(prompt, str):
            prompt = [{"role": "user", "content": prompt}]
        return {**row, "prompt": prompt, TRL_ENV_COLUMN: row[ENV_COLUMN]}

    # -- trainer ----------------------------------------------------------------------------------------------------

    @hookimpl
    def trl_ext_trainer_kwargs(self, stage, tokenizer):
        """GRPO's dict ``environment_factory`` (one factory per environment name) when some environment has tools."""
        if not self.params.uses_tools:
            return None
        from trl_ext_plugins.rollout.tool_envs import resolve_environment

        if not _renders_tool_calls(tokenizer):
            raise ValueError(self._no_tool_template(f"the tokenizer of {stage.model!r}"))
        return {"environment_factory": {env.name: resolve_environment(env.environment or NO_TOOL_ENVIRONMENT)
                                        for env in self.params.environments}}

    # -- rewards ----------------------------------------------------------------------------------------------------

    @hookimpl
    def trl_ext_reward_functions(self, stage):
        from trl_ext.host import PluginHost
        from trl_ext.rewards import collect_reward_functions

        catalog = current_catalog()
        functions = []
        for env in self.params.environments:
            plugins = [reward_plugin(catalog, s) for s in env.rewards]
            for fn in collect_reward_functions(PluginHost(plugins), stage):
                functions.append(RewardFunction(f"{env.name}/{fn.name}", self._routed(env.name, fn.fn), fn.weight))
        return functions

    def _routed(self, env_name: str, fn):
        """``fn`` applied to this environment's rows only (``None`` elsewhere); a crash costs only the rows it hits."""

        def routed(completions, **kwargs):
            envs = kwargs.get(ENV_COLUMN)
            if envs is None:
                raise ValueError(f"plugin {self.name!r}: rows have no {ENV_COLUMN!r} column (is the train dataset the "
                                 f"multi_env mixture?)")
            n = len(completions)
            mine = [i for i, e in enumerate(envs) if e == env_name]
            out: list[float | None] = [None] * n
            if not mine:
                return out

            # A column only other environments have is not this environment's: its rows hold None there, which a
            # reward would score as a gold value (exact_match: str(None), 0 for every row, silently).
            foreign = self.foreign_columns.get(env_name, frozenset())

            def subset(indices):
                sub = {k: ([v[i] for i in indices] if _per_row(v, n) else v) for k, v in kwargs.items()
                       if k not in foreign}
                return {**sub, "completions": [completions[i] for i in indices]}

            try:
                values = await_rewards(fn(**subset(mine)))  # an async verifier's coroutine, awaited
                pairs = list(zip(mine, values, strict=True))
            except Exception as exc:
                missing = exc.args[0] if isinstance(exc, KeyError) and exc.args else None
                if isinstance(missing, str) and missing in foreign:  # a recipe error, not a flaky verifier
                    raise ValueError(f"plugin {self.name!r}: a reward of environment {env_name!r} reads the column "
                                     f"{missing!r}, which only other environments' datasets have; add it to its "
                                     f"dataset or point the reward at a column it has") from None
                logger.warning("multi_env: verifier of environment %r raised %r; scoring its rows one by one",
                               env_name, exc)
                pairs = []
                for i in mine:
                    try:
                        pairs.append((i, await_rewards(fn(**subset([i])))[0]))
                    except Exception:
                        self.verifier_errors[env_name] += 1
            for i, value in pairs:
                out[i] = value
            return out

        return routed

    @hookimpl
    def trl_ext_filter_groups(self, rewards, batch):
        """Mask rows nobody could score (a crashed verifier); log each environment's share and reward."""
        names = [e.name for e in self.params.environments]
        local = torch.tensor([names.index(row[ENV_COLUMN]) for row in batch.inputs], device=rewards.device)
        trainer = batch.trainer
        envs = trainer.accelerator.gather(local) if trainer is not None else local
        # Each rank scores (and counts the verifier errors of) its own rows; the logged count is every rank's.
        errors = torch.tensor([float(self.verifier_errors[name]) for name in names], device=rewards.device)
        if trainer is not None and trainer.accelerator.num_processes > 1:
            errors = trainer.accelerator.reduce(errors, reduction="sum")
        for index, name in enumerate(names):
            rows = envs == index
            scored = rows & ~torch.isnan(rewards)
            batch.metrics[f"multi_env/{name}/share"] = rows.float().mean().item()
            if scored.any():
                batch.metrics[f"multi_env/{name}/reward"] = rewards[scored].mean().item()
            batch.metrics[f"multi_env/{name}/verifier_errors"] = errors[index].item()
        if self.params.uses_tools:
            # Tool results per rollout (TRL appends one "tool" message per executed call), per environment.
            local_calls = torch.tensor([float(sum(m.get("role") == "tool" for m in c)) if isinstance(c, list) else 0.0
                                        for c in batch.completions], device=rewards.device)
            calls = trainer.accelerator.gather(local_calls) if trainer is not None else local_calls
            for index, name in enumerate(names):
                rows = envs == index
                if rows.any():
                    batch.metrics[f"multi_env/{name}/tool_calls"] = calls[rows].mean().item()
        return ~torch.isnan(rewards)

    # -- held-out evaluation ----------------------------------------------------------------------------------------

    @hookimpl
    def trl_ext_trainer_created(self, trainer):
        self.before = self.evaluate(trainer)

    @hookimpl
    def trl_ext_after_stage(self, stage, output_dir, trainer):
        from accelerate import PartialState

        from trl_ext.files import write_json_atomic

        after = self.evaluate(trainer)
        result = {env: {"before": self.before.get(env), "after": after[env]} for env in after}
        if PartialState().is_main_process and result:
            write_json_atomic(Path(output_dir) / "multi_env_eval.json", result)
            plot_environment_rewards(Path(output_dir) / "metrics.jsonl", Path(output_dir) / "multi_env.png",
                                     [e.name for e in self.params.environments])
        return {"multi_env_eval": result} if result else None

    def evaluate(self, trainer) -> dict[str, dict]:
        """Greedy held-out score of every environment that has an ``eval_dataset`` (main process; others: {}). Under
        ZeRO-3 or FSDP every rank evaluates in step, as the stage's own evaluation does
        (:func:`trl_ext.evaluation.evaluation_model`): the main process cannot run a sharded model alone."""
        from accelerate import PartialState

        from trl_ext.evaluation import evaluation_model

        main = PartialState().is_main_process
        with evaluation_model(trainer, main) as (model, evaluate_here):
            out = self._evaluate_environments(trainer, model) if evaluate_here else {}
        return out if main else {}

    def _evaluate_environments(self, trainer, model) -> dict[str, dict]:
        from trl_ext.evaluation import evaluate_generation, sampled_evaluation, training_reward_kwargs
        from trl_ext.host import PluginHost
        from trl_ext.rewards import collect_reward_functions, weighted_reward

        catalog = current_catalog()
        reward_kwargs = training_reward_kwargs(trainer)  # TRL's keywords, as in training
        tokenizer = trainer.processing_class
        out = {}
        for env in self.params.environments:
            if env.eval_dataset is None:
                continue
            from trl_ext.recipe import StageSpec

            probe = StageSpec(trainer="grpo", model="-", dataset=env.eval_dataset)
            plugins = [reward_plugin(catalog, s) for s in env.rewards]
            score = weighted_reward(collect_reward_functions(PluginHost(plugins), probe))
            data = _load(env.eval_dataset, catalog, probe)
            if self.params.uses_tools:
                from datasets import Dataset

                data = Dataset.from_list([self._routed_row({**row, ENV_COLUMN: env.name}) for row in data])
            if env.environment is not None:
                from trl_ext_plugins.rollout.tool_envs import evaluate_tool_environment, resolve_environment

                cls = resolve_environment(env.environment)
                out[env.name] = evaluate_tool_environment(
                    model, tokenizer, data, cls, score, max_new_tokens=self.params.eval_tool_max_new_tokens,
                    max_tool_calls=self.params.eval_max_tool_calls,
                    chat_template=getattr(trainer, "chat_template", None), reward_kwargs=reward_kwargs)
                continue
            out[env.name] = evaluate_generation(model, tokenizer, data, score,
                                                max_new_tokens=self.params.eval_max_new_tokens,
                                                batch_size=self.params.eval_batch_size,
                                                reward_kwargs=reward_kwargs)
            if self.params.eval_mean_at_k is not None:
                out[env.name].update(sampled_evaluation(
                    model, tokenizer, data, score, self.params.eval_mean_at_k, self.params.eval_temperature or 1.0,
                    seed=trainer.args.seed, max_new_tokens=self.params.eval_max_new_tokens,
                    batch_size=self.params.eval_batch_size, reward_kwargs=reward_kwargs))
        return out


def plot_environment_rewards(metrics_path: Path, out_png: Path, names: list[str]) -> Path | None:
    """One curve per environment: ``multi_env/<env>/reward`` against the step."""
    if not metrics_path.exists():
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from trl_ext.files import read_jsonl, save_figure_atomic

    records = read_jsonl(metrics_path)  # a torn last line (a killed run) is skipped
    figure, axes = plt.subplots(figsize=(6, 4))
    for name in names:
        key = f"multi_env/{name}/reward"
        points = [(r["step"], r[key]) for r in records if key in r]
        if points:
            axes.plot(*zip(*points), label=name)
    axes.set_xlabel("step")
    axes.set_ylabel("train reward")
    axes.legend()
    figure.tight_layout()
    save_figure_atomic(figure, out_png)
    plt.close(figure)
    return out_png


def _renders_tool_calls(tokenizer) -> bool:
    """TRL's two requirements on a tool-calling tokenizer: its chat template renders a tool-call exchange and TRL
    knows how to parse its responses (``add_response_schema``), unless the tokenizer already carries a parser."""
    import copy

    from trl.chat_template_utils import add_response_schema, supports_tool_calling

    if not supports_tool_calling(tokenizer):
        return False
    if getattr(tokenizer, "response_template", None) is not None or getattr(tokenizer, "response_schema", None):
        return True
    try:
        add_response_schema(copy.copy(tokenizer))
    except ValueError:
        return False
    return True


def _offline_tokenizer(model_ref: str):
    """The tokenizer of an embedded model or a local folder, without loading the model; ``None`` when it cannot be
    known before the run (hub ids, ``stage:`` references, models registered by other packages)."""
    from trl_ext.recipe import EMBEDDED_PREFIX

    if model_ref.startswith(EMBEDDED_PREFIX):
        from trl_ext.embedded.models import EMBEDDED_MODELS, embedded_tokenizer

        name = model_ref[len(EMBEDDED_PREFIX):]
        return embedded_tokenizer(name) if name in EMBEDDED_MODELS else None
    if Path(model_ref).is_dir():
        from transformers import AutoTokenizer

        try:
            return AutoTokenizer.from_pretrained(model_ref)
        except Exception:  # no tokenizer files: the runner reports that
            return None
    return None


def _per_row(value: Any, n: int) -> bool:
    """A per-row column of a reward call (a list, or a dataset column object), not a scalar, mapping or string."""
    return (not isinstance(value, (str, bytes, dict)) and hasattr(value, "__getitem__") and hasattr(value, "__len__")
            and len(value) == n)


def reward_plugin(catalog, selection: PluginSelection):
    """The reward plugin a selection names, built with its params; ``ValueError`` (one line: the plugin, or
    ``params.<field>``) for an unknown plugin, one that is no reward plugin, or bad params. Used by every plugin that
    takes a reward selection as a parameter (multi_env's environments, pass_rate_filter)."""
    from pydantic import ValidationError

    cls = catalog.resolve(selection.name).cls
    if "trl_ext_reward_functions" not in cls.implemented_hooks() or cls is MultiEnv:
        raise ValueError(f"plugin {selection.name!r} is not a reward plugin")
    try:
        return cls(cls.Params.model_validate(selection.params))
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(map(str, first["loc"]))
        raise ValueError(f"params.{where}: {validation_message(first)} (plugin {cls.name!r})") from None


def current_catalog():
    """The catalog of the run, or of the validation, in progress (the one the recipe is resolved against)."""
    from trl_ext.catalog import Catalog, validating_catalog
    from trl_ext.runner import current_run

    run = current_run()
    if run is not None:
        return run.catalog
    return validating_catalog() or Catalog.discover()


def _loadable_offline(spec: DatasetSpec) -> bool:
    """Embedded builders and local files can be checked at validation; hub datasets are checked when loaded."""
    from trl_ext.recipe import EMBEDDED_PREFIX

    return spec.source.startswith(EMBEDDED_PREFIX) or Path(spec.source).exists()


def _load(spec: DatasetSpec, catalog, stage):
    from trl_ext.runner import current_run, load_split
    from trl_ext.stage import load_local_file

    if current_run() is None and Path(spec.source).is_file():
        # Outside a run (validation, and `train` before its run starts) load_split has no output directory for
        # datasets' Arrow cache, which would go to ~/.cache/huggingface: read the file into memory instead.
        data = load_local_file(spec.source)
        return data.select(range(min(spec.limit, len(data)))) if spec.limit is not None else data
    return load_split(spec, catalog, stage, "train", None)
