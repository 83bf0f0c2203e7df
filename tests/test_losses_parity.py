"""Parity of the plugin loss path with TRL 1.16's own ``GRPOTrainer._compute_loss`` (and experimental GMPO).

Both paths run on the same float64 inputs through a minimal trainer-like object (TRL's method is called unbound on it,
so TRL's real code computes the reference); loss and gradient w.r.t. the current log-probs must agree to 1e-6 (they
agree to ~1e-15). The plugin path is ``ExtGRPOTrainer._plugin_loss`` with the TRL fields each plugin's
``trl_ext_configure_args`` sets, so the args a recipe would resolve to are the ones compared.
"""

from __future__ import annotations

import pytest
import torch
from trl import GRPOTrainer

from tests.trl_fixtures.cases import grpo_trainer_like
from trl_ext.host import PluginHost
from trl_ext_plugins.corrections.icepop import IcePop
from trl_ext_plugins.corrections.mis import MIS
from trl_ext_plugins.corrections.tis import TIS
from trl_ext_plugins.losses.aggregation import Aggregation
from trl_ext_plugins.losses.cispo import CISPO
from trl_ext_plugins.losses.dapo import DAPO
from trl_ext_plugins.losses.dr_grpo import DrGRPO
from trl_ext_plugins.losses.gmpo import GMPO
from trl_ext_plugins.losses.grpo import GRPO
from trl_ext_plugins.losses.gspo import GSPO
from trl_ext_plugins.losses.sapo import SAPO

D = torch.float64
B, T = 4, 6


def batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(B, T, dtype=torch.long)
    mask[1, 4:] = 0
    mask[3, 2:] = 0
    theta = -torch.rand(B, T, generator=g, dtype=D) * 3 - 0.05
    old = theta + torch.randn(B, T, generator=g, dtype=D) * 0.3  # off-policy enough to clip
    rollout = old + torch.randn(B, T, generator=g, dtype=D) * 0.6  # a large train/inference mismatch
    inputs = {
        "prompt_ids": torch.zeros(B, 2, dtype=torch.long), "prompt_mask": torch.ones(B, 2, dtype=torch.long),
        "completion_ids": torch.zeros(B, T, dtype=torch.long), "completion_mask": mask,
        "advantages": torch.tensor([1.2, -0.7, 0.4, -1.5], dtype=D),
        "old_per_token_logps": old, "num_items_in_batch": mask.sum() * 2,  # two micro-batches per generation batch
    }
    return theta, rollout, inputs


def trainer_like(args, theta, entropies=None):
    """The attributes TRL's _compute_loss and trl-ext's _plugin_loss read, with TRL's defaults overridden by ``args``
    (gradient accumulation 2, 2 steps per generation, completions of 8: the TRL fixtures' trainer-like object)."""
    return grpo_trainer_like(args, theta, entropies)


def plugin_args(plugins):
    args = {}
    for p in plugins:
        configure = getattr(p, "trl_ext_configure_args", None)
        args.update((configure and configure(trainer="grpo", args={})) or {})
    return args


def loss_and_grad(fn, t, leaf, inputs):
    loss = fn(t, None, inputs)
    (grad,) = torch.autograd.grad(loss, leaf)
    return loss.detach(), grad


def assert_parity(plugins, trl_args, inputs_fn=None, trl_compute=GRPOTrainer._compute_loss, shared_args=None,
                  entropies=None):
    """``shared_args``: TRL options both paths get (TRL's options the pipeline re-expresses); ``entropies``: the forward
    pass's entropies as a function of the current log-probs."""
    theta, rollout, inputs = batch()
    if inputs_fn is not None:
        inputs_fn(inputs, rollout)
    ours, leaf = trainer_like({**plugin_args(plugins), **(shared_args or {})}, theta, entropies)
    ours.plugin_host = PluginHost(plugins)
    theirs, leaf2 = trainer_like({**trl_args, **(shared_args or {})}, theta, entropies)
    l1, g1 = loss_and_grad(lambda t, m, i: t._plugin_loss(m, i), ours, leaf, dict(inputs))
    l2, g2 = loss_and_grad(trl_compute, theirs, leaf2, dict(inputs))
    assert torch.allclose(l1, l2, atol=1e-6, rtol=0), (l1, l2)
    assert torch.allclose(g1, g2, atol=1e-6, rtol=0)
    assert g1.abs().sum() > 0
    return l1, g1


@pytest.mark.parametrize("plugins, trl_args", [
    ([GRPO()], {"loss_type": "grpo"}),
    ([DrGRPO()], {"loss_type": "dr_grpo"}),
    ([DAPO()], {"loss_type": "dapo", "epsilon_high": 0.28}),
    ([GRPO(), Aggregation(Aggregation.Params(mode="batch-token-mean"))], {"loss_type": "bnpo"}),
    ([GRPO(), Aggregation(Aggregation.Params(mode="token-mean"))], {"loss_type": "dapo"}),
    ([GRPO(), Aggregation(Aggregation.Params(mode="seq-mean-token-sum-norm"))], {"loss_type": "dr_grpo"}),
    ([GSPO()], {"loss_type": "grpo", "importance_sampling_level": "sequence", "epsilon": 3e-4, "epsilon_high": 4e-4}),
    ([GSPO(GSPO.Params(epsilon_low=0.05, epsilon_high=0.05))],
     {"loss_type": "grpo", "importance_sampling_level": "sequence", "epsilon": 0.05}),
    ([SAPO()], {"loss_type": "sapo"}),
    ([SAPO(SAPO.Params(tau_pos=2.0, tau_neg=0.5))],
     {"loss_type": "sapo", "sapo_temperature_pos": 2.0, "sapo_temperature_neg": 0.5}),
    ([CISPO()], {"loss_type": "cispo", "epsilon_high": 5.0}),
    ([CISPO(CISPO.Params(epsilon_high=0.1))], {"loss_type": "cispo", "epsilon_high": 1.1}),
], ids=["grpo", "dr_grpo", "dapo", "bnpo", "token-mean", "sum-norm", "gspo", "gspo-wide", "sapo", "sapo-tau", "cispo",
        "cispo-tight"])
def test_objective_parity_with_trl(plugins, trl_args):
    assert_parity(plugins, trl_args)


@pytest.mark.parametrize("plugins, trl_args", [
    ([GRPO()], {"loss_type": "grpo"}),
    ([DAPO()], {"loss_type": "dapo", "epsilon_high": 0.28}),
    ([GRPO(), Aggregation(Aggregation.Params(mode="batch-token-mean"))], {"loss_type": "bnpo", "epsilon": 0.1}),
    ([], {"loss_type": "dr_grpo"}),  # TRL's objective run by the pipeline (a replaced KL term routes it there)
], ids=["grpo", "dapo", "bnpo", "trl-objective"])
def test_clip_ratio_metrics_match_trl(plugins, trl_args):
    """The plugin path logged none of TRL's ``clip_ratio/*`` metrics; with a PPO-clip objective they now equal TRL's
    (fraction of loss tokens clipped low with A < 0 / high with A > 0, and the per-sequence extremes)."""
    from trl_ext.ops import KLTerm

    theta, _, inputs = batch()
    ours, _ = trainer_like({**trl_args, **plugin_args(plugins)}, theta)
    ours.plugin_host = PluginHost(plugins)
    ours.kl_term = KLTerm("k3", coef=0.0)
    theirs, _ = trainer_like(trl_args, theta)
    ours._plugin_loss(None, dict(inputs))
    GRPOTrainer._compute_loss(theirs, None, dict(inputs))
    expected = {k: v for k, v in theirs._metrics["train"].items() if k.startswith("clip_ratio/")}
    got = {k: v for k, v in ours._metrics["train"].items() if k.startswith("clip_ratio/")}
    assert set(expected) == set(got) and len(expected) == 5
    assert all(v == pytest.approx(expected[k], abs=1e-6) for k, v in got.items()), (got, expected)  # TRL: float32
    assert 0 < expected["clip_ratio/region_mean"][0] < 1  # the case clips some tokens, not all


def test_gspo_token_form_matches_trl_sequence_gradient():
    # Same value and same gradient as TRL's sequence-level GSPO (advantages are per sequence).
    assert_parity([GSPO(GSPO.Params(form="token", epsilon_low=0.05, epsilon_high=0.05)), Aggregation(
        Aggregation.Params(mode="seq-mean-token-mean"))],
        {"loss_type": "grpo", "importance_sampling_level": "sequence", "epsilon": 0.05})


@pytest.mark.parametrize("recipe_bias", [None, False])
def test_gmpo_with_a_kl_term_matches_trl_experimental_gmpo(recipe_bias):
    """TRL's GMPOTrainer adds beta * (plain k3, sequence mean); the pipeline followed TRL GRPO's default bias
    correction (k3 * ratio), so with beta > 0 loss and gradient differed (0.1082954 vs 0.1082155 here)."""
    from trl.experimental.gmpo import GMPOTrainer

    def with_reference(inputs, _rollout):
        inputs["ref_per_token_logps"] = inputs["old_per_token_logps"] - 0.2

    plugin = GMPO()
    recipe = {} if recipe_bias is None else {"use_bias_correction_kl": recipe_bias}
    configured = {**recipe, **plugin.trl_ext_configure_args(trainer="grpo", args=recipe)}
    assert configured["use_bias_correction_kl"] is False
    theta, _, inputs = batch()
    with_reference(inputs, None)
    trl_args = {"loss_type": "grpo", "epsilon": 0.4, "epsilon_high": 0.4, "beta": 0.04}
    ours, leaf = trainer_like({**configured, "beta": 0.04}, theta)
    ours.plugin_host = PluginHost([plugin])
    theirs, leaf2 = trainer_like(trl_args, theta)
    l1, g1 = loss_and_grad(lambda t, m, i: t._plugin_loss(m, i), ours, leaf, dict(inputs))
    l2, g2 = loss_and_grad(GMPOTrainer._compute_loss, theirs, leaf2, dict(inputs))
    assert torch.allclose(l1, l2, atol=1e-6, rtol=0) and torch.allclose(g1, g2, atol=1e-6, rtol=0), (l1, l2)
    assert GMPO(GMPO.Params(kl_bias_correction=True)).trl_ext_configure_args(
        trainer="grpo", args={})["use_bias_correction_kl"] is True
    assert "use_bias_correction_kl" not in plugin.trl_ext_configure_args(trainer="grpo",
                                                                         args={"use_bias_correction_kl": True})


def test_gmpo_parity_with_trl_experimental_gmpo():
    from trl.experimental.gmpo import GMPOTrainer

    assert_parity([GMPO()], {"loss_type": "grpo", "epsilon": 0.4, "epsilon_high": 0.4},
                  trl_compute=GMPOTrainer._compute_loss)


def trl_importance_ratio(mode, clip_min, clip_max):
    """Feed TRL's _compute_loss the IS factor it would build for ``mode`` (see test_corrections_trainer.py for the
    check against TRL's own computation inside _generate_and_score_completions)."""
    def add(inputs, rollout):
        mask = inputs["completion_mask"]
        diff = (inputs["old_per_token_logps"] - rollout) * mask
        if mode.startswith("sequence"):
            diff = diff.sum(-1, keepdim=True)
        ratio = torch.exp(diff)
        if mode.endswith("truncate"):
            ratio = torch.clamp(ratio, min=clip_min, max=clip_max)
        else:
            ratio = ratio.masked_fill((ratio < (clip_min or 0)) | (ratio > clip_max), 0.0)
        inputs["importance_sampling_ratio"] = ratio
    return add


@pytest.mark.parametrize("correction, objective, trl_args, mode, lo, hi", [
    (TIS(), GRPO(), {"loss_type": "grpo"}, "token_truncate", None, 2.0),
    (TIS(TIS.Params(level="sequence", upper=3.0)), DAPO(), {"loss_type": "dapo", "epsilon_high": 0.28},
     "sequence_truncate", None, 3.0),
    (MIS(), GRPO(), {"loss_type": "grpo"}, "token_mask", 0.5, 2.0),
    (MIS(MIS.Params(level="sequence", lower=None, upper=3.0)), GRPO(), {"loss_type": "grpo"}, "sequence_mask", None,
     3.0),
    (IcePop(), GRPO(), {"loss_type": "grpo"}, "token_mask", 0.5, 2.0),
    (IcePop(), CISPO(), {"loss_type": "cispo", "epsilon_high": 5.0}, "token_mask", 0.5, 2.0),
], ids=["tis", "tis-seq-dapo", "mis", "mis-seq", "icepop", "icepop-cispo"])
def test_correction_parity_with_trl_vllm_modes(correction, objective, trl_args, mode, lo, hi):
    theta, rollout, _ = batch()

    def ours_inputs(inputs, rollout_):
        inputs["sampling_per_token_logps"] = rollout_

    # our path: plugin weights from sampling log-probs; TRL's path: its IS factor multiplied in _compute_loss
    theta_, rollout_, inputs = batch()
    ours_inputs(inputs, rollout_)
    ours, leaf = trainer_like(plugin_args([objective, correction]), theta_)
    ours.plugin_host = PluginHost([objective, correction])
    l1, g1 = loss_and_grad(lambda t, m, i: t._plugin_loss(m, i), ours, leaf, dict(inputs))
    _, _, trl_inputs = batch()
    trl_importance_ratio(mode, lo, hi)(trl_inputs, rollout)
    theirs, leaf2 = trainer_like({**trl_args, "use_vllm": True}, theta)
    l2, g2 = loss_and_grad(GRPOTrainer._compute_loss, theirs, leaf2, trl_inputs)
    assert torch.allclose(l1, l2, atol=1e-6, rtol=0) and torch.allclose(g1, g2, atol=1e-6, rtol=0)
    changed = ours._metrics["train"][f"{correction.name}/changed_fraction"][0]
    assert 0 < changed < 1  # the batch exercises both kept and truncated/masked tokens


# -- TRL options the loss pipeline re-expresses (TrlLossOptions): off-policy sequence mask, entropy filter and bonus,
# two-sided clip, each against TRL's own _compute_loss -----------------------------------------------------------


def entropy_of(logps):
    """Per-token entropies that depend on the current log-probs (so TRL's bonus has a gradient), distinct per token."""
    return 0.5 - logps * torch.exp(logps) + 0.1 * logps ** 2


def opsm_threshold(sampler_key=None):
    """A threshold between the mean sampled-token KL of the two negative-advantage rows of :func:`batch`, so the mask
    drops one of them and keeps the other."""
    theta, rollout, inputs = batch()
    sampler = rollout if sampler_key == "sampling" else inputs["old_per_token_logps"]
    mask = inputs["completion_mask"].to(D)
    kl = ((sampler - theta) * mask).sum(1) / mask.sum(1)
    low, high = sorted([kl[1].item(), kl[3].item()])
    assert high - low > 0.02, (low, high)
    return (low + high) / 2


def with_sampling(inputs, rollout):
    inputs["sampling_per_token_logps"] = rollout


@pytest.mark.parametrize("plugins, trl_args, shared, inputs_fn", [
    ([GRPO()], {"loss_type": "grpo"}, {"off_policy_mask_threshold": opsm_threshold()}, None),
    ([DAPO()], {"loss_type": "dapo", "epsilon_high": 0.28}, {"off_policy_mask_threshold": opsm_threshold()}, None),
    ([CISPO()], {"loss_type": "cispo", "epsilon_high": 5.0}, {"off_policy_mask_threshold": opsm_threshold()}, None),
    ([GRPO()], {"loss_type": "grpo"}, {"off_policy_mask_threshold": opsm_threshold("sampling")}, with_sampling),
    ([GRPO()], {"loss_type": "grpo"}, {"top_entropy_quantile": 0.4}, None),
    ([DAPO()], {"loss_type": "dapo", "epsilon_high": 0.28}, {"top_entropy_quantile": 0.2}, None),
    ([GRPO()], {"loss_type": "grpo"}, {"entropy_coef": 0.05}, None),
    ([DAPO()], {"loss_type": "dapo", "epsilon_high": 0.28}, {"entropy_coef": 0.05, "top_entropy_quantile": 0.5}, None),
    ([GRPO(), Aggregation(Aggregation.Params(mode="token-mean"))], {"loss_type": "dapo"},
     {"off_policy_mask_threshold": opsm_threshold(), "top_entropy_quantile": 0.5, "entropy_coef": 0.05}, None),
    ([Aggregation(Aggregation.Params(mode="token-mean"))], {"loss_type": "dapo"}, {"delta": 1.25}, None),
    ([Aggregation(Aggregation.Params(mode="seq-mean-token-mean"))], {"loss_type": "grpo"}, {"delta": 1.1}, None),
], ids=["opsm-grpo", "opsm-dapo", "opsm-cispo", "opsm-sampler", "entropy-mask", "entropy-mask-dapo", "entropy-bonus",
        "entropy-bonus-masked", "all-three", "delta-dapo", "delta-below-clip"])
def test_trl_options_the_pipeline_applies_match_trl(plugins, trl_args, shared, inputs_fn):
    """These options were refused whenever a plugin routed the loss through trl-ext's pipeline; they now apply as in
    TRL 1.16 (same tokens dropped, same denominators, the bonus with its gradient), and each one changes the loss."""
    loss, grad = assert_parity(plugins, trl_args, inputs_fn, shared_args=shared, entropies=entropy_of)
    plain, plain_grad = assert_parity(plugins, trl_args, inputs_fn, entropies=entropy_of)
    assert not torch.allclose(loss, plain, atol=1e-9) or not torch.allclose(grad, plain_grad, atol=1e-9)


def with_vllm_ratio(inputs, rollout):
    """TRL's vLLM importance ratio (token_truncate at 2) in the batch, for both paths."""
    inputs["importance_sampling_ratio"] = torch.exp(inputs["old_per_token_logps"] - rollout).clamp(max=2.0)


@pytest.mark.parametrize("trl_args, shared, inputs_fn", [
    ({"loss_type": "luspo", "importance_sampling_level": "sequence"}, {}, None),
    ({"loss_type": "luspo", "importance_sampling_level": "sequence"}, {"delta": 1.3}, None),
    ({"loss_type": "luspo", "importance_sampling_level": "sequence", "use_vllm": True}, {}, with_vllm_ratio),
    ({"loss_type": "vespo"}, {}, None),
    ({"loss_type": "vespo", "vespo_k_pos": 1.0, "vespo_lambda_neg": 4.0}, {}, None),
    ({"loss_type": "vespo", "use_vllm": True}, {}, with_vllm_ratio),
    ({"loss_type": "vespo"}, {"off_policy_mask_threshold": opsm_threshold(), "entropy_coef": 0.05}, None),
], ids=["luspo", "luspo-delta", "luspo-vllm", "vespo", "vespo-params", "vespo-vllm", "vespo-opsm-entropy"])
def test_luspo_and_vespo_through_the_pipeline_match_trl(trl_args, shared, inputs_fn):
    """TRL's luspo and vespo loss types were refused whenever a plugin routed the loss through the pipeline; its
    objectives and aggregations now re-express them (vespo's Gamma weights are TRL's own get_gamma_weights, with TRL's
    vLLM ratio folded in rather than multiplied again)."""
    theta, rollout, inputs = batch()
    if inputs_fn is not None:
        inputs_fn(inputs, rollout)
    ours, leaf = trainer_like({**trl_args, **shared}, theta, entropy_of)
    ours.plugin_host = PluginHost([])
    theirs, leaf2 = trainer_like({**trl_args, **shared}, theta, entropy_of)
    l1, g1 = loss_and_grad(lambda t, m, i: t._plugin_loss(m, i), ours, leaf, dict(inputs))
    l2, g2 = loss_and_grad(GRPOTrainer._compute_loss, theirs, leaf2, dict(inputs))
    assert torch.allclose(l1, l2, atol=1e-6, rtol=0), (l1, l2)
    assert torch.allclose(g1, g2, atol=1e-6, rtol=0)
    assert g1.abs().sum() > 0


def test_off_policy_mask_drops_whole_negative_sequences_over_the_threshold():
    """DeepSeek-V3.2 Eq. 9 by hand: of the two negative-advantage rows, the one whose mean KL exceeds the threshold
    has no gradient; the other rows keep theirs."""
    theta, _, inputs = batch()
    mask = inputs["completion_mask"].to(D)
    kl = ((inputs["old_per_token_logps"] - theta) * mask).sum(1) / mask.sum(1)
    dropped = 1 if kl[1] > kl[3] else 3
    _, grad = assert_parity([GRPO()], {"loss_type": "grpo"},
                            shared_args={"off_policy_mask_threshold": opsm_threshold()})
    for row in range(B):
        has_grad = bool(grad[row].abs().sum() > 0)
        assert has_grad == (row != dropped), (row, dropped)


def test_grpo_dual_clip_is_trls_delta_above_the_clip():
    """The validation message sends delta users with an objective plugin to grpo's dual_clip: the same loss and
    gradient as TRL's two-sided clip for delta >= 1 + epsilon_high."""
    assert_parity([GRPO(GRPO.Params(dual_clip=1.25))], {"loss_type": "grpo", "delta": 1.25})


def test_delta_is_refused_with_an_objective_plugin_and_applied_without_one():
    from trl_ext.catalog import Catalog
    from trl_ext.errors import RecipeError
    from trl_ext.recipe import StageSpec
    from trl_ext.stage import resolve_stage

    def stage(plugins, **args):
        return StageSpec(trainer="grpo", model="embedded:tiny-qwen2", dataset="embedded:arithmetic",
                         plugins=[*plugins, "exact_match"], args=args)

    catalog = Catalog.discover()
    with pytest.raises(RecipeError, match=r"args\.delta: applies to TRL's own objective only.*'cispo'.*dual_clip"):
        resolve_stage(stage(["cispo"], delta=2.0), 0, catalog)
    for options in ({"delta": 2.0}, {"off_policy_mask_threshold": 0.5}, {"top_entropy_quantile": 0.2},
                    {"entropy_coef": 0.01}, {"loss_type": "vespo"},
                    {"loss_type": "luspo", "importance_sampling_level": "sequence"}):
        resolve_stage(stage([{"aggregation": {"mode": "token-mean"}}], **{"loss_type": "dapo", **options}), 0, catalog)
    for options in ({"off_policy_mask_threshold": 0.5}, {"top_entropy_quantile": 0.2}, {"entropy_coef": 0.01},
                    {"use_adaptive_entropy": True}):
        resolve_stage(stage(["cispo"], **options), 0, catalog)


def test_delta_with_an_objective_plugin_is_refused_at_the_first_loss(tiny_trainer):
    """A trainer built without recipe validation still cannot ignore delta silently."""
    trainer = tiny_trainer("grpo", plugins=[GRPO()], args={"loss_type": "grpo", "delta": 2.0})
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1  # set by Trainer's training loop; this test calls the loss
    inputs = trainer._generate_and_score_completions([trainer.train_dataset[i // 4] for i in range(4)])
    with pytest.raises(ValueError, match=r"args\.delta: applies to TRL's own objective only.*'grpo'.*dual_clip"):
        trainer._compute_loss(trainer.model, inputs)


@pytest.mark.parametrize("plugins, trl_args, shared", [
    ([GRPO()], {"loss_type": "grpo"}, {}),
    ([DAPO()], {"loss_type": "dapo", "epsilon_high": 0.28}, {"top_entropy_quantile": 0.5}),
], ids=["grpo", "dapo-entropy-mask"])
@pytest.mark.parametrize("target", [0.1, 5.0], ids=["entropy-above-target", "entropy-below-target"])
def test_adaptive_entropy_controller_matches_trl_over_an_accumulation_window(plugins, trl_args, shared, target):
    """TRL's use_adaptive_entropy (Skywork-OR1) through the pipeline: the same loss and gradient on each micro-batch
    of a two-micro-batch window, the same coefficient after the optimizer step (moved up or down), and no bonus while
    the last step's entropy was above the target, as in TRL."""
    theta, rollout, inputs = batch()
    args = {**shared, "use_adaptive_entropy": True, "entropy_coef": 0.05, "entropy_target": target}
    ours, leaf = trainer_like({**plugin_args(plugins), **args}, theta, entropy_of)
    ours.plugin_host = PluginHost(plugins)
    theirs, leaf2 = trainer_like({**trl_args, **args}, theta, entropy_of)
    for t in (ours, theirs):
        t._last_world_entropy = 0.0  # the previous step measured a low entropy: the bonus applies
    for sync in (False, True):
        for t in (ours, theirs):
            t.accelerator.sync_gradients = sync
        l1, g1 = loss_and_grad(lambda t, m, i: t._plugin_loss(m, i), ours, leaf, dict(inputs))
        l2, g2 = loss_and_grad(GRPOTrainer._compute_loss, theirs, leaf2, dict(inputs))
        assert torch.allclose(l1, l2, atol=1e-6, rtol=0) and torch.allclose(g1, g2, atol=1e-6, rtol=0)
    assert ours.entropy_coef == pytest.approx(theirs.entropy_coef) and ours.entropy_coef != 0.05
    assert ours._metrics["train"]["entropy_coef"] == pytest.approx(theirs._metrics["train"]["entropy_coef"])
    assert ours._last_world_entropy == pytest.approx(theirs._last_world_entropy)
    assert ours._entropy_window_stats is None and theirs._entropy_window_stats is None
    # the window's entropy against the target decides the bonus of the next step
    l1, _ = loss_and_grad(lambda t, m, i: t._plugin_loss(m, i), ours, leaf, dict(inputs))
    l2, _ = loss_and_grad(GRPOTrainer._compute_loss, theirs, leaf2, dict(inputs))
    assert torch.allclose(l1, l2, atol=1e-6, rtol=0)
    assert (ours._applied_entropy_coef() == 0.0) == (ours._last_world_entropy > target)


def test_trl_options_on_the_real_trainer_match_trls_own_loss(tiny_trainer):
    """On a real GRPO trainer and rollout, the pipeline with the off-policy mask (a threshold below 0 drops every
    negative-advantage sequence on policy, where the KL is 0), the entropy filter and the bonus gives TRL's loss and
    gradient (TRL's get_high_entropy_mask with the trainer's real accelerator)."""
    args = {"loss_type": "grpo", "off_policy_mask_threshold": -1e-9, "top_entropy_quantile": 0.5,
            "entropy_coef": 0.05}
    def length_reward(completions, **_):  # the untrained model earns nothing on the task; lengths vary
        return [float(len(str(c)) % 5) for c in completions]

    trainer = tiny_trainer("grpo", args=args, reward_funcs=[length_reward])
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1  # set by Trainer's training loop; this test calls the loss
    inputs = trainer._generate_and_score_completions([trainer.train_dataset[i // 4] for i in range(8)])
    assert (inputs["advantages"] < 0).any() and (inputs["advantages"] > 0).any()
    params = [p for p in trainer.model.parameters() if p.requires_grad]

    def loss_and_grads(compute):
        loss = compute(trainer.model, dict(inputs))
        return loss.detach(), torch.autograd.grad(loss, params)

    ours, our_grads = loss_and_grads(trainer._plugin_loss)
    theirs, their_grads = loss_and_grads(lambda m, i: GRPOTrainer._compute_loss(trainer, m, i))
    assert torch.allclose(ours, theirs, atol=1e-6), (ours, theirs)
    for a, b in zip(our_grads, their_grads):
        assert torch.allclose(a, b, atol=1e-6)
    trainer.off_policy_mask_threshold, trainer.top_entropy_quantile, trainer.entropy_coef = None, 1.0, 0.0
    plain, _ = loss_and_grads(trainer._plugin_loss)
    assert not torch.allclose(plain, ours, atol=1e-6)
