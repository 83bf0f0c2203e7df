"""Advantage plugins on the GRPO trainer (tiny embedded model), parity with TRL, and recipe validation."""

import math

import pytest
import torch

from trl_ext.errors import RecipeError
from trl_ext.recipe import StageSpec
from trl_ext.stage import resolve_stage
from trl_ext.testing import check_plugin_conformance
from trl_ext_plugins.advantages import plugin_classes
from trl_ext_plugins.advantages import math as adv
from trl_ext_plugins.advantages.reinforce_baseline import ReinforceBaseline, ReinforceBaselineParams
from trl_ext_plugins.advantages.reinforce_pp import ReinforcePP, ReinforcePPBaseline, ReinforcePPParams
from trl_ext_plugins.advantages.remax import ReMax
from trl_ext_plugins.advantages.rloo import RLOO, RLOOParams

# 8 rows = 2 prompts x 4 samples; NaN = unscorable, a group with a single scorable row, and a tie group
REWARDS = [1.0, 0.0, math.nan, 0.25, 2.0, math.nan, math.nan, math.nan]


def scripted_reward(values):
    """A TRL reward function returning ``values`` in order, cycling per call (None for NaN)."""
    state = {"calls": []}

    def reward(completions, **kwargs):
        state["calls"].append(list(completions))
        out = values[: len(completions)]
        return [None if isinstance(v, float) and math.isnan(v) else v for v in out]

    reward.state = state
    return reward


def rollout(trainer, rows=8):
    trainer.model.train()
    inputs = [trainer.train_dataset[i // 4] for i in range(rows)]  # each prompt repeated num_generations=4 times
    return trainer._generate_and_score_completions(inputs)


@pytest.mark.parametrize("plugin", plugin_classes())
def test_conformance(plugin):
    check_plugin_conformance(plugin)


# -- parity with TRL ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("normalize", [False, True])
def test_rloo_parity_with_trl_rloo_trainer(tiny_trainer, normalize):
    """TRL's RLOOTrainer and the rloo estimator give the same advantages on the same (float64) rewards."""
    trainer = tiny_trainer("rloo", args={"beta": 0.0, "normalize_advantages": normalize})
    rewards = torch.tensor(REWARDS, dtype=torch.float64)
    trainer._calculate_rewards = lambda *a, **k: rewards.unsqueeze(1).clone()
    trl_advantages = rollout(trainer)["advantages"]
    ours = adv.rloo_advantages(rewards, 4, normalize=normalize)
    assert trl_advantages.dtype == torch.float64
    assert torch.allclose(trl_advantages, ours, atol=1e-12, rtol=0)


def test_reinforce_group_mean_matches_trl_grpo_without_std_scaling(tiny_trainer):
    values = [1.0, 0.0, 0.0, 0.5, 0.2, 0.2, 0.9, 0.1]
    trl = rollout(tiny_trainer("grpo", args={"scale_rewards": "none"}, reward_funcs=[scripted_reward(values)]))
    ours = rollout(tiny_trainer("grpo", plugins=[ReinforceBaseline()], reward_funcs=[scripted_reward(values)]))
    assert torch.allclose(ours["advantages"], trl["advantages"], atol=1e-6)


# -- the hook on the GRPO trainer -----------------------------------------------------------------------------------


def test_rloo_on_grpo_trainer(tiny_trainer):
    trainer = tiny_trainer("grpo", plugins=[RLOO()], reward_funcs=[scripted_reward(REWARDS)])
    out = rollout(trainer)
    expected = adv.rloo_advantages(torch.tensor(REWARDS), 4)
    assert torch.allclose(out["advantages"], expected, atol=1e-6)
    assert out["advantages"].view(2, 4).sum(1).abs().max() < 1e-6


def test_reinforce_moving_average_uses_previous_batches(tiny_trainer):
    plugin = ReinforceBaseline(ReinforceBaselineParams(baseline="moving_average", decay=0.5, initial=0.2))
    values = [1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 0.0]
    trainer = tiny_trainer("grpo", plugins=[plugin], reward_funcs=[scripted_reward(values)])
    first = rollout(trainer)["advantages"]
    assert torch.allclose(first, torch.tensor(values) - 0.2)
    assert plugin.running_baseline == pytest.approx(0.5 * 0.2 + 0.5 * 0.5)
    second = rollout(trainer)["advantages"]
    assert torch.allclose(second, torch.tensor(values) - 0.35)


def test_remax_greedy_pass_one_per_prompt(tiny_trainer):
    calls = []

    def reward(completions, **kwargs):
        calls.append(list(completions))
        return [float(len(c)) for c in completions]  # deterministic in the text

    trainer = tiny_trainer("grpo", plugins=[ReMax()], reward_funcs=[reward], args={"temperature": 1.5})
    out = rollout(trainer)
    assert [len(c) for c in calls] == [8, 2]  # the sampled batch, then one greedy completion per prompt
    sampled, greedy = torch.tensor([float(len(c)) for c in calls[0]]), torch.tensor([float(len(c)) for c in calls[1]])
    assert torch.allclose(out["advantages"], sampled - greedy.repeat_interleave(4))
    # the greedy completions are the model's argmax decode, and the sampling configuration is restored afterwards
    assert trainer.generation_config.do_sample is True and trainer.generation_kwargs["do_sample"] is True
    texts = []
    for i in (0, 1):
        prompt_ids = torch.tensor(trainer._tokenize_prompts([trainer.train_dataset[i]["prompt"]])[0])
        with torch.no_grad():
            ids = trainer.model.generate(prompt_ids, do_sample=False, max_new_tokens=4,
                                         eos_token_id=trainer.eos_token_ids, pad_token_id=trainer._tokenizer.pad_token_id)
        texts += trainer.processing_class.batch_decode(ids[:, prompt_ids.shape[1]:], skip_special_tokens=True)
    assert calls[1] == texts


def rollout_away_from_the_reference(trainer):
    """A rollout after the policy moved away from the reference (so the KL is not zero), and ``d = log pi - log
    pi_ref`` of its sampled tokens (float64), recomputed from the policy."""
    with torch.no_grad():
        for p in trainer.model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    out = rollout(trainer)
    mask = out["completion_mask"]
    ids = torch.cat([out["prompt_ids"], out["completion_ids"]], 1)
    with torch.no_grad():
        logps, _, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model, ids, torch.cat([out["prompt_mask"], mask], 1), mask.shape[1])
    d = (logps - out["ref_per_token_logps"]).double()
    assert (d * mask).abs().sum() > 0
    return out, d


def test_reinforce_pp_token_advantages(tiny_trainer):
    params = ReinforcePPParams(kl_coef=0.5, kl_estimator="k2")
    values = [1.0, 0.0, 0.0, 1.0, 0.0, 1.0, 1.0, 1.0]
    trainer = tiny_trainer("grpo", plugins=[ReinforcePP(params)], args={"beta": 0.04},
                           reward_funcs=[scripted_reward(values)])
    out, d = rollout_away_from_the_reference(trainer)
    mask = out["completion_mask"].float()
    lengths = mask.sum(1).long()
    expected = torch.zeros_like(d)
    for row in range(8):  # r_t = 1[t = last] R - beta * d^2/2, G_t = sum_{s >= t} r_s
        r = -0.5 * (d[row, : lengths[row]] ** 2 / 2)
        r[-1] += values[row]
        expected[row, : lengths[row]] = torch.flip(torch.cumsum(torch.flip(r, [0]), 0), [0])
    valid = mask.bool()
    expected = (expected - expected[valid].mean()) / torch.sqrt(expected[valid].var() + 1e-8) * mask
    assert out["advantages"].shape == mask.shape
    assert torch.allclose(out["advantages"].double(), expected, atol=1e-4)


def test_reinforce_pp_baseline_whitens_group_centred_rewards(tiny_trainer):
    values = [1.0, 0.0, 0.0, 1.0, 0.0, 1.0, 1.0, 1.0]
    trainer = tiny_trainer("grpo", plugins=[ReinforcePPBaseline()], reward_funcs=[scripted_reward(values)])
    out = rollout(trainer)
    mask = out["completion_mask"].float()
    centred = torch.tensor(values).view(2, 4)
    per_token = (centred - centred.mean(1, keepdim=True)).view(-1, 1) * mask
    valid = mask.bool()
    expected = (per_token - per_token[valid].mean()) / torch.sqrt(per_token[valid].var() + 1e-8) * mask
    assert torch.allclose(out["advantages"], expected, atol=1e-5)


@pytest.mark.parametrize("whiten", ["areal", "verl"])
def test_group_norm_whitens_the_group_advantages_over_tokens_when_asked(tiny_trainer, whiten):
    """AReaL's GRPO recipes (reward_norm per group, then adv_norm over the batch's tokens, its (x - mean) / (std +
    1e-5)) and slime's --normalize-advantages (verl's formula): the group-normalised advantage of each row on each of
    its tokens, whitened over the loss tokens; computed here by hand (AReaL's recipes use epsilon 1e-5)."""
    from trl_ext_plugins.advantages.group_norm import GroupNorm

    values = [1.0, 0.0, 0.0, 1.0, 0.0, 1.0, 1.0, 1.0]
    plugin = GroupNorm(GroupNorm.Params(whiten=whiten, epsilon=1e-5))
    trainer = tiny_trainer("grpo", plugins=[plugin], reward_funcs=[scripted_reward(values)])
    out = rollout(trainer)
    mask = out["completion_mask"].double()
    grouped = torch.tensor(values, dtype=torch.float64).view(2, 4)
    per_row = (grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-5)
    per_token = per_row.view(-1, 1) * mask
    valid = mask.bool()
    mean, std = per_token[valid].mean(), per_token[valid].std()
    expected = (per_token - mean) / ((std + 1e-5) if whiten == "areal" else torch.sqrt(std ** 2 + 1e-8)) * mask
    assert out["advantages"].shape == mask.shape
    assert torch.allclose(out["advantages"].double(), expected, atol=1e-5)
    assert not torch.allclose(out["advantages"].double(), per_token, atol=1e-3)  # the whitening moved them


def test_reinforce_pp_baseline_whitens_as_openrlhf_when_asked(tiny_trainer):
    values = [1.0, 0.0, 0.0, 1.0, 0.0, 1.0, 1.0, 1.0]
    plugin = ReinforcePPBaseline(ReinforcePPBaseline.Params(whitening="openrlhf"))
    trainer = tiny_trainer("grpo", plugins=[plugin], reward_funcs=[scripted_reward(values)])
    out = rollout(trainer)
    mask = out["completion_mask"].float()
    centred = torch.tensor(values).view(2, 4)
    per_token = (centred - centred.mean(1, keepdim=True)).view(-1, 1) * mask
    valid = mask.bool()
    population = per_token[valid].var(unbiased=False)  # OpenRLHF: divided by n, floor max(var, 1e-8)
    expected = (per_token - per_token[valid].mean()) / torch.sqrt(population.clamp(min=1e-8)) * mask
    assert torch.allclose(out["advantages"], expected, atol=1e-5)


@pytest.mark.parametrize("form", ["sequence", "token", "returns"])
def test_reinforce_pp_baseline_folds_the_kl_into_the_reward_in_either_form(tiny_trainer, form):
    """kl_form sequence (verl's use_kl_in_reward: S = R - beta * sum_t KL_t, centred on the group mean of S), token
    (NeMo-RL: A'_t = R - group mean of R - beta * KL_t) or returns (AReaL: - beta * sum_{s >= t} KL_s), then
    whitened; computed here by hand from the policy's and the reference's log-probs (k1, beta 0.5; OpenRLHF / NeMo-RL
    whitening)."""
    values = [1.0, 0.0, 0.0, 1.0, 0.0, 1.0, 1.0, 1.0]
    plugin = ReinforcePPBaseline(ReinforcePPBaseline.Params(kl_coef=0.5, kl_form=form, whitening="openrlhf"))
    trainer = tiny_trainer("grpo", plugins=[plugin], args={"beta": 0.04}, reward_funcs=[scripted_reward(values)])
    out, d = rollout_away_from_the_reference(trainer)
    mask = out["completion_mask"].double()
    kl = d * mask
    rewards = torch.tensor(values, dtype=torch.float64)
    if form == "sequence":
        score = (rewards - 0.5 * kl.sum(1)).view(2, 4)
        per_token = (score - score.mean(1, keepdim=True)).view(-1, 1) * mask
    else:
        grouped = rewards.view(2, 4)
        penalty = kl if form == "token" else torch.flip(torch.cumsum(torch.flip(kl, [1]), 1), [1])
        per_token = ((grouped - grouped.mean(1, keepdim=True)).view(-1, 1) - 0.5 * penalty) * mask
    valid = mask.bool()
    expected = (per_token - per_token[valid].mean()) / per_token[valid].var(unbiased=False).clamp(min=1e-8).sqrt()
    assert torch.allclose(out["advantages"].double(), expected * mask, atol=1e-4)


@pytest.mark.parametrize("plugin", [RLOO(), ReinforcePP()])
def test_one_training_step_runs(tiny_trainer, plugin):
    trainer = tiny_trainer("grpo", plugins=[plugin], args={"max_steps": 1, "beta": 0.04})
    result = trainer.train()
    assert math.isfinite(result.training_loss)


# -- validation -----------------------------------------------------------------------------------------------------


def _stage(plugin, **args):
    return StageSpec(trainer="grpo", model="embedded:tiny-qwen2", dataset="embedded:arithmetic",
                     plugins=[plugin, "exact_match"], args=args)


@pytest.fixture
def catalog(trl_ext_catalog, register_plugin):
    from trl_ext_plugins.rewards.exact_match import ExactMatch

    register_plugin(ExactMatch)
    return trl_ext_catalog


def test_rloo_rejects_one_generation(catalog, register_plugin):
    register_plugin(RLOO)
    with pytest.raises(RecipeError, match=r"num_generations must be >= 2"):
        resolve_stage(_stage("rloo", num_generations=1, per_device_train_batch_size=2), 0, catalog)
    resolve_stage(_stage("rloo", num_generations=2, per_device_train_batch_size=2), 0, catalog)


def test_reinforce_pp_gets_its_reference_and_remax_refuses_vllm(catalog, register_plugin):
    register_plugin(ReinforcePP)
    register_plugin(ReMax)
    # The KL in the reward asks TRL for the reference (beta 1.0, no loss term) when the recipe sets no beta ...
    assert resolve_stage(_stage("reinforce_pp"), 0, catalog).args["beta"] == 1.0
    assert resolve_stage(_stage("reinforce_pp", beta=0.01), 0, catalog).args["beta"] == 0.01  # ... else keeps it
    with pytest.raises(RecipeError, match="use_vllm"):
        resolve_stage(_stage("remax", use_vllm=True), 0, catalog)


def test_params_are_validated():
    with pytest.raises(ValueError):
        ReinforceBaselineParams(baseline="median")
    with pytest.raises(ValueError):
        ReinforcePPParams(kl_estimator="k4")
    assert RLOOParams().normalize is False


@pytest.mark.parametrize("recipe", ["rloo", "reinforce_baseline", "remax", "reinforce_pp", "reinforce_pp_baseline"])
def test_recipes_validate(recipe, capsys):
    from pathlib import Path

    from trl_ext.cli import main

    path = Path(__file__).resolve().parents[1] / "configs" / f"{recipe}.yaml"
    assert main(["validate", str(path)]) == 0
    assert recipe in capsys.readouterr().out


# -- TRL options keep their meaning when a KL-in-the-reward plugin routes the loss through the pipeline -------------


@pytest.mark.parametrize("arg", [{"top_entropy_quantile": 0.2}, {"entropy_coef": 0.01}, {"delta": 2.0},
                                 {"off_policy_mask_threshold": 0.5}, {"use_adaptive_entropy": True},
                                 {"loss_type": "vespo"}])
def test_reward_kl_plugins_accept_the_trl_options_the_pipeline_applies(catalog, register_plugin, arg):
    """Dropping the loss KL (kl_coef > 0 with args.beta 0 or kl_in_loss false) makes the trainer run trl-ext's loss
    pipeline. It once lacked these options, which were then refused here; it now applies each as TRL does
    (tests/test_losses_parity.py), so they validate."""
    register_plugin(ReinforcePP)

    def stage(params, **args):
        return StageSpec(trainer="grpo", model="embedded:tiny-qwen2", dataset="embedded:arithmetic",
                         plugins=[{"name": "reinforce_pp", "params": params}, "exact_match"], args={**args, **arg})

    resolve_stage(_stage("reinforce_pp", **arg), 0, catalog)
    resolve_stage(stage({"kl_in_loss": False}, beta=0.01), 0, catalog)


def test_a_kl_term_replaced_after_validation_keeps_trls_options(tiny_trainer):
    """A KL term replaced after validation (trl_ext_trainer_created) routes the loss through the pipeline at the first
    loss; TRL's entropy filter and bonus still apply there: the loss equals TRL's own (the replaced term's weight is 0).
    """
    from trl import GRPOTrainer

    from trl_ext.ops import KLTerm

    def length_reward(completions, **_):  # the untrained model earns nothing on the task; lengths vary
        return [float(len(str(c)) % 5) for c in completions]

    trainer = tiny_trainer("grpo", args={"loss_type": "grpo", "top_entropy_quantile": 0.5, "entropy_coef": 0.05},
                           reward_funcs=[length_reward])
    trainer.kl_term = KLTerm("k3", coef=0.0)
    inputs = rollout(trainer, rows=8)
    trainer.current_gradient_accumulation_steps = 1  # set by Trainer's training loop; this test calls the loss
    ours = trainer._compute_loss(trainer.model, dict(inputs))
    theirs = GRPOTrainer._compute_loss(trainer, trainer.model, dict(inputs))
    assert torch.allclose(ours, theirs, atol=1e-6), (ours, theirs)
    trainer.top_entropy_quantile, trainer.entropy_coef = 1.0, 0.0
    assert not torch.allclose(trainer._compute_loss(trainer.model, dict(inputs)), ours, atol=1e-6)
