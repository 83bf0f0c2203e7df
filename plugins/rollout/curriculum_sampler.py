"""A lazy train sampler over a mutable, ordered curriculum queue (``pass_rate_filter`` with ``reestimate_every``).

TRL's ``RepeatSampler`` fixes a whole epoch's order when its iterator starts. :class:`CurriculumSampler` keeps
RepeatSampler's repeat structure exactly (each generation chunk of ``batch_size`` prompts is emitted ``repeat_count``
times, each prompt ``mini_repeat_count`` times in a row; only whole chunks) but takes each chunk from the head of a
:class:`CurriculumQueue` at the moment the chunk's first index is requested, so re-ordering or re-filtering the queue
changes every chunk not yet drawn.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch.utils.data import Sampler
from transformers import TrainerCallback

from trl_ext_plugins.rollout.control_math import CurriculumOrder, select_and_order


class CurriculumQueue:
    """Every prompt's newest pass rate, and the ordered prompts still to be drawn in the current pass.

    A *pass* is one trip through the kept prompts. It starts with a base order of every row (a fresh ``torch.randperm``
    from a generator seeded once with ``seed`` when ``shuffle``, as TRL's RepeatSampler draws it, else dataset order);
    the pending queue is the rows of that base order whose newest rate lies within the bounds, sorted by ``order``
    (stable, so ties keep the base order). :meth:`update` stores new rates for some rows and rebuilds the pending queue
    from every row not yet drawn in this pass, so a too-hard prompt the first filter dropped can re-enter and a
    mastered one leaves. A pass ends when fewer than one chunk's prompts are pending (they are skipped, as
    RepeatSampler skips an incomplete last chunk); the next pass is built from the newest rates of every row.
    """

    def __init__(self, rates: Sequence[float], *, lower: float, upper: float, inclusive: bool,
                 order: CurriculumOrder, shuffle: bool, seed: int):
        self.rates = [float(r) for r in rates]
        self.lower, self.upper, self.inclusive, self.order = lower, upper, inclusive, order
        self.shuffle = shuffle
        self.generator = torch.Generator()
        self.generator.manual_seed(seed)
        self.pass_index = -1
        self.base_order: list[int] = []
        self.pending: list[int] = []
        self.drawn: list[int] = []

    def _kept_in_order(self, rows: Sequence[int]) -> list[int]:
        picked = select_and_order([self.rates[i] for i in rows], self.lower, self.upper, self.inclusive, self.order)
        return [rows[j] for j in picked]

    def start_pass(self) -> None:
        self.pass_index += 1
        n = len(self.rates)
        self.base_order = torch.randperm(n, generator=self.generator).tolist() if self.shuffle else list(range(n))
        self.pending = self._kept_in_order(self.base_order)
        self.drawn = []

    def next_chunk(self, size: int) -> list[int]:
        """The next ``size`` prompts; a new pass starts when fewer are pending."""
        if len(self.pending) < size:
            self.start_pass()
            if len(self.pending) < size:
                raise RuntimeError(
                    f"plugin 'pass_rate_filter': only {len(self.pending)} prompts have a newest pass rate within "
                    f"({self.lower}, {self.upper}), fewer than one generation batch ({size} prompts); widen the bounds")
        chunk, self.pending = self.pending[:size], self.pending[size:]
        self.drawn += chunk
        return chunk

    def undrawn(self) -> list[int]:
        """Rows not drawn in the current pass, in the pass's base order (the rows a re-estimation covers)."""
        drawn = set(self.drawn)
        return [i for i in self.base_order if i not in drawn]

    def update(self, rows: Sequence[int], rates: Sequence[float]) -> dict[str, float]:
        """Store new rates for ``rows`` and rebuild the pending queue from the undrawn rows; return what changed."""
        before = set(self.pending)
        for row, rate in zip(rows, rates, strict=True):
            self.rates[row] = float(rate)
        self.pending = self._kept_in_order(self.undrawn())
        after = set(self.pending)
        kept_rates = [self.rates[i] for i in self.pending]
        return {"kept": float(len(after)), "entered": float(len(after - before)), "left": float(len(before - after)),
                "mean_kept": sum(kept_rates) / len(kept_rates) if kept_rates else 0.0}

    def state_dict(self) -> dict[str, Any]:
        return {"rates": list(self.rates), "pass_index": self.pass_index, "base_order": list(self.base_order),
                "pending": list(self.pending), "drawn": list(self.drawn),
                "generator": self.generator.get_state().tolist()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if len(state["rates"]) != len(self.rates):
            raise ValueError(f"plugin 'pass_rate_filter': the checkpoint's queue covers {len(state['rates'])} prompts, "
                             f"the train dataset has {len(self.rates)}")
        self.rates = [float(r) for r in state["rates"]]
        self.pass_index = int(state["pass_index"])
        self.base_order, self.pending = list(state["base_order"]), list(state["pending"])
        self.drawn = list(state["drawn"])
        self.generator.set_state(torch.tensor(state["generator"], dtype=torch.uint8))


class CurriculumSampler(Sampler):
    """RepeatSampler's index stream, drawn chunk by chunk from a :class:`CurriculumQueue`.

    ``mini_repeat_count = num_generations``, ``batch_size = generation_batch_size // num_generations``,
    ``repeat_count = num_iterations * steps_per_generation``, as TRL's GRPO/RLOO trainers build RepeatSampler. Each
    iteration (one trainer epoch) yields ``num_chunks`` chunks, fixed when the sampler is built (the trainer computes
    its epoch length, step counts and resume offsets from ``len(sampler)`` once); the queue's passes run on across
    iterations. With nothing changed and every prompt kept, the stream equals RepeatSampler's, epoch after epoch.

    Resume: the chunks drawn in the current iteration are part of the state; on a resumed run they are replayed first
    (``replay``), so the batches the trainer skips to reach its step are the ones it trained, and a chunk that was
    prefetched before the checkpoint is trained as in the uninterrupted run. An iteration that was finished (its last
    index handed out, which happens only during the epoch's last optimizer step) is not replayed.
    """

    def __init__(self, queue: CurriculumQueue, *, mini_repeat_count: int, batch_size: int, repeat_count: int,
                 num_chunks: int):
        self.queue = queue
        self.mini_repeat_count, self.batch_size, self.repeat_count = mini_repeat_count, batch_size, repeat_count
        self.num_chunks = num_chunks
        self.iteration_chunks: list[list[int]] = []  # chunks drawn in the current iteration, in order
        self.iteration_done = False
        self.replay: list[list[int]] = []

    def __len__(self) -> int:
        return self.num_chunks * self.batch_size * self.mini_repeat_count * self.repeat_count

    def __iter__(self):
        replay, self.replay = self.replay, []
        self.iteration_chunks, self.iteration_done = [], False
        for position in range(self.num_chunks):
            chunk = replay[position] if position < len(replay) else self.queue.next_chunk(self.batch_size)
            self.iteration_chunks.append(list(chunk))
            for _ in range(self.repeat_count):
                for index in chunk:
                    for _ in range(self.mini_repeat_count):
                        yield index
        self.iteration_done = True

    def state_dict(self) -> dict[str, Any]:
        return {"queue": self.queue.state_dict(), "iteration_chunks": [list(c) for c in self.iteration_chunks],
                "iteration_done": self.iteration_done}

    def load_state_dict(self, state: dict[str, Any], replay: bool = True) -> None:
        """Restore the queue; replay the saved iteration's chunks unless it had finished (or ``replay`` is false:
        the trainer skips no batches, ``args.ignore_data_skip``)."""
        self.queue.load_state_dict(state["queue"])
        unfinished = not state["iteration_done"]
        self.replay = [list(c) for c in state["iteration_chunks"]] if replay and unfinished else []


class ReestimateCallback(TrainerCallback):
    """Calls ``plugin.reestimate(trainer, step)`` at the end of every ``reestimate_every``-th optimizer step (on every
    rank), except after the last step, where nothing is left to draw."""

    def __init__(self, plugin, trainer):
        self.plugin, self.trainer = plugin, trainer

    def on_train_begin(self, args, state, control, **kwargs):
        if self.plugin.sampler is None:  # TRL attaches no sampler to an iterable dataset
            raise ValueError("plugin 'pass_rate_filter': reestimate_every needs a map-style train dataset (the trainer "
                             "built its dataloader without the plugin's sampler)")

    def on_step_end(self, args, state, control, **kwargs):
        every = self.plugin.params.reestimate_every
        if state.global_step % every == 0 and not 0 < state.max_steps <= state.global_step:
            self.plugin.reestimate(self.trainer, state.global_step)
