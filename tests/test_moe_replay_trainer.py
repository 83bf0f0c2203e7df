"""routing_replay on a real ExtGRPOTrainer with the embedded tiny Qwen3-MoE (CPU).

A real mismatch: rollouts sampled by a bfloat16 copy of the policy (``rollout_logprobs``) and scored in float32 route
some tokens to other experts; ``measure`` sees it, R3 replays the rollout routing so the experts of every training
forward receive exactly the recorded experts (checked at the experts' input, independently of the plugin's counters).
Also: R2 after a policy change, gradient checkpointing, PEFT LoRA on the experts (and the PEFT reference pass),
composition with dapo + tis / icepop, and the refusals.
"""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoTokenizer, PhimoeConfig
from trl import GRPOConfig

from trl_ext.catalog import Catalog
from trl_ext.embedded.arithmetic import arithmetic_dataset
from trl_ext.embedded.models import materialize_model
from trl_ext.errors import RecipeError
from trl_ext.host import PluginHost
from trl_ext.recipe import StageSpec
from trl_ext.stage import resolve_stage
from trl_ext.trainers.grpo import ExtGRPOTrainer
from trl_ext_plugins.corrections.icepop import IcePop
from trl_ext_plugins.corrections.tis import TIS
from trl_ext_plugins.losses.dapo import DAPO
from trl_ext_plugins.moe.routing_replay import ROUTES_KEY, RoutingReplay
from trl_ext_plugins.rollout.rollout_logprobs import RolloutLogprobs

ROWS = 16  # 8 prompts x 2 completions


def length_reward(completions, **kwargs):
    return [float(sum(map(ord, c)) % 3) for c in completions]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(materialize_model("tiny-qwen3-moe", tmp_path_factory.mktemp("moe") / "model"))


def build(model_dir, tmp_path, plugins, peft_config=None, **overrides):
    args = dict(output_dir=str(tmp_path / "out"), per_device_train_batch_size=ROWS, num_generations=2,
                max_completion_length=6, max_steps=1, bf16=False, use_cpu=True, report_to="none",
                gradient_checkpointing=False, temperature=1.0, logging_steps=1, seed=0, loss_type="grpo",
                num_iterations=2)
    args.update(overrides)
    host = PluginHost(plugins)
    for impl in reversed(host.pm.hook.trl_ext_configure_args.get_hookimpls()):
        args.update(impl.function(trainer="grpo", args=dict(args)) or {})
    trainer = ExtGRPOTrainer(model=model_dir, reward_funcs=[length_reward], args=GRPOConfig(**args),
                             train_dataset=arithmetic_dataset("train", format="prompt", size=16),
                             processing_class=AutoTokenizer.from_pretrained(model_dir), plugin_host=host,
                             peft_config=peft_config)
    host.hook.trl_ext_trainer_created(trainer=trainer)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1  # set by Trainer.train(); these tests call the loss directly
    return trainer


def rollout(trainer, seed=0):
    data = arithmetic_dataset("train", format="prompt", size=16)
    torch.manual_seed(seed)
    return trainer._generate_and_score_completions([data[i // 2] for i in range(ROWS)])


def logged(trainer, key):
    return trainer._metrics["train"][key]


class ExpertsSpy:
    """Records the expert indices every MoE block hands its experts (forward and any recomputation)."""

    def __init__(self, model):
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        self.calls: list[tuple[int, torch.Tensor]] = []
        self.handles = [layer.mlp.experts.register_forward_pre_hook(self._hook(i))
                        for i, layer in enumerate(base.model.layers)]

    def _hook(self, layer):
        def hook(module, args):
            self.calls.append((layer, args[1].detach().clone()))
        return hook

    def remove(self):
        for h in self.handles:
            h.remove()


def assert_experts_got(spy, routes, expected_calls):
    """Every recorded expert call used ``routes`` at every recorded position (order within top-k ignored)."""
    assert len(spy.calls) == expected_calls
    sentinel = torch.iinfo(routes.dtype).max
    for layer, indices in spy.calls:
        given = routes[:, :, layer].reshape(-1, routes.shape[-1]).long()
        known = (given != sentinel).all(-1)
        assert known.sum() > 0
        assert torch.equal(indices[known].sort(-1).values, given[known].sort(-1).values)


def forced(routes):
    """Other experts than recorded at every recorded position (a routing the model would never pick by itself)."""
    sentinel = torch.iinfo(routes.dtype).max
    return torch.where(routes == sentinel, routes, ((routes.long() + 1) % 4).to(routes.dtype))


# -- a real mismatch, measured and removed ---------------------------------------------------------------------------


def move_routers(model, scale=0.5, seed=1):
    """The policy moved since it sampled the batch (a later micro-batch when steps_per_generation > 1): each router
    weight gets seeded noise of ``scale`` times its spread."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in model.model.layers:
            weight = layer.mlp.gate.weight
            weight.add_(torch.randn(weight.shape, generator=g) * weight.std() * scale)


def test_rollout_mismatch_is_measured_and_r3_replays_it_away(model_dir, tmp_path):
    # Sampled by a bfloat16 copy of the policy, trained in float32 after the policy moved: the training forward
    # routes some tokens to other experts than the rollout did.
    measure = build(model_dir, tmp_path, [RoutingReplay(RoutingReplay.Params(mode="measure")),
                                          RolloutLogprobs(RolloutLogprobs.Params(dtype="bfloat16"))],
                    num_iterations=1)
    out = rollout(measure)
    routes = out[ROUTES_KEY]
    assert routes.dtype == torch.uint8 and routes.shape == (ROWS, out["prompt_ids"].size(1) +
                                                            out["completion_ids"].size(1), 2, 2)
    # Rollout routing of real tokens is recorded (except each completion's last token); padding is not.
    real = torch.cat([out["prompt_mask"], out["completion_mask"]], 1).bool()
    recorded = (routes != 255).all(-1).all(-1)
    assert not recorded[~real].any() and recorded[real].float().mean() > 0.8
    move_routers(measure.model)
    measure._compute_loss(measure.model, out).backward()
    without = logged(measure, "routing_replay/mismatch")[-1]
    assert without > 0.01  # measured in the training forward without replay
    assert sum(logged(measure, f"routing_replay/mismatch/layer_{i}")[-1] for i in range(2)) / 2 == \
        pytest.approx(without, abs=0.05)  # per layer (layers hold the same token count)
    assert logged(measure, "routing_replay/bytes_per_token")[-1] >= 2 * 2  # L x k uint8 per token, plus padding

    r3 = build(model_dir, tmp_path, [RoutingReplay(), RolloutLogprobs(RolloutLogprobs.Params(dtype="bfloat16"))],
               num_iterations=1)
    out = rollout(r3)  # same seed, same weights: the same rollouts
    assert torch.equal(out[ROUTES_KEY], routes)
    move_routers(r3.model)
    spy = ExpertsSpy(r3.model)
    r3._compute_loss(r3.model, out).backward()
    spy.remove()
    assert_experts_got(spy, out[ROUTES_KEY], expected_calls=2)
    assert logged(r3, "routing_replay/mismatch")[-1] == pytest.approx(without)  # the router's own choice differs
    assert logged(r3, "routing_replay/replayed_mismatch")[-1] == 0.0  # what the experts got does not
    assert r3.model.model.layers[0].mlp.gate.weight.grad.abs().sum() > 0  # the router still learns


def test_mismatch_counts_only_tokens_the_forward_attends_to(model_dir, tmp_path):
    # Sampled and scored in float32 by the same weights: the routing agrees at every token (old-policy and training
    # forwards alike). TRL's mask_truncated_completions zeroes the mask of completions cut at max_completion_length; the
    # forwards hide them from attention, so their routing is not the rollout's, and they must not count (was 0.125).
    trainer = build(model_dir, tmp_path, [RoutingReplay(RoutingReplay.Params(mode="measure"))], num_iterations=2,
                    mask_truncated_completions=True)
    out = rollout(trainer)
    assert (out["completion_mask"].sum(1) == 0).sum() >= 4  # several truncated completions, masked out
    trainer._compute_loss(trainer.model, out)
    assert logged(trainer, "routing_replay/old_policy/mismatch")[-1] == 0.0
    assert logged(trainer, "routing_replay/mismatch")[-1] == 0.0


def test_r3_replays_in_the_old_policy_forward(model_dir, tmp_path):
    trainer = build(model_dir, tmp_path, [RoutingReplay(), RolloutLogprobs(RolloutLogprobs.Params(
        dtype="bfloat16"))], num_iterations=2)
    spy = ExpertsSpy(trainer.model)
    out = rollout(trainer)  # bfloat16 generation copy (not spied) then the float32 old-policy forward
    spy.remove()
    assert_experts_got(spy, out[ROUTES_KEY], expected_calls=2)
    assert logged(trainer, "routing_replay/old_policy/replayed_mismatch")[-1] == 0.0


# -- R2 --------------------------------------------------------------------------------------------------------------


def test_r2_replays_the_old_policy_routing_after_the_policy_moved(model_dir, tmp_path):
    trainer = build(model_dir, tmp_path, [RoutingReplay(RoutingReplay.Params(mode="R2"))], num_iterations=2)
    out = rollout(trainer)
    routes = out[ROUTES_KEY]
    real = torch.cat([out["prompt_mask"], out["completion_mask"]], 1).bool()
    assert (routes[real] != 255).all() and (routes[~real] == 255).all()  # the old forward routes every real token
    trainer._compute_loss(trainer.model, out)
    assert logged(trainer, "routing_replay/mismatch")[-1] == 0.0  # unchanged policy: its own routing
    with torch.no_grad():  # an update moves the routers
        for layer in trainer.model.model.layers:
            layer.mlp.gate.weight.add_(torch.randn_like(layer.mlp.gate.weight))
    spy = ExpertsSpy(trainer.model)
    trainer._compute_loss(trainer.model, out).backward()
    spy.remove()
    assert logged(trainer, "routing_replay/mismatch")[-1] > 0  # the moved policy would route otherwise ...
    assert logged(trainer, "routing_replay/replayed_mismatch")[-1] == 0.0  # ... but replays the old routing
    assert_experts_got(spy, routes, expected_calls=2)


def test_r2_without_an_old_policy_forward_is_refused(model_dir, tmp_path):
    with pytest.raises(ValueError, match="mode R2 .* computes only when a batch is reused"):
        build(model_dir, tmp_path, [RoutingReplay(RoutingReplay.Params(mode="R2"))], num_iterations=1)


# -- gradient checkpointing and PEFT ---------------------------------------------------------------------------------


@pytest.mark.parametrize("reentrant", [False, True])
def test_gradient_checkpointing_recomputation_replays_the_same_routes(model_dir, tmp_path, reentrant):
    trainer = build(model_dir, tmp_path, [RoutingReplay()], gradient_checkpointing=True, num_iterations=1,
                    gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    out = rollout(trainer)
    trainer.model.gradient_checkpointing_enable(trainer.args.gradient_checkpointing_kwargs)  # as Trainer.train does
    out[ROUTES_KEY] = forced(out[ROUTES_KEY])
    spy = ExpertsSpy(trainer.model)
    trainer._compute_loss(trainer.model, out).backward()
    spy.remove()
    assert_experts_got(spy, out[ROUTES_KEY], expected_calls=4)  # 2 layers: forward + recomputation in backward
    assert logged(trainer, "routing_replay/replayed_mismatch")[-1] == 0.0


def test_peft_lora_on_experts_still_replays_and_reference_pass_too(model_dir, tmp_path):
    from peft import LoraConfig

    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                      target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    trainer = build(model_dir, tmp_path, [RoutingReplay()], peft_config=lora, beta=0.04, num_iterations=1)
    assert any("lora" in name and "experts" in name for name, _ in trainer.model.named_parameters())
    out = rollout(trainer)
    assert logged(trainer, "routing_replay/reference/replayed_mismatch")[-1] == 0.0  # adapter-disabled reference
    out[ROUTES_KEY] = forced(out[ROUTES_KEY])
    spy = ExpertsSpy(trainer.model)
    trainer._compute_loss(trainer.model, out).backward()
    spy.remove()
    assert_experts_got(spy, out[ROUTES_KEY], expected_calls=2)
    grads = [p.grad for name, p in trainer.model.named_parameters() if "lora" in name and "experts" in name]
    assert any(g is not None and g.abs().sum() > 0 for g in grads)


# -- composition -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("correction", [TIS, IcePop])
def test_composes_with_dapo_and_a_correction(model_dir, tmp_path, correction):
    trainer = build(model_dir, tmp_path, [DAPO(), correction(), RolloutLogprobs(RolloutLogprobs.Params(
        dtype="bfloat16")), RoutingReplay()], loss_type="dapo", num_iterations=1)
    out = rollout(trainer)
    assert "sampling_per_token_logps" in out and ROUTES_KEY in out
    loss = trainer._compute_loss(trainer.model, out)
    assert torch.isfinite(loss)
    loss.backward()
    assert logged(trainer, "routing_replay/replayed_mismatch")[-1] == 0.0
    assert f"{correction.name}/weight/mean" in trainer._metrics["train"]  # the correction ran on the replayed forward


def test_a_corrections_extra_forward_of_the_micro_batch_replays_the_same_routes(model_dir, tmp_path):
    # tis with support 'sampled' runs a second (no-grad) forward of the micro-batch inside the loss: it used to find
    # the routes consumed and raise "rows 16:32 of a forward over 16 x 12 tokens". It must replay the same routes, and
    # the gradient-checkpointing recomputation after it too.
    trainer = build(model_dir, tmp_path, [TIS(TIS.Params(support="sampled")), RolloutLogprobs(RolloutLogprobs.Params(
        dtype="bfloat16")), RoutingReplay()], num_iterations=1, gradient_checkpointing=True)
    out = rollout(trainer)
    trainer.model.gradient_checkpointing_enable(trainer.args.gradient_checkpointing_kwargs)
    out[ROUTES_KEY] = forced(out[ROUTES_KEY])
    spy = ExpertsSpy(trainer.model)
    loss = trainer._compute_loss(trainer.model, out)
    loss.backward()
    spy.remove()
    assert torch.isfinite(loss)
    assert_experts_got(spy, out[ROUTES_KEY], expected_calls=6)  # 2 layers: loss forward, tis forward, recomputation
    assert logged(trainer, "routing_replay/replayed_mismatch")[-1] == 0.0


def test_dynamic_sampling_rounds_with_other_prompt_widths_keep_routes_on_their_tokens(model_dir, tmp_path):
    # The first round has short prompts only, the refill rounds draw long ones too: the merged batch is padded to the
    # longest prompt. The routes (prompt columns left-padded, completion columns right-padded) must move with their
    # tokens; they were padded on the right as a whole, so short-prompt rows replayed other tokens' experts (the
    # float32 training forward then disagreed with the float32 rollout on 56% of token-layers instead of none).
    from datasets import Dataset

    from trl_ext_plugins.rollout.dynamic_sampling import DynamicSampling

    trainer = build(model_dir, tmp_path, [DynamicSampling(DynamicSampling.Params(max_rounds=4)),
                                          RoutingReplay(RoutingReplay.Params(mode="measure"))], num_iterations=1)
    trainer.train_dataset = Dataset.from_list([{"prompt": "1+1=" if i % 2 else "12345+67890+111="} for i in range(16)])
    torch.manual_seed(0)
    out = trainer._generate_and_score_completions([{"prompt": "1+1="}] * ROWS)
    assert logged(trainer, "dynamic_sampling/rounds")[-1] >= 2
    assert len(set(out["prompt_mask"].sum(1).tolist())) == 2  # rows of both prompt widths in the merged batch
    trainer._compute_loss(trainer.model, out)
    assert logged(trainer, "routing_replay/mismatch")[-1] == 0.0
    # Independently: the routes at every attended position are what a float32 forward of the merged batch routes.
    routing = next(p for p in trainer.plugin_host.pm.get_plugins() if isinstance(p, RoutingReplay)).policy
    mask = torch.cat([out["prompt_mask"], out["completion_mask"]], 1)
    routing.begin(None, replay=False, record=True)
    with torch.no_grad():
        trainer.model(input_ids=torch.cat([out["prompt_ids"], out["completion_ids"]], 1), attention_mask=mask)
    own, _ = routing.end(mask)
    routes = out[ROUTES_KEY]
    compare = (routes != 255).all(-1) & mask.bool()[..., None]
    assert compare.sum() > 0.8 * mask.sum() * 2
    assert torch.equal(own.sort(-1).values[compare], routes.sort(-1).values[compare])


# -- bad input -------------------------------------------------------------------------------------------------------


def test_routes_that_do_not_match_the_batch_fail_before_any_loss(model_dir, tmp_path):
    trainer = build(model_dir, tmp_path, [RoutingReplay()], num_iterations=1)
    out = rollout(trainer)
    out[ROUTES_KEY] = out[ROUTES_KEY][:, :-1]
    with pytest.raises(ValueError, match="do not match the batch"):
        trainer._compute_loss(trainer.model, out)


def stage(model, *plugins, **args):
    return StageSpec(trainer="grpo", model=model, dataset="embedded:arithmetic", plugins=list(plugins), args=args)


def test_dense_model_refused_at_validation():
    with pytest.raises(RecipeError, match="routing_replay': model class Qwen2ForCausalLM is dense"):
        resolve_stage(stage("embedded:tiny-qwen2", "routing_replay", "exact_match"), 0, Catalog.discover())


def test_unsupported_moe_class_refused_at_validation(tmp_path):
    PhimoeConfig(architectures=["PhimoeForCausalLM"]).save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "phimoe"
    with pytest.raises(RecipeError, match="unsupported mixture-of-experts model class PhimoeForCausalLM"):
        resolve_stage(stage(str(tmp_path), "routing_replay", "exact_match"), 0, Catalog.discover())


def test_vllm_refuses_r3_but_not_r2():
    with pytest.raises(RecipeError, match="args.use_vllm: plugin 'routing_replay' mode R3"):
        resolve_stage(stage("embedded:tiny-qwen3-moe", "routing_replay", "exact_match", use_vllm=True), 0,
                      Catalog.discover())
    try:
        resolve_stage(stage("embedded:tiny-qwen3-moe", {"routing_replay": {"mode": "R2"}}, "exact_match",
                            use_vllm=True), 0, Catalog.discover())
    except RecipeError as error:
        assert "routing_replay" not in str(error), error


def test_partial_rollout_refused_with_r3_but_not_r2():
    with pytest.raises(RecipeError, match="routing_replay' mode R3 with 'partial_rollout'"):
        resolve_stage(stage("embedded:tiny-qwen3-moe", "routing_replay", "partial_rollout", "exact_match"), 0,
                      Catalog.discover())
    try:
        resolve_stage(stage("embedded:tiny-qwen3-moe", {"routing_replay": {"mode": "R2"}}, "partial_rollout",
                            "exact_match", num_iterations=2), 0, Catalog.discover())
    except RecipeError as error:
        assert "routing_replay" not in str(error), error


def test_supported_moe_resolves():
    rs = resolve_stage(stage("embedded:tiny-qwen3-moe", "routing_replay", "exact_match"), 0, Catalog.discover())
    assert rs.host.names() == ["routing_replay", "exact_match"]
