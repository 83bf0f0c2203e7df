"""``routing_replay``: MoE rollout routing replay (R3) and old-policy routing replay (R2) on transformers MoE models."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Literal

import torch
from pydantic import Field

from trl_ext import Plugin, PluginParams, hookimpl
from trl_ext import metrics as figures
from trl_ext_plugins.moe.routing import (GenerationCapture, ModelRouting, align_generation_routes, base_model,
                                         masked_routes, model_refusal)

ROUTES_KEY = "routing_replay_routes"  # RolloutBatch.loss_extras key: (B, P + C, L, k) routes of each row


class RoutingReplayParams(PluginParams):
    mode: Literal["R3", "R2", "measure"] = Field(
        "R3", description="R3: record the routing at rollout (transformers generation) and replay it in the "
                          "old-policy, reference and update forwards. R2: record the old-policy forward's routing "
                          "and replay it in the update forwards of the same batch. measure: record the rollout "
                          "routing and only measure the mismatch (no forward changed; the baseline to compare "
                          "against).")


def _stage_model_config(ref: str):
    """The stage model's transformers config if it can be read without loading weights, else ``None``."""
    from trl_ext.recipe import EMBEDDED_PREFIX, STAGE_PREFIX

    if ref.startswith(STAGE_PREFIX):
        return None  # produced by an earlier stage: checked when the trainer is built
    if ref.startswith(EMBEDDED_PREFIX):
        from trl_ext.embedded.models import embedded_config

        try:
            return embedded_config(ref[len(EMBEDDED_PREFIX):])
        except ValueError:
            return None  # a third-party embedded model
    if (Path(ref) / "config.json").is_file():
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(ref)
    return None


class RoutingReplay(Plugin):
    """Routing replay for mixture-of-experts RL: R3, "Stabilizing MoE Reinforcement Learning by Aligning Training and
    Inference Routers" (Ma et al. 2025, arXiv 2510.11370), and R2, training-side routing replay (GSPO, arXiv
    2507.18071).

    **R3** (``mode: R3``, default) records, during TRL's transformers generation, the top-k experts every router chose
    for every token (prefill for the prompt, one KV-cache decode step per completion token; forward hooks on the
    routers, no second forward) and replays them in the old-policy, reference and update forwards: the selection is
    the recorded one, the gate weights are the family's own formula on the *training* router logits at those experts
    (R3's ``g_i = I_i exp(s_i) / sum_j I_j exp(s_j)`` where the family renormalises), so the router keeps its
    gradient and an unselected expert gets none from that token. **R2** (``mode: R2``) records the old-policy forward's
    routing and replays it in the update forwards of the same batch (needs TRL's old-policy forward, i.e.
    ``num_iterations > 1`` or generation not aligned with optimizer steps; refused otherwise when the trainer is
    built). ``mode: measure`` records and measures only.

    Conventions chosen:

    * Gate renormalisation follows each family as transformers computes it (one function per router in
      :data:`trl_ext_plugins.moe.routing.FAMILIES`): Qwen3-MoE, Qwen2-MoE, OLMoE softmax over all experts, renormalised
      over the selected ones iff ``norm_topk_prob`` (without it the denominator keeps every expert, so unselected
      logits do get gradient, as in the model); Mixtral always renormalised; DeepSeek-V3 sigmoid scores, renormalised
      iff ``norm_topk_prob``, times ``routed_scaling_factor`` (the correction bias only steers selection); GPT-OSS
      softmax over the selected logits. With renormalisation the gate is computed as a softmax over the selected logits
      (exactly zero gradient for the others); equal selections give the model's own weights up to float rounding.
    * Tested families (tiny configs built in code): ``qwen3_moe``, ``qwen2_moe``, ``mixtral``, ``olmoe``,
      ``deepseek_v3``, ``gpt_oss``. Other MoE classes (also subclasses of these routers) and dense models are refused
      with one line naming the class: at validation when the model is an ``embedded:`` name or a local folder,
      otherwise when the trainer is built, before any step.
    * Routes: ``uint8`` (``int16`` above 254 experts) ``(B, P + C, L, k)`` aligned with TRL's padded prompt +
      completion, handed to the loss micro-batches through ``RolloutBatch.loss_extras`` and dropped with the batch;
      positions never routed at rollout (padding, the last sampled token) keep the training forward's own routing.
      ``routing_replay/bytes_per_token`` logs stored bytes per real token.
    * Mismatch (per step): ``routing_replay/mismatch`` and ``.../layer_<l>`` are the fraction of token-layer
      selections (top-k *sets*, over the tokens the forward attends to: padding and completions whose mask TRL or a
      filter zeroed, e.g. ``mask_truncated_completions`` or dropped groups, are neither compared nor replayed, since
      their context differs from the rollout's and they cannot change the loss) where the training router's own
      choice differs from the recorded one, in
      the update forwards (``routing_replay/old_policy/...`` in the old-policy forward). With ``measure`` the forward
      runs its own routing, so this is exactly the mismatch without replay; under replay, a layer's own choice is the
      one its router makes on the replayed upstream states. ``routing_replay/replayed_mismatch`` compares what the
      experts actually received with the recorded routes: exactly 0 under replay. On several processes the counts of
      every rank are summed before the fractions are taken.
    * Rollout source: transformers generation (plain or through ``rollout_logprobs``, whose reduced-precision copy is
      captured too). vLLM in TRL 1.16 does not hand back routed experts, so R3 and ``measure`` are refused with
      ``use_vllm`` (R2 works); multi-turn tool calls, continuous batching and ``partial_rollout`` (resumed
      trajectories) are refused.
    * Router auxiliary loss (only when the model's ``output_router_logits`` makes TRL add it): transformers'
      ``load_balancing_loss_func`` on this forward's router logits, left as it is: its dispatch fractions count the
      training router's own top-k, not the replayed experts (Megatron's router replay counts the replayed routing
      map); the router-probability factor, which carries its gradient, is the same either way.
    * Gradient checkpointing: the routes bound at a forward stay bound until the next top-level forward, so the
      recomputation in backward replays them (a second forward over the whole micro-batch inside the loss, e.g. a
      correction's ``support: sampled`` pass, binds the same routes again). PEFT/LoRA (also on the experts) leaves
      the router modules in place.
    """

    name = "routing_replay"
    aliases = ("r3",)  # R2 is `routing_replay: {mode: R2}`: an alias cannot carry the mode
    family = "moe"
    trainers = frozenset({"grpo"})
    Params = RoutingReplayParams

    def __init__(self, params=None):
        super().__init__(params)
        self.policy: ModelRouting | None = None
        self.reference: ModelRouting | None = None
        self._rollout_routes: torch.Tensor | None = None  # R3/measure: this rank's generation batch
        self._old_routes: torch.Tensor | None = None  # R2: recorded in the old-policy forward

    # -- validation and installation ----------------------------------------------------------------------------------

    @hookimpl
    def trl_ext_validate_stage(self, stage, plugins):
        errors = []
        config = _stage_model_config(stage.model)
        if config is not None:
            architecture = (getattr(config, "architectures", None) or [type(config).__name__])[0]
            reason = model_refusal(getattr(config, "model_type", None), architecture, config)
            if reason:
                errors.append(f"model: plugin {self.name!r}: {reason}")
        if self.params.mode != "R2" and stage.args.get("use_vllm"):
            errors.append(f"args.use_vllm: plugin {self.name!r} mode {self.params.mode}: vLLM as TRL 1.16 drives it "
                          "does not return the routed experts, so the rollout routing cannot be recorded; generate "
                          "with transformers or use mode R2")
        if self.params.mode != "R2" and any(getattr(p, "name", None) == "partial_rollout" for p in plugins):
            errors.append(f"plugins: plugin {self.name!r} mode {self.params.mode} with 'partial_rollout': a resumed "
                          "trajectory's earlier tokens were routed at an earlier step and never kept, and its "
                          "continuation is prefilled after them; use mode R2")
        if stage.args.get("use_transformers_continuous_batching"):
            errors.append(f"args.use_transformers_continuous_batching: plugin {self.name!r} records routing from "
                          "batched transformers generation only")
        return errors or None

    @hookimpl
    def trl_ext_trainer_created(self, trainer):
        self.install(trainer)

    def install(self, trainer) -> None:
        """Hook the policy's (and a separate reference model's) routers; refuses dense / unsupported models and an R2
        setup in which TRL computes no old-policy forward."""
        if self.policy is not None:
            return
        if self.params.mode == "R2":
            generate_every = trainer.args.steps_per_generation * trainer.num_iterations
            if trainer.args.gradient_accumulation_steps % generate_every == 0 and not (
                    trainer.use_vllm and trainer.vllm_importance_sampling_correction):
                raise ValueError(f"plugin {self.name!r} mode R2 replays the old-policy forward's routing, which TRL "
                                 "computes only when a batch is reused (num_iterations > 1, or steps_per_generation "
                                 "not dividing gradient_accumulation_steps); the update is on-policy here: use R3")
        self.policy = ModelRouting(trainer.model)
        ref = getattr(trainer, "ref_model", None)
        if ref is not None:
            self.reference = ModelRouting(ref)

    def _routing_for(self, model) -> ModelRouting:
        if self.reference is not None and base_model(model) is self.reference.model:
            return self.reference
        return self.policy

    # -- the passes ---------------------------------------------------------------------------------------------------

    @hookimpl
    def trl_ext_model_forward(self, trainer, model, phase, inputs):
        self.install(trainer)
        mode = self.params.mode
        if phase == "generate":
            return None if mode == "R2" else self._capture(trainer, inputs)
        routing = self._routing_for(model)
        if phase == "old_policy":
            if mode == "R2":
                return self._pass(trainer, routing, None, "old_policy", inputs["attention_mask"], replay=False,
                                  record=True)
            routes = masked_routes(self._checked(self._rollout_routes, inputs["input_ids"]), inputs["attention_mask"])
            return self._pass(trainer, routing, routes, "old_policy", inputs["attention_mask"], replay=mode == "R3")
        if phase == "reference":
            if mode != "R3":
                return None
            routes = masked_routes(self._checked(self._rollout_routes, inputs["input_ids"]), inputs["attention_mask"])
            return self._pass(trainer, routing, routes, "reference", inputs["attention_mask"], replay=True)
        if phase == "train":
            routes = inputs.get(ROUTES_KEY)
            if routes is None:
                return None
            attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)  # as the loss runs it
            routes = masked_routes(self._checked(routes, attention_mask), attention_mask)
            return self._pass(trainer, routing, routes, "train", None, replay=mode != "measure")
        return None

    def _checked(self, routes: torch.Tensor | None, input_ids: torch.Tensor) -> torch.Tensor:
        if routes is None:
            raise RuntimeError(f"plugin {self.name!r}: no rollout routing was recorded for this batch (was it "
                               "generated by transformers generation in this trainer?)")
        if tuple(routes.shape[:2]) != tuple(input_ids.shape[:2]):
            raise ValueError(f"plugin {self.name!r}: routes of shape {tuple(routes.shape)} do not match the batch "
                             f"{tuple(input_ids.shape[:2])} (rows, prompt + completion positions)")
        return routes

    @contextmanager
    def _capture(self, trainer, inputs):
        if trainer.use_vllm or trainer.use_transformers_continuous_batching:
            raise RuntimeError(f"plugin {self.name!r} mode {self.params.mode} records routing from transformers "
                               "generation only (vLLM and continuous batching return no routed experts)")
        with GenerationCapture(self.policy.dtype) as capture:
            yield
        prompt_ids, completion_ids = inputs["output"][0], inputs["output"][1]
        routes = align_generation_routes(capture.calls, self.policy.num_layers, [len(p) for p in prompt_ids],
                                         [len(c) for c in completion_ids], trainer.pad_to_multiple_of,
                                         self.policy.dtype)
        self._rollout_routes = routes.to(trainer.accelerator.device)

    @contextmanager
    def _pass(self, trainer, routing, routes, phase, attention_mask, *, replay, record=False):
        routing.begin(routes, replay=replay, record=record)
        try:
            yield
        except BaseException:
            routing.abort()
            raise
        recorded, counts = routing.end(attention_mask)
        if record:
            self._old_routes = recorded
        if trainer.accelerator.num_processes > 1:  # TRL logs rank 0's figures: count every rank's tokens
            device = trainer.accelerator.device
            counts = trainer.accelerator.reduce(counts.to(device), reduction="sum").cpu()
        trainer._log_plugin_metrics(mismatch_metrics(counts, phase, replay))

    # -- handing the routes to the loss micro-batches -----------------------------------------------------------------

    @hookimpl
    def trl_ext_filter_groups(self, rewards, batch):
        # Not a filter: the one rollout hook that sees the finished batch before its tensors are split into
        # micro-batches, so the routes travel (shuffled and split with the rows) as a loss extra. Keeps every row.
        routes = self._old_routes if self.params.mode == "R2" else self._rollout_routes
        self._old_routes = self._rollout_routes = None
        if routes is None or batch.prompt_ids is None:
            return None
        expected = (batch.prompt_ids.size(0), batch.prompt_ids.size(1) + batch.completion_ids.size(1))
        if tuple(routes.shape[:2]) != expected:
            raise ValueError(f"plugin {self.name!r}: routes of shape {tuple(routes.shape)} do not match the batch "
                             f"{expected} (rows, prompt + completion positions)")
        batch.loss_extras[ROUTES_KEY] = routes
        tokens = batch.prompt_mask.sum() + batch.completion_mask.sum()
        batch.metrics["routing_replay/bytes_per_token"] = figures.mean(float(routes.nbytes), tokens)  # all ranks
        return None


def mismatch_metrics(counts: torch.Tensor, phase: str, replay: bool) -> dict[str, float]:
    """Metric dict from per-layer counts ``(L, 3)`` = (own choice differs, compared, experts' input differs)."""
    compared = counts[:, 1].sum().item()
    if not compared:
        return {}
    prefix = "routing_replay/" if phase == "train" else f"routing_replay/{phase}/"
    metrics = {f"{prefix}mismatch": counts[:, 0].sum().item() / compared}
    for layer, (differs, seen, _) in enumerate(counts.tolist()):
        metrics[f"{prefix}mismatch/layer_{layer}"] = differs / max(seen, 1)
    if replay:
        metrics[f"{prefix}replayed_mismatch"] = counts[:, 2].sum().item() / compared
    return metrics
