"""``rollout_logprobs``: record per-token sampling log-probs on the transformers generation path (no vLLM needed)."""

from __future__ import annotations

import copy
from contextlib import contextmanager
from typing import Literal

import torch
from pydantic import Field
from transformers import LogitsProcessor, LogitsProcessorList

from trl_ext import Need, Plugin, PluginParams, Slot, hookimpl

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


class RolloutLogprobsParams(PluginParams):
    dtype: Literal["policy", "bfloat16", "float16", "float32"] = Field(
        "policy", description="'policy': sample with the policy itself; otherwise sample with a copy of the policy cast "
                              "to this dtype (re-synced after every optimizer step), creating a real train/inference "
                              "mismatch, e.g. bfloat16 on CPU.")


def sampled_token_logprobs(scores: tuple[torch.Tensor, ...], tokens: torch.Tensor) -> torch.Tensor:
    """Log-probs ``(B, T)`` of ``tokens`` under the processed scores transformers sampled from (one ``(B, V)`` tensor
    per step: logits after temperature, top-k, top-p, min-p and any other processor), one step at a time."""
    return torch.stack([torch.log_softmax(step.float(), dim=-1).gather(-1, tokens[:, t:t + 1]).squeeze(-1)
                        for t, step in enumerate(scores)], dim=1)


class SampledTokenLogprobs(LogitsProcessor):
    """Records, while transformers generates, the log-prob of each sampled token under the processed scores it was
    sampled from, keeping one step's scores at a time (``output_scores`` keeps every step's ``(B, V)`` scores until
    generation ends: O(T x B x V)).

    It must be the last processor (after temperature, top-k, top-p, min-p and any other): :func:`recording_logprobs`
    appends it to the list transformers builds. A step's sampled token is the last input id of the next call, or the
    last column of the finished sequences for the final step (:meth:`result`). Results go into one ``(B,
    max_new_tokens)`` buffer allocated at the first step: a small tensor kept per step would pin the allocator's heap
    between the large per-step temporaries (measured: 12x the generation's own memory growth instead of 1x)."""

    def __init__(self, max_new_tokens: int):
        self.max_new_tokens = max_new_tokens
        self._last_scores: torch.Tensor | None = None
        self._buffer: torch.Tensor | None = None
        self._steps = 0

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if self._buffer is None:
            self._buffer = torch.empty(scores.size(0), self.max_new_tokens, dtype=torch.float32, device=scores.device)
        self._take(input_ids[:, -1])
        self._last_scores = scores
        return scores

    def _take(self, tokens: torch.Tensor) -> None:
        if self._last_scores is None:
            return
        scores, self._last_scores = self._last_scores, None
        if self._steps >= self.max_new_tokens:
            raise RuntimeError(f"generation ran past max_new_tokens={self.max_new_tokens}")
        picked = torch.log_softmax(scores.float(), dim=-1).gather(-1, tokens[:, None].to(scores.device))
        self._buffer[:, self._steps] = picked.squeeze(-1)
        self._steps += 1

    def result(self, completion_ids: torch.Tensor) -> torch.Tensor:
        """``(B, T)`` log-probs of ``completion_ids`` (the generated columns of the returned sequences)."""
        if completion_ids.size(1):
            self._take(completion_ids[:, -1])
        if self._steps != completion_ids.size(1):  # a transformers change bypassed the processor: say so, loudly
            raise RuntimeError(f"recorded {self._steps} sampling steps for {completion_ids.size(1)} generated "
                               "tokens: transformers did not run the log-prob recorder as the last logits processor")
        if self._buffer is None:
            return torch.zeros(completion_ids.size(0), 0, device=completion_ids.device)
        return self._buffer[:, :self._steps]


@contextmanager
def recording_logprobs(model, max_new_tokens: int):
    """Within the block, ``model.generate`` (at most ``max_new_tokens`` new tokens) records sampled-token log-probs
    into the yielded :class:`SampledTokenLogprobs`. transformers merges processors passed to ``generate`` *before* its
    sampling warpers, so the recorder is appended to the list transformers builds (``_get_logits_processor``, shadowed
    on the instance that generates for this block only)."""
    generating = model.get_base_model() if hasattr(model, "get_base_model") else model  # PEFT delegates generate
    recorder = SampledTokenLogprobs(max_new_tokens)
    build = generating._get_logits_processor

    def with_recorder(*args, **kwargs):
        return LogitsProcessorList([*build(*args, **kwargs), recorder])

    generating._get_logits_processor = with_recorder
    try:
        yield recorder
    finally:
        del generating._get_logits_processor


def generate_single_turns_with(trainer, prompts, generate, plugin_name: str, single_turn):
    """TRL's generation (``generate(prompts)``) with its transformers call replaced, for this one call, by
    ``single_turn(prompt_ids, images, multimodal_fields) -> (completion_ids, logprobs)``. TRL's ``_generate`` calls
    ``self._generate_single_turn``, so the replacement shadows it on the trainer instance. Plain transformers
    generation only: vLLM, continuous batching and tools are refused naming the plugin."""
    if trainer.use_vllm or trainer.use_transformers_continuous_batching or trainer.tools:
        raise RuntimeError(f"plugin {plugin_name!r} supports only plain transformers generation without tools")
    trainer._generate_single_turn = lambda prompt_ids, images, multimodal_fields, num_generations, \
        has_tool_images=False: single_turn(prompt_ids, images, multimodal_fields)
    try:
        return generate(prompts)
    finally:
        del trainer._generate_single_turn


class RolloutLogprobs(Plugin):
    """Sampling log-probs without vLLM (provides the ``sampling_logprobs`` need).

    Replaces TRL's transformers generation for one call (``_generate_single_turn``, text-only path) by the same
    ``model.generate(..., generation_config=trainer.generation_config)`` with a last logits processor that sees the
    processed logits each token was sampled from (temperature, top-k, top-p, min-p applied by transformers), so the
    recorded log-prob is ``log softmax(processed logits)[sampled token]`` of the very step that sampled it, like vLLM's
    ``processed_logprobs`` (the same numbers as ``output_scores``, tested bit for bit). TRL then puts them in the
    batch as ``sampling_per_token_logps`` for the corrections (tis, mis, icepop, rollout_ratio, m2po). Cost: one
    step's ``(B, V)`` scores at a time, not transformers' ``output_scores`` tuple of every step
    (``benchmarks/rollout_logprobs_memory.py``). With ``dtype`` set, generation runs on a copy of the policy in that
    precision, re-synced from the policy whenever the optimizer step changes (as TRL syncs vLLM weights). Refused with
    vLLM (which records them itself), continuous batching, tools or a multimodal processor.
    """

    name = "rollout_logprobs"
    family = "rollout"
    trainers = frozenset({"grpo"})
    slots = frozenset({Slot.GENERATION})
    provides = frozenset({Need.SAMPLING_LOGPROBS})
    Params = RolloutLogprobsParams

    def __init__(self, params=None):
        super().__init__(params)
        self._copy = None
        self._copy_step = None

    @hookimpl
    def trl_ext_validate_stage(self, stage, plugins):
        errors = [f"args.{key}: plugin {self.name!r} records log-probs on the transformers generation path; "
                  f"remove it when `{key}` is set"
                  for key in ("use_vllm", "use_transformers_continuous_batching") if stage.args.get(key)]
        return errors or None

    @hookimpl
    def trl_ext_generate(self, trainer, prompts, generate):
        return generate_single_turns_with(
            trainer, prompts, generate, self.name,
            lambda prompt_ids, images, fields: self._generate_single_turn(trainer, prompt_ids, images, fields))

    def _generation_model(self, trainer, unwrapped):
        dtype = DTYPES.get(self.params.dtype)
        if dtype is None:
            return unwrapped
        step = trainer.state.global_step
        if self._copy is None:
            # Built from the config, not deep-copied: trainers patch `forward` on the policy instance (accelerate's
            # output conversion, TRL's fused head) with closures over the original module, so a deep copy's forward
            # would silently keep running the full-precision policy. Its random initialisation (overwritten next
            # line) must not draw from the global generator: the copy is built at the first rollout of a session, so
            # a run resumed from a checkpoint would build it at another step than the uninterrupted run and sample
            # other tokens from then on.
            devices = [unwrapped.device] if unwrapped.device.type == "cuda" else []
            with torch.random.fork_rng(devices=devices):
                self._copy = type(unwrapped)._from_config(unwrapped.config, dtype=dtype).to(unwrapped.device)
            self._copy.load_state_dict(unwrapped.state_dict())
            self._copy.generation_config = copy.deepcopy(unwrapped.generation_config)
            self._copy.eval()
            self._copy_step = step
        elif self._copy_step != step:
            with torch.no_grad():
                for target, source in zip(self._copy.parameters(), unwrapped.parameters(), strict=True):
                    target.copy_(source)
            self._copy_step = step
        return self._copy

    def _generate_single_turn(self, trainer, prompt_ids, images, multimodal_fields):
        from trl.models import unwrap_model_for_generation
        from trl.trainer.utils import pad

        if images is not None or multimodal_fields:
            raise RuntimeError(f"plugin {self.name!r} does not support multimodal prompts")
        device = trainer.accelerator.device
        tensors = [torch.tensor(ids) for ids in prompt_ids]
        input_ids = pad(tensors, padding_value=trainer._tokenizer.pad_token_id, padding_side="left",
                        pad_to_multiple_of=trainer.pad_to_multiple_of).to(device)
        attention_mask = pad([torch.ones_like(t) for t in tensors], padding_value=0, padding_side="left",
                             pad_to_multiple_of=trainer.pad_to_multiple_of).to(device)
        with (
            unwrap_model_for_generation(
                trainer.model_wrapped, trainer.accelerator, gather_deepspeed3_params=trainer.args.ds3_gather_for_generation,
                generation_kwargs=trainer.generation_kwargs,
                gradient_checkpointing_kwargs=trainer.args.gradient_checkpointing_kwargs,
            ) as unwrapped,
            torch.no_grad(),
        ):
            model = self._generation_model(trainer, unwrapped)
            with recording_logprobs(model, trainer.generation_config.max_new_tokens) as recorder:
                sequences = model.generate(input_ids=input_ids, attention_mask=attention_mask,
                                           generation_config=trainer.generation_config)
        completion_ids = sequences[:, input_ids.size(1):]
        logprobs = recorder.result(completion_ids)
        # Keep tokens up to and including the first EOS, as TRL does.
        is_eos = torch.isin(completion_ids, torch.tensor(trainer.eos_token_ids, device=completion_ids.device))
        lengths = torch.where(is_eos.any(1), is_eos.int().argmax(1) + 1, torch.full_like(is_eos[:, 0], is_eos.size(1),
                                                                                       dtype=torch.long))
        ids = [row[:n].tolist() for row, n in zip(completion_ids.cpu(), lengths.tolist(), strict=True)]
        lps = [row[:n].tolist() for row, n in zip(logprobs.cpu(), lengths.tolist(), strict=True)]
        return ids, lps
