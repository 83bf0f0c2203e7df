"""``partial_rollout``: stop generating once a fraction lambda of the batch has finished; resume the rest next step."""

from __future__ import annotations

import copy
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

import torch
from pydantic import Field, model_validator
from transformers import StoppingCriteria, StoppingCriteriaList, TrainerCallback

from trl_ext import Need, Plugin, PluginParams, Slot, hookimpl
from trl_ext.batches import TokenWeights
from trl_ext.files import write_text_atomic
from trl_ext_plugins.rollout.control_math import finish_target, stale_token_mask, versions_per_trajectory
from trl_ext_plugins.rollout.math import trained_group_rewards
from trl_ext_plugins.rollout.rollout_logprobs import generate_single_turns_with, recording_logprobs

STALE_KEY = "partial_rollout_stale"  # RolloutBatch.loss_extras key: 1.0 on tokens of an older policy version
BUFFER_FILE = "partial_rollout_rank{rank}.json"


class PartialRolloutParams(PluginParams):
    finish_fraction: float = Field(0.75, gt=0.0, le=1.0, description="lambda: generation stops once ceil(lambda * N) "
                                   "of the N trajectories this rank is generating have finished (EOS or "
                                   "max_completion_length). 1 = plain generation. Lower saves more decoding steps "
                                   "and defers more groups: see the measured trade-off in the plugin docstring.")
    stop_unit: Literal["trajectories", "groups"] = Field(
        "trajectories", description="What lambda counts. trajectories: ceil(lambda * N) of the N trajectories this "
        "call generates have finished (the default, ALGORITHMS.md's wording); groups: ceil(lambda * "
        "P) of the call's P prompt groups are complete, every member finished (slime's partial rollout, the code "
        "behind APRIL, which stops once rollout_batch_size whole groups are done). groups defers fewer groups per "
        "step and stops later: see the plugin docstring.")
    mask_offpolicy: bool = Field(False, description="Give tokens sampled by an older policy version zero loss weight "
                                 "(slime's --mask-offpolicy-in-partial-rollout); false keeps them, corrected only by "
                                 "importance-sampling plugins through their recorded sampling log-probs. Measured "
                                 "harmful: the mask removes a deferred group's early finishers, so what trains "
                                 "depends on length (plugin docstring).")
    max_deferrals: int | None = Field(None, ge=0, description="Bound on how often one prompt group may be deferred: "
                                      "a group already deferred this many times is generated to the end in its "
                                      "next round (the call runs until its unfinished members reach EOS or "
                                      "max_completion_length), so no trained token is more than max_deferrals "
                                      "generation rounds old (AReaL's staleness bound). null: unbounded (Kimi k1.5, "
                                      "APRIL, slime); 0: nothing is deferred (lambda 1).")
    repeat_window: int | None = Field(None, ge=2, description="Repeat detection (Kimi k1.5): a trajectory whose last "
                                      "repeat_window tokens repeat one block of at most repeat_max_period tokens "
                                      "is ended there, as finished (no EOS, so length_shaping's no_stop_penalty or "
                                      "TRL's mask_truncated_completions apply to it). null: off (the default).")
    repeat_max_period: int = Field(16, ge=1, description="Longest repeated block repeat detection looks for, in "
                                   "tokens; at most repeat_window / 2, so a detected block occurs at least twice.")

    @model_validator(mode="after")
    def _period_fits_the_window(self):
        if self.repeat_window is not None and 2 * self.repeat_max_period > self.repeat_window:
            raise ValueError(f"repeat_max_period ({self.repeat_max_period}) must be at most half of repeat_window "
                             f"({self.repeat_window}), so a detected block occurs at least twice")
        return self


@dataclass
class Trajectory:
    """One sample's completion so far: token ids, their sampling log-probs and the policy version (optimizer step)
    that sampled each token."""

    ids: list[int] = field(default_factory=list)
    logps: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finished: bool = False
    repeated: bool = False  # ended by repeat detection (finished, without EOS)


@dataclass
class PendingGroup:
    """A prompt group with at least one unfinished trajectory: its dataset rows and its G trajectories."""

    rows: list[dict]
    samples: list[Trajectory]
    deferrals: int = 1  # generation rounds that ended with this group unfinished


def capped(trajectory: Trajectory, max_len: int) -> Trajectory:
    """``trajectory`` cut to ``max_len`` tokens, finished once it has that many (a trajectory cut by
    ``max_completion_length`` counts as finished). A buffer restored into a run with a smaller ``max_completion_length``
    holds longer prefixes: their remaining budget would be negative, and ``ids[:budget]`` then kept all but the last
    ``-budget`` new tokens, growing a trajectory past the cap."""
    if len(trajectory.ids) >= max_len:
        trajectory.ids, trajectory.logps = trajectory.ids[:max_len], trajectory.logps[:max_len]
        trajectory.versions, trajectory.finished = trajectory.versions[:max_len], True
    return trajectory


def periodic_tails(ids: torch.Tensor, window: int, max_period: int) -> torch.Tensor:
    """Bool ``(B,)``: whether each row's last ``window`` tokens repeat one block of ``p <= max_period`` tokens, i.e.
    ``ids[t] == ids[t - p]`` for every ``t`` of the window after its first ``p`` tokens (the block then occurs
    ``window / p >= 2`` times). Rows shorter than ``window`` are False."""
    if ids.size(1) < window:
        return torch.zeros(ids.size(0), dtype=torch.bool, device=ids.device)
    tail = ids[:, -window:]
    found = torch.zeros(ids.size(0), dtype=torch.bool, device=ids.device)
    for period in range(1, max_period + 1):
        found |= (tail[:, period:] == tail[:, :-period]).all(dim=1)
    return found


class StopWhenEnoughFinished(StoppingCriteria):
    """Per-row stop at EOS or at the row's own token budget; all rows stop once ``target`` units have finished.

    A unit is a row, or with ``groups`` (each row's group index) a group, finished once all its rows in the call are.
    Rows marked ``required`` (groups at the deferral bound) must also be done before the call ends. With ``repeat``
    (window, max_period), a row whose completion (``prefix_lengths`` tokens before the call, then the new ones) ends in
    a periodic window is done too; ``repeat_cut`` holds the number of new tokens it keeps (-1: not cut).
    transformers pads a finished row from then on and ends ``generate`` when every row is done, so returning all-True
    ends the call right after the step in which the ``target``-th unit finished.
    """

    def __init__(self, prompt_width: int, budgets: list[int], eos_ids: list[int], target: int,
                 groups: list[int] | None = None, required: list[bool] | None = None,
                 repeat: tuple[int, int] | None = None, prefix_lengths: list[int] | None = None):
        self.prompt_width = prompt_width
        self.repeat = repeat
        self.prefix_lengths = torch.tensor(prefix_lengths or [0] * len(budgets))
        self.repeat_cut = torch.full((len(budgets),), -1, dtype=torch.long)
        self.budgets = torch.tensor(budgets)
        self.eos_ids = torch.tensor(eos_ids)
        self.target = target
        self.groups = None if groups is None else torch.unique(torch.tensor(groups), return_inverse=True)[1]
        self.done = torch.zeros(len(budgets), dtype=torch.bool)
        self.required = torch.zeros(len(budgets), dtype=torch.bool) if required is None else torch.tensor(required)
        self.steps = 0

    def finished_units(self) -> int:
        if self.groups is None:
            return int(self.done.sum())
        unfinished = torch.zeros(int(self.groups.max()) + 1, dtype=torch.long).index_add_(
            0, self.groups, (~self.done).long())
        return int((unfinished == 0).sum())

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs) -> torch.Tensor:
        self.steps = input_ids.shape[1] - self.prompt_width
        last = input_ids[:, -1].cpu()
        ended = torch.isin(last, self.eos_ids) | (self.steps >= self.budgets)
        if self.repeat is not None:
            window, max_period = self.repeat
            long_enough = self.prefix_lengths + self.steps >= window
            repeated = ~self.done & ~ended & long_enough & periodic_tails(input_ids, window, max_period).cpu()
            self.repeat_cut[repeated] = self.steps
            ended |= repeated
        self.done |= ended
        if self.finished_units() >= self.target and bool(self.done[self.required].all()):
            return torch.ones_like(self.done).to(input_ids.device)
        return self.done.clone().to(input_ids.device)


class PartialRollout(Plugin):
    """Partial rollouts (Kimi k1.5, arXiv 2501.12599; APRIL, arXiv 2509.18521; ALGORITHMS.md item 44).

    In training, generation stops once ``ceil(lambda * N)`` of the ``N`` trajectories this rank is generating
    have finished (``finish_fraction``, default 0.75). The unfinished trajectories keep their tokens, their per-token
    sampling log-probs and the policy version (``trainer.state.global_step``) of every token; their whole prompt group
    waits in a buffer and takes the first slots of the next generation batch, where its unfinished trajectories
    continue (prompt + prefix fed back unchanged, so the prefix stays byte-identical) under the then-current policy,
    with the remaining budget ``max_completion_length - len(prefix)``; finished members wait unchanged. The fresh
    prompts displaced by resumed groups are skipped for this step (APRIL discards over-provisioned requests likewise).

    Conventions chosen:

    * the unit of buffering is the prompt group (GRPO advantages need whole groups): a group trains in the step in
      which its last trajectory finishes; groups still unfinished get zero advantage and a zero completion mask in
      this step (``trl_ext_filter_groups``), so they leave every token count and the row count of sequence-mean
      aggregations (``grpo``, ``dr_grpo``: the step is the mean over the trained rows). A step therefore trains fewer
      samples than the batch holds (``partial_rollout/trained_fraction``: 0.46-0.66 at lambda 0.75 on the embedded
      addition task, about a third early on long tails), so learning compares per trained trajectory, not per step
      (``benchmarks/partial_rollout.py --held-out``; measured below);
    * the stop rule counts the trajectories this call generates, per rank (no collective inside generation):
      ``ceil(lambda * N_active)``, where ``N_active`` excludes finished members of resumed groups, which only wait (had
      they counted, a batch of mostly waiting members would stop after one more token); a trajectory cut by
      ``max_completion_length`` counts as finished (TRL's ``clipped_ratio``). At least one trajectory finishes per
      call, so generation always progresses;
    * what lambda counts (``stop_unit``): ``trajectories`` (the default, as ALGORITHMS.md words it: "when a fraction
      lambda of the N x K trajectories finish") or ``groups``: ``ceil(lambda * P)`` of the call's ``P`` prompt groups
      are complete, every member finished, as slime (the code behind APRIL) stops once ``rollout_batch_size`` whole
      groups of ``over_sampling_batch_size`` are done. One long member holds back its whole group, so at the same
      lambda ``trajectories`` defers more groups (a call at lambda 0.75 can leave half of them waiting) and
      ``groups`` decodes longer but trains at least lambda of the groups each step;
    * how long a group may wait (``max_deferrals``): unbounded by default, as in Kimi k1.5, APRIL and slime, whose
      buffers hold a group until it completes. ``max_deferrals: k`` bounds it as AReaL bounds staleness (its eta, in
      policy versions): a group deferred ``k`` times is generated to the end in its next round, so the call then
      decodes until that group's unfinished members reach EOS or the cap, whatever lambda says, and no trained token is
      more than ``k`` generation rounds old (``k`` optimizer steps with TRL's default of one step per generation
      batch). The bound counts rounds, not optimizer steps, so it holds with ``steps_per_generation`` and
      ``num_iterations`` too; ``partial_rollout/forced_groups`` logs how many groups a round had to finish. A buffer
      larger than a round's groups (only after resuming on fewer processes) resumes its most deferred groups first,
      and a group left waiting counts that round as a deferral;
    * repeat detection (``repeat_window``, off by default): Kimi k1.5 says its rollout system detects repeated content
      during decoding and ends such rollouts early, with a penalty, but gives no rule. The rule here: a trajectory
      whose last ``repeat_window`` completion tokens repeat one block of at most ``repeat_max_period`` tokens (default
      16) is ended in that decoding step and counts as finished; it keeps its tokens up to there and has no EOS.
      The penalty is left to the plugins that already score a completion that did not stop on its own:
      ``length_shaping``'s ``no_stop_penalty`` (added to its reward) or TRL's ``mask_truncated_completions`` (out of
      the loss). ``partial_rollout/repeat_stopped`` logs how many trajectories a round ended this way;
    * the sampling log-probs come from the processed scores of the step that sampled each token (as
      ``rollout_logprobs``), so the plugin provides ``sampling_logprobs``: importance-sampling plugins (tis, mis,
      icepop, m2po) then correct the stale segment; ``mask_offpolicy: true`` removes it from the loss instead (a mask,
      so it also leaves the aggregation denominator);
    * the buffer is saved with every checkpoint (``partial_rollout_rank<r>.json`` in the checkpoint folder, written
      atomically) and restored when training resumes from it, so no prefix is lost (dataset row values that are not
      JSON types come back as their string form); resumed on a different number of processes, the saved groups are
      dealt round-robin over the new ranks;
    * the plugin implements ``trl_ext_token_weights`` (for ``mask_offpolicy``), so trl-ext's loss pipeline computes
      the loss (TRL's loss re-expressed; TRL options it does not re-implement are refused at validation);
    * evaluation generates every trajectory to the end (plain TRL generation). Transformers generation only (no vLLM,
      tools, continuous batching or multimodal prompts); it fills the ``generation`` and ``refill`` slots, so it does
      not combine with ``rollout_logprobs`` or ``dynamic_sampling``. ``generate`` keeps decoding every row of a call
      until the call ends, so what the plugin saves is decoding steps per optimizer step, not per trained trajectory
      (rollout time per trained trajectory 1.01-1.24 of TRL's in the runs below).

    Measured on the embedded addition task (``benchmarks/partial_rollout.py --held-out 400 --grpo-seeds 0 1 2``:
    configs/partial_rollout.yaml's GRPO stage from one SFT warm-up at 0.415, answers of 2-3 tokens, greedy held-out
    accuracy on 200 problems, mean and spread over three GRPO seeds, about 51k trained trajectories each):

    ==============================================================  ==============  =====================
    run                                                             held-out        per seed
    ==============================================================  ==============  =====================
    TRL, 16 prompts x 8 per step, 400 steps                         0.508           0.490 0.500 0.535
    TRL, 8 x 8 per step (the batch the plugin trains), 800 steps    0.498           0.500 0.495 0.500
    plugin at lambda 1 (nothing deferred), 400 steps                0.505           0.500 0.500 0.515
    lambda 0.9 + tis, 528 steps (about 47k trajectories)            0.538           0.565 0.540 0.510
    lambda 0.75 + tis, 800 steps                                    0.440           0.440 0.475 0.405
    lambda 0.75 + tis + mask_offpolicy, 800 steps                   0.268           0.245 0.255 0.305
    lambda 0.75 ``stop_unit: groups`` + tis, 533 steps (about 62k)  0.523           0.545 0.480 0.545
    ==============================================================  ==============  =====================

    So the plugin's generation and loss path matches TRL (lambda 1), and deferral at lambda 0.9 learns as much per
    trained trajectory. At lambda 0.75, where about half the groups wait each step and 65% of the trained tokens were
    sampled by an older policy version (32% at 0.9; ``partial_rollout/stale_token_fraction``), it learns less in every
    seed. The cause is not measured; three candidates are ruled out. Not TIS: 0.455 without it (one seed). Not the
    correction: with ``rollout_ratio`` (a double-sided trust region against the sampling log-probs) in place of TIS,
    0.427 (0.430 / 0.450 / 0.400). Not one step of staleness as such: TRL training each 16-prompt generation batch over
    two optimizer steps (``steps_per_generation: 2``, batch 64, 800 steps: half the samples train one step late) reached
    0.542 (0.540 / 0.520 / 0.565). What the plugin adds beyond these is that lateness follows length: a group waits
    because one of its samples is long. ``mask_offpolicy`` is worse than no correction: in a deferred group the stale
    tokens are the members that finished first and the prefixes of the late ones, so the mask keeps mostly the tails of
    the long samples; the signal then depends on length, and sampled completions grew (decoding steps per call 3.2 ->
    4.3). Counting groups (``stop_unit: groups``) at lambda 0.75 defers at most a quarter of the groups (trained
    fraction 0.90-0.93 against 0.46-0.66) and learns like TRL (0.523 against 0.508), so what costs the trajectory rule
    its learning at 0.75 is how many groups it defers, not deferral itself; on these short answers it saves no time
    (6.8 decoding steps per call against TRL's 7.9, rollout seconds per step 1.08-1.13 of TRL's).

    Every figure above with groups deferred was measured while the deferred rows still counted in ``grpo``'s mean
    over sequences (each added 0), so a step at a trained fraction ``f`` moved the policy ``f`` times as far as its
    trained rows alone would: about half at lambda 0.75 trajectories, 0.9 at ``groups``. That matches the pattern
    above. Since 66d3dd6 the row count holds only the trained rows (``per_kept_row``). Re-measured from one warm-up
    (0.400), 600 steps each, GRPO seeds 0 and 1 (the ``half`` and ``partial75`` stages of
    ``benchmarks/partial_rollout.py --half-batch --partial-steps 600 --fractions 0.75``, run as one recipe):

    * TRL at 8 x 8 per step: held-out 0.450 and 0.475;
    * lambda 0.75 + tis with the fix: 0.405 and 0.390;
    * lambda 0.75 + tis before the fix (seed 0 only, commit 9aa698b): 0.305.

    The trained fraction was 0.51 in every plugin run, so each trained about as many trajectories as TRL (64 per step).
    The mean train reward of the trained groups, first -> last 100 steps, climbed alike:

    * TRL: 0.133 -> 0.190 and 0.126 -> 0.207;
    * with the fix: 0.135 -> 0.223 and 0.138 -> 0.211;
    * before it: 0.135 -> 0.207.

    Four more GRPO seeds from the same warm-up (the same recipe, seeds 2-5): TRL 0.435 / 0.360 / 0.450 / 0.405,
    lambda 0.75 + tis 0.480 / 0.470 / 0.455 / 0.465. Over the six seeds TRL reaches 0.429 and lambda 0.75 0.444: with
    the row count fixed, the gap the first two seeds showed is within the seed-to-seed spread (the row count was the
    cause measured: seed 0 before it, 0.305).

    Long tails after the fix (``benchmarks/partial_rollout.py --held-out 400 --partial-steps 1000 --fractions 0.75
    --long-tail 0.1 --eval-every 100 --grpo-seeds 0 1 2``, one run, warm-up 0.465): rollout seconds per step were 0.56
    and 0.53 of TRL's (seeds 1 and 2; seed 0's TRL stage ran beside a test job, so its 0.37 is not a fair ratio), per
    trained trajectory 1.16 and 1.12. Held-out greedy accuracy, mean of the three seeds at about equal trained
    trajectories:

    ============================  ===========  ===========  ===========  =====================
    trained trajectories          about 25k    about 38k    about 52k    end of run (sd)
    ============================  ===========  ===========  ===========  =====================
    TRL, 16 x 8 per step          0.543        0.587        0.503        0.503 (0.068), 51.2k
    lambda 0.75 + tis             0.387        0.532        0.527        0.530 (0.044), 60k
    ============================  ===========  ===========  ===========  =====================

    So on long tails the plugin takes about half of TRL's rollout time per step and its held-out curve meets TRL's by
    about 50k trajectories, but trails before that. Early on the buffer holds about 10 of the 16 groups, a group waits
    up to 4-6 steps, 51-63% of the trained tokens are stale and a third of the batch trains per step; held-out accuracy
    first dips below the warm-up (step 100, 4.3k trajectories: 0.205 / 0.355 / 0.320 against 0.465). Part of that is
    the smaller batch per step, not deferral: TRL at 8 x 8 per step from the same warm-up (seeds 0 and 1, 200 steps)
    also dips, 0.430 / 0.370 at step 100 and 0.480 / 0.350 at step 200, where the plugin reads 0.385 / 0.380 / 0.435.

    Bounding the wait, ``max_deferrals: 1``, on the same long tails from the same warm-up (0.465). Runs:
    ``benchmarks/partial_rollout.py --held-out 200 --partial-steps 400 --fractions 0.75 --long-tail 0.1 --eval-every
    100 --grpo-seeds 0 1 --max-deferrals none 1``, then ``--held-out 400 --partial-steps 700 --grpo-seeds 2 3
    --max-deferrals 1``. Effect on the trained batch: the trained fraction rises from 0.35 to 0.59-0.72, the stale
    share of the trained tokens falls from 0.65 to 0.34-0.44, and ``staleness_max`` is at most 1 (4.1 on average
    unbounded). A call decodes 32 steps against 12 unbounded and TRL's 63.
    Held-out greedy accuracy, mean over the GRPO seeds, at about equal trained trajectories:

    ==================================  ========  ========  ========  ========  ========  ========
    trained trajectories                about 8k  about 16k about 24k about 38k about 45k about 52k
    ==================================  ========  ========  ========  ========  ========  ========
    TRL, 16 x 8 (seeds 0-3; 2-3 late)   -         0.488     0.523     0.563     -         0.508
    lambda 0.75 + tis (seeds 0-1)       0.383     0.378     0.480     -         -         -
    + ``max_deferrals: 1`` (0-3; 2-3)   0.430     0.415     0.484     0.435     0.605     0.560
    ==================================  ========  ========  ========  ========  ========  ========

    TRL's 16k column is its 12.8k checkpoint, and its 24k column its 25.6k checkpoint. The unbounded 24k column is at
    18k trajectories; the earlier three-seed run read 0.387 at 25k.

    Per seed, the bound sits at or above the unbounded run early (0.385 / 0.460 against 0.385 / 0.380 at about 8k). It
    ends above TRL at about 52k (0.575 / 0.545 against 0.440 / 0.575). In between it still trails TRL at some points:
    0.330 / 0.555 / 0.570 / 0.480 at about 23k against TRL's 0.515 / 0.530 / 0.585 / 0.460 at 25.6k, and 0.470 / 0.400
    at 38k against 0.620 / 0.505. Single checkpoints move by 0.1-0.2 from one 100-step save to the next in both arms.
    So the bound narrows the early gap but does not remove it, and the default stays unbounded, the papers'
    convention. Time, measured apart on an idle CPU (the same command at ``--held-out 100 --partial-steps 100
    --grpo-seeds 0 --max-deferrals none 1``, the first 100 steps): rollout seconds per step were 0.55 of TRL's with
    the bound and 0.21 without it, and per trained trajectory 0.87 and 0.62. Held-out at step 100 was 0.385 with the
    bound, 0.205 without it and 0.465 for TRL, the same as in the runs above, which are deterministic on this CPU.
    On the untrained model's geometric lengths (``--rollouts 16 --fractions 0.75 --max-deferrals none 1 2``, twice),
    the bound of 1 took 0.56 / 0.62 of TRL's seconds per step (0.94 / 1.05 per trained trajectory), against 0.54 / 0.58
    unbounded.

    Where the early gap comes from, and how it closes, measured on the same long tails from the same warm-up:

    * Against TRL training the batch the plugin trains (8 x 8 per step, ``--half-batch --arms half --partial-steps
      800 --grpo-seeds 0 1``), the bound is not behind early: TRL at 8 x 8 reads 0.400 / 0.415 / 0.433 / 0.528 at 6.4k /
      12.8k / 19.2k / 25.6k trajectories (0.443 / 0.508 / 0.503 / 0.568 at 32k / 38k / 45k / 51k), the bound 0.430 /
      0.415 / 0.484 at about 8k / 16k / 24k. A smaller batch per step at the same learning rate learns less per
      trajectory at first, and the plugin trains 59-72% of the generation batch per step.
    * Two more GRPO seeds (4, 5; ``--held-out 400 --partial-steps 700 --max-deferrals 1 --arms plain partial75_d1``):
      TRL 0.510 / 0.513 / 0.530 / 0.590 at 12.8k / 25.6k / 38.4k / 51.2k, the bound 0.485 / 0.505 / 0.475 / 0.448 /
      0.500 / 0.573 / 0.513 at about 9k / 16k / 24k / 31k / 38k / 45k / 52k. Paired over the seeds measured (the bound
      minus TRL, per seed): -0.038 at about 24k (six seeds, standard error 0.033), -0.079 at about 38k (four seeds,
      0.044), -0.012 at about 52k (four seeds, 0.056). The differences between seeds (sd 0.08-0.11) are larger than the
      mean gap, and in no column is the gap beyond two standard errors, but the point estimates trail until about 50k.
    * Over-provisioning, as APRIL does: a generation batch of 25 prompts x 8 (``--partial-batch 200``) so that the
      groups that finish fill about TRL's 128 rows (116-128 trained per step). At equal steps, which is then equal
      trajectories (seeds 4, 5, 400 steps): 0.430 / 0.410 / 0.533 / 0.590 at steps 100-400 (12.5k / 24k / 35.5k /
      46.5k trajectories) against TRL's 0.510 / 0.513 / 0.530 / 0.590; it trails at steps 100-200 and meets TRL from
      step 300 on. Its rollout seconds per step on an idle CPU (seed 4, the first 100 steps, ``--held-out 100
      --partial-steps 100 --partial-batch 200 --arms plain partial75_d1``) were 0.66 of TRL's, and so 0.66 per
      trained trajectory, while training about TRL's batch per step. The first 100 to 200 steps stay behind in both
      seeds, so the early dip is not only the batch size.

    Time. With geometric lengths on the untrained model (``benchmarks/partial_rollout.py --fractions 0.75 0.9``: 32
    trajectories, cap 64) rollout seconds per step were 0.58 (lambda 0.75) and 0.85 (0.9) of TRL's, per trained
    trajectory 1.06 and 1.08; at lambda 1 the plugin's generation costs 1.03 (this benchmark) to 1.14 (128 trajectories
    of at most 8 tokens) of TRL's (profiled: spread over per-row tensor building, no single hotspot). Before the
    row-count fix, with long-tailed lengths (``--long-tail 0.1 --eval-every 100``, one seed, warm-up 0.495; TRL 0.520 /
    0.630 / 0.585 at 25.6k / 38.4k / 51.2k trajectories), lambda 0.75 took 0.47 of TRL's rollout seconds per step and
    trailed (0.450 / 0.515 / 0.555 at 24.4k / 38.1k / 52.6k); lambda 0.9 matched at equal trajectories (0.420 / 0.560 /
    0.585 at 23.2k / 34.8k / 47.6k) but took 1.04 of TRL's rollout seconds per step (twice measured) although it decoded
    48 steps per call against 64. ``stop_unit: groups`` at lambda 0.75 on the same long tails (one seed, 500 steps)
    decoded 49 steps per call and took 1.27 of TRL's rollout seconds per step; held-out 0.405 / 0.530 / 0.565 / 0.625 /
    0.405 at 9.8k / 19.6k / 31.5k / 44.3k / 57.1k trajectories (TRL: 0.490 / 0.520 / 0.630 / 0.585 at 12.8k / 25.6k /
    38.4k / 51.2k). Why resuming costs so much here, measured apart on the tiny model (2 CPU cores, 128 rows):
    transformers keeps no KV cache between calls, so a resumed prefix is prefilled again, and every row of the call is
    left-padded to the longest resumed input. 48 decoding steps take 0.23 s from inputs of 8 tokens and 0.46 s from
    inputs padded to 70 (TRL's 64 steps from 8 tokens: 0.33 s): one 60-token prefix doubles the cost of the whole call,
    in prefill and in attention over the padded width. Two calls, resumed rows apart from fresh ones, cost 0.11 + 0.22
    s, since each decoding step has a fixed cost that is then paid twice; transformers' continuous batching
    (``generate_batch``, no padding) took 7.2 s for 128 prompts x 64 tokens against 0.39 s for padded ``generate`` on
    this CPU. So before the row-count fix no setting measured on transformers generation gave both the time saving and
    TRL's learning; since it, lambda 0.75 gives both per step on long tails by about 50k trajectories (the table above),
    not per trained trajectory (1.12-1.16 of TRL's rollout seconds). Engines that neither pad nor keep finished rows
    decoding (vLLM, SGLang) are where APRIL reports a saving per trajectory too.

    Logged per generation batch, over every rank: ``partial_rollout/buffer_groups`` (groups waiting after this step),
    ``partial_rollout/resumed_trajectories``, ``partial_rollout/trained_fraction`` (samples in finished groups),
    ``partial_rollout/versions_per_trajectory`` (mean distinct policy versions per trained trajectory),
    ``partial_rollout/staleness_max`` (current step minus the oldest version of a trained token),
    ``partial_rollout/generation_steps`` (decoding steps of this call), ``partial_rollout/stale_token_fraction`` (share
    of the trained tokens that an older policy version sampled), and ``partial_rollout/trained_reward_mean`` and
    ``partial_rollout/trained_zero_std_fraction`` (the reward and the share of all-agreeing groups among the groups
    that train; TRL's ``reward`` and ``frac_reward_zero_std`` also count deferred groups, scored on unfinished text).
    """

    name = "partial_rollout"
    family = "rollout"
    trainers = frozenset({"grpo"})
    slots = frozenset({Slot.GENERATION, Slot.REFILL})
    provides = frozenset({Need.SAMPLING_LOGPROBS})
    Params = PartialRolloutParams

    def __init__(self, params=None):
        super().__init__(params)
        self.buffer: list[PendingGroup] = []
        self._plan: list[Trajectory | None] | None = None  # this round's slots: resumed trajectory or None (fresh)
        self._deferrals: list[int] = []  # this round's groups: how often each was deferred before (0: fresh)
        self._forced_groups = 0  # this round's groups at the max_deferrals bound, generated to the end
        self._repeat_stopped = 0  # this round's trajectories ended by repeat detection
        self._states: list[Trajectory] | None = None  # this round's trajectories after generation
        self._last_steps = 0  # decoding steps of the last generation call (logged)
        self._trained_rewards = (float("nan"), float("nan"))  # this round's trained groups: mean reward, zero-std share
        self._trained_tokens = (0, 0)  # this rank's trained tokens this round: (sampled by an older version, all)
        self.history: list[dict[str, float]] = []

    # -- validation -------------------------------------------------------------------------------------------------

    @hookimpl
    def trl_ext_validate_stage(self, stage, plugins):
        errors = [f"args.{key}: plugin {self.name!r} runs transformers generation; remove it when `{key}` is set"
                  for key in ("use_vllm", "use_transformers_continuous_batching") if stage.args.get(key)]
        return errors or None

    # -- the generation batch: resumed groups first, fresh prompts after ----------------------------------------------

    @hookimpl
    def trl_ext_refill_groups(self, trainer, inputs, score):
        G = trainer.num_generations
        if len(inputs) % G:
            raise ValueError(f"plugin {self.name!r}: this rank's generation batch ({len(inputs)} rows) does not hold "
                             f"whole groups of {G}; make the per-device generation batch a multiple of num_generations")
        sizes = sorted({len(group.samples) for group in self.buffer} - {G})
        if sizes:  # a buffer restored into a run with another num_generations: its groups cannot fill G slots each
            raise ValueError(f"plugin {self.name!r}: the buffer restored from the checkpoint holds groups of {sizes} "
                             f"trajectories, but num_generations is {G}; resume with the num_generations it was "
                             "saved with")
        capacity = len(inputs) // G
        if len(self.buffer) > capacity:  # only after resuming on fewer processes: the most deferred groups go first
            self.buffer.sort(key=lambda group: -group.deferrals)
        resumed, self.buffer = self.buffer[:capacity], self.buffer[capacity:]
        for group in self.buffer:  # left waiting a whole round: one deferral more
            group.deferrals += 1
        rows = [row for group in resumed for row in group.rows] + list(inputs[: len(inputs) - G * len(resumed)])
        self._plan = [copy.deepcopy(s) for group in resumed for s in group.samples]
        self._plan += [None] * (len(inputs) - len(self._plan))
        self._deferrals = [group.deferrals for group in resumed] + [0] * (capacity - len(resumed))
        resumed_trajectories = sum(not s.finished for group in resumed for s in group.samples)
        self._trained_rewards, self._trained_tokens = (float("nan"), float("nan")), (0, 0)
        self._forced_groups = 0
        self._repeat_stopped = 0
        try:
            output, _keep = score(rows)
        finally:
            self._plan = None
        states, self._states = self._states, None
        for start in range(0, len(states), G):
            if not all(s.finished for s in states[start:start + G]):
                self.buffer.append(PendingGroup(rows[start:start + G], states[start:start + G],
                                                self._deferrals[start // G] + 1))
        record = self._record(trainer, states, G, resumed_trajectories)
        self.history.append(record)
        trainer._log_plugin_metrics(record)
        return output

    def _record(self, trainer, states, G, resumed_trajectories):
        """The logged figures over every rank's generation batch (each rank buffers its own groups; TRL logs rank 0's
        metric buffers, so the figures are combined here: counts summed, maxima taken, means over all trajectories)."""
        step = trainer.state.global_step
        trained = [s for start in range(0, len(states), G) if all(x.finished for x in states[start:start + G])
                   for s in states[start:start + G]]
        versions = [s.versions for s in trained if s.versions]
        local = torch.tensor([len(self.buffer), resumed_trajectories, len(trained), len(states),
                              sum(versions_per_trajectory(versions)), len(versions),
                              max((step - min(v) for v in versions), default=0), self._last_steps,
                              *self._trained_tokens, self._forced_groups, self._repeat_stopped],
                             dtype=torch.float64, device=trainer.accelerator.device)
        ranks = trainer.accelerator.gather(local).view(-1, local.numel()).cpu()
        total, top = ranks.sum(0).tolist(), ranks.max(0).values.tolist()
        return {
            "partial_rollout/buffer_groups": int(total[0]),
            "partial_rollout/resumed_trajectories": int(total[1]),
            "partial_rollout/trained_fraction": total[2] / total[3],
            "partial_rollout/versions_per_trajectory": total[4] / total[5] if total[5] else 1.0,
            "partial_rollout/staleness_max": int(top[6]),
            "partial_rollout/generation_steps": int(top[7]),
            "partial_rollout/stale_token_fraction": total[8] / total[9] if total[9] else 0.0,
            "partial_rollout/trained_reward_mean": self._trained_rewards[0],
            "partial_rollout/trained_zero_std_fraction": self._trained_rewards[1],
            "partial_rollout/forced_groups": int(total[10]),
            "partial_rollout/repeat_stopped": int(total[11]),
        }

    # -- generation -------------------------------------------------------------------------------------------------

    @hookimpl
    def trl_ext_generate(self, trainer, prompts, generate):
        if not trainer.model.training or self._plan is None:
            return generate(prompts)
        return generate_single_turns_with(
            trainer, prompts, generate, self.name,
            lambda prompt_ids, images, fields: self._continue(trainer, prompt_ids, images, fields))

    def _continue(self, trainer, prompt_ids, images, multimodal_fields):
        """Generate the unfinished trajectories of this round until the stop rule; return TRL's (ids, logprobs)."""
        from trl.models import unwrap_model_for_generation
        from trl.trainer.utils import pad

        if images is not None or multimodal_fields:
            raise RuntimeError(f"plugin {self.name!r} does not support multimodal prompts")
        plan = self._plan
        max_len = trainer.max_completion_length
        states = [capped(copy.deepcopy(p), max_len) if p is not None else Trajectory() for p in plan]
        active = [i for i, s in enumerate(states) if not s.finished]
        # Rows of one prompt group sit next to each other (refill_groups), so slot i belongs to group i // G.
        G, limit = trainer.num_generations, self.params.max_deferrals
        groups = [i // G for i in active] if self.params.stop_unit == "groups" else None
        target = finish_target(len(active) if groups is None else len(set(groups)), self.params.finish_fraction)
        # a group deferred max_deferrals times already must finish in this call: its unfinished rows are required
        required = [limit is not None and self._deferrals[i // G] >= limit for i in active]
        self._forced_groups = len({i // G for i, r in zip(active, required) if r})
        self._last_steps = 0
        if active:
            device = trainer.accelerator.device
            tensors = [torch.tensor(list(prompt_ids[i]) + states[i].ids) for i in active]
            input_ids = pad(tensors, padding_value=trainer._tokenizer.pad_token_id, padding_side="left").to(device)
            attention_mask = pad([torch.ones_like(t) for t in tensors], padding_value=0,
                                 padding_side="left").to(device)
            budgets = [max_len - len(states[i].ids) for i in active]
            p = self.params
            stop = StopWhenEnoughFinished(
                input_ids.size(1), budgets, list(trainer.eos_token_ids), target, groups, required,
                repeat=None if p.repeat_window is None else (p.repeat_window, p.repeat_max_period),
                prefix_lengths=[len(states[i].ids) for i in active])
            config = copy.deepcopy(trainer.generation_config)
            config.max_new_tokens = max(budgets)
            with (
                unwrap_model_for_generation(
                    trainer.model_wrapped, trainer.accelerator,
                    gather_deepspeed3_params=trainer.args.ds3_gather_for_generation,
                    generation_kwargs=trainer.generation_kwargs,
                    gradient_checkpointing_kwargs=trainer.args.gradient_checkpointing_kwargs,
                ) as unwrapped,
                torch.no_grad(),
            ):
                with recording_logprobs(unwrapped, config.max_new_tokens) as recorder:
                    sequences = unwrapped.generate(input_ids=input_ids, attention_mask=attention_mask,
                                                   generation_config=config,
                                                   stopping_criteria=StoppingCriteriaList([stop]))
            new_logps = recorder.result(sequences[:, input_ids.size(1):]).cpu()
            new_ids = sequences[:, input_ids.size(1):].cpu()
            self._last_steps = new_ids.size(1)
            version = trainer.state.global_step
            eos = set(trainer.eos_token_ids)
            for row, i in enumerate(active):
                cut = int(stop.repeat_cut[row])
                # a row cut by repeat detection keeps its tokens up to the cut (what follows is padding, which may be
                # the EOS token)
                ids = new_ids[row].tolist()[: budgets[row] if cut < 0 else cut]
                ended = next((t for t, tok in enumerate(ids) if tok in eos), None)
                n = len(ids) if ended is None else ended + 1
                states[i].ids += ids[:n]
                states[i].logps += new_logps[row, :n].tolist()
                states[i].versions += [version] * n
                states[i].repeated = cut >= 0 and ended is None
                states[i].finished = ended is not None or len(states[i].ids) >= max_len or states[i].repeated
            self._repeat_stopped = sum(states[i].repeated for i in active)
        self._states = states
        return [s.ids for s in states], [s.logps for s in states]

    # -- masking unfinished groups and stale tokens -----------------------------------------------------------------

    @hookimpl
    def trl_ext_filter_groups(self, rewards, batch):
        states = self._states
        trainer = batch.trainer
        if states is None or trainer is None or not trainer.model.training:
            return None
        G = batch.num_generations
        complete = [all(s.finished for s in states[g:g + G]) for g in range(0, len(states), G)]
        local = torch.tensor([c for c in complete for _ in range(G)], device=rewards.device)
        stale = torch.zeros(batch.completion_ids.shape, dtype=torch.float32, device=batch.completion_ids.device)
        for row, s in enumerate(states):
            marks = stale_token_mask(s.versions, trainer.state.global_step)
            stale[row, : len(marks)] = torch.tensor(marks, dtype=torch.float32)
        # The logged share counts the tokens the loss sees: TRL's completion mask, which mask_truncated_completions
        # has already zeroed for trajectories cut by the cap, within the groups that train.
        trained = batch.completion_mask.bool() & local.to(stale.device).unsqueeze(1)
        self._trained_tokens = (int((stale.bool() & trained).sum()), int(trained.sum()))
        batch.loss_extras[STALE_KEY] = stale
        keep = trainer.accelerator.gather(local)
        self._trained_rewards = trained_group_rewards(rewards, keep, G)
        return keep

    @hookimpl
    def trl_ext_token_weights(self, inputs):
        stale = inputs.extra.get(STALE_KEY)
        if not self.params.mask_offpolicy or stale is None:
            return None
        return TokenWeights(mask=stale[:, : inputs.mask.size(1)] == 0)

    # -- checkpoints ------------------------------------------------------------------------------------------------

    @hookimpl
    def trl_ext_trainer_created(self, trainer):
        accelerator = trainer.accelerator
        trainer.add_callback(PartialRolloutCheckpoint(self, accelerator.process_index, accelerator.num_processes))

    def buffer_state(self) -> list[dict]:
        return [{"rows": g.rows, "samples": [asdict(s) for s in g.samples], "deferrals": g.deferrals}
                for g in self.buffer]

    def load_buffer_state(self, state: list[dict]) -> None:
        # buffers saved before max_deferrals existed carry no count: each of their groups was deferred at least once
        self.buffer = [PendingGroup(g["rows"], [Trajectory(**s) for s in g["samples"]], g.get("deferrals", 1))
                       for g in state]


class PartialRolloutCheckpoint(TrainerCallback):
    """Writes the buffer of unfinished groups into each checkpoint and restores it when training resumes.

    Each rank writes its own file. A run resumed with as many processes reads its own rank's file; with a different
    number, every rank reads all the files, concatenates their groups in rank order and keeps every ``world``-th
    group starting at its rank, so no group is lost or trained twice when a job restarts on more or fewer GPUs."""

    def __init__(self, plugin: PartialRollout, rank: int, world: int = 1):
        self.plugin, self.rank, self.world = plugin, rank, world

    def _path(self, args, step: int, rank: int) -> Path:
        return Path(args.output_dir) / f"checkpoint-{step}" / BUFFER_FILE.format(rank=rank)

    def on_save(self, args, state, control, **kwargs):
        # atomic and flushed to disk: a checkpoint never holds half a buffer
        write_text_atomic(self._path(args, state.global_step, self.rank),
                          json.dumps(self.plugin.buffer_state(), default=str))

    def on_train_begin(self, args, state, control, **kwargs):
        if state.global_step == 0:
            return
        files = saved_buffer_files(self._path(args, state.global_step, 0).parent)
        if not files:
            return
        if len(files) == self.world:
            own = files.get(self.rank)
            self.plugin.load_buffer_state(json.loads(own.read_text()) if own is not None else [])
            return
        groups = [g for rank in sorted(files) for g in json.loads(files[rank].read_text())]
        self.plugin.load_buffer_state(groups[self.rank::self.world])


def saved_buffer_files(checkpoint: Path) -> dict[int, Path]:
    """The buffer files a checkpoint holds, by the rank that wrote them."""
    prefix, suffix = BUFFER_FILE.split("{rank}")
    files = {}
    for path in checkpoint.glob(BUFFER_FILE.format(rank="*")):
        index = path.name[len(prefix):-len(suffix)]
        if index.isdigit():
            files[int(index)] = path
    return files
