"""Preference plugins on trl-ext's DPO/KTO trainers: parity with TRL on the same batch, reference-free losses,
extra reward columns reaching the loss, and bad-input checks."""

import math
from types import SimpleNamespace

import pytest
import torch
from datasets import Dataset

from trl_ext.embedded.arithmetic import arithmetic_dataset
from trl_ext.host import PluginHost
from trl_ext.recipe import StageSpec
from trl_ext_plugins.preference import APO, DPO, IPO, KTO, ORPO, QRPO, RPO, SimPO
from trl_ext_plugins.preference import math as pm
from trl_ext_plugins.preference.common import PreferenceDataError


def _perturb(model, seed=0, scale=0.05):
    """Move the policy away from the reference so log-ratios are non-zero."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=gen, dtype=p.dtype))


def _batch(trainer):
    return trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))


def _double(trainer):
    trainer.model.double()
    if trainer.ref_model is not None:
        trainer.ref_model.double()


PARITY = [(DPO(), "sigmoid", math.log(2)), (IPO(), "ipo", 1.0),
          (APO(APO.Params(variant="zero")), "apo_zero", 1.0), (APO(APO.Params(variant="down")), "apo_down", 1.0)]


def test_parity_with_trl_dpo_loss_types(tiny_trainer):
    """One trainer, one perturbed policy, one batch: each plugin's loss against TRL's loss_type on the same batch."""
    trainer = tiny_trainer("dpo", [DPO()], args={"beta": 0.5})
    _double(trainer)
    _perturb(trainer.model)
    batch = _batch(trainer)
    for plugin, loss_type, value_at_init in PARITY:
        trainer.plugin_host = PluginHost([plugin])
        ours = trainer.compute_loss(trainer.model, batch)
        trainer.plugin_host = PluginHost([])  # ExtDPOTrainer now runs TRL's own _compute_loss
        trainer.loss_types, trainer.loss_weights = [loss_type], [1.0]
        theirs = trainer.compute_loss(trainer.model, batch)
        # TRL's fused LM head returns float32 log-probs even for a float64 model; both paths share them
        assert abs(ours.item() - theirs.item()) < 1e-6, loss_type
        assert abs(ours.item() - value_at_init) > 1e-3, loss_type  # the perturbation made the check non-trivial


def test_evaluation_with_outputs_keeps_the_plugin_loss(tiny_trainer):
    """With compute_metrics, TRL's prediction_step asks for outputs too; that call returned TRL's own loss_type, so
    eval_loss was the sigmoid DPO loss whatever the plugin (IPO here, 1.0 at the initial policy, not ln 2)."""
    trainer = tiny_trainer("dpo", [IPO()], args={"beta": 0.5})
    _double(trainer)
    _perturb(trainer.model)
    batch = _batch(trainer)
    plain = trainer.compute_loss(trainer.model, batch)
    with_outputs, outputs = trainer.compute_loss(trainer.model, batch, return_outputs=True)
    assert with_outputs.item() == pytest.approx(plain.item(), abs=1e-9)
    assert outputs.logits.shape[:2] == batch["input_ids"].shape
    trainer.plugin_host = PluginHost([])
    trainer.loss_types, trainer.loss_weights = ["sigmoid"], [1.0]
    assert abs(trainer.compute_loss(trainer.model, batch).item() - plain.item()) > 1e-3  # the two losses differ


def test_parity_simpo_with_trl_cpo_and_orpo_odds_ratio():
    from trl.experimental.cpo import CPOTrainer
    from trl.experimental.orpo import ORPOTrainer

    gen = torch.Generator().manual_seed(1)
    chosen = -torch.rand(16, generator=gen, dtype=torch.float64) * 3 - 1e-3
    rejected = -torch.rand(16, generator=gen, dtype=torch.float64) * 3 - 1e-3
    cpu = SimpleNamespace(device=torch.device("cpu"))
    cpo = SimpleNamespace(alpha=0.0, loss_type="simpo", beta=2.0, simpo_gamma=1.2, label_smoothing=0.0, accelerator=cpu)
    theirs, _, _ = CPOTrainer.cpo_loss(cpo, chosen, rejected)
    torch.testing.assert_close(pm.simpo_loss(chosen, rejected, 2.0, 1.2), theirs, atol=1e-12, rtol=0)
    orpo = SimpleNamespace(beta=0.1, accelerator=cpu)
    theirs = ORPOTrainer.odds_ratio_loss(orpo, chosen, rejected)[0]  # beta * log sigma(log odds ratio), in float32
    ours = -0.1 * pm.orpo_odds_ratio_loss(chosen, rejected)
    torch.testing.assert_close(ours.float(), theirs, atol=1e-6, rtol=0)


def _count_forwards(module):
    calls = []
    handle = module.register_forward_pre_hook(lambda *_: calls.append(1))
    return calls, handle


@pytest.mark.parametrize("plugin", [SimPO(), ORPO()])
def test_reference_free_losses_load_and_run_no_reference(tiny_trainer, plugin):
    import trl.trainer.dpo_trainer as dpo_module

    real = dpo_module.create_model_from_path
    trainer = tiny_trainer("dpo", [plugin], args={"max_steps": 2})
    assert trainer.ref_model is None
    assert dpo_module.create_model_from_path is real  # the construction-time patch is undone
    calls, handle = _count_forwards(trainer.model)
    batch = _batch(trainer)
    loss = trainer.compute_loss(trainer.model, batch)
    assert len(calls) == 1  # the policy forward only: no reference pass through the policy either
    assert torch.isfinite(loss)
    trainer.train()
    handle.remove()
    assert len(calls) == 1 + 2  # one forward per training step


def test_reference_using_loss_still_runs_reference(tiny_trainer):
    trainer = tiny_trainer("dpo", [DPO()])
    assert trainer.ref_model is not None
    policy_calls, h1 = _count_forwards(trainer.model)
    ref_calls, h2 = _count_forwards(trainer.ref_model)
    trainer.compute_loss(trainer.model, _batch(trainer))
    h1.remove(), h2.remove()
    assert (len(policy_calls), len(ref_calls)) == (1, 1)


def test_orpo_value_matches_formula_on_batch(tiny_trainer):
    trainer = tiny_trainer("dpo", [ORPO()], args={"beta": 0.25})
    _double(trainer)
    batch = _batch(trainer)
    loss = trainer.compute_loss(trainer.model, batch)
    # independent: per-token log-probs from a plain forward
    with torch.no_grad():
        logits = trainer.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    logps = torch.log_softmax(logits[:, :-1], -1).gather(-1, batch["input_ids"][:, 1:, None]).squeeze(-1)
    mask = batch["completion_mask"][:, 1:].to(logps.dtype)
    sums, lengths = (logps * mask).sum(1), mask.sum(1)
    (cw, cr), (lw, lr) = sums.chunk(2), lengths.chunk(2)
    nll = -cw.sum() / lw.sum()
    expected = nll + 0.25 * pm.orpo_odds_ratio_loss(cw / lw, cr / lr).mean()
    assert loss.item() == pytest.approx(expected.item(), abs=1e-5)  # float32 fused head


def _with_rewards(size=16):
    data = arithmetic_dataset("train", format="preference", size=size)
    gen = torch.Generator().manual_seed(0)
    chosen = (torch.rand(size, generator=gen) + 1).tolist()
    rejected = torch.rand(size, generator=gen).tolist()
    refs = [torch.rand(4, generator=gen).tolist() for _ in range(size)]
    return data.add_column("chosen_reward", chosen).add_column("rejected_reward", rejected).add_column("ref_rewards", refs)


class _Spy:
    def __init__(self, plugin):
        self.plugin, self.seen = plugin, []
        original = plugin.trl_ext_preference_loss

        def hook(inputs):
            self.seen.append(inputs)
            return original(inputs)

        plugin.trl_ext_preference_loss = hook  # the instance attribute keeps the @hookimpl marker of the method
        hook.trl_ext_impl = original.trl_ext_impl


def test_rpo_columns_reach_the_loss_and_match_formula_at_init(tiny_trainer):
    plugin = RPO(RPO.Params(eta=2.0))
    spy = _Spy(plugin)
    data = _with_rewards()
    trainer = tiny_trainer("dpo", [plugin], dataset=data, args={"max_steps": 1})
    assert trainer.args.remove_unused_columns is False
    batch = _batch(trainer)
    forward_kwargs = []
    handle = trainer.model.register_forward_pre_hook(lambda _m, _a, kw: forward_kwargs.append(set(kw)), with_kwargs=True)
    loss = trainer.compute_loss(trainer.model, batch)
    handle.remove()
    pref = spy.seen[-1]
    assert {"chosen_reward", "rejected_reward"} <= set(pref.batch)
    assert forward_kwargs and not any({"chosen_reward", "rejected_reward"} & kw for kw in forward_kwargs)
    # at initialisation the policy equals the reference: the loss is KL(sigma(eta dr*) || sigma(0))
    gap = 2.0 * (pref.batch["chosen_reward"] - pref.batch["rejected_reward"]).double()
    expected = [pm.bernoulli_kl(g, torch.zeros((), dtype=torch.float64)).item() for g in gap]
    assert loss.item() == pytest.approx(sum(expected) / len(expected), abs=1e-5)
    trainer.train()
    assert math.isfinite(trainer.state.log_history[-1]["train_loss"])


def test_qrpo_trains_with_reference_rewards_and_matches_formula_at_init(tiny_trainer):
    plugin = QRPO()
    spy = _Spy(plugin)
    trainer = tiny_trainer("dpo", [plugin], dataset=_with_rewards(), args={"max_steps": 1, "beta": 0.5})
    loss = trainer.compute_loss(trainer.model, _batch(trainer))
    pref = spy.seen[-1]
    assert pref.batch["ref_rewards"].shape[1] == 4
    log_z = pm.qrpo_log_partition(0.5)
    expected = [((pm.quantile_reward(pref.batch[c].double(), pref.batch["ref_rewards"].double()) - 0.5 * log_z) ** 2)
                for c in ("chosen_reward", "rejected_reward")]
    assert loss.item() == pytest.approx(((expected[0] + expected[1]) / 2).mean().item(), abs=1e-5)
    trainer.train()


def test_kto_parity_with_trl_kto_trainer(tiny_trainer):
    trainer = tiny_trainer("kto", [KTO()], args={"beta": 0.5, "desirable_weight": 1.5})
    assert trainer.loss_type == "kto"
    _double(trainer)
    _perturb(trainer.model)
    batch = _batch(trainer)
    theirs = trainer.compute_loss(trainer.model, batch)

    def seq_logps(model, ids, attn, comp):
        with torch.no_grad():
            logits = model(input_ids=ids, attention_mask=attn).logits
        lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        return (lp * comp[:, 1:]).sum(1)

    args = (batch["input_ids"], batch["attention_mask"], batch["completion_mask"])
    kl_args = (batch["KL_input_ids"], batch["KL_attention_mask"], batch["KL_completion_mask"])
    logratios = seq_logps(trainer.model, *args) - seq_logps(trainer.ref_model, *args)
    kl = (seq_logps(trainer.model, *kl_args) - seq_logps(trainer.ref_model, *kl_args)).mean()
    ours = pm.kto_loss(logratios, batch["label"], kl, 0.5, desirable_weight=1.5).mean()
    assert abs(ours.item() - theirs.item()) < 1e-6


def test_apo_on_kto_trainer_selects_trl_unpaired_loss(tiny_trainer):
    trainer = tiny_trainer("kto", [APO()])
    assert trainer.loss_type == "apo_zero_unpaired"
    stage = StageSpec(trainer="kto", model="m", dataset={"source": "embedded:arithmetic"})
    assert APO(APO.Params(variant="down")).trl_ext_validate_stage(stage=stage, plugins=[]) != []


# ---------------------------------------------------------------------------------------------------------------------
# Bad input


def _stage(trainer="dpo", **kw):
    return StageSpec(trainer=trainer, model="m", dataset={"source": "embedded:arithmetic"}, **kw)


def _prepare(plugin, data, trainer="dpo"):
    return plugin.trl_ext_prepare_dataset(dataset=data, split="train", stage=_stage(trainer))


def test_missing_columns_are_named():
    data = arithmetic_dataset("train", format="preference", size=4)
    with pytest.raises(PreferenceDataError, match="rpo: train dataset lacks column.*'chosen_reward', 'rejected_reward'"):
        _prepare(RPO(), data)
    with pytest.raises(PreferenceDataError, match="'rejected'"):
        _prepare(DPO(), data.remove_columns("rejected"))
    with pytest.raises(PreferenceDataError, match="'label'"):
        _prepare(KTO(), arithmetic_dataset("train", format="unpaired", size=4).remove_columns("label"), "kto")
    assert _prepare(DPO(), data) is None  # a good dataset passes unchanged


def test_empty_and_identical_pairs_rejected():
    rows = [{"prompt": "1+1=", "chosen": "2", "rejected": "3"}, {"prompt": "2+2=", "chosen": "4", "rejected": "4"}]
    with pytest.raises(PreferenceDataError, match="'chosen' equals 'rejected' in rows 1"):
        _prepare(IPO(), Dataset.from_list(rows))
    rows[1]["rejected"] = "  "
    with pytest.raises(PreferenceDataError, match="empty 'rejected' in rows 1"):
        _prepare(SimPO(), Dataset.from_list(rows))


def test_nan_rewards_and_short_reference_rewards_rejected():
    data = _with_rewards(4)
    bad = data.map(lambda row, i: {"rejected_reward": math.nan if i == 2 else row["rejected_reward"]},
                   with_indices=True)
    with pytest.raises(PreferenceDataError, match="'rejected_reward' is NaN or missing in rows 2"):
        _prepare(RPO(), bad)
    short = data.map(lambda row, i: {"ref_rewards": row["ref_rewards"][:1] if i == 0 else row["ref_rewards"]},
                     with_indices=True)
    with pytest.raises(PreferenceDataError, match="'ref_rewards' needs at least 2 non-NaN values per row; rows 0"):
        _prepare(QRPO(), short)
    assert _prepare(QRPO(), data) is None


def test_missing_reference_rewards_inside_a_list_are_nan_in_the_batch():
    """A None inside ``ref_rewards`` counts as missing in the dataset check (the row keeps 2 values, so it passes), so
    the collator must hand the loss a NaN there (ignored by the quantile), not crash on torch.tensor([.., None, ..])."""
    from trl_ext_plugins.preference.common import Column, ColumnCollator

    data = _with_rewards(2).map(lambda row, i: {"ref_rewards": [0.1, None, 0.5] if i == 0 else [0.2, 0.4]},
                                with_indices=True)
    assert _prepare(QRPO(), data) is None
    collate = ColumnCollator(base=lambda examples: {}, columns=(Column("ref_rewards", is_list=True, min_items=2),))
    batch = collate([data[0], data[1]])["ref_rewards"]
    assert torch.equal(torch.isnan(batch), torch.tensor([[False, True, False], [False, False, True]]))
    assert pm.quantile_reward(torch.tensor([0.3, 0.3]), batch).tolist() == pytest.approx([0.5, 0.5])


def test_reference_free_refuses_ref_model():
    stage = _stage(ref_model="some/model")
    assert any("reference-free" in e for e in SimPO().trl_ext_validate_stage(stage=stage, plugins=[]))
    assert DPO().trl_ext_validate_stage(stage=stage, plugins=[]) == []


def test_a_beta_the_preference_loss_cannot_use_is_refused_before_loading():
    """beta scales every DPO-family implicit reward: 0 made IPO and QRPO fail at the first step (after the models
    loaded) and left DPO a constant loss; a negative beta silently reversed the preference."""
    from trl_ext.catalog import Catalog
    from trl_ext.errors import RecipeError
    from trl_ext.stage import resolve_stage

    catalog = Catalog.discover()

    def stage(plugins, **args):
        return StageSpec(trainer="dpo", model="embedded:tiny-qwen2", dataset="embedded:arithmetic", plugins=plugins,
                         args=args)

    for plugins, beta in ((["ipo"], 0.0), (["qrpo"], 0.0), (["dpo"], -0.1), ([], 0.0), (["orpo"], -1.0)):
        with pytest.raises(RecipeError, match=r"stages\[0\]\.args\.beta: "):
            resolve_stage(stage(plugins, beta=beta), 0, catalog)
    resolve_stage(stage(["orpo"], beta=0.0), 0, catalog)  # ORPO's lambda 0: the NLL term alone
    resolve_stage(stage([], beta=0.0, loss_type=["sft"]), 0, catalog)  # TRL's loss without a preference term
    resolve_stage(stage(["ipo"], beta=0.1), 0, catalog)


@pytest.mark.parametrize("trl, params", [
    ({"loss_type": ["robust"], "label_smoothing": 0.2}, {"label_smoothing": 0.2, "label_smoothing_form": "robust"}),
    ({"loss_type": ["robust"], "label_smoothing": 0.45, "beta": 0.5},
     {"label_smoothing": 0.45, "label_smoothing_form": "robust"}),
    ({"loss_type": ["sigmoid_norm"], "beta": 0.5}, {"length_normalize": True}),
], ids=["robust", "robust-near-half", "sigmoid_norm"])
def test_dpo_label_smoothing_and_length_normalisation_match_trl(trl, params):
    """rDPO (TRL's robust) and length-normalised DPO (TRL's sigmoid_norm) through the dpo plugin equal TRL 1.16's own
    DPOTrainer loss and gradient on the fixtures' pairs (log-ratios up to +-12, a one-token completion); neither could
    be combined with a preference plugin. (TRL 1.16's sigmoid ignores label_smoothing; cDPO is checked by hand.)"""
    from tests.trl_fixtures.cases import dpo_ext, preference_inputs, run_trl_dpo

    inputs = preference_inputs()
    theirs, their_grad = run_trl_dpo(trl, inputs)
    ours, our_grad = dpo_ext(lambda: DPO(DPO.Params(**params)), trl)(inputs)
    plain, _ = dpo_ext(lambda: DPO(), trl)(inputs)
    assert torch.allclose(ours, theirs, atol=1e-10) and not torch.allclose(ours, plain, atol=1e-6)
    assert torch.allclose(our_grad["per_token_logps"], their_grad["per_token_logps"], atol=1e-10)


def test_cdpo_by_hand_and_robust_needs_eps_below_half():
    """r_w = 2, r_l = -1, beta 0.1: -log sigmoid(0.3) = 0.554355; eps 0.1 gives 0.584355 (OpenRLHF's DPOLoss), rDPO
    (0.9 * 0.554355 - 0.1 * 0.854355) / 0.8 = 0.516855."""
    inputs = SimpleNamespace(chosen_logps=torch.tensor([2.0], dtype=torch.float64), ref_chosen_logps=torch.zeros(1),
                             rejected_logps=torch.tensor([-1.0], dtype=torch.float64),
                             ref_rejected_logps=torch.zeros(1), beta=0.1)
    loss = DPO(DPO.Params(label_smoothing=0.1)).trl_ext_preference_loss(inputs=inputs)
    assert loss.item() == pytest.approx(0.584355, abs=1e-6)
    robust = DPO(DPO.Params(label_smoothing=0.1, label_smoothing_form="robust")).trl_ext_preference_loss(inputs=inputs)
    assert robust.item() == pytest.approx(0.516855, abs=1e-6)
    with pytest.raises(ValueError, match="below 0.5"):
        DPO.Params(label_smoothing=0.5, label_smoothing_form="robust")


def test_qrpo_log_transform_through_the_plugin_is_the_reference_implementations_loss():
    """transform log (the QRPO repository's default): ((log max(r_q, 1/n) - beta log(beta/(1+beta))) - beta
    log-ratio)^2 per completion, mean of chosen and rejected; by hand on one pair with 4 reference rewards."""
    beta = 0.5
    refs = torch.tensor([[0.1, 0.5, 0.9, 0.3]], dtype=torch.float64)
    batch = {"chosen_reward": torch.tensor([0.6], dtype=torch.float64),
             "rejected_reward": torch.tensor([0.0], dtype=torch.float64), "ref_rewards": refs}
    inputs = SimpleNamespace(chosen_logps=torch.tensor([-2.0], dtype=torch.float64),
                             ref_chosen_logps=torch.tensor([-2.5], dtype=torch.float64),
                             rejected_logps=torch.tensor([-3.0], dtype=torch.float64),
                             ref_rejected_logps=torch.tensor([-2.8], dtype=torch.float64),
                             beta=beta, batch=batch, metrics={})
    loss = QRPO(QRPO.Params(transform="log")).trl_ext_preference_loss(inputs=inputs)
    log_z = math.log(beta / (1 + beta))
    chosen = (math.log(3 / 4) - beta * log_z - beta * 0.5) ** 2  # 3 of 4 reference rewards <= 0.6
    rejected = (math.log(1 / 4) - beta * log_z - beta * -0.2) ** 2  # none <= 0.0: clamped to 1/n
    assert loss.item() == pytest.approx((chosen + rejected) / 2, rel=1e-12)


def test_qrpo_scaled_normal_icdf_is_the_reference_implementations_loss(tmp_path):
    """transform scaled_normal_icdf (the repository's scaled-normal-icdf): s * Phi^-1(clamp(r_q, 1/n, 1 - 1/n)) with
    s = (the row's reference-reward sample std) / (the train split's mean of it), log Z = s^2 / (2 beta^2); by hand
    with the statistics module on a three-row train split and one pair."""
    import statistics

    from datasets import Dataset

    beta = 0.5
    train_refs = [[0.1, 0.5, 0.9, 0.3], [0.2, 0.2, 0.4, 0.2], [1.0, 0.0, 0.5, 0.5]]
    train = Dataset.from_list([{"prompt": "p", "chosen": "a", "rejected": "b", "chosen_reward": 0.0,
                                "rejected_reward": 0.0, "ref_rewards": r} for r in train_refs])
    plugin = QRPO(QRPO.Params(transform="scaled_normal_icdf"))
    stage = SimpleNamespace(trainer="dpo", ref_model=None, model="unused")
    assert plugin.trl_ext_prepare_dataset(dataset=train, split="train", stage=stage) is None
    mean_std = statistics.mean(statistics.stdev(r) for r in train_refs)
    assert plugin.mean_reference_std == pytest.approx(mean_std, rel=1e-12)

    refs = train_refs[0]
    batch = {"chosen_reward": torch.tensor([0.6], dtype=torch.float64),
             "rejected_reward": torch.tensor([0.0], dtype=torch.float64),
             "ref_rewards": torch.tensor([refs], dtype=torch.float64)}
    inputs = SimpleNamespace(chosen_logps=torch.tensor([-2.0], dtype=torch.float64),
                             ref_chosen_logps=torch.tensor([-2.5], dtype=torch.float64),
                             rejected_logps=torch.tensor([-3.0], dtype=torch.float64),
                             ref_rejected_logps=torch.tensor([-2.8], dtype=torch.float64),
                             beta=beta, batch=batch, metrics={})
    loss = plugin.trl_ext_preference_loss(inputs=inputs)
    s = statistics.stdev(refs) / mean_std
    icdf = statistics.NormalDist().inv_cdf
    log_z = s * s / (2 * beta * beta)
    chosen = (s * icdf(3 / 4) - beta * log_z - beta * 0.5) ** 2  # 3 of 4 reference rewards <= 0.6
    rejected = (s * icdf(1 / 4) - beta * log_z - beta * -0.2) ** 2  # r_q 0 clamped to 1/n
    assert loss.item() == pytest.approx((chosen + rejected) / 2, rel=1e-12)

    flat = Dataset.from_list([{"prompt": "p", "chosen": "a", "rejected": "b", "chosen_reward": 0.0,
                               "rejected_reward": 0.0, "ref_rewards": [0.5, 0.5]}] * 2)
    with pytest.raises(ValueError, match="scaled_normal_icdf.*'ref_rewards'.*is 0"):
        QRPO(QRPO.Params(transform="scaled_normal_icdf")).trl_ext_prepare_dataset(dataset=flat, split="train",
                                                                                  stage=stage)
    infinite = Dataset.from_list([{"prompt": "p", "chosen": "a", "rejected": "b", "chosen_reward": 0.0,
                                   "rejected_reward": 0.0, "ref_rewards": r} for r in ([0.1, float("inf")], [0.2, 0.4])])
    with pytest.raises(ValueError, match="scaled_normal_icdf needs finite 'ref_rewards' values; the train split"):
        QRPO(QRPO.Params(transform="scaled_normal_icdf")).trl_ext_prepare_dataset(dataset=infinite, split="train",
                                                                                  stage=stage)


@pytest.mark.parametrize("eps", [0.1, 0.5])
def test_simpo_label_smoothing_matches_trls_cpo(eps):
    """TRL's CPOTrainer.cpo_loss with loss_type simpo and label_smoothing (-(1 - eps) log sigma(z) - eps log
    sigma(-z)) against the simpo plugin, loss and gradients, on the fixtures' pairs."""
    from tests.trl_fixtures.cases import _grad, _pref_inputs_from_means, run_trl_cpo, sequence_pair_inputs, tensors

    inputs, beta, gamma = sequence_pair_inputs(), 2.0, 1.2
    trl = {"loss_type": "simpo", "beta": beta, "simpo_gamma": gamma, "alpha": 0.0, "label_smoothing": eps}
    theirs, their_grads = run_trl_cpo(trl, inputs)
    pref, c, r = _pref_inputs_from_means(tensors(inputs), beta)
    loss = SimPO(SimPO.Params(gamma=gamma, label_smoothing=eps)).trl_ext_preference_loss(pref).mean()
    ours, our_grads = _grad(loss, {"chosen_logps": c, "rejected_logps": r})
    assert torch.allclose(ours, theirs, atol=1e-10)
    for key in ("chosen_logps", "rejected_logps"):
        assert torch.allclose(our_grads[key], their_grads[key], atol=1e-10)
    plain = SimPO(SimPO.Params(gamma=gamma)).trl_ext_preference_loss(_pref_inputs_from_means(tensors(inputs), beta)[0])
    assert not torch.allclose(plain.mean(), ours, atol=1e-6)
