"""``rejection_sampling``: sample K, keep what a verifier accepts, SFT, iterate (RFT / STaR / ReST-EM)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from pydantic import Field

from trl_ext import Plugin, PluginParams, hookimpl
from trl_ext_plugins.preference import generation as gen

logger = logging.getLogger("trl_ext.distill")


class RejectionSamplingParams(PluginParams):
    rounds: int = Field(3, ge=1, description="E-step/M-step iterations (ReST-EM: about 3). Each round trains the "
                                             "stage's `max_steps`.")
    k: int = Field(4, ge=1, description="Samples per prompt from the current policy (ReST-EM: 32 on MATH).")
    max_per_prompt: int | None = Field(10, ge=1, description="Cap on accepted samples kept per prompt (ReST-EM: "
                                                             "about 10), so easy prompts do not dominate; None: no cap.")
    dedupe: bool = Field(True, description="Keep one copy of identical accepted responses per prompt (RFT keeps "
                                           "distinct reasoning paths).")
    verifier: str = Field("exact_match", description="Reward plugin whose reward decides acceptance.")
    verifier_params: dict[str, Any] = Field(default_factory=dict, description="Parameters of the verifier plugin.")
    min_reward: float = Field(1.0, description="A sample is accepted when its reward is at least this.")
    restart_from_base: bool = Field(False, description="ReST-EM: fine-tune each round from the base model (the "
                                                       "stage's `model`) instead of continuing from the last round.")
    max_new_tokens: int = Field(64, gt=0, description="Generation length limit.")
    temperature: float = Field(1.0, gt=0, description="Sampling temperature (ReST-EM: 1.0).")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus mass.")
    batch_size: int = Field(64, gt=0, description="Prompts per generate() call.")
    seed: int = Field(0, description="Sampling seed (round r uses seed + r).")


def select_accepted(groups: list[list[str]], rewards: list[list[float | None]], min_reward: float,
                    max_per_prompt: int | None, dedupe: bool) -> list[tuple[int, str]]:
    """(prompt index, response) pairs kept: accepted, deduplicated per prompt if asked, at most ``max_per_prompt``
    per prompt, in sampling order. A prompt with no accepted sample contributes nothing."""
    kept = []
    for index, (texts, scores) in enumerate(zip(groups, rewards, strict=True)):
        seen, count = set(), 0
        for text, score in zip(texts, scores, strict=True):
            if score is None or not score >= min_reward or (dedupe and text in seen):  # NaN is no acceptance
                continue
            if max_per_prompt is not None and count >= max_per_prompt:
                break
            seen.add(text)
            count += 1
            kept.append((index, text))
    return kept


class RejectionSampling(Plugin):
    """Rejection-sampling fine-tuning: STaR (arXiv 2203.14465), RFT (arXiv 2308.01825), ReST-EM (arXiv 2312.06585).

    E-step: for each prompt of the stage's train split draw ``k`` responses from the current policy (temperature
    sampling, transformers generation) and keep ``D_r = {(x, y): R(x, y) >= min_reward}`` with the ``verifier``
    reward plugin, deduplicated and capped per prompt. M-step: the stage's SFT loss on ``D_r`` (``max_steps`` steps
    with the stage's arguments). Round 1 runs as the stage itself (its dataset is built from the stage's model);
    rounds 2.. run after it, each sampling from the model the previous round produced and training from it, or from
    the base model with ``restart_from_base`` (ReST-EM), and the final round's model is the stage's output. Under
    ``peft:`` every round trains what round 1 trains: the stage's PEFT method on a fresh adapter over the base model
    (``restart_from_base``) or the same adapter further; every round's model is saved as the runner saves the stage
    (``adapter/``, and the merged model at the top when the runner wrote one), so the stage folder ends as a one-round
    stage's would. Round r's checkpoints go to ``<stage>/checkpoints/round-<r>``. The
    acceptance rate (accepted / (prompts x k), before cap and dedupe) and the kept count of every round go to the
    stage summary, ``<stage>/rejection_sampling.json`` and ``<stage>/rejection_sampling.png``. Defaults: 3 rounds,
    cap 10 (ReST-EM), dedupe on (RFT), ``k = 4`` (small for CPU; the paper used 32). A round with nothing accepted is
    an error naming the round. On several processes the main process's round dataset is every rank's (sampling and
    the verifier need not agree across ranks); round 1 is sampled on the main process only, later rounds on every rank
    (a ZeRO-3/FSDP-sharded policy generates only with every rank taking part), keeping the main process's rows.
    """

    name = "rejection_sampling"
    aliases = ("rft", "rest_em")
    family = "distill"
    trainers = frozenset({"sft"})
    Params = RejectionSamplingParams

    def __init__(self, params=None):
        super().__init__(params)
        self.history: list[dict[str, Any]] = []
        self._base: str | None = None
        self._prompts = None

    @hookimpl
    def trl_ext_prepare_dataset(self, dataset, split, stage):
        if split != "train":
            return None
        if "prompt" not in dataset.column_names:
            raise ValueError(f"rejection_sampling: the train dataset has no 'prompt' column "
                             f"(has: {', '.join(dataset.column_names)})")
        self._prompts = dataset.remove_columns([c for c in ("completion",) if c in dataset.column_names])
        self._base = gen.resolve_model(stage.model, self.name)
        # The main process samples and verifies; every rank trains on its rows (a verifier's timeouts or sampling need
        # not agree across ranks).
        data, figures = gen.on_main_process(lambda: self.e_step(*gen.load_policy(self._base), round_index=1), self.name)
        self.history = [figures]
        return data

    def e_step(self, model, tokenizer, round_index: int):
        """Sample, verify, select: the round's SFT dataset and its figures."""
        from datasets import Dataset

        p = self.params
        prompts = list(self._prompts["prompt"])
        groups = gen.sample_completions(model, tokenizer, prompts, num_samples=p.k, max_new_tokens=p.max_new_tokens,
                                        do_sample=True, temperature=p.temperature, top_p=p.top_p,
                                        batch_size=p.batch_size, seed=p.seed + round_index)
        score = gen.reward_function_from_plugin(p.verifier, p.verifier_params)
        columns = {c: [v for v in self._prompts[c] for _ in range(p.k)] for c in self._prompts.column_names
                   if c != "prompt"}
        flat = score(prompts=[x for x in prompts for _ in range(p.k)],
                     completions=[gen.as_completion(x, t) for x, g in zip(prompts, groups) for t in g], **columns)
        rewards = [flat[i * p.k:(i + 1) * p.k] for i in range(len(prompts))]
        accepted = sum(r is not None and r >= p.min_reward for r in flat)
        kept = select_accepted(groups, rewards, p.min_reward, p.max_per_prompt, p.dedupe)
        figures = {"round": round_index, "acceptance_rate": accepted / max(len(flat), 1), "kept": len(kept),
                   "prompts_with_a_kept_sample": len({i for i, _ in kept})}
        logger.info("rejection_sampling round %d: acceptance %.3f, kept %d", round_index,
                    figures["acceptance_rate"], len(kept))
        if not kept:
            raise ValueError(f"rejection_sampling: round {round_index}: the verifier {p.verifier!r} accepted none of "
                             f"the {len(flat)} samples")
        rows = [{**self._prompts[i], "completion": gen.as_completion(self._prompts[i]["prompt"], text)}
                for i, text in kept]
        return Dataset.from_list(rows), figures

    @hookimpl
    def trl_ext_after_stage(self, stage, output_dir, trainer):
        from accelerate import PartialState

        from trl_ext.runner import save_stage_model
        from trl_ext.stage import build_peft_config

        stage_dir = Path(output_dir)
        # Round 1's trainer writes to the stage's checkpoints folder; every later round's sits beside the others in it.
        checkpoints = Path(trainer.args.output_dir)
        # The runner has just saved round 1 with save_stage_model; later rounds save the same way. Whether it wrote a
        # merged copy (runner.wants_merged_copy, which needs the whole recipe) shows in the folder: a merged or full
        # model has its config.json at the top, an adapter-only save keeps everything under adapter/.
        merged = (stage_dir / "config.json").is_file()
        for round_index in range(2, self.params.rounds + 1):
            model = trainer.accelerator.unwrap_model(trainer.model)
            data, figures = gen.on_main_process(lambda: self.e_step(model, trainer.processing_class, round_index),
                                                self.name, every_rank_runs=True)
            self.history.append(figures)
            if self.params.restart_from_base:
                # A fresh start from the base weights: wrap them in the stage's PEFT method again, as the runner did
                # for round 1 (without it the whole model would be fine-tuned).
                start, peft_config = self._base, build_peft_config(stage.peft)
            else:
                # A PeftModel keeps training its adapter (TRL refuses a second peft_config on one).
                start, peft_config = model, None
            trainer = next_round_trainer(trainer, start, data, round_index, checkpoints, peft_config)
            trainer.train()
            # Not trainer.save_model: under PEFT it would drop adapter files at the top, next to round 1's merged
            # model and adapter/.
            save_stage_model(trainer, trainer.processing_class, stage_dir, is_main=PartialState().is_main_process,
                             merged=merged)
        if PartialState().is_main_process:
            write_history(Path(output_dir), self.history)
        return {"rejection_sampling": self.history}


def next_round_trainer(previous, model, dataset, round_index: int, checkpoints, peft_config=None):
    """A fresh SFT trainer of the same kind and arguments on ``dataset``, starting from ``model`` (a path restarts
    from those weights; a module continues from it), wrapped in ``peft_config`` when given. Its checkpoints go to
    ``<checkpoints>/round-<r>`` (``checkpoints``: the stage's checkpoints folder, not the previous round's, which
    would nest the rounds) so the runner's resume logic only ever sees round 1's; the stage's metrics file is left to
    round 1 (the rounds' figures are in ``rejection_sampling.json``)."""
    import copy

    args = copy.deepcopy(previous.args)
    args.output_dir = str(Path(checkpoints) / f"round-{round_index}")
    return type(previous)(model=model, args=args, train_dataset=dataset, processing_class=previous.processing_class,
                          peft_config=peft_config, plugin_host=previous.plugin_host)


def write_history(directory: Path, history: list[dict[str, Any]]) -> None:
    from matplotlib.figure import Figure

    from trl_ext.files import save_figure_atomic

    from trl_ext.files import write_json_atomic

    write_json_atomic(directory / "rejection_sampling.json", history)
    figure = Figure(figsize=(5, 3.5), layout="constrained")
    axes = figure.subplots()
    axes.plot([h["round"] for h in history], [h["acceptance_rate"] for h in history], marker="o")
    axes.set_xlabel("round")
    axes.set_ylabel("acceptance rate")
    axes.set_ylim(0, 1)
    axes.set_title("rejection sampling: verifier acceptance per round")
    save_figure_atomic(figure, directory / "rejection_sampling.png")
