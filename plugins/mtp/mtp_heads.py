"""``mtp_heads``: retrain the multi-token-prediction heads on the policy's own samples after RL ("MTP healing")."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import Field

from trl_ext import Plugin, PluginParams, hookimpl
from trl_ext.recipe import DatasetSpec, StageSpec

SAMPLES_FILE = "mtp_samples.jsonl"
FIGURES_FILE = "mtp_acceptance.json"
PLOT_FILE = "mtp_acceptance.png"
BEFORE_PREFIX = ".mtp-before-"  # the starting model, saved for the "before" measurement


class MtpHeadsParams(PluginParams):
    completions: Literal["sample", "dataset"] = Field(
        "sample", description="sample: train on completions sampled from the stage's policy for the dataset's "
        "prompts (cached in the stage folder); dataset: use the dataset's own completion / completion_ids column "
        "(e.g. completions cached from the RL stage)")
    samples_per_prompt: int = Field(4, gt=0, description="completions sampled per training prompt")
    max_new_tokens: int = Field(16, gt=0, description="tokens per sampled completion")
    temperature: float = Field(1.0, gt=0, description="sampling temperature (1.0: the policy's own distribution, "
                               "the one the heads should match)")
    batch_size: int = Field(64, gt=0, description="prompts per sampling batch")
    heads_from: str | None = Field(None, description="start from the MTP heads of this checkpoint (`stage:<name>`, "
                                   "`embedded:<name>`, a folder or a hub id; same architecture), e.g. the pre-RL "
                                   "stage whose heads went stale; None: the stage model's own heads, or fresh ones")
    held_out: DatasetSpec = Field(description="held-out prompts (a `prompt` column) for the acceptance measurement")
    acceptance_prompts: int = Field(64, gt=0, description="held-out prompts decoded per acceptance measurement")
    # The first new token comes from the prefill and each verification step keeps the trunk's own token after its
    # accepted drafts, so below 3 no draft can ever be kept and every acceptance figure would be undefined.
    acceptance_max_new_tokens: int = Field(16, ge=3, description="max new tokens per held-out decode (at least 3: "
                                           "the first comes from the prefill, and a step's draft counts only when "
                                           "the trunk's token after it also fits)")
    acceptance_sampling: bool = Field(False, description="False: greedy decoding, a draft is accepted when it equals "
                                      "the trunk's argmax; True: speculative sampling at `temperature`")


class MtpHeads(Plugin):
    """MTP healing: after RL, retrain only the multi-token-prediction heads, trunk frozen, on the policy's samples.

    Paper: Nemotron 3 Super (NVIDIA 2026, arXiv 2604.12374), the last post-training stage after RLVR / SWE-RL / RLHF;
    MTP design: DeepSeek-V3 (arXiv 2412.19437). RL moves the policy's distribution, so the draft heads used for
    speculative decoding stop matching it and acceptance falls; retraining the heads on the policy's own behaviour
    restores it without touching the policy.

    Runs on the ``mtp`` trainer (trl_ext/trainers/mtp.py), which holds the model side: transformers' native
    ``MtpModel`` / ``MtpLayer`` heads (existing ones loaded, fresh ones initialised by the family's ``_init_weights``),
    every trunk parameter frozen (embeddings, layers, final norm, the shared LM head), the trunk forward without
    gradient, and a checkpoint that ``AutoModelForCausalLM`` loads unchanged with the heads as the decoder layers after
    ``num_hidden_layers`` for ``generate(use_mtp=True)``. Its ``args.mtp_loss`` is ``soft`` by default: cross-entropy
    against the detached policy's next-token distribution at the shifted positions (speculative sampling accepts with
    probability sum_v min(p, q), which rises as the draft distribution q approaches the policy's p; every position
    contributes a full distribution instead of one sampled token); ``hard`` is the paper's SFT-style cross-entropy on
    the realised next token (DeepSeek-V3's MTP loss). Both are token means per depth, averaged over depths.

    This plugin adds:

    * the data: ``samples_per_prompt`` completions per training prompt sampled from the stage's policy at
      ``temperature`` (1.0 by default: the policy's own distribution), written to ``mtp_samples.jsonl`` in the stage
      folder (headed by a key of model, prompts and sampling settings) and reused by a rerun with the same key; or
      ``completions: dataset`` to train on the dataset's cached completions;
    * ``heads_from``: start from another checkpoint's heads (a stage saves only its trunk, so the heads trained
      before RL are read from the stage that trained them);
    * acceptance length (mean accepted draft tokens per verification step) measured with transformers' own MTP
      drafting on ``acceptance_prompts`` held-out prompts, greedy by default (deterministic): for the ``heads_from``
      checkpoint as saved (its own trunk: e.g. before RL), for the stage's starting point (this trunk with the starting
      heads: after RL, before healing) and for the saved result (after healing). Written to the stage summary
      (``mtp_acceptance_*``), ``mtp_acceptance.json`` and the bar chart ``mtp_acceptance.png``; a measurement in which
      no step carried a draft (e.g. every held-out decode ended at once) reports ``None`` / null, not 0.

    A model class without MTP support (no ``num_mtp_layers`` in its config, or MTP weights transformers would not
    find at the layers after ``num_hidden_layers``) is refused naming the class: at validation when the model is
    embedded or a local folder, else by the trainer before training. DeepSpeed ZeRO-3 is refused the same way (the
    trainer's frozen trunk would be partitioned outside the engine); under DDP and ZeRO-2 the main process writes the
    starting copy with the trainer's own writer, since before training DeepSpeed has no engine for ``save_model``.
    """

    name = "mtp_heads"
    aliases = ("mtp_healing",)
    family = "mtp"
    trainers = frozenset({"mtp"})
    Params = MtpHeadsParams

    def __init__(self, params=None):
        super().__init__(params)
        self._figures: dict[str, Any] = {}
        self._stage: StageSpec | None = None

    # -- data -----------------------------------------------------------------------------------------------------

    @hookimpl
    def trl_ext_prepare_dataset(self, dataset, split: str, stage: StageSpec):
        self._stage = stage  # the later hooks get the trainer only
        if self.params.completions == "dataset" or split != "train":
            return None
        from accelerate import PartialState

        from trl_ext.runner import current_run, resolve_model_ref

        ctx = current_run()
        if ctx is None:
            raise RuntimeError("mtp_heads samples completions inside a recipe run (trl-ext train)")
        cache = ctx.output_dir / stage.name / SAMPLES_FILE
        prompts, seed = list(dataset["prompt"]), ctx.recipe.seed or 0
        # A rerun reuses the samples only if they were drawn from the same model, prompts and sampling settings.
        key = _sampling_key(stage.model, prompts, self.params, seed)
        with PartialState().main_process_first():
            rows = _read_jsonl(cache) if cache.exists() else []
            if not rows or rows[0].get("key") != key:
                rows = [{"key": key}] + sample_completions(resolve_model_ref(stage.model, ctx), prompts, self.params,
                                                           seed=seed)
                _write_jsonl(cache, rows)
        from datasets import Dataset

        return Dataset.from_list(rows[1:])

    # -- before training ------------------------------------------------------------------------------------------

    @hookimpl
    def trl_ext_trainer_created(self, trainer) -> None:
        from accelerate import PartialState

        from trl_ext.runner import current_run, resolve_model_ref
        from trl_ext.trainers.mtp import save_with_heads

        ctx = current_run()
        heads_from = resolve_model_ref(self.params.heads_from, ctx) if ctx and self.params.heads_from else \
            self.params.heads_from
        if heads_from:
            trainer.load_heads(heads_from)
        if PartialState().is_main_process:
            prompts = self._held_out_prompts(ctx)
            if heads_from:
                self._figures["heads_from"] = self._measure(heads_from, prompts, trainer.args.seed)
            # The starting model is saved inside the stage's own folder, never the system temp directory; a copy
            # left by a run killed here is removed when the stage starts again.
            scratch = Path(trainer.args.output_dir)
            scratch.mkdir(parents=True, exist_ok=True)
            for stale in scratch.glob(f"{BEFORE_PREFIX}*"):
                shutil.rmtree(stale, ignore_errors=True)
            # The trainer's own writer, not save_model: before training DeepSpeed has no engine yet, and save_model's
            # DeepSpeed path (ZeRO-2 included) failed on the bare heads ('MtpModel' has no 'save_checkpoint').
            with tempfile.TemporaryDirectory(dir=scratch, prefix=BEFORE_PREFIX) as tmp:
                save_with_heads(trainer.policy, trainer.heads, tmp, trainer.processing_class)
                self._figures["before"] = self._measure(tmp, prompts, trainer.args.seed)
        PartialState().wait_for_everyone()

    # -- after training ---------------------------------------------------------------------------------------------

    @hookimpl
    def trl_ext_after_stage(self, stage: StageSpec, output_dir: str, trainer) -> dict[str, Any] | None:
        from accelerate import PartialState

        from trl_ext.runner import current_run, write_json_atomic

        if not PartialState().is_main_process:
            return None
        from trl_ext_plugins.mtp.acceptance import plot_acceptance

        prompts = self._held_out_prompts(current_run())
        figures = dict(self._figures)
        figures["after"] = self._measure(output_dir, prompts, trainer.args.seed)
        labels = {"heads_from": f"heads_from\n({self.params.heads_from})", "before": "before\n(start of stage)",
                  "after": "after\n(end of stage)"}
        plot = plot_acceptance({labels[k]: v for k, v in figures.items()}, Path(output_dir) / PLOT_FILE,
                               title=f"MTP acceptance, stage {stage.name!r}")
        write_json_atomic(Path(output_dir) / FIGURES_FILE, {k: v.as_dict() for k, v in figures.items()})
        # None (no drafted step, see acceptance.summarize) stays None: the summary is JSON, null says "undefined".
        summary: dict[str, Any] = {f"mtp_acceptance_{k}": _rounded(v.acceptance_length) for k, v in figures.items()}
        summary.update({f"mtp_acceptance_rate_{k}": _rounded(v.acceptance_rate) for k, v in figures.items()})
        summary["mtp_acceptance_plot"] = str(plot)
        return summary

    # -- helpers ------------------------------------------------------------------------------------------------------

    def _held_out_prompts(self, ctx) -> list:
        from trl_ext.runner import load_split

        dataset = load_split(self.params.held_out, ctx.catalog, self._stage, "evaluation", None)
        return list(dataset["prompt"][: self.params.acceptance_prompts])

    def _measure(self, folder, prompts, seed):
        from trl_ext_plugins.mtp.acceptance import measure_acceptance

        return measure_acceptance(folder, prompts, max_new_tokens=self.params.acceptance_max_new_tokens,
                                  do_sample=self.params.acceptance_sampling, temperature=self.params.temperature,
                                  seed=seed)


@torch.no_grad()
def sample_completions(model_dir: str, prompts: list, params: MtpHeadsParams, seed: int) -> list[dict[str, Any]]:
    """``samples_per_prompt`` completions per prompt from the policy in ``model_dir`` (left-padded batches), each
    cut after its first eos; rows hold the prompt and completion token ids and texts."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trl_ext_plugins.mtp.acceptance import prompt_ids

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    rows = []
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for start in range(0, len(prompts), params.batch_size):
            chunk = prompts[start: start + params.batch_size]
            encoded = [prompt_ids(tokenizer, p) for p in chunk]
            width = max(len(e) for e in encoded)
            ids = torch.tensor([[pad] * (width - len(e)) + e for e in encoded])
            attention = torch.tensor([[0] * (width - len(e)) + [1] * len(e) for e in encoded])
            out = model.generate(ids, attention_mask=attention, do_sample=True, temperature=params.temperature,
                                 top_k=0, top_p=1.0, max_new_tokens=params.max_new_tokens, pad_token_id=pad,
                                 num_return_sequences=params.samples_per_prompt)
            for i, sequence in enumerate(out[:, width:].tolist()):
                cut = next((j + 1 for j, token in enumerate(sequence) if token in eos), len(sequence))
                completion = sequence[:cut]
                prompt = chunk[i // params.samples_per_prompt]
                rows.append({"prompt": prompt if isinstance(prompt, str) else json.dumps(prompt),
                             "prompt_ids": encoded[i // params.samples_per_prompt], "completion_ids": completion,
                             "completion": tokenizer.decode(completion)})
    return rows


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


def _sampling_key(model: str, prompts: list, params: MtpHeadsParams, seed: int) -> str:
    import hashlib

    fields = params.model_dump(mode="json", include={"samples_per_prompt", "max_new_tokens", "temperature"})
    blob = json.dumps([model, prompts, fields, seed], sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _write_jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
    from trl_ext.files import write_text_atomic

    write_text_atomic(path, "".join(json.dumps(r) + "\n" for r in rows))


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
