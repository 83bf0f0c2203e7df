"""``ppo`` and ``vapo``: value-loss math, the critic on the GRPO trainer, VAPO's parts, end-to-end learning, resume.

The GAE example of ALGORITHMS.md item 38 and VAPO's length-adaptive lambda (item 39) are tested as pure functions in
tests/test_advantages_math.py; here they are checked again only through the plugins.
"""

import copy
import dataclasses
import json

import pytest
import torch

from trl_ext import hookimpl
from trl_ext.batches import LossInputs
from trl_ext.metrics import reduce_figures
from trl_ext.recipe import parse_recipe
from trl_ext.testing import Interrupted, fresh_catalog, straight_and_resumed
from trl_ext_plugins.advantages import math as adv
from trl_ext_plugins.advantages.ppo import PPO, PPOParams
from trl_ext_plugins.advantages.vapo import POSITIVE, POSITIVE_TOKENS, VAPO, VAPOParams

f64 = torch.float64


def t(x):
    return torch.tensor(x, dtype=f64)


# -- value loss and explained variance (pure functions) --------------------------------------------------------------


def test_clipped_value_loss_formula():
    values, old, returns = t([[1.0, 0.0, 2.0]]), t([[0.0, 0.0, 1.9]]), t([[0.2, 1.0, 5.0]])
    mask = t([[1.0, 1.0, 0.0]])
    # token 0: V moved 1.0 from V_old, clip 0.5 -> clipped 0.5; max((1-0.2)^2, (0.5-0.2)^2) = 0.64
    # token 1: V = V_old -> (0-1)^2 = 1; token 2 is padding
    assert torch.isclose(adv.clipped_value_loss(values, old, returns, mask, 0.5), t(0.5 * (0.64 + 1.0) / 2))
    # the clipped branch wins when clipping keeps V further from R: V_old=2, V=1 -> clipped 1.5, R=2.5
    loss = adv.clipped_value_loss(t([[1.0]]), t([[2.0]]), t([[2.5]]), t([[1.0]]), 0.5)
    assert torch.isclose(loss, t(0.5 * max((1 - 2.5) ** 2, (1.5 - 2.5) ** 2)))
    loss = adv.clipped_value_loss(t([[1.0]]), t([[-2.0]]), t([[2.5]]), t([[1.0]]), 0.5)  # clipped -1.5: 16 > 2.25
    assert torch.isclose(loss, t(0.5 * 16.0))
    assert torch.isclose(adv.clipped_value_loss(t([[1.0]]), t([[-2.0]]), t([[2.5]]), t([[1.0]]), None), t(0.5 * 2.25))


def test_clipped_value_loss_gradient_masks_and_clip_region():
    values = t([[1.0, 0.0, 3.0]]).requires_grad_()
    adv.clipped_value_loss(values, t([[0.0, 0.0, 0.0]]), t([[0.2, 1.0, 7.0]]), t([[1.0, 1.0, 0.0]]), 0.5).backward()
    # token 0: unclipped branch (0.64 > 0.09) -> d/dV 0.5*(V-R)^2/2 = (1-0.2)/2; token 1: (0-1)/2; padding exactly 0
    assert torch.allclose(values.grad, t([[0.4, -0.5, 0.0]]))
    values = t([[1.0]]).requires_grad_()  # clipped branch wins (V_old=-2): its gradient w.r.t. V is 0
    adv.clipped_value_loss(values, t([[-2.0]]), t([[2.5]]), t([[1.0]]), 0.5).backward()
    assert values.grad.item() == 0.0
    # a non-finite value, old value or return at a padded token changes neither the loss nor the other gradients
    nan, inf = float("nan"), float("inf")
    values = t([[1.0, 0.0, nan]]).requires_grad_()
    loss = adv.clipped_value_loss(values, t([[0.0, 0.0, inf]]), t([[0.2, 1.0, nan]]), t([[1.0, 1.0, 0.0]]), 0.5)
    loss.backward()
    assert torch.isclose(loss, t(0.5 * (0.64 + 1.0) / 2)) and torch.equal(values.grad, t([[0.4, -0.5, 0.0]]))


def test_explained_variance():
    returns, mask = t([[1.0, 2.0, 3.0, 99.0]]), t([[1.0, 1.0, 1.0, 0.0]])
    assert torch.isclose(adv.explained_variance(returns, returns, mask), t(1.0))
    assert torch.isclose(adv.explained_variance(torch.full_like(returns, 2.0), returns, mask), t(0.0))
    noisy = t([[1.5, 2.0, 2.5, 0.0]])  # residual [-0.5, 0, 0.5]: var 0.25 vs var(R) 1
    assert torch.isclose(adv.explained_variance(noisy, returns, mask), t(0.75))
    assert torch.isnan(adv.explained_variance(returns, torch.ones_like(returns), mask))


# -- parameters and validation ---------------------------------------------------------------------------------------


def test_params_and_needs():
    assert PPO().needs == {"reference"} and PPO(PPOParams(kl_coef=0.0)).needs == frozenset()
    with pytest.raises(ValueError, match="critic_path"):
        PPOParams(critic="path")
    p = VAPOParams()
    assert (p.lam_critic, p.length_adaptive_alpha, p.epsilon_high, p.nll_coef, p.critic_warmup_steps) == (
        1.0, 0.05, 0.28, 0.1, 50)


def test_vapo_configure_args_each_part_switchable():
    assert VAPO().trl_ext_configure_args("grpo", {}) == {"epsilon_high": 0.28, "loss_type": "dapo"}
    assert VAPO(VAPOParams(clip_higher=False)).trl_ext_configure_args("grpo", {}) == {"loss_type": "dapo"}
    assert VAPO(VAPOParams(token_level_loss=False, epsilon_high=0.3)).trl_ext_configure_args("grpo", {}) == {
        "epsilon_high": 0.3}
    assert VAPO(VAPOParams(clip_higher=False, token_level_loss=False)).trl_ext_configure_args("grpo", {}) is None


# -- the critic on the GRPO trainer ----------------------------------------------------------------------------------

REWARDS = [1.0, 0.0, 0.5, 0.25, 2.0, 0.0, 1.0, 0.0]


def scripted(values):
    def reward(completions, **kwargs):
        return values[: len(completions)]

    return reward


def rollout(trainer, rows=8):
    trainer.model.train()
    inputs = [trainer.train_dataset[i // 4] for i in range(rows)]
    return trainer._generate_and_score_completions(inputs)


def expected_advantages(critic, out, rewards, gamma, lam, whiten=True):
    """Independent recomputation in float64 from the critic as it was before the rollout."""
    mask = out["completion_mask"].to(f64)
    with torch.no_grad():
        values = critic(out["prompt_ids"], out["prompt_mask"], out["completion_ids"], out["completion_mask"]).to(f64)
    values = values * mask
    lengths = mask.sum(-1).long()
    token_r = torch.zeros_like(mask)
    token_r[torch.arange(len(lengths)), lengths - 1] = torch.tensor(rewards, dtype=f64)
    lam = torch.as_tensor(lam, dtype=f64).expand(len(lengths))
    a = torch.zeros_like(mask)
    for row in range(len(lengths)):  # plain per-sequence loop, written independently of math.gae
        running, n = 0.0, lengths[row].item()
        for step in reversed(range(n)):
            next_v = values[row, step + 1].item() if step + 1 < n else 0.0
            delta = token_r[row, step].item() + gamma * next_v - values[row, step].item()
            running = delta + gamma * lam[row].item() * running
            a[row, step] = running
    if whiten:
        valid = a[mask.bool()]
        a = (a - valid.mean()) / torch.sqrt(valid.var() + 1e-8) * mask
    return a, values


def test_ppo_advantages_are_whitened_gae_of_the_critic_and_the_critic_learns(tiny_trainer):
    plugin = PPO(PPOParams(kl_coef=0.0, gamma=0.9, lam=0.8, critic_lr=1e-3))
    trainer = tiny_trainer("grpo", plugins=[plugin], reward_funcs=[scripted(REWARDS)])
    before = copy.deepcopy(plugin.critic)
    policy_before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    out = rollout(trainer)
    expected, _ = expected_advantages(before, out, REWARDS, 0.9, 0.8)
    assert out["advantages"].shape == out["completion_mask"].shape and not out["advantages"].requires_grad
    assert torch.allclose(out["advantages"].to(f64), expected, atol=1e-5)
    assert (out["advantages"][out["completion_mask"] == 0] == 0).all()
    # the critic took one optimizer step: every parameter (trunk and head) moved; the policy did not
    for (name, p0), p1 in zip(before.named_parameters(), plugin.critic.parameters()):
        assert not torch.equal(p0, p1), f"critic parameter {name} got no update"
    for k, v in trainer.model.state_dict().items():
        assert torch.equal(v, policy_before[k])


def test_truncated_row_bootstrap_picks_the_value_after_the_last_token_of_cut_off_rows_only():
    from trl_ext_plugins.advantages.ppo import truncated_row_bootstrap

    eos, pad = 2, 0
    ids = torch.tensor([[5, 6, 2, 0], [5, 6, 7, 8], [5, 0, 0, 0], [0, 0, 0, 0], [5, 0, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [1, 0, 0, 0], [0, 0, 0, 0], [1, 1, 0, 0]])
    values_next = torch.arange(25, dtype=f64).reshape(5, 5)  # row r, column c: 5r + c
    got = truncated_row_bootstrap(values_next, ids, mask, [eos, pad])
    # ended by EOS: 0; full row of 4: column 4 (9); one token 5: column 1 (11); empty: 0; last token padding: 0
    assert torch.equal(got, t([0.0, 9.0, 11.0, 0.0, 0.0]))


def test_ppo_truncation_bootstrap_is_gae_with_the_critic_value_after_a_cut_off_row(tiny_trainer):
    plugin = PPO(PPOParams(kl_coef=0.0, gamma=0.9, lam=0.8, critic_lr=1e-3, truncation="bootstrap",
                           whiten_advantages=False))
    trainer = tiny_trainer("grpo", plugins=[plugin], reward_funcs=[scripted(REWARDS)])
    before = copy.deepcopy(plugin.critic)
    out = rollout(trainer)
    ids, mask = out["completion_ids"], out["completion_mask"]
    # independently: every position's value from the trunk and head; V after a row's last token is read at it
    with torch.no_grad():
        hidden = before.trunk(input_ids=torch.cat([out["prompt_ids"], ids], 1),
                              attention_mask=torch.cat([out["prompt_mask"], mask], 1)).last_hidden_state
        every = before.head(hidden).squeeze(-1).to(f64)
    start, lengths = out["prompt_ids"].size(1) - 1, mask.sum(-1).long()
    ended_by = [*trainer.eos_token_ids, trainer.processing_class.pad_token_id]
    expected = torch.zeros(ids.shape, dtype=f64)
    cut_off = 0
    for row in range(ids.size(0)):
        n = lengths[row].item()
        v = every[row, start : start + n].tolist()
        truncated = n > 0 and ids[row, n - 1].item() not in ended_by
        cut_off += truncated
        v.append(every[row, start + n].item() if truncated else 0.0)
        running = 0.0
        for step in reversed(range(n)):
            delta = (REWARDS[row] if step == n - 1 else 0.0) + 0.9 * v[step + 1] - v[step]
            running = delta + 0.9 * 0.8 * running
            expected[row, step] = running
    assert cut_off > 0  # the tiny model's 4-token completions are cut off, so the bootstrap is exercised
    assert torch.allclose(out["advantages"].to(f64), expected, atol=1e-5)
    # the terminal default on the same critic: the cut-off rows' advantages differ, the ended rows' do not
    terminal, _ = expected_advantages(before, out, REWARDS, 0.9, 0.8, whiten=False)
    assert not torch.allclose(terminal, expected, atol=1e-5)


def test_ppo_critic_update_matches_one_manual_adam_step(tiny_trainer):
    plugin = PPO(PPOParams(kl_coef=0.0, lam=1.0, critic_lr=1e-3, value_clip=0.2, critic_max_grad_norm=None))
    trainer = tiny_trainer("grpo", plugins=[plugin], reward_funcs=[scripted(REWARDS)])
    manual = copy.deepcopy(plugin.critic)
    out = rollout(trainer)
    mask = out["completion_mask"].float()
    inputs = (out["prompt_ids"], out["prompt_mask"], out["completion_ids"], out["completion_mask"])
    with torch.no_grad():
        old = manual(*inputs) * mask
    returns = torch.zeros_like(mask)  # lam = gamma = 1: the return of every token is the sequence reward
    returns[:] = torch.tensor(REWARDS).unsqueeze(1)
    optimizer = torch.optim.AdamW(manual.parameters(), lr=1e-3, weight_decay=0.0)
    values = manual(*inputs)
    clipped = old + (values - old).clamp(-0.2, 0.2)
    loss = 0.5 * (torch.maximum((values - returns) ** 2, (clipped - returns) ** 2) * mask).sum() / mask.sum()
    loss.backward()
    optimizer.step()
    logged = trainer._metrics["train"]["ppo/value_loss"][-1]
    assert abs(logged - loss.item()) < 1e-6
    # Adam's first step is ~lr * sign(g): elements whose gradient is near Adam's eps are ill-conditioned in float32,
    # so compare at a tenth of the learning rate (a different loss would flip signs: differences of 2 * lr)
    for p0, p1 in zip(manual.parameters(), plugin.critic.parameters()):
        torch.testing.assert_close(p0, p1, atol=1e-4, rtol=0)


def test_ppo_kl_in_the_reward_uses_the_reference(tiny_trainer):
    plugin = PPO(PPOParams(kl_coef=0.5, lam=1.0, gamma=1.0, whiten_advantages=False))
    trainer = tiny_trainer("grpo", plugins=[plugin], args={"beta": 0.01}, reward_funcs=[scripted(REWARDS)])
    with torch.no_grad():  # make the policy differ from the reference so the KL is not 0
        for p in trainer.model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    before = copy.deepcopy(plugin.critic)
    out = rollout(trainer)
    mask = out["completion_mask"].to(f64)
    kl = (out["old_per_token_logps"] if out.get("old_per_token_logps") is not None else None)
    if kl is None:  # TRL did not record pi_old: it is the current policy
        from trl_ext_plugins.advantages.rollout import sampling_policy_logps
        from types import SimpleNamespace

        kl = sampling_policy_logps(SimpleNamespace(old_per_token_logps=None, trainer=trainer, **{
            k: out[k] for k in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask")}))
    kl = (kl - out["ref_per_token_logps"]).to(f64) * mask
    assert kl.abs().sum() > 0
    _, values = expected_advantages(before, out, REWARDS, 1.0, 1.0, whiten=False)
    # lam = gamma = 1: A_t = sum_{s >= t} r_s - V_t with r_s = 1[last] R - 0.5 KL_s
    tail_kl = kl.flip(-1).cumsum(-1).flip(-1)
    expected = (torch.tensor(REWARDS, dtype=f64).unsqueeze(1) - 0.5 * tail_kl - values) * mask
    assert torch.allclose(out["advantages"].to(f64), expected, atol=1e-4)


def test_critic_warmup_leaves_the_policy_unchanged(tiny_trainer):
    plugin = PPO(PPOParams(kl_coef=0.0, critic_warmup_steps=2, critic_lr=1e-3))
    trainer = tiny_trainer("grpo", plugins=[plugin], args={"max_steps": 2, "learning_rate": 1e-2},
                           reward_funcs=[scripted(REWARDS)])
    policy = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    critic = copy.deepcopy(plugin.critic.state_dict())
    trainer.train()
    assert all(torch.equal(v, policy[k]) for k, v in trainer.model.state_dict().items())
    assert not torch.equal(plugin.critic.state_dict()["head.weight"], critic["head.weight"])
    assert trainer.state.log_history[0]["ppo/critic_warmup"] == 1.0


def test_vapo_critic_warmup_leaves_the_policy_unchanged_with_the_nll_term_on(tiny_trainer):
    """Value pre-training trains the critic alone: the positive-example NLL term (mu 0.1, on by default) must not
    move the policy during the warm-up either (its gradient does not pass through the zeroed advantages)."""
    plugin = VAPO(VAPOParams(critic_warmup_steps=2, critic_lr=1e-3, nll_coef=0.1, positive_threshold=0.4))
    trainer = tiny_trainer("grpo", plugins=[plugin], args={"max_steps": 2, "learning_rate": 1e-2},
                           reward_funcs=[scripted(REWARDS)])
    policy = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    trainer.train()
    assert all(torch.equal(v, policy[k]) for k, v in trainer.model.state_dict().items())
    rows = [r for r in trainer.state.log_history if "ppo/critic_warmup" in r]
    assert len(rows) == 2 and not any("vapo/nll" in r for r in rows)


def test_critic_from_a_reward_model_path_takes_its_score_head(tiny_model_dir, tmp_path):
    from transformers import AutoModelForSequenceClassification

    reward_model = AutoModelForSequenceClassification.from_pretrained(tiny_model_dir, num_labels=1)
    reward_model.config.pad_token_id = reward_model.config.pad_token_id or 0
    reward_model.save_pretrained(tmp_path / "rm")
    from trl_ext_plugins.advantages.critic import critic_from_path

    critic = critic_from_path(str(tmp_path / "rm"))
    torch.testing.assert_close(critic.head.weight, reward_model.score.weight)
    ids, ones = torch.tensor([[5, 6, 7, 8]]), torch.ones(1, 4, dtype=torch.long)
    score = reward_model(input_ids=ids, attention_mask=ones).logits[0, 0]  # the RM scores the last token
    # completion token t is valued at the position predicting it (P - 1 + t): append one token to read position 3
    values = critic(ids[:, :1], ones[:, :1], torch.cat([ids[:, 1:], ids[:, :1]], 1), ones)
    torch.testing.assert_close(values[0, 3], score, atol=1e-5, rtol=1e-5)


# -- VAPO ------------------------------------------------------------------------------------------------------------


def test_vapo_decoupled_gae_uses_length_adaptive_policy_lambda(tiny_trainer):
    plugin = VAPO(VAPOParams(critic_warmup_steps=0, nll_coef=0.0, length_adaptive_alpha=0.5, gamma=1.0))
    trainer = tiny_trainer("grpo", plugins=[plugin], reward_funcs=[scripted(REWARDS)])
    before = copy.deepcopy(plugin.critic)
    out = rollout(trainer)
    lengths = out["completion_mask"].sum(-1).to(f64)
    lam = (1 - 1 / (0.5 * lengths).clamp(min=1.0)).clamp(0, 1)  # alpha=0.5, l=4 -> 0.5
    expected, _ = expected_advantages(before, out, REWARDS, 1.0, lam)
    assert torch.allclose(out["advantages"].to(f64), expected, atol=1e-5)
    assert POSITIVE not in out  # nll_coef 0: no extra columns


def test_vapo_positive_example_nll(tiny_trainer):
    mu = 0.1
    plugin = VAPO(VAPOParams(nll_coef=mu, critic_warmup_steps=0, positive_threshold=0.4))
    trainer = tiny_trainer("grpo", plugins=[plugin], reward_funcs=[scripted(REWARDS)])
    out = rollout(trainer)
    positive = torch.tensor(REWARDS) > 0.4
    assert torch.equal(out[POSITIVE].bool(), positive)
    assert out[POSITIVE_TOKENS][0] == out["completion_mask"][positive].sum()

    logps = torch.randn(8, out["completion_mask"].shape[1], dtype=f64).requires_grad_()
    mask = out["completion_mask"].to(f64)
    li = LossInputs(num_items_in_batch=mask.sum(), grad_accum_steps=1, steps_per_generation=1, num_processes=1,
                    training=True, loss_type="dapo", max_completion_length=4, per_token_logps=logps,
                    old_per_token_logps=logps.detach(), advantages=torch.zeros(8, 1, dtype=f64), mask=mask,
                    sampling_per_token_logps=None, ref_per_token_logps=None, entropies=None, epsilon_low=0.2,
                    epsilon_high=0.28, beta=0.0, extra={POSITIVE: out[POSITIVE], POSITIVE_TOKENS: out[POSITIVE_TOKENS]})
    term = plugin.trl_ext_extra_loss(li)
    pos_mask = mask * positive.unsqueeze(1)
    expected = -mu * (logps.detach() * pos_mask).sum() / pos_mask.sum()
    assert torch.isclose(term.detach(), expected)
    term.backward()
    assert (logps.grad[~positive] == 0).all() and (logps.grad[mask == 0] == 0).all()
    assert torch.allclose(logps.grad[positive], (-mu / pos_mask.sum() * pos_mask)[positive])
    assert VAPO(VAPOParams(nll_coef=0.0)).trl_ext_extra_loss(li) is None
    # -inf log-probs outside the NLL's tokens (padding, samples below the threshold) change neither the term nor its
    # logged value, and the gradient there stays exactly 0
    hostile = logps.detach().masked_fill(pos_mask == 0, float("-inf")).requires_grad_()
    li_hostile = dataclasses.replace(li, per_token_logps=hostile, metrics={})
    term_hostile = plugin.trl_ext_extra_loss(li_hostile)
    assert torch.isclose(term_hostile.detach(), expected)
    assert reduce_figures(li_hostile.metrics)["vapo/nll"] == pytest.approx(expected.item() / mu)
    term_hostile.backward()
    assert torch.isfinite(hostile.grad).all() and (hostile.grad[pos_mask == 0] == 0).all()


def test_vapo_nll_term_reaches_the_loss_through_the_trainer(tiny_trainer):
    seen = []

    class Recording(VAPO):
        @hookimpl
        def trl_ext_extra_loss(self, inputs):
            term = super().trl_ext_extra_loss(inputs)
            seen.append((inputs.extra[POSITIVE].clone(), term))
            return term

    plugin = Recording(VAPOParams(nll_coef=0.1, critic_warmup_steps=0, positive_threshold=0.4))
    trainer = tiny_trainer("grpo", plugins=[plugin], args={"max_steps": 1}, reward_funcs=[scripted(REWARDS)])
    trainer.train()
    assert seen and all(term is not None and term.requires_grad for _, term in seen)
    assert sorted(torch.cat([flags for flags, _ in seen]).tolist()) == sorted(
        (torch.tensor(REWARDS) > 0.4).float().tolist())
    assert trainer.args.loss_type == "dapo" and trainer.args.epsilon_high == 0.28


# -- end to end ------------------------------------------------------------------------------------------------------


def leading_digit_reward(prompts, **kwargs):
    """A reward the critic can predict from the prompt alone (1 when the first operand is >= 50), so its fit shows."""
    return [float(prompt[0] >= "5") for prompt in prompts]


def test_ppo_end_to_end_value_loss_falls_and_explained_variance_rises(tiny_trainer):
    # 8 prompts x 2 samples per step. Explained variance is a per-batch figure and jumps when a batch's returns hardly
    # vary (e.g. all 8 prompts on one side), so the test compares medians of the first and last 8 steps.
    torch.manual_seed(0)
    plugin = PPO(PPOParams(kl_coef=0.0, critic_lr=1e-3))
    trainer = tiny_trainer("grpo", plugins=[plugin], reward_funcs=[leading_digit_reward], args={
        "max_steps": 24, "learning_rate": 1e-4, "per_device_train_batch_size": 16, "num_generations": 2})
    trainer.train()
    rows = [r for r in trainer.state.log_history if "ppo/value_loss" in r]
    assert len(rows) == 24
    loss = torch.tensor([r["ppo/value_loss"] for r in rows])
    ev = torch.tensor([r["ppo/explained_variance"] for r in rows])
    assert loss[-8:].mean() < 0.3 * loss[:8].mean(), loss
    assert ev[-8:].nanmedian() > 0 and ev[-8:].nanmedian() > ev[:8].nanmedian() + 1, ev
    assert all(k in rows[0] for k in ("ppo/returns_mean", "ppo/advantages_mean", "ppo/values_mean"))


def _ppo_recipe():
    return parse_recipe({
        "seed": 0, "keep_checkpoints": True,  # the test reads checkpoint-2's critic after the run completed
        "trainer": "grpo", "model": "embedded:tiny-qwen2", "name": "ppo",
        "plugins": [{"ppo": {"kl_coef": 0.05, "critic_lr": 1e-3}}, "exact_match"],
        "dataset": {"source": "embedded:arithmetic", "params": {"format": "prompt"}},
        "args": {"max_steps": 4, "save_steps": 2, "per_device_train_batch_size": 8, "num_generations": 4,
                 "max_completion_length": 4, "beta": 0.001, "learning_rate": 1e-3, "logging_steps": 1,
                 "gradient_checkpointing": False},
    })


def test_interrupted_ppo_resumes_critic_and_its_optimizer(tmp_path):
    from transformers import TrainerCallback

    from trl_ext_plugins.rewards.exact_match import ExactMatch

    catalog = fresh_catalog()
    for cls in (PPO, ExactMatch):
        catalog.add_plugin(cls)

    class StopAfterCheckpoint(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step == 2:  # checkpoint-2 (with critic.pt) is complete
                raise Interrupted()

    straight, resumed, messages = straight_and_resumed(_ppo_recipe, catalog, tmp_path, StopAfterCheckpoint())
    assert (resumed / "ppo" / "checkpoints" / "checkpoint-2" / "critic.pt").exists()
    assert any("resuming from" in m and "checkpoint-2" in m for m in messages)

    a = torch.load(straight / "ppo" / "critic.pt", weights_only=True)
    b = torch.load(resumed / "ppo" / "critic.pt", weights_only=True)
    mid = torch.load(resumed / "ppo" / "checkpoints" / "checkpoint-2" / "critic.pt", weights_only=True)
    assert a["model"].keys() == b["model"].keys()
    for key in a["model"]:
        torch.testing.assert_close(a["model"][key], b["model"][key], rtol=0, atol=1e-6)
    assert any(not torch.equal(a["model"][k], mid["model"][k]) for k in a["model"])  # it kept learning after step 2
    sa, sb = a["optimizer"]["state"], b["optimizer"]["state"]
    assert sa.keys() == sb.keys() and all(sa[i]["step"] == sb[i]["step"] == 4 for i in sa)
    for i in sa:
        for name in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(sa[i][name], sb[i][name], rtol=0, atol=1e-6)
    rows = [json.loads(line) for line in (resumed / "ppo" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "ppo/value_loss" in r] == [1, 2, 3, 4]


def test_rank_token_share_makes_the_mean_over_ranks_the_global_token_mean():
    from types import SimpleNamespace

    from trl_ext_plugins.advantages.ppo import rank_token_share

    masks = [torch.tensor([[1, 1, 1, 0]]), torch.tensor([[1, 0, 0, 0]])]  # 3 tokens on rank 0, 1 on rank 1
    losses = [torch.tensor(2.0), torch.tensor(6.0)]  # each rank's own token mean
    total = sum(m.sum() for m in masks).float()

    def trainer(world):
        return SimpleNamespace(accelerator=SimpleNamespace(num_processes=world, reduce=lambda t, reduction: total))

    shared = [loss * rank_token_share(mask, trainer(2)) for loss, mask in zip(losses, masks)]
    assert torch.stack(shared).mean().item() == pytest.approx((2.0 * 3 + 6.0 * 1) / 4)  # not (2 + 6) / 2
    assert rank_token_share(masks[0], trainer(1)) == 1.0


def test_ppo_killed_after_its_last_step_saves_the_trained_critic(tmp_path):
    """A stage killed after its last checkpoint (here: while training ends) is finished from that checkpoint without
    ``trainer.train``; the ``critic.pt`` saved after the stage must be the trained critic of that checkpoint, not the
    critic the plugin was built with (on_train_begin, where the critic is restored, never runs on that path)."""
    from transformers import TrainerCallback

    from trl_ext_plugins.rewards.exact_match import ExactMatch

    catalog = fresh_catalog()
    for cls in (PPO, ExactMatch):
        catalog.add_plugin(cls)

    class KilledAfterTraining(TrainerCallback):
        def on_train_end(self, args, state, control, **kwargs):  # checkpoint-4 is complete by now
            raise Interrupted()

    straight, resumed, messages = straight_and_resumed(_ppo_recipe, catalog, tmp_path, KilledAfterTraining())
    assert any("is the last step; finishing the stage" in m for m in messages)

    a = torch.load(straight / "ppo" / "critic.pt", weights_only=True)
    b = torch.load(resumed / "ppo" / "critic.pt", weights_only=True)
    last = torch.load(resumed / "ppo" / "checkpoints" / "checkpoint-4" / "critic.pt", weights_only=True)
    for key in a["model"]:
        torch.testing.assert_close(b["model"][key], last["model"][key], rtol=0, atol=0)
        torch.testing.assert_close(a["model"][key], b["model"][key], rtol=0, atol=1e-6)
    assert all(state["step"] == 4 for state in b["optimizer"]["state"].values())
