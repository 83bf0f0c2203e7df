"""Routing replay math and hooks, without a trainer: R3 gate numbers by hand (ALGORITHMS.md item 45), gradients,
equality with native routing, replay on every supported transformers MoE family, alignment of generation routes,
and clear refusals."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import (
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    GptOssConfig,
    GptOssForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    OlmoeConfig,
    OlmoeForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
)

from trl_ext.embedded.models import build_model
from trl_ext_plugins.moe import routing
from trl_ext_plugins.moe.routing import ModelRouting, align_generation_routes, softmax_gates

S_TRAIN = torch.tensor([[2.0, 1.0, 0.5, 0.1]])
PICKED = torch.tensor([[0, 2]])  # inference chose {0, 2}; training's own top-2 would be {0, 1}


def test_r3_gate_numbers_by_hand():
    # g_i = I_i exp(s_i) / sum_j I_j exp(s_j): e^2 / (e^2 + e^0.5) and e^0.5 / (e^2 + e^0.5)
    expected = [math.exp(2.0) / (math.exp(2.0) + math.exp(0.5)), math.exp(0.5) / (math.exp(2.0) + math.exp(0.5))]
    assert expected == pytest.approx([0.817574, 0.182426], abs=1e-6)
    gates = softmax_gates(S_TRAIN, PICKED, renormalize=True)
    assert gates[0].tolist() == pytest.approx(expected, abs=1e-6)
    dense = torch.zeros(4).scatter(0, PICKED[0], gates[0])
    assert dense.tolist() == pytest.approx([0.817574, 0.0, 0.182426, 0.0], abs=1e-6)


def test_r3_gradient_zero_for_unselected_logit_and_present_for_selected():
    s = S_TRAIN.clone().requires_grad_(True)
    gates = softmax_gates(s, PICKED, renormalize=True)
    (gates * torch.tensor([[1.0, 3.0]])).sum().backward()  # a loss that depends on the gates
    assert s.grad[0, 1] == 0.0 and s.grad[0, 3] == 0.0  # training's own pick (1) and the never-picked expert
    g0, g2 = gates[0].tolist()
    # d/ds_0 (g0 + 3 g2) = g0 (1 - g0) - 3 g0 g2 ; d/ds_2 = -g0 g2 + 3 g2 (1 - g2)
    assert s.grad[0, 0].item() == pytest.approx(g0 * (1 - g0) - 3 * g0 * g2, abs=1e-6)
    assert s.grad[0, 2].item() == pytest.approx(-g0 * g2 + 3 * g2 * (1 - g2), abs=1e-6)


def test_without_renormalisation_the_family_denominator_keeps_every_expert():
    gates = softmax_gates(S_TRAIN, PICKED, renormalize=False)
    total = sum(math.exp(v) for v in [2.0, 1.0, 0.5, 0.1])
    assert gates[0].tolist() == pytest.approx([math.exp(2.0) / total, math.exp(0.5) / total], abs=1e-6)


def test_same_selection_equals_the_routers_own_weights():
    model = build_model("tiny-qwen3-moe", seed=0)
    router = model.model.layers[0].mlp.gate
    torch.nn.init.normal_(router.weight)
    hidden = torch.randn(9, router.hidden_dim)
    logits, weights, indices = router(hidden)
    assert torch.allclose(routing.FAMILIES["qwen3_moe"].gates(router, logits, indices), weights, atol=1e-6, rtol=0)


# -- every supported family -------------------------------------------------------------------------------------------

COMMON = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, vocab_size=64,
              max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def _family_models():
    return {
        "qwen3_moe": lambda: build_model("tiny-qwen3-moe", seed=0),
        "qwen2_moe": lambda: Qwen2MoeForCausalLM(Qwen2MoeConfig(
            **COMMON, intermediate_size=64, moe_intermediate_size=32, shared_expert_intermediate_size=32,
            num_experts=4, num_experts_per_tok=2, norm_topk_prob=False)),
        "mixtral": lambda: MixtralForCausalLM(MixtralConfig(
            **COMMON, intermediate_size=64, num_local_experts=4, num_experts_per_tok=2)),
        "olmoe": lambda: OlmoeForCausalLM(OlmoeConfig(
            **COMMON, intermediate_size=64, num_experts=4, num_experts_per_tok=2)),
        "deepseek_v3": lambda: DeepseekV3ForCausalLM(DeepseekV3Config(
            **{**COMMON, "num_key_value_heads": 2}, intermediate_size=64, moe_intermediate_size=32, n_routed_experts=4,
            num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=0, q_lora_rank=None,
            kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, n_shared_experts=1,
            routed_scaling_factor=2.5, norm_topk_prob=True)),
        "gpt_oss": lambda: GptOssForCausalLM(GptOssConfig(
            **COMMON, head_dim=16, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2)),
    }


def _expected_gates(model_type, router, logits, idx):
    """Each family's gate formula, written out from its transformers forward (independent of routing.FAMILIES)."""
    logits = logits.float()
    if model_type == "deepseek_v3":
        w = torch.sigmoid(logits).gather(1, idx)
        return w / (w.sum(-1, keepdim=True) + 1e-20) * router.routed_scaling_factor
    if model_type == "gpt_oss":
        return torch.exp(logits.gather(1, idx)) / torch.exp(logits.gather(1, idx)).sum(-1, keepdim=True)
    w = torch.exp(logits).gather(1, idx) / torch.exp(logits).sum(-1, keepdim=True)
    renormalize = model_type == "mixtral" or router.norm_topk_prob
    return w / w.sum(-1, keepdim=True) if renormalize else w


# Tolerances per training precision: outputs of the same routing computed twice, gates against the formula.
TOLERANCE = {torch.float32: (1e-6, 1e-5), torch.bfloat16: (0.0, 2e-2)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("model_type", ["qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "deepseek_v3", "gpt_oss"])
def test_replay_on_each_family(model_type, dtype):
    same_atol, gate_atol = TOLERANCE[dtype]
    torch.manual_seed(0)
    model = _family_models()[model_type]().to(dtype)
    assert model.config.model_type == model_type
    for module in model.modules():  # spread the (zero-initialised) routers so top-k has no ties
        if type(module) in routing.router_classes():
            torch.nn.init.normal_(module.weight, std=1.0)
    state = ModelRouting(model)
    assert state.num_layers == 2 and state.top_k == 2 and state.dtype == torch.uint8
    ids = torch.randint(3, 64, (2, 6))
    mask = torch.ones_like(ids)

    state.begin(None, replay=False, record=True)
    native = model(input_ids=ids, attention_mask=mask).logits
    recorded, _ = state.end(mask)
    assert recorded.shape == (2, 6, 2, 2) and recorded.dtype == torch.uint8

    # Replaying the model's own routing changes nothing.
    state.begin(recorded, replay=True, record=False)
    same = model(input_ids=ids, attention_mask=mask).logits
    _, counts = state.end()
    assert torch.allclose(same, native, atol=same_atol) and counts[:, 0].sum() == 0 and counts[:, 2].sum() == 0

    # Forcing other experts: the experts receive exactly them, with the family's gates on this forward's logits.
    forced = ((recorded.long() + 1) % 4).to(torch.uint8)
    seen = []
    parents = {id(c): p for p in model.modules() for c in p.children()}
    handles = []
    for router, _family in state.routers:
        handles.append(router.register_forward_pre_hook(lambda m, a: seen.append(("in", m, a[0]))))
        experts = parents[id(router)].experts
        handles.append(experts.register_forward_pre_hook(lambda m, a: seen.append(("ex", a[1], a[2]))))
    for p in model.parameters():
        p.grad = None
    state.begin(forced, replay=True, record=False)
    out = model(input_ids=ids, attention_mask=mask).logits
    _, counts = state.end()
    for h in handles:
        h.remove()
    assert not torch.allclose(out, native, atol=1e-4)
    assert counts[:, 0].sum() == counts[:, 1].sum() == 2 * 6 * 2  # every own choice differs from the forced one
    assert counts[:, 2].sum() == 0  # what the experts got is the forced routing
    for layer in range(2):
        (_, router, hidden), (_, idx, weights) = seen[2 * layer], seen[2 * layer + 1]
        assert torch.equal(idx.long(), forced[:, :, layer].reshape(-1, 2).long())
        hidden = hidden.reshape(-1, router.hidden_dim)
        bias = getattr(router, "bias", None)
        bias = None if bias is None else bias.float()
        logits = torch.nn.functional.linear(hidden.float(), router.weight.float(), bias)
        expected = _expected_gates(model_type, router, logits, idx.long())
        assert torch.allclose(weights.float(), expected, atol=gate_atol)
    out.sum().backward()
    for router, _family in state.routers:
        assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0  # the router still learns
    state.remove()


def test_unselected_expert_gets_zero_gradient_from_replayed_tokens():
    torch.manual_seed(0)
    model = build_model("tiny-qwen3-moe", seed=0)
    state = ModelRouting(model)
    ids = torch.randint(3, 30, (1, 5))
    routes = torch.zeros(1, 5, state.num_layers, 2, dtype=torch.uint8)
    routes[..., 1] = 2  # every token, every layer: experts {0, 2}
    state.begin(routes, replay=True, record=False)
    model(input_ids=ids).logits.sum().backward()
    state.end()
    experts = model.model.layers[0].mlp.experts
    assert experts.gate_up_proj.grad[[1, 3]].abs().sum() == 0 and experts.down_proj.grad[[1, 3]].abs().sum() == 0
    assert experts.gate_up_proj.grad[[0, 2]].abs().sum() > 0
    state.remove()


# -- alignment of generation routes with TRL's layout -----------------------------------------------------------------


def test_generation_routes_align_with_trl_padding():
    # 2 prompts (lengths 3 and 1, left-padded to 3), 2 layers, top-1; completions of 3 and 2 tokens: 2 decode steps.
    L, sentinel = 2, 255

    def call(values):
        return torch.tensor(values, dtype=torch.uint8).reshape(-1, 1)

    prefill = [call([10, 11, 12, 90, 90, 13]), call([20, 21, 22, 91, 91, 23])]  # rows x positions, per layer
    step1 = [call([30, 31]), call([40, 41])]
    step2 = [call([32, 33]), call([42, 43])]
    routes = align_generation_routes(prefill + step1 + step2, L, [3, 1], [3, 2], None, torch.uint8)
    assert routes.shape == (2, 3 + 3, L, 1)
    assert routes[0, :, 0, 0].tolist() == [10, 11, 12, 30, 32, sentinel]  # last sampled token never routed
    assert routes[1, :, 0, 0].tolist() == [sentinel, sentinel, 13, 31, 33, sentinel]  # completion of 2: pad after
    assert routes[0, :, 1, 0].tolist() == [20, 21, 22, 40, 42, sentinel]
    padded = align_generation_routes(prefill + step1 + step2, L, [3, 1], [3, 2], 4, torch.uint8)
    assert padded.shape == (2, 8, L, 1) and padded[1, 3, 0, 0] == 13 and padded[1, 4, 0, 0] == 31


def test_generation_routes_refuse_what_is_not_one_batched_generation():
    calls = [torch.zeros(6, 1, dtype=torch.uint8)] * 2 + [torch.zeros(3, 1, dtype=torch.uint8)] * 2
    with pytest.raises(RuntimeError, match="not one batched generation"):
        align_generation_routes(calls, 2, [3, 1], [2, 2], None, torch.uint8)


def test_generation_routes_refuse_completions_longer_than_the_decode_steps():
    # A continued trajectory (earlier tokens from an earlier generation): 3 completion tokens need 2 decode steps.
    calls = [torch.zeros(6, 1, dtype=torch.uint8)] * 2 + [torch.zeros(2, 1, dtype=torch.uint8)] * 2  # 1 decode step
    with pytest.raises(RuntimeError, match="1 decode steps .* completions of up to 3 tokens"):
        align_generation_routes(calls, 2, [3, 1], [3, 2], None, torch.uint8)
    assert align_generation_routes(calls, 2, [3, 1], [2, 2], None, torch.uint8).shape == (2, 5, 2, 1)


def test_route_dtype_grows_past_254_experts():
    assert routing.route_dtype(4) == torch.uint8 and routing.route_dtype(256) == torch.int16
    assert routing.unrecorded(torch.uint8) == 255


# -- refusals ----------------------------------------------------------------------------------------------------------


def test_dense_model_is_refused_naming_its_class():
    with pytest.raises(ValueError, match="Qwen2ForCausalLM is dense"):
        ModelRouting(build_model("tiny-qwen2"))


def test_unsupported_moe_class_is_refused_naming_it():
    from transformers import PhimoeConfig, PhimoeForCausalLM

    model = PhimoeForCausalLM(PhimoeConfig(**COMMON, intermediate_size=64, num_local_experts=4, num_experts_per_tok=2))
    with pytest.raises(ValueError, match="unsupported mixture-of-experts model class PhimoeForCausalLM"):
        ModelRouting(model)


def test_routes_that_do_not_match_the_batch_are_refused():
    model = build_model("tiny-qwen3-moe", seed=0)
    state = ModelRouting(model)
    with pytest.raises(ValueError, match="do not fit this model"):
        state.begin(torch.zeros(2, 5, 3, 2, dtype=torch.uint8), replay=True, record=False)  # 3 layers, model has 2
    state.begin(torch.zeros(2, 5, 2, 2, dtype=torch.uint8), replay=True, record=False)
    with pytest.raises(ValueError, match="do not match the batch"):
        model(input_ids=torch.ones(2, 7, dtype=torch.long))  # 7 positions, routes have 5
    state.abort()
    state.remove()


def test_dense_qwen2_config_check_is_a_one_liner():
    reason = routing.model_refusal("qwen2", "Qwen2ForCausalLM", Qwen2Config())
    assert "dense" in reason and "\n" not in reason
    assert routing.model_refusal("qwen3_moe", "Qwen3MoeForCausalLM", None) is None
    assert Qwen2ForCausalLM  # the dense class named above exists in this transformers


def test_bfloat16_alone_routes_some_tokens_of_the_tiny_moe_elsewhere():
    # The mismatch routing replay exists for: the same weights in bfloat16 (a rollout engine) and float32 (training).
    fp32 = build_model("tiny-qwen3-moe", seed=0)
    bf16 = build_model("tiny-qwen3-moe", seed=0).to(torch.bfloat16)
    ids = torch.randint(3, 30, (16, 14), generator=torch.Generator().manual_seed(0))
    routes = []
    for model in (fp32, bf16):
        state = ModelRouting(model)
        state.begin(None, replay=False, record=True)
        with torch.no_grad():
            model(input_ids=ids)
        routes.append(state.end(torch.ones_like(ids))[0])
        state.remove()
    differs = routing.selection_differs(routes[0].reshape(-1, 2).long(), routes[1].reshape(-1, 2).long())
    assert 0 < differs.float().mean() < 0.05
