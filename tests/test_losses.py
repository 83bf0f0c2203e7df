"""Formula, gradient and numerics tests of the ``losses`` family (ALGORITHMS.md items 27, 31-37, 48, convention 2).

Numbers are the ones ALGORITHMS.md lists, computed independently here in float64. Three policies are named as in
convention 7: ``theta`` (current, requires grad), ``old`` (trainer copy at sampling time), ``rollout`` (engine).
"""

from __future__ import annotations

import math

import pytest
import torch

from trl_ext.batches import LossInputs
from trl_ext_plugins.losses import aggregation as agg
from trl_ext_plugins.losses import math as lm
from trl_ext_plugins.losses.ce_gppo import CEGPPO
from trl_ext_plugins.losses.cispo import CISPO
from trl_ext_plugins.losses.clip_higher import ClipHigher
from trl_ext_plugins.losses.dapo import DAPO
from trl_ext_plugins.losses.dr_grpo import DrGRPO
from trl_ext_plugins.losses.gmpo import GMPO
from trl_ext_plugins.losses.grpo import GRPO
from trl_ext_plugins.losses.gspo import GSPO
from trl_ext_plugins.losses.reinforce import REINFORCE
from trl_ext_plugins.losses.sapo import SAPO

D = torch.float64


def make_inputs(theta, old=None, advantages=None, mask=None, rollout=None, eps_low=0.2, eps_high=0.2, **extra):
    """A LossInputs for one micro-batch (float64, no gradient accumulation, eval-style scaling)."""
    if not (isinstance(theta, torch.Tensor) and theta.requires_grad):  # else: part of a caller's graph, kept as is
        theta = torch.as_tensor(theta, dtype=D)
        theta = theta if theta.dim() == 2 else theta.unsqueeze(0)
        theta = theta.clone().requires_grad_(True)
    old = theta.detach().clone() if old is None else torch.as_tensor(old, dtype=D).reshape(theta.shape)
    adv = torch.ones(theta.size(0), 1, dtype=D) if advantages is None else torch.as_tensor(advantages, dtype=D)
    adv = adv.reshape(theta.size(0), -1)
    mask = torch.ones_like(theta.detach()) if mask is None else torch.as_tensor(mask, dtype=D).reshape(theta.shape)
    return LossInputs(
        num_items_in_batch=mask.sum(), grad_accum_steps=1, steps_per_generation=1, num_processes=1, training=False,
        loss_type="grpo", max_completion_length=theta.size(1), per_token_logps=theta, old_per_token_logps=old,
        advantages=adv, mask=mask,
        sampling_per_token_logps=None if rollout is None else torch.as_tensor(rollout, dtype=D).reshape(theta.shape),
        ref_per_token_logps=None, entropies=None, epsilon_low=eps_low, epsilon_high=eps_high, beta=0.0,
        extra={"sapo_tau_pos": 1.0, "sapo_tau_neg": 1.05, **extra},
    )


def token_grad(loss_tokens, li):
    """d(sum of per-token losses)/d log pi_theta."""
    (grad,) = torch.autograd.grad(loss_tokens.sum(), li.per_token_logps, allow_unused=True)
    return torch.zeros_like(li.per_token_logps) if grad is None else grad


def at_ratio(r, advantage=1.0, **kw):
    """Inputs with one token whose ratio pi_theta/pi_old is r (log pi_old = 0)."""
    return make_inputs([[math.log(r)]], old=[[0.0]], advantages=[[advantage]], **kw)


# -- GRPO / DAPO / clip-higher ----------------------------------------------------------------------------------------


def test_grpo_clip_value_and_zero_gradient_when_clipped():
    li = at_ratio(1.3)
    loss = GRPO().trl_ext_policy_loss(inputs=li)
    assert loss.item() == pytest.approx(-1.2, abs=1e-12)
    assert token_grad(loss, li).item() == 0.0
    li = at_ratio(1.1)
    loss = GRPO().trl_ext_policy_loss(inputs=li)
    assert loss.item() == pytest.approx(-1.1) and token_grad(loss, li).item() == pytest.approx(-1.1)


def test_dapo_clip_higher_numbers():
    li = at_ratio(1.25, eps_high=0.28)  # A>0, 1.25 < 1.28: not clipped, gradient -r*A
    loss = DAPO().trl_ext_policy_loss(inputs=li)
    assert loss.item() == pytest.approx(-1.25) and token_grad(loss, li).item() == pytest.approx(-1.25)
    li = at_ratio(0.75, advantage=-1.0, eps_high=0.28)  # A<0, clipped at 0.8
    loss = DAPO().trl_ext_policy_loss(inputs=li)
    assert loss.item() == pytest.approx(0.8) and token_grad(loss, li).item() == 0.0
    li = at_ratio(1.25, eps_high=0.2)  # plain GRPO clips the same token
    assert token_grad(ClipHigher().trl_ext_policy_loss(inputs=li), li).item() == 0.0


def test_presets_pin_trl_fields():
    token = {"importance_sampling_level": "token"}
    assert DAPO().trl_ext_configure_args(trainer="grpo", args={}) == {
        **token, "epsilon_high": 0.28, "loss_type": "dapo", "mask_truncated_completions": True, "beta": 0.0}
    assert DAPO(DAPO.Params(token_level_loss=False, overlong_filtering=False, no_kl=False)).trl_ext_configure_args(
        trainer="grpo", args={}) == {**token, "epsilon_high": 0.28}
    assert DrGRPO().trl_ext_configure_args(trainer="grpo", args={}) == {
        **token, "loss_type": "dr_grpo", "scale_rewards": "none"}
    assert GSPO().trl_ext_configure_args(trainer="grpo", args={})["importance_sampling_level"] == "sequence"
    assert ClipHigher().trl_ext_configure_args(trainer="grpo", args={}) == {**token, "epsilon_high": 0.28}


@pytest.mark.parametrize("plugin", ["grpo", "dr_grpo", "dapo", "gmpo", "sapo", "cispo", "ce_gppo", "clip_higher",
                                    "reinforce", "rollout_ratio"])
def test_token_ratio_objectives_refuse_trl_sequence_level(plugin):
    """These objectives form their own per-token ratio: TRL's importance_sampling_level 'sequence' (GSPO) would be
    ignored by the loss (grpo gave -0.95677 where TRL's sequence-level grpo gives -0.96722) while still switching the
    KL bias-correction ratio, so a recipe asking for it is refused, naming field and plugin; gspo keeps 'sequence'."""
    from trl_ext.catalog import Catalog
    from trl_ext.errors import RecipeError
    from trl_ext.recipe import StageSpec
    from trl_ext.stage import resolve_stage

    def stage(name, level):
        extra = ["rollout_logprobs"] if name == "rollout_ratio" else []
        return StageSpec.model_validate({
            "name": "s", "trainer": "grpo", "model": "embedded:tiny-qwen2",
            "dataset": {"source": "embedded:arithmetic", "params": {"format": "prompt"}},
            "plugins": [name, "exact_match", *extra], "args": {"importance_sampling_level": level}})

    catalog = Catalog.discover()
    with pytest.raises(RecipeError, match=f"args.importance_sampling_level: the recipe sets 'sequence' but plugin "
                                          f"'{plugin}' requires 'token'"):
        resolve_stage(stage(plugin, "sequence"), 0, catalog)
    assert resolve_stage(stage(plugin, "token"), 0, catalog).args["importance_sampling_level"] == "token"
    assert resolve_stage(stage("gspo", "sequence"), 0, catalog).args["importance_sampling_level"] == "sequence"


# -- aggregation (convention 2) ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode, constant, expected", [
    ("token-mean", None, 0.25), ("batch-token-mean", None, 0.25), ("seq-mean-token-mean", None, 0.5),
    ("seq-mean-token-sum-norm", 4, 0.125),
])
def test_aggregation_modes(mode, constant, expected):
    # sequences with per-token losses [1] and [0, 0, 0]
    loss = torch.tensor([[1.0, 0, 0], [0, 0, 0]], dtype=D, requires_grad=True)
    mask = torch.tensor([[1.0, 0, 0], [1, 1, 1]], dtype=D)
    li = make_inputs(torch.zeros(2, 3), mask=mask)
    plugin = agg.Aggregation(agg.Aggregation.Params(mode=mode, constant=constant))
    value = plugin.trl_ext_aggregate_loss(per_token_loss=loss, mask=mask, inputs=li)
    assert value.item() == pytest.approx(expected)
    (grad,) = torch.autograd.grad(value, loss)
    assert torch.all(grad[mask == 0] == 0)  # masked tokens get exactly zero gradient


@pytest.mark.parametrize("mode, count, exclude", [("seq-mean-token-mean", 1.0, 2.0), ("seq-mean-token-sum", 2.0, 4.0)])
def test_empty_rows_exclude_leaves_fully_masked_rows_out_of_the_row_count(mode, count, exclude):
    """OpenRLHF's test_loss_batch_info_excludes_fully_masked_sequences: losses [[1, 3], [5, 7]], the second row fully
    masked: its seq-mean is (1 + 3) / 2 over the one non-empty row = 2.0 (token-sum: 4.0); TRL's convention, the
    default, counts the empty row: half that. The masked row gets zero gradient either way."""
    loss = torch.tensor([[1.0, 3.0], [5.0, 7.0]], dtype=D, requires_grad=True)
    mask = torch.tensor([[1.0, 1.0], [0.0, 0.0]], dtype=D)
    li = make_inputs(torch.zeros(2, 2), mask=mask)
    for empty_rows, expected in (("count", count), ("exclude", exclude)):
        plugin = agg.Aggregation(agg.Aggregation.Params(mode=mode, empty_rows=empty_rows))
        value = plugin.trl_ext_aggregate_loss(per_token_loss=loss, mask=mask, inputs=li)
        assert value.item() == pytest.approx(expected)
        (grad,) = torch.autograd.grad(value, loss)
        assert torch.all(grad[1] == 0)
    # every row empty: 0, not NaN
    plugin = agg.Aggregation(agg.Aggregation.Params(mode=mode, empty_rows="exclude"))
    assert plugin.trl_ext_aggregate_loss(per_token_loss=loss, mask=torch.zeros_like(mask), inputs=li).item() == 0.0
    with pytest.raises(ValueError, match="empty_rows: exclude applies to seq-mean-token-mean and seq-mean-token-sum"):
        agg.Aggregation.Params(mode="token-mean", empty_rows="exclude")


def test_token_mean_is_global_and_accumulation_aware():
    # TRL dapo normaliser: num_items_in_batch (global generation batch) / processes * GA / steps_per_generation
    loss = torch.ones(2, 3, dtype=D)
    mask = torch.ones(2, 3, dtype=D)
    li = make_inputs(torch.zeros(2, 3))
    li.training, li.grad_accum_steps, li.steps_per_generation, li.num_items_in_batch = True, 4, 4, torch.tensor(24.0)
    value = agg.Aggregation().trl_ext_aggregate_loss(per_token_loss=loss, mask=mask, inputs=li)
    assert value.item() == pytest.approx(6 / 24)  # 4 micro-batches of 6 tokens sum to 1


@pytest.mark.parametrize("mode, empty_rows", [
    ("token-mean", "count"), ("batch-token-mean", "count"), ("token-sum", "count"), ("seq-mean-token-mean", "count"),
    ("seq-mean-token-sum", "count"), ("seq-mean-token-sum-norm", "count"), ("seq-mean-token-mean", "exclude"),
    ("seq-mean-token-sum", "exclude")])
def test_filtered_rows_leave_every_denominator_as_if_removed(mode, empty_rows):
    # Four rows of which two were filtered by trl_ext_filter_groups (zero mask): with kept_row_fraction 0.5 every mode
    # gives what it gives on the two kept rows alone, in two micro-batches of a generation batch whose global token
    # count is that of the kept rows (as the trainer recomputes it). The kept rows sit one in each micro-batch.
    losses = torch.tensor([[1.0, 3.0, 0.0], [2.0, 0.0, 0.0], [5.0, 7.0, 9.0], [4.0, 4.0, 4.0]], dtype=D)
    mask = torch.tensor([[1.0, 1, 0], [0, 0, 0], [1, 1, 1], [0, 0, 0]], dtype=D)
    plugin = agg.Aggregation(agg.Aggregation.Params(mode=mode, empty_rows=empty_rows))

    def value(rows, fraction, micro_batches):
        total = 0.0
        for part in torch.tensor(rows).chunk(micro_batches):
            li = make_inputs(torch.zeros(len(part), 3), mask=mask[part])
            li.training, li.grad_accum_steps, li.steps_per_generation = True, micro_batches, micro_batches
            li.num_items_in_batch, li.kept_row_fraction = mask[rows].sum(), fraction
            total += plugin.trl_ext_aggregate_loss(per_token_loss=losses[part], mask=mask[part], inputs=li).item()
        return total

    assert value([0, 1, 2, 3], 0.5, 2) == pytest.approx(value([0, 2], 1.0, 2))
    if mode.startswith("seq-mean") and empty_rows == "count":  # the row count used to include the filtered rows:
        # half the kept rows' value (empty_rows: exclude never counts a row without tokens, whatever the kept share)
        assert value([0, 1, 2, 3], 1.0, 2) == pytest.approx(0.5 * value([0, 2], 1.0, 2))


@pytest.mark.parametrize("loss_type", ["grpo", "sapo", "dr_grpo", "bnpo", "dapo"])
def test_trl_loss_types_divide_by_the_kept_rows(loss_type):
    from trl_ext.trainers.grpo import DEFAULT_AGGREGATIONS

    losses = torch.tensor([[1.0, 3.0], [2.0, 2.0], [6.0, 0.0]], dtype=D)
    mask = torch.tensor([[1.0, 1], [0, 0], [1, 0]], dtype=D)
    filtered = make_inputs(torch.zeros(3, 2), mask=mask)
    filtered.kept_row_fraction = 2 / 3
    kept = make_inputs(torch.zeros(2, 2), mask=mask[[0, 2]])
    aggregate = DEFAULT_AGGREGATIONS[loss_type]
    assert aggregate(losses, mask, filtered).item() == pytest.approx(aggregate(losses[[0, 2]], mask[[0, 2]],
                                                                                kept).item())
    # seq-mean-token-mean of the kept rows: (2 + 6) / 2; Dr. GRPO: 10 / (2 rows * L = 2); token means: 10 / 3
    expected = {"grpo": 4.0, "sapo": 4.0, "dr_grpo": 2.5, "bnpo": 10 / 3, "dapo": 10 / 3}[loss_type]
    assert aggregate(losses, mask, filtered).item() == pytest.approx(expected)


# -- GSPO -------------------------------------------------------------------------------------------------------------


def test_gspo_sequence_ratio_numbers_and_clipping():
    li = make_inputs([[0.1, -0.1, 0.3]], old=[[0.0, 0.0, 0.0]], eps_low=3e-4, eps_high=4e-4)
    s = lm.gspo_sequence_ratio(li.log_ratio, li.mask)
    assert s.item() == pytest.approx(1.105171, abs=1e-6)
    loss = GSPO().trl_ext_policy_loss(inputs=li)
    assert loss.shape == (1, 1) and loss.item() == pytest.approx(-(1 + 4e-4))
    assert torch.all(token_grad(loss, li) == 0)  # clipped for A>0 -> zero gradient for that sequence
    doubled = make_inputs([[0.1, 0.1, -0.1, -0.1, 0.3, 0.3]], old=torch.zeros(1, 6))
    assert lm.gspo_sequence_ratio(doubled.log_ratio, doubled.mask).item() == pytest.approx(s.item())


def test_gspo_token_form_same_value_and_gradient_as_sequence_form():
    theta = [[-1.0, -2.0, -0.5, -3.0]]
    old = [[-1.00005, -1.99998, -0.50001, -3.0]]
    mask = [[1.0, 1, 1, 0]]
    seq_li = make_inputs(theta, old=old, mask=mask, eps_low=3e-4, eps_high=4e-4)
    tok_li = make_inputs(theta, old=old, mask=mask, eps_low=3e-4, eps_high=4e-4)
    seq = GSPO().trl_ext_policy_loss(inputs=seq_li)
    tok = GSPO(GSPO.Params(form="token")).trl_ext_policy_loss(inputs=tok_li)
    assert torch.allclose(tok, seq.expand_as(tok))
    a = agg.Aggregation(agg.Aggregation.Params(mode="seq-mean-token-mean"))
    g_seq = torch.autograd.grad(a.trl_ext_aggregate_loss(per_token_loss=seq, mask=seq_li.mask, inputs=seq_li),
                                seq_li.per_token_logps)[0]
    g_tok = torch.autograd.grad(a.trl_ext_aggregate_loss(per_token_loss=tok, mask=tok_li.mask, inputs=tok_li),
                                tok_li.per_token_logps)[0]
    assert torch.allclose(g_seq, g_tok, atol=1e-12) and g_seq[0, 3] == 0 and g_seq[0, 0] != 0


# -- GMPO -------------------------------------------------------------------------------------------------------------


def test_gmpo_geometric_mean_and_log_space_clip():
    li = make_inputs([[math.log(1.2), math.log(0.8)]], old=[[0.0, 0.0]], eps_low=0.4, eps_high=0.4)
    assert GMPO().trl_ext_policy_loss(inputs=li).item() == pytest.approx(-0.979796, abs=1e-6)
    li = make_inputs([[math.log(10.0), 0.0]], old=[[0.0, 0.0]], eps_low=0.4, eps_high=0.4)
    loss = GMPO().trl_ext_policy_loss(inputs=li)
    assert loss.item() == pytest.approx(-math.exp(0.4 / 2))  # the outlier contributes at most e^0.4
    grad = token_grad(loss, li)
    assert grad[0, 0] == 0 and grad[0, 1] != 0  # clipped token: no gradient
    li = make_inputs([[math.log(10.0), 0.0]], old=[[0.0, 0.0]], advantages=[[-1.0]], eps_low=0.4, eps_high=0.4)
    assert GMPO().trl_ext_policy_loss(inputs=li).item() == pytest.approx(math.exp(math.log(10.0) / 2))  # A<0: no clip


# -- SAPO -------------------------------------------------------------------------------------------------------------


def sapo_gate_derivative(r, tau, advantage=1.0):
    li = at_ratio(r, advantage=advantage)
    plugin = SAPO(SAPO.Params(tau_pos=tau, tau_neg=tau))
    ratio = torch.tensor([[r]], dtype=D, requires_grad=True)
    from trl_ext import ops
    f = -ops.sapo_objective(ratio, li.advantages, tau, tau) / advantage
    (df,) = torch.autograd.grad(f.sum(), ratio)
    return df.item(), plugin


@pytest.mark.parametrize("r, tau, expected", [(1.0, 1.0, 1.0), (1.0, 1.05, 1.0), (1.0, 3.0, 1.0), (1.5, 1.0, 0.940015),
                                              (2.0, 1.0, 0.786448), (1.5, 1.05, 0.934140), (0.5, 1.05, 0.934140)])
def test_sapo_gate_derivative(r, tau, expected):
    assert sapo_gate_derivative(r, tau)[0] == pytest.approx(expected, abs=1e-6)


def test_sapo_value_and_temperature_by_sign():
    li = at_ratio(1.0)
    assert SAPO().trl_ext_policy_loss(inputs=li).item() == pytest.approx(-2.0)  # f(1) = 2/tau_pos
    li = at_ratio(1.0, advantage=-1.0)
    assert SAPO().trl_ext_policy_loss(inputs=li).item() == pytest.approx(2 / 1.05)  # tau_neg for A<0


# -- CISPO ------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("r, coefficient", [(1.5, 1.28), (0.9, 0.9)])
def test_cispo_gradient_coefficient(r, coefficient):
    li = at_ratio(r)
    loss = CISPO(CISPO.Params(epsilon_high=0.28)).trl_ext_policy_loss(inputs=li)
    assert token_grad(loss, li).item() == pytest.approx(-coefficient)  # -w * A * grad log pi, PPO would give 0


def test_cispo_weight_is_detached():
    ratio = torch.tensor([[1.5]], dtype=D, requires_grad=True)
    logp = torch.tensor([[-1.0]], dtype=D)
    from trl_ext import ops
    loss = ops.cispo_objective(ratio, logp, torch.ones(1, 1, dtype=D), 1.28)
    assert not loss.requires_grad  # no gradient can reach the ratio path


# -- CE-GPPO ----------------------------------------------------------------------------------------------------------


def test_ce_gppo_bounded_gradients_of_clipped_tokens():
    li = at_ratio(0.5, advantage=-1.0)  # A<0, r < 1-eps_low
    loss = CEGPPO().trl_ext_policy_loss(inputs=li)
    assert token_grad(loss, li).item() == pytest.approx(0.6)  # |.|=0.75*0.8, descent pushes log pi down
    assert loss.item() == pytest.approx(0.75 * 0.8)  # forward = clipped value * beta1
    li = at_ratio(1.5, advantage=1.0, eps_high=0.28)
    loss = CEGPPO().trl_ext_policy_loss(inputs=li)
    assert token_grad(loss, li).item() == pytest.approx(-1.28)  # pushes log pi up
    for r, a in [(1.1, 1.0), (0.9, -1.0)]:  # inside the band: equal to PPO, d/dlogpi = -r*A
        li = at_ratio(r, advantage=a, eps_high=0.28)
        assert token_grad(CEGPPO().trl_ext_policy_loss(inputs=li), li).item() == pytest.approx(-r * a)
    li = at_ratio(4.0, advantage=-1.0, eps_high=0.28)  # dual clip c=3
    loss = CEGPPO().trl_ext_policy_loss(inputs=li)
    assert loss.item() == pytest.approx(3.0) and token_grad(loss, li).item() == 0.0


# -- REINFORCE --------------------------------------------------------------------------------------------------------


def test_reinforce_gradient_is_minus_advantage():
    rewards = torch.tensor([1.0, 0.0], dtype=D)
    advantages = rewards - 0.5  # baseline b = 0.5
    assert advantages.tolist() == [0.5, -0.5]
    li = make_inputs([[-0.7, -1.2], [-2.0, -0.1]], advantages=advantages.unsqueeze(1))
    grad = token_grad(REINFORCE().trl_ext_policy_loss(inputs=li), li)
    assert torch.equal(grad, -advantages.unsqueeze(1).expand(2, 2))
    shifted = make_inputs([[-0.7, -1.2], [-2.0, -0.1]], advantages=((rewards + 3) - (0.5 + 3)).unsqueeze(1))
    assert torch.equal(token_grad(REINFORCE().trl_ext_policy_loss(inputs=shifted), shifted), grad)


def test_reinforce_baseline_leaves_expected_gradient_unchanged():
    # Exact expectation over a small categorical policy: E_y[(R(y) - b) grad log pi(y)] does not depend on b.
    logits = torch.tensor([0.3, -1.0, 2.0, 0.1], dtype=D, requires_grad=True)
    reward = torch.tensor([1.0, 0.0, 0.5, 0.0], dtype=D)

    def expected_gradient(baseline):
        probs = torch.softmax(logits, -1).detach()
        total = torch.zeros(4, dtype=D)
        for y in range(4):
            li = make_inputs(torch.log_softmax(logits, -1)[y].view(1, 1), advantages=[[reward[y] - baseline]])
            loss = REINFORCE().trl_ext_policy_loss(inputs=li)
            total += probs[y] * torch.autograd.grad(loss.sum(), logits)[0]
        return total

    assert torch.allclose(expected_gradient(0.7), expected_gradient(0.0), atol=1e-12)
    assert not torch.allclose(expected_gradient(0.0), torch.zeros(4, dtype=D))


def test_reinforce_refuses_reused_batches():
    from types import SimpleNamespace
    assert REINFORCE().trl_ext_validate_stage(stage=SimpleNamespace(args={"num_iterations": 2}), plugins=[])
    assert REINFORCE().trl_ext_validate_stage(stage=SimpleNamespace(args={}), plugins=[]) is None


@pytest.mark.parametrize("args, refused", [
    ({"steps_per_generation": 4}, True),  # one generation batch over 4 optimizer steps: 3 of them off-policy
    ({"steps_per_generation": 4, "gradient_accumulation_steps": 2}, True),
    ({"steps_per_generation": 2, "gradient_accumulation_steps": 2}, False),  # one generation per optimizer step
    ({"steps_per_generation": 1, "gradient_accumulation_steps": 4}, False),
])
def test_reinforce_refuses_a_generation_batch_spanning_optimizer_steps(args, refused):
    """TRL trains micro-batches of one generation batch after earlier optimizer steps when steps_per_generation >
    gradient_accumulation_steps (it then recomputes pi_old); REINFORCE has no ratio, so those are off-policy."""
    from types import SimpleNamespace
    errors = REINFORCE().trl_ext_validate_stage(stage=SimpleNamespace(args=args), plugins=[])
    assert bool(errors) == refused
    if refused:
        assert "steps_per_generation" in errors[0] and "'reinforce' is on-policy" in errors[0]
    # generation_batch_size sets steps_per_generation only once the process count is known: checked at build time
    resolved = SimpleNamespace(num_iterations=1, steps_per_generation=args["steps_per_generation"],
                               gradient_accumulation_steps=args.get("gradient_accumulation_steps", 1))
    trainer = SimpleNamespace(args=resolved)
    if refused:
        with pytest.raises(ValueError, match="steps_per_generation"):
            REINFORCE().trl_ext_trainer_created(trainer=trainer)
    else:
        REINFORCE().trl_ext_trainer_created(trainer=trainer)


# -- numerics: extreme log-probs ------------------------------------------------------------------------------------


@pytest.mark.parametrize("plugin", [GRPO(), DrGRPO(), DAPO(), GSPO(), GSPO(GSPO.Params(form="token")), GMPO(), SAPO(),
                                    CISPO(), CEGPPO(), ClipHigher(), REINFORCE()], ids=lambda p: p.name)
def test_extreme_log_probs_stay_finite(plugin):
    li = make_inputs([[-1e4, -30.0, 0.0, -1e-9], [-50.0, -1e3, -1e4, 0.0]],
                     old=[[0.0, -1e4, -1e4, -1e3], [-1e-6, 0.0, -1e4, -40.0]],
                     advantages=[[1.5], [-0.5]], mask=[[1, 1, 1, 1], [1, 1, 0, 1]])
    loss = plugin.trl_ext_policy_loss(inputs=li)
    value = agg.Aggregation().trl_ext_aggregate_loss(per_token_loss=loss, mask=li.mask, inputs=li)
    (grad,) = torch.autograd.grad(value, li.per_token_logps, allow_unused=True)
    assert torch.isfinite(value)
    assert grad is None or (torch.isfinite(grad).all() and grad[1, 2] == 0)  # masked token: exactly zero gradient


@pytest.mark.parametrize("plugin", [GRPO(), DrGRPO(), DAPO(), GSPO(), GSPO(GSPO.Params(form="token")), GMPO(), SAPO(),
                                    CISPO(), CEGPPO(), ClipHigher(), REINFORCE()], ids=lambda p: p.name)
def test_infinite_and_nan_values_at_masked_positions_change_nothing(plugin):
    """A hook called on raw inputs (padding log-probs -inf, NaN per-token advantages there) must give the same loss
    on real tokens as with clean padding, and exactly zero gradient at the padding."""
    theta = [[-0.3, -1.2, -0.7, 0.0], [-2.0, -0.1, 0.0, 0.0]]
    old = [[-0.5, -1.0, -0.6, 0.0], [-1.7, -0.2, 0.0, 0.0]]
    mask = [[1, 1, 1, 0], [1, 1, 0, 0]]
    advantages = [[1.5, 1.5, 1.5, 0.0], [-0.5, -0.5, 0.0, 0.0]]
    clean = make_inputs(theta, old=old, advantages=advantages, mask=mask)
    hostile_theta = torch.tensor(theta, dtype=D)
    hostile_theta[0, 3] = hostile_theta[1, 2] = hostile_theta[1, 3] = -math.inf
    hostile_old = torch.tensor(old, dtype=D)
    hostile_old[0, 3] = hostile_old[1, 3] = -math.inf
    hostile_old[1, 2] = math.nan
    hostile_adv = torch.tensor(advantages, dtype=D)
    hostile_adv[0, 3] = hostile_adv[1, 2] = math.nan
    hostile = make_inputs(hostile_theta.requires_grad_(True), old=hostile_old, advantages=hostile_adv, mask=mask)
    expected = plugin.trl_ext_policy_loss(inputs=clean)
    loss = plugin.trl_ext_policy_loss(inputs=hostile)
    real = clean.mask.bool()
    assert torch.allclose(loss[real.expand_as(loss)] if loss.shape == real.shape else loss,
                          expected[real.expand_as(expected)] if expected.shape == real.shape else expected)
    value = agg.Aggregation().trl_ext_aggregate_loss(per_token_loss=loss, mask=hostile.mask, inputs=hostile)
    (grad,) = torch.autograd.grad(value, hostile.per_token_logps)
    assert torch.isfinite(value) and torch.isfinite(grad).all()
    assert (grad[~real] == 0).all()


def test_gspo_sequence_mean_advantage_is_areals():
    """AReaL's GSPO replaces per-token advantages by each sequence's masked mean before the clip: log r = 0.3 on 4
    tokens, A = [2, -1, 1, -1.5] (mean 0.125), eps 0.2: every token -min(e^0.3 * 0.125, 1.2 * 0.125) = -0.15. The
    default keeps each token's own A (TRL, verl). A fifth, masked token with a NaN advantage stays out."""
    theta = [[0.3, 0.3, 0.3, 0.3, 0.0]]
    kw = dict(old=[[0.0] * 5], advantages=[[2.0, -1.0, 1.0, -1.5, float("nan")]], mask=[[1, 1, 1, 1, 0]])
    p = GSPO.Params(epsilon_low=0.2, epsilon_high=0.2)
    li = make_inputs(theta, **kw)
    loss = GSPO(GSPO.Params(**{**p.model_dump(), "advantage": "sequence_mean"})).trl_ext_policy_loss(inputs=li)
    assert loss.shape == (1, 1) and loss.item() == pytest.approx(-0.15, rel=1e-12)
    own = GSPO(p).trl_ext_policy_loss(inputs=make_inputs(theta, **kw))
    s = math.exp(0.3)
    expected = [-min(s * a, min(max(s, 0.8), 1.2) * a) for a in (2.0, -1.0, 1.0, -1.5)]
    assert own[0, :4].tolist() == pytest.approx(expected, rel=1e-12)
