"""MoE routing capture and replay at the transformers router modules (the math and the hooks; no trainer code).

Seam: in transformers 5.24 every supported family computes its top-k routing in one router module per MoE layer
(``Qwen3MoeTopKRouter`` at ``model.model.layers[i].mlp.gate``, ``GptOssTopKRouter`` at ``...mlp.router``, ...) whose
``forward`` returns ``(router_logits, top_k_weights, top_k_indices)``, and the MoE block passes the last two to its
experts. A forward hook on the router can therefore *record* the indices, or *replace* the output: the indices by the
recorded ones and the weights by the family's own gate formula evaluated on this forward's logits at those indices
(:data:`FAMILIES`), so the router keeps its gradient and no transformers code is copied or patched.

Routes are stored as small integers, ``(B, T, L, k)`` = (rows, prompt+completion positions, MoE layers, top-k), in
``uint8`` (``int16`` for more than 254 experts); the dtype's maximum marks a position whose routing was not recorded
(padding, and the last sampled token, which generation never feeds back): there the forward keeps its own routing,
which cannot change any scored log-prob (padding is masked, and the last position only predicts past the completion).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn


# --------------------------------------------------------------------------------------------------------------------
# Gate weights over given experts, one formula per router convention (pure functions of the training logits)
# --------------------------------------------------------------------------------------------------------------------


def softmax_gates(logits: torch.Tensor, indices: torch.Tensor, renormalize: bool,
                  out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Softmax router gates at ``indices`` (float32 math, cast to ``out_dtype``).

    ``renormalize`` (``norm_topk_prob``): R3's ``g_i = I_i exp(s_i) / sum_j I_j exp(s_j)`` (arXiv 2510.11370),
    computed as a softmax over the selected logits only, so an unselected expert's logit gets exactly zero gradient
    (the routers' own softmax-then-renormalise is the same value up to float rounding, ~1e-7). Without it (Qwen and
    OLMoE with ``norm_topk_prob=False``) the weight is the softmax over all experts at ``indices``, as those families
    compute it, and unselected logits do get gradient through the denominator.
    """
    if renormalize:
        weights = torch.softmax(logits.gather(-1, indices), dim=-1, dtype=torch.float)
    else:
        weights = torch.softmax(logits, dim=-1, dtype=torch.float).gather(-1, indices)
    return weights if out_dtype is None else weights.to(out_dtype)


def sigmoid_gates(logits: torch.Tensor, indices: torch.Tensor, renormalize: bool, scale: float) -> torch.Tensor:
    """DeepSeek-V3: sigmoid scores at ``indices`` (the score-correction bias steers only the choice, not the
    weight), renormalised (``+1e-20`` as the model does) when ``norm_topk_prob``, times ``routed_scaling_factor``.
    Each weight depends only on the selected logits."""
    weights = logits.sigmoid().gather(1, indices)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scale


def selected_softmax_gates(logits: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """GPT-OSS: softmax over the selected experts' logits only (top-k first, then softmax)."""
    top = logits.gather(-1, indices)
    return torch.softmax(top, dim=1, dtype=top.dtype)


@dataclass(frozen=True)
class RouterFamily:
    """A transformers MoE family whose router module returns ``(logits, top_k_weights, top_k_indices)``."""

    model_type: str  # config.model_type
    module: str  # where the router class lives
    router_class: str
    gates: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]  # (router, logits, indices) -> weights

    def load(self) -> type:
        return getattr(importlib.import_module(self.module), self.router_class)


_M = "transformers.models"
FAMILIES: dict[str, RouterFamily] = {f.model_type: f for f in [
    RouterFamily("qwen3_moe", f"{_M}.qwen3_moe.modeling_qwen3_moe", "Qwen3MoeTopKRouter",
                 lambda r, s, i: softmax_gates(s, i, r.norm_topk_prob, s.dtype)),
    RouterFamily("qwen2_moe", f"{_M}.qwen2_moe.modeling_qwen2_moe", "Qwen2MoeTopKRouter",
                 lambda r, s, i: softmax_gates(s, i, r.norm_topk_prob, s.dtype)),
    RouterFamily("olmoe", f"{_M}.olmoe.modeling_olmoe", "OlmoeTopKRouter",
                 lambda r, s, i: softmax_gates(s, i, r.norm_topk_prob, s.dtype)),
    # Mixtral always renormalises and keeps the float32 weights.
    RouterFamily("mixtral", f"{_M}.mixtral.modeling_mixtral", "MixtralTopKRouter",
                 lambda r, s, i: softmax_gates(s.float(), i, True)),
    RouterFamily("deepseek_v3", f"{_M}.deepseek_v3.modeling_deepseek_v3", "DeepseekV3TopkRouter",
                 lambda r, s, i: sigmoid_gates(s, i, r.norm_topk_prob, r.routed_scaling_factor)),
    RouterFamily("gpt_oss", f"{_M}.gpt_oss.modeling_gpt_oss", "GptOssTopKRouter",
                 lambda r, s, i: selected_softmax_gates(s, i)),
]}

# Config fields that make a transformers config a mixture of experts (used to tell "dense" from "unsupported MoE").
EXPERT_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


def router_classes() -> dict[type, RouterFamily]:
    return {family.load(): family for family in FAMILIES.values()}


def model_refusal(model_type: str | None, architecture: str, config) -> str | None:
    """``None`` when routing replay supports the model, else the one-line reason (dense or unsupported MoE)."""
    if model_type in FAMILIES:
        return None
    supported = ", ".join(sorted(FAMILIES))
    if any(getattr(config, name, None) for name in EXPERT_FIELDS):
        return (f"unsupported mixture-of-experts model class {architecture} (model_type {model_type!r}); routing "
                f"replay supports the model types {supported}")
    return (f"model class {architecture} is dense (no mixture-of-experts router); routing replay needs an MoE model "
            f"of a supported type ({supported})")


# --------------------------------------------------------------------------------------------------------------------
# Routes: storage dtype, sentinel, comparison, alignment of what generation recorded
# --------------------------------------------------------------------------------------------------------------------


def route_dtype(num_experts: int) -> torch.dtype:
    """Smallest integer dtype holding expert ids plus the "not recorded" sentinel (its maximum)."""
    return torch.uint8 if num_experts < torch.iinfo(torch.uint8).max else torch.int16


def unrecorded(dtype: torch.dtype) -> int:
    return torch.iinfo(dtype).max


def selection_differs(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``(N,)`` bool: the top-k expert *sets* of two ``(N, k)`` selections differ (order within top-k is ignored)."""
    return (a.sort(dim=-1).values != b.sort(dim=-1).values).any(dim=-1)


def masked_routes(routes: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """``routes`` with the positions the forward's ``attention_mask`` hides (padding, and completions TRL or a filter
    masked: truncated, dropped groups) marked unrecorded: those tokens are no key of any other token and score no
    log-prob, so their routing cannot change the loss, and the forward's own routing of a token whose context differs
    from the rollout's must not count as a mismatch."""
    keep = attention_mask.to(routes.device).bool()[..., None, None]
    return torch.where(keep, routes, torch.full_like(routes, unrecorded(routes.dtype)))


def _round_up(n: int, multiple: int | None) -> int:
    return n if not multiple else -(-n // multiple) * multiple


def align_generation_routes(calls: list[torch.Tensor], num_layers: int, prompt_lengths: list[int],
                            completion_lengths: list[int], pad_to_multiple_of: int | None,
                            dtype: torch.dtype) -> torch.Tensor:
    """Routes ``(B, P + C, L, k)`` in TRL's training layout from the router outputs of one batched generation.

    ``calls`` are the top-k index tensors in call order: each model forward calls the ``L`` routers in layer order, the
    first forward (prefill) with ``B x P_gen`` left-padded prompt tokens, every later one (a KV-cache decode step) with
    ``B`` tokens, the token sampled at the previous step. Completion token ``j`` is therefore routed at decode step
    ``j + 1``; the last sampled token never is (left unrecorded). TRL pads prompts left to ``P`` and completions right
    to ``C`` (each rounded up to ``pad_to_multiple_of``), which this reproduces.
    """
    batch = len(prompt_lengths)
    if not calls or len(calls) % num_layers:
        raise RuntimeError(f"routing_replay: generation called {len(calls)} routers, not a multiple of the model's "
                           f"{num_layers} MoE layers")
    steps = [torch.stack(calls[i:i + num_layers], dim=1) for i in range(0, len(calls), num_layers)]  # (n, L, k) each
    prefill, decode = steps[0], steps[1:]
    if prefill.shape[0] % batch or any(step.shape[0] != batch for step in decode):
        raise RuntimeError("routing_replay: the recorded routing is not one batched generation of "
                           f"{batch} prompts (multi-turn, tool calls and continuous batching are not supported)")
    prefill = prefill.reshape(batch, -1, num_layers, prefill.shape[-1])
    decoded = torch.stack(decode, dim=1) if decode else prefill[:, :0]
    if max(completion_lengths, default=0) > decoded.shape[1] + 1 or max(prompt_lengths, default=0) > prefill.shape[1]:
        # a completion token this generation never fed back, or a prompt longer than the prefill: the tokens were
        # not all produced by this one generation (e.g. a continued trajectory), so the routes cannot be placed
        raise RuntimeError(f"routing_replay: generation fed {decoded.shape[1]} decode steps after a prefill of "
                           f"{prefill.shape[1]} positions, too few for prompts of up to {max(prompt_lengths)} and "
                           f"completions of up to {max(completion_lengths)} tokens")
    width_p, width_c = _round_up(max(prompt_lengths), pad_to_multiple_of), _round_up(max(completion_lengths),
                                                                                      pad_to_multiple_of)
    routes = torch.full((batch, width_p + width_c, num_layers, prefill.shape[-1]), unrecorded(dtype), dtype=dtype,
                        device=prefill.device)
    for row, (n_p, n_c) in enumerate(zip(prompt_lengths, completion_lengths, strict=True)):
        if n_p:
            routes[row, width_p - n_p:width_p] = prefill[row, prefill.shape[1] - n_p:]
        fed = min(n_c, decoded.shape[1])  # the last sampled token is never fed back
        routes[row, width_p:width_p + fed] = decoded[row, :fed]
    return routes


# --------------------------------------------------------------------------------------------------------------------
# Hooks on one model
# --------------------------------------------------------------------------------------------------------------------


def base_model(model: nn.Module) -> nn.Module:
    """The transformers model under DDP/accelerate and PEFT wrappers."""
    while hasattr(model, "module") and isinstance(model.module, nn.Module):  # DDP / DataParallel
        model = model.module
    get_base = getattr(model, "get_base_model", None)  # PEFT
    return get_base() if callable(get_base) else model


def describe(model: nn.Module) -> tuple[str | None, str]:
    config = getattr(model, "config", None)
    return getattr(config, "model_type", None), type(model).__name__


class GenerationCapture:
    """Records the top-k indices of every supported router called while active (a process-wide module hook, so a
    generation copy of the policy, e.g. ``rollout_logprobs``'s reduced-precision one, is captured too)."""

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype
        self.types = tuple(router_classes())
        self.calls: list[torch.Tensor] = []
        self._handle = None

    def _hook(self, module, args, output):
        if type(module) in self.types:
            self.calls.append(output[2].detach().to(self.dtype))

    def __enter__(self):
        self.calls = []
        self._handle = nn.modules.module.register_module_forward_hook(self._hook)
        return self

    def __exit__(self, *exc):
        self._handle.remove()
        return False


class ModelRouting:
    """Forward hooks on one model's routers: record them, measure them against given routes, or replay those routes.

    A *plan* (routes ``(B, T, L, k)`` for the rows of one pass) is consumed in row order by the model's own forward
    calls (TRL scores a generation batch in chunks of ``batch_size`` rows): a pre-hook on the top module binds the next
    rows to the routers at each call; a further forward over all ``B`` rows after they are consumed binds them again.
    The binding stays until the next top-level forward, so a gradient-checkpointing recomputation during backward
    (which re-runs the layers but not the top module) replays the same routes.
    """

    def __init__(self, model: nn.Module):
        self.model = base_model(model)
        families = router_classes()
        self.routers: list[tuple[nn.Module, RouterFamily]] = [
            (m, families[type(m)]) for m in self.model.modules() if type(m) in families]
        if not self.routers:
            model_type, architecture = describe(self.model)
            reason = model_refusal(model_type, architecture, getattr(self.model, "config", None))
            raise ValueError(f"plugin 'routing_replay': {reason or f'no supported router found in {architecture}'}")
        first = self.routers[0][0]
        self.top_k, self.num_experts = first.top_k, first.num_experts
        self.num_layers = len(self.routers)
        self.dtype = route_dtype(self.num_experts)
        self.sentinel = unrecorded(self.dtype)
        self.plan: torch.Tensor | None = None
        self.replay = False
        self.cursor = 0
        self.bound: torch.Tensor | None = None
        self.recorded: list[list[torch.Tensor]] | None = None
        self.counts = torch.zeros(self.num_layers, 3, dtype=torch.long)  # mismatched, compared, replayed-mismatched
        self._handles = [self.model.register_forward_pre_hook(self._bind, with_kwargs=True)]
        parents = {id(child): parent for parent in self.model.modules() for child in parent.children()}
        for layer, (router, _family) in enumerate(self.routers):
            self._handles.append(router.register_forward_hook(self._routing_hook(layer)))
            experts = getattr(parents.get(id(router)), "experts", None)
            if isinstance(experts, nn.Module):
                self._handles.append(experts.register_forward_pre_hook(self._experts_hook(layer)))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()

    # -- passes -------------------------------------------------------------------------------------------------------

    def begin(self, routes: torch.Tensor | None, replay: bool, record: bool) -> None:
        """Start a pass: ``routes`` (or ``None``) to compare against and, when ``replay``, to force; ``record`` keeps
        this pass's own routing (R2)."""
        if routes is not None:
            expected = (self.num_layers, self.top_k)
            if routes.dim() != 4 or tuple(routes.shape[2:]) != expected:
                raise ValueError(f"routing_replay: routes of shape {tuple(routes.shape)} do not fit this model "
                                 f"((rows, positions, {expected[0]} MoE layers, top-{expected[1]}) expected)")
        self.plan, self.replay, self.cursor = routes, replay and routes is not None, 0
        self.recorded = [[] for _ in self.routers] if record else None
        self.counts.zero_()

    def abort(self) -> None:
        """Drop a pass that raised."""
        self.plan, self.recorded, self.bound = None, None, None

    def end(self, attention_mask: torch.Tensor | None = None) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Finish a pass: ``(recorded routes (B, T, L, k) or None, counts (L, 3))``. Padding (``attention_mask`` 0) is
        stored as unrecorded. The routers stay bound for a recomputation (see the class docstring)."""
        if self.plan is not None and self.cursor != self.plan.shape[0]:
            rows = self.plan.shape[0]
            self.plan = None
            raise ValueError(f"routing_replay: routes for {rows} rows but the pass ran {self.cursor} rows")
        self.plan = None
        recorded = None
        if self.recorded is not None:
            recorded = torch.stack([torch.cat(chunks) for chunks in self.recorded], dim=1)  # (B*T, L, k)
            self.recorded = None
            if attention_mask is not None:
                recorded = recorded.reshape(*attention_mask.shape, self.num_layers, self.top_k)
                keep = attention_mask.to(recorded.device).bool()[..., None, None]
                recorded = torch.where(keep, recorded, torch.full_like(recorded, self.sentinel))
        return recorded, self.counts.clone()

    # -- hooks --------------------------------------------------------------------------------------------------------

    def _bind(self, module, args, kwargs):
        if self.plan is None:
            self.bound = None
            return None
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is None:
            ids = kwargs["inputs_embeds"]
        rows, positions = ids.shape[:2]
        if self.cursor == self.plan.shape[0] == rows:
            # Another forward over all the pass's rows once they are consumed: a loss plugin's extra forward of the
            # same micro-batch (e.g. a correction's no-grad pi_old on the sampler's support) replays the same routes,
            # and leaves them bound for the recomputation of the loss forward.
            self.cursor = 0
        routes = self.plan[self.cursor:self.cursor + rows]
        if routes.shape[:2] != (rows, positions):
            raise ValueError(f"routing_replay: routes of shape {tuple(self.plan.shape)} do not match the batch: rows "
                             f"{self.cursor}:{self.cursor + rows} of a forward over {rows} x {positions} tokens")
        self.cursor += rows
        self.bound = routes
        return None

    def _routing_hook(self, layer: int):
        def hook(router, args, output):
            logits, _weights, indices = output
            if self.recorded is not None:
                self.recorded[layer].append(indices.detach().to(self.dtype))
            if self.bound is None:
                return None
            given = self.bound[:, :, layer].reshape(-1, self.top_k).to(indices.device)
            if given.shape[0] != indices.shape[0]:
                raise ValueError(f"routing_replay: layer {layer} routes {indices.shape[0]} tokens but "
                                 f"{given.shape[0]} routes are bound")
            known = (given != self.sentinel).all(dim=-1)
            with torch.no_grad():
                self.counts[layer, 0] += (selection_differs(indices, given.long()) & known).sum().cpu()
                self.counts[layer, 1] += known.sum().cpu()
            if not self.replay:
                return None
            chosen = torch.where(known.unsqueeze(-1), given.long(), indices)
            return logits, self.routers[layer][1].gates(router, logits, chosen), chosen
        return hook

    def _experts_hook(self, layer: int):
        # What the experts actually receive: the replayed forward's mismatch, measured where it matters.
        def hook(experts, args):
            if self.bound is None or not self.replay or len(args) < 2:
                return None
            given = self.bound[:, :, layer].reshape(-1, self.top_k).to(args[1].device)
            known = (given != self.sentinel).all(dim=-1)
            with torch.no_grad():
                self.counts[layer, 2] += (selection_differs(args[1], given.long()) & known).sum().cpu()
            return None
        return hook
