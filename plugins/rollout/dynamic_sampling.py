"""``dynamic_sampling``: DAPO's dynamic sampling: drop zero-variance groups and refill the batch with new prompts."""

from __future__ import annotations

from typing import Literal

import numpy as np
import torch
from pydantic import Field

from trl_ext import Plugin, PluginParams, Slot, hookimpl
from trl_ext_plugins.rollout.math import group_has_signal, nonzero_variance_groups, select_groups

LEFT_PADDED = ("prompt_ids", "prompt_mask")  # every other (B, T) tensor of TRL's rollout dict is right-padded
TOKEN_IDS = ("prompt_ids", "completion_ids")  # padded with the pad token; everything else with 0
RECOMPUTED = ("num_items_in_batch", "kept_row_fraction")  # scalars over the whole batch: recomputed after the merge


class DynamicSamplingParams(PluginParams):
    max_rounds: int = Field(10, ge=1, description="Most generation rounds per generation batch, the first one "
                                                  "included (verl filter_groups.max_num_gen_batches; DAPO's recipe: "
                                                  "10). 1 = filter only. When reached, the batch is completed with "
                                                  "dropped groups, masked out.")
    round_prompts: int | None = Field(None, ge=1, description="Prompts per generation round over all ranks (verl "
                                      "data.gen_batch_size; DAPO's recipe: 3x the train batch); the target stays the "
                                      "trainer's generation batch (verl train_batch_size). null: the generation "
                                      "batch's own prompt count. round_prompts * num_generations must divide evenly "
                                      "over the processes.")
    on_cap: Literal["mask", "error"] = Field(
        "mask", description="When max_rounds rounds still hold fewer groups with a signal than the batch has room for. "
        "mask: train what was kept, the batch completed with dropped groups, masked out (the default); error: stop "
        "training with an error, as verl's DAPO trainer does at filter_groups.max_num_gen_batches (DAPO itself samples "
        "until the batch is full).")
    metric: str | None = Field(None, description="Reward function whose within-group variance decides (a reward "
                                                 "name of the stage, e.g. exact_match, as DAPO filters on accuracy); "
                                                 "null: the weighted total reward the advantages use.")


class DynamicSampling(Plugin):
    """Dynamic sampling (DAPO, Yu et al. 2025, arXiv 2503.14476; ALGORITHMS.md item 47).

    Groups whose rewards all agree (std = 0, e.g. all correct or all wrong) have zero group-normalised advantage and
    carry no gradient. This plugin drops them and generates further rounds of new prompts until the generation batch
    again holds as many groups with a learning signal as it has room for, or until ``max_rounds`` rounds (default 10,
    the first included) have run; then it keeps what there is and completes the batch with dropped groups, masked out
    (``on_cap: mask``, the default), or raises (``on_cap: error``, verl's behaviour at ``max_num_gen_batches``; DAPO's
    paper samples until the batch is full, i.e. no cap).

    Conventions chosen:

    * the filter is a ``trl_ext_filter_groups`` mask (``0 < std``, NaN rewards ignored, "zero" as TRL's
      ``frac_reward_zero_std`` tests it), so dropped or left-over groups get zero advantage and a zero completion mask:
      they leave every token-count denominator (ALGORITHMS.md convention 8: masking, not zero-weighting). Another
      plugin's filter ANDs with it, and refilling continues until enough groups pass all filters (a group counts if
      any of its samples is kept). Filtering and refilling apply in training only;
    * the target is the trainer's generation batch (verl's ``train_batch_size``); a round has ``round_prompts``
      prompts (verl's ``gen_batch_size``), by default the target's own size (verl's default, equal sizes). The first
      round is the data loader's batch; with ``round_prompts`` larger than the target it is completed to
      ``round_prompts`` by one extra generation of drawn prompts (so every round has ``round_prompts`` prompts, as in
      verl); with a smaller one only the refill rounds are smaller (the loader's batch is never cut). Surplus groups of
      the last round are discarded, as verl does. Advantages are computed per generation (group normalisation is
      within a group, so the merge does not change them; with ``scale_rewards: batch`` the batch std is that
      generation's);
    * new prompts are drawn from the trainer's ``train_dataset`` (a map-style dataset), uniformly without replacement
      within a round, from a generator seeded by ``(args.seed, trainer micro-step, round)``: the same prompts on every
      rank, reproducible (a resumed run draws what the uninterrupted run drew: the micro-step is counted from the
      restored ``global_step``), independent of the data loader's position (refill prompts may repeat prompts seen
      elsewhere);
    * the number of rounds is decided from the gathered keep mask, so every rank runs the same rounds; a refilled batch
      is merged through all-gathers of each rollout tensor and every rank keeps its own slice, so batch sizes do not
      change on any rank. Cost: each round runs TRL's whole scoring (generation, rewards, and the old-policy / reference
      forwards when configured) and a refilled batch is gathered on every rank once. Multimodal rollouts are refused.

    Logged per generation batch: ``dynamic_sampling/rounds``, ``dynamic_sampling/prompts`` (prompts generated, all
    ranks), ``dynamic_sampling/kept_groups_fraction`` (groups of the final batch with a signal) and
    ``dynamic_sampling/cap_hit``.
    """

    name = "dynamic_sampling"
    family = "rollout"
    trainers = frozenset({"grpo"})
    slots = frozenset({Slot.REFILL})
    Params = DynamicSamplingParams

    def __init__(self, params=None):
        super().__init__(params)
        self.history: list[dict[str, float]] = []  # one record per generation batch (what is logged)

    @hookimpl
    def trl_ext_validate_stage(self, stage, plugins):
        generations = stage.args.get("num_generations", 8)  # TRL's default
        if generations is not None and generations < 2:
            return [f"plugin {self.name!r}: args.num_generations must be at least 2 (a group of one has no variance)"]
        return None

    @hookimpl
    def trl_ext_filter_groups(self, rewards, batch):
        if batch.trainer is not None and not batch.trainer.model.training:
            return None
        values = rewards
        if self.params.metric is not None:
            if self.params.metric not in batch.reward_names:
                raise ValueError(f"plugin {self.name!r}: metric {self.params.metric!r} is not a reward function of "
                                 f"this stage ({', '.join(batch.reward_names)})")
            values = batch.rewards_per_func[:, batch.reward_names.index(self.params.metric)]
        groups = nonzero_variance_groups(values, batch.num_generations)
        return groups.repeat_interleave(batch.num_generations)

    @hookimpl
    def trl_ext_refill_groups(self, trainer, inputs, score):
        G = trainer.num_generations
        rounds = [score(inputs)]
        if rounds[0][1] is None:  # no filter answered (cannot happen in training): nothing to refill
            return rounds[0][0]
        needed = rounds[0][1].numel() // G
        size = self.params.round_prompts or needed
        signal = [group_has_signal(rounds[0][1], G)]
        prompts = needed
        if size > needed:  # the first round is the loader's batch plus drawn prompts up to round_prompts
            rounds.append(score(self._new_rows(trainer, inputs, 0, size - needed)))
            signal.append(group_has_signal(rounds[-1][1], G))
            prompts = size
        round_count = 1
        while sum(int(s.sum()) for s in signal) < needed and round_count < self.params.max_rounds:
            rounds.append(score(self._new_rows(trainer, inputs, len(rounds), size)))
            signal.append(group_has_signal(rounds[-1][1], G))
            round_count, prompts = round_count + 1, prompts + size
        chosen = select_groups(signal, needed)
        kept = sum(int(signal[r][g]) for r, g in chosen)
        if kept < needed and self.params.on_cap == "error":  # kept comes from gathered masks: every rank raises
            raise RuntimeError(f"plugin {self.name!r}: {round_count} generation rounds ({prompts} prompts) found "
                               f"{kept} of the {needed} groups with reward variance the batch needs (on_cap: error, "
                               "as verl); raise max_rounds, use easier prompts, or set on_cap: mask")
        record = {"dynamic_sampling/rounds": round_count, "dynamic_sampling/prompts": prompts,
                  "dynamic_sampling/kept_groups_fraction": kept / needed,
                  "dynamic_sampling/cap_hit": float(kept < needed)}
        self.history.append(record)
        trainer._log_plugin_metrics(record)
        if len(rounds) == 1:  # nothing to merge: dropped groups are already masked by the host
            return rounds[0][0]
        kept_rows = sum(int(rounds[r][1][g * G:(g + 1) * G].sum()) for r, g in chosen)
        return merge_rounds(trainer, [output for output, _ in rounds], chosen, G, len(inputs),
                            kept_rows / (len(chosen) * G))

    def _new_rows(self, trainer, inputs, round_index, n_prompts=None):
        """This rank's slice of a fresh generation of ``n_prompts`` prompts (default: as many as the generation batch)
        drawn identically on every rank, each repeated G times, laid out as TRL's sampler shards a generation batch
        (rank r holds global rows [r*b, (r+1)*b), b = n_prompts * G / processes)."""
        dataset = trainer.train_dataset
        if not hasattr(dataset, "__len__") or not hasattr(dataset, "__getitem__"):
            raise RuntimeError(f"plugin {self.name!r} refills from a map-style train dataset (not an iterable one)")
        G, acc = trainer.num_generations, trainer.accelerator
        n_prompts = len(inputs) * acc.num_processes // G if n_prompts is None else n_prompts
        if (n_prompts * G) % acc.num_processes:
            raise ValueError(f"plugin {self.name!r}: a generation of {n_prompts} prompts x {G} samples does not divide "
                             f"over {acc.num_processes} processes; choose params.round_prompts so that it does")
        per_rank = n_prompts * G // acc.num_processes
        rng = np.random.default_rng([int(trainer.args.seed), micro_step(trainer), round_index])
        picks = rng.choice(len(dataset), size=n_prompts, replace=n_prompts > len(dataset)).tolist()
        columns = list(inputs[0])  # the columns the data loader delivered
        rows = [{key: row[key] for key in columns} for row in (dataset[i] for i in picks) for _ in range(G)]
        start = acc.process_index * per_rank
        return rows[start:start + per_rank]


def micro_step(trainer) -> int:
    """The trainer's micro-step counter as an uninterrupted run has it, also after a resume.

    TRL's ``_step`` counts this session's micro-steps and restarts at 0 when training resumes from a checkpoint (its
    ``global_step`` is restored, ``_step`` is not), so seeding with it would draw the first steps' prompts again. A
    checkpoint lies on an optimizer-step boundary, so ``global_step`` accumulation steps plus this session's position
    inside the current accumulation equals ``_step`` of the run that was never interrupted.
    """
    accumulation = int(trainer.args.gradient_accumulation_steps)
    return int(trainer.state.global_step) * accumulation + int(trainer._step) % accumulation


def merge_rounds(trainer, outputs: list[dict], chosen: list[tuple[int, int]], num_generations: int,
                 local_size: int, kept_row_fraction: float = 1.0) -> dict:
    """Assemble the chosen ``(round, group)`` groups of several rounds' rollout dicts into this rank's slice.

    ``kept_row_fraction`` is the share of the chosen rows the group filters kept (left-over groups that complete a
    batch at ``max_rounds`` are masked), written as the merged batch's ``kept_row_fraction``.

    Every tensor is gathered from all ranks (padded to a common width, left for prompt tensors, right otherwise; a
    tensor over the ``P + C`` positions of the model input is split there and each side padded as its kind, with 0),
    rounds are padded to a common width and stacked, the chosen groups' rows are taken in order, and this rank keeps
    rows ``[rank * local_size, (rank + 1) * local_size)``. Collective calls happen in sorted key order on every rank.
    """
    acc = trainer.accelerator
    pad_id = trainer._tokenizer.pad_token_id
    keys = sorted(outputs[0])
    for output in outputs[1:]:
        if sorted(output) != keys:
            raise RuntimeError(f"dynamic_sampling: rounds returned different keys ({keys} vs {sorted(output)})")
    mine = None
    merged = {}
    for key in keys:
        if key in RECOMPUTED:
            continue
        if not all(isinstance(o[key], torch.Tensor) and o[key].dim() >= 1 for o in outputs):
            raise RuntimeError(f"dynamic_sampling cannot merge rollout field {key!r} (multimodal rollouts are not "
                               f"supported)")
        value = pad_id if key in TOKEN_IDS else 0
        if key not in LEFT_PADDED + TOKEN_IDS and all(_model_input_layout(o, o[key]) for o in outputs):
            # (B, P + C, ...): prompt columns left-padded, completion columns right-padded (e.g. routing_replay's
            # routes); each side is merged as its own tensor, or rounds with other prompt widths would be shifted
            widths = [o["prompt_ids"].size(1) for o in outputs]
            sides = [([o[key][:, :w] for o, w in zip(outputs, widths)], True),
                     ([o[key][:, w:] for o, w in zip(outputs, widths)], False)]
        else:
            sides = [([o[key] for o in outputs], key in LEFT_PADDED)]
        merged_sides = []
        for tensors, left in sides:
            parts = [_gather_rows(acc, t, left, value) for t in tensors]
            if mine is None:  # rounds may differ in size: each round's rows start after the previous rounds' rows
                starts = [0]
                for part in parts[:-1]:
                    starts.append(starts[-1] + part.size(0))
                rows = torch.tensor([starts[r] + g * num_generations + j for r, g in chosen
                                     for j in range(num_generations)])
                mine = rows[acc.process_index * local_size:(acc.process_index + 1) * local_size]
            if parts[0].dim() >= 2:
                width = max(p.size(1) for p in parts)
                parts = [_pad_width(p, width, left, value) for p in parts]
            merged_sides.append(torch.cat(parts)[mine.to(parts[0].device)])
        merged[key] = torch.cat(merged_sides, dim=1) if len(merged_sides) > 1 else merged_sides[0]
    loss_mask = merged["completion_mask"] * merged.get("tool_mask", 1)
    merged["num_items_in_batch"] = acc.gather(loss_mask.sum()).sum()
    if kept_row_fraction < 1.0:
        merged["kept_row_fraction"] = torch.tensor(kept_row_fraction, device=loss_mask.device)
    return merged


def _model_input_layout(output: dict, tensor: torch.Tensor) -> bool:
    """``tensor`` spans the prompt and completion positions of the model input (``P + C`` columns, ``P > 0``)."""
    prompt = output["prompt_ids"].size(1)
    return prompt > 0 and tensor.dim() >= 2 and tensor.size(1) == prompt + output["completion_ids"].size(1)


def _gather_rows(acc, tensor: torch.Tensor, left: bool, value) -> torch.Tensor:
    if tensor.dim() >= 2:
        tensor = acc.pad_across_processes(tensor, dim=1, pad_index=value, pad_first=left)
    return acc.gather(tensor)


def _pad_width(tensor: torch.Tensor, width: int, left: bool, value) -> torch.Tensor:
    missing = width - tensor.size(1)
    if missing == 0:
        return tensor
    pad = tensor.new_full((tensor.size(0), missing, *tensor.shape[2:]), value)
    return torch.cat([pad, tensor] if left else [tensor, pad], dim=1)
