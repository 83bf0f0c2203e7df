"""``rollout_correction``: the corrections as one family, level x mode x statistic x thresholds (issue 10).

* presets ``tis`` / ``mis`` / ``icepop`` are bit-identical to those plugins (weights, changed flags, metrics, loss and
  gradient through the real loss pipeline) on random float64 inputs with extreme log-ratios and masked tokens;
* every legal grid point against weights written out by hand from the formula (plain ``math``);
* conformance (``assert_conforms``) of value and gradient against references written here with plain torch ops;
* illegal combinations refused at validation, one line naming the plugin and the field.

rho = pi_old / pi_rollout. Fixtures set log pi_old = log pi_theta = -1 and log pi_rollout = -1 - log rho.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import test_losses_parity as parity
from test_fidelity_properties import SETTINGS, loss_inputs, micro_batch
from test_losses import D, make_inputs
from trl_ext import ops
from trl_ext.catalog import Catalog
from trl_ext.errors import RecipeError
from trl_ext.host import PluginHost
from trl_ext.metrics import reduce_figures
from trl_ext.recipe import StageSpec
from trl_ext.stage import resolve_stage
from trl_ext.testing import assert_conforms, check_plugin_conformance
from trl_ext.trainers.grpo import compose_loss
from trl_ext_plugins.corrections import PLUGINS
from trl_ext_plugins.corrections.icepop import IcePop, IcePopParams
from trl_ext_plugins.corrections.mis import MIS, MISParams
from trl_ext_plugins.corrections.rollout_correction import RolloutCorrectionParams, UnifiedCorrection
from trl_ext_plugins.corrections.tis import TIS, TISParams
from trl_ext_plugins.losses.cispo import CISPO
from trl_ext_plugins.losses.dapo import DAPO
from trl_ext_plugins.losses.grpo import GRPO


def rc(**params):
    return UnifiedCorrection(RolloutCorrectionParams(**params))


def rho_inputs(rows, advantages=None):
    """Inputs whose loss tokens have the given rho per row (None = padding; rows padded to equal length)."""
    width = max(len(r) for r in rows)
    rows = [list(r) + [None] * (width - len(r)) for r in rows]
    mask = torch.tensor([[0.0 if x is None else 1.0 for x in r] for r in rows], dtype=D)
    log_rho = torch.tensor([[0.0 if x is None else math.log(x) for x in r] for r in rows], dtype=D)
    theta = torch.full_like(mask, -1.0)
    return make_inputs(theta, old=theta, rollout=theta - log_rho, mask=mask, advantages=advantages)


def valid_weights(plugin, rows):
    """The plugin's weight on each row's loss tokens (a per-sequence weight repeated per token)."""
    li = rho_inputs(rows)
    weight = plugin.trl_ext_token_weights(inputs=li).weight.expand_as(li.mask)
    return [[weight[i, j].item() for j in range(len(r))] for i, r in enumerate(rows)], reduce_figures(li.metrics)


# -- preset equivalence ----------------------------------------------------------------------------------------------


def random_batch(seed):
    """float64 micro-batch: 5 rows x 6 tokens; log rho ~ N(0, 0.6) with +-100 and +-25 outliers; ragged padding with
    -inf log-probs there, one single-token row and one row without loss tokens."""
    g = torch.Generator().manual_seed(seed)
    b, t = 5, 6
    mask = (torch.rand(b, t, generator=g, dtype=D) > 0.25).to(D)
    mask[1] = torch.tensor([1, 0, 0, 0, 0, 0], dtype=D)  # single-token completion
    mask[4] = 0.0  # all tokens masked
    theta = -torch.rand(b, t, generator=g, dtype=D) * 3 - 0.05
    old = theta + torch.randn(b, t, generator=g, dtype=D) * 0.3
    log_rho = torch.randn(b, t, generator=g, dtype=D) * 0.6
    extremes = torch.tensor([100.0, -100.0, 25.0, -25.0], dtype=D)
    pick = torch.rand(b, t, generator=g, dtype=D) < 0.15
    log_rho = torch.where(pick, extremes[torch.randint(0, 4, (b, t), generator=g)], log_rho)
    rollout = old - log_rho
    inf = torch.tensor(float("-inf"), dtype=D)
    theta, old, rollout = (torch.where(mask.bool(), x, inf) for x in (theta, old, rollout))
    advantages = torch.randn(b, 1, generator=g, dtype=D)
    return theta, old, rollout, mask, advantages


def pipeline(plugins, batch, loss_type):
    theta, old, rollout, mask, advantages = batch
    li = make_inputs(theta.clone().requires_grad_(True), old=old, rollout=rollout, mask=mask, advantages=advantages)
    li.loss_type = loss_type
    loss, loss_mask, _ = compose_loss(PluginHost(plugins), li, loss_type=loss_type, kl=ops.KLTerm("k3"))
    (grad,) = torch.autograd.grad(loss, li.per_token_logps)
    return loss.detach(), grad, loss_mask, li.metrics


PRESET_PAIRS = [
    ({"preset": "tis"}, TIS()),
    ({"preset": "tis", "level": "sequence", "upper": 3.0}, TIS(TISParams(level="sequence", upper=3.0))),
    ({"preset": "tis", "lower": 0.5, "upper": 1.5}, TIS(TISParams(lower=0.5, upper=1.5))),
    ({"preset": "mis"}, MIS()),
    ({"preset": "mis", "level": "sequence"}, MIS(MISParams(level="sequence"))),
    ({"preset": "mis", "level": "geometric"}, MIS(MISParams(level="geometric"))),
    ({"preset": "mis", "level": "sequence", "lower": None, "upper": 3.0},
     MIS(MISParams(level="sequence", lower=None, upper=3.0))),
    ({"preset": "mis", "drop_from_denominator": True}, MIS(MISParams(drop_from_denominator=True))),
    ({"preset": "mis", "level": "geometric", "drop_from_denominator": True},
     MIS(MISParams(level="geometric", drop_from_denominator=True))),
    ({"preset": "icepop"}, IcePop()),
    ({"preset": "icepop", "upper": 5.0}, IcePop(IcePopParams(beta=5.0))),
    ({"preset": "icepop", "upper": 5.0, "lower": 0.5}, IcePop(IcePopParams(beta=5.0, lower=0.5))),
    ({}, MIS()),  # no preset: the mis grid
]


@pytest.mark.parametrize("params, existing", PRESET_PAIRS, ids=[
    "tis", "tis-seq", "tis-lower", "mis", "mis-seq", "mis-geo", "mis-seq-upper-only", "mis-drop", "mis-geo-drop",
    "icepop", "icepop-beta5", "icepop-lower", "default"])
def test_presets_are_bit_identical_to_the_existing_plugins(params, existing):
    unified = rc(**params)
    for seed in range(4):
        theta, old, rollout, mask, _ = batch = random_batch(seed)
        log_rho = torch.nan_to_num((old - rollout) * mask, nan=0.0)
        for got, want in zip(unified.weights(log_rho, mask), existing.weights(log_rho, mask)):
            assert got.shape == want.shape and torch.equal(got, want)
        for objective, loss_type in ((None, "bnpo"), (None, "dapo"), (GRPO(), "grpo"), (CISPO(), "grpo")):
            others = [objective] if objective else []
            l1, g1, m1, metrics1 = pipeline([*others, unified], batch, loss_type)
            l2, g2, m2, metrics2 = pipeline([*others, existing], batch, loss_type)
            assert torch.isfinite(l1) and torch.isfinite(g1).all()
            assert torch.equal(l1, l2) and torch.equal(g1, g2) and torch.equal(m1, m2), (seed, loss_type)
            assert {k.split("/", 1)[1]: v for k, v in metrics1.items()} == \
                {k.split("/", 1)[1]: v for k, v in metrics2.items()}
            assert metrics1 and all(k.startswith("rollout_correction/") for k in metrics1)


@pytest.mark.parametrize("params, objective, trl_args, mode, lo, hi", [
    ({"preset": "tis"}, GRPO(), {"loss_type": "grpo"}, "token_truncate", None, 2.0),
    ({"preset": "tis", "level": "sequence", "upper": 3.0}, DAPO(), {"loss_type": "dapo", "epsilon_high": 0.28},
     "sequence_truncate", None, 3.0),
    ({"preset": "mis"}, GRPO(), {"loss_type": "grpo"}, "token_mask", 0.5, 2.0),
    ({"level": "sequence", "lower": None, "upper": 3.0}, GRPO(), {"loss_type": "grpo"}, "sequence_mask", None, 3.0),
    ({"preset": "icepop"}, CISPO(), {"loss_type": "cispo", "epsilon_high": 5.0}, "token_mask", 0.5, 2.0),
], ids=["tis", "tis-seq-dapo", "mis", "mis-seq", "icepop-cispo"])
def test_parity_with_trl_vllm_importance_sampling_modes(params, objective, trl_args, mode, lo, hi):
    # TRL 1.16's own _compute_loss with its vLLM IS factor (tests/test_losses_parity.py's harness)
    parity.test_correction_parity_with_trl_vllm_modes(rc(**params), objective, trl_args, mode, lo, hi)


def test_batches_exercise_kept_changed_and_extreme_tokens():
    _, old, rollout, mask, _ = random_batch(0)
    log_rho = ((old - rollout) * mask).nan_to_num(nan=0.0)[mask.bool()]
    assert (log_rho.abs() == 100).any() and (log_rho.abs() < 0.69).any() and (log_rho.abs() > 0.7).any()


# -- every legal grid point by hand ----------------------------------------------------------------------------------

# Row 0: rho [1.5, 1.5, 1.2] (product 2.7, geometric mean 2.7^(1/3) = 1.3925); row 1: rho [0.8, 3.0] + padding
# (product 2.4, geometric mean sqrt(2.4) = 1.5492). k2: row 0 mean 0.5 ln^2 = 0.0603, row 1 = 0.3142.
ROWS = [[1.5, 1.5, 1.2], [0.8, 3.0]]
GEO0, GEO1 = 2.7 ** (1 / 3), math.sqrt(2.4)
K2_ROW0 = 0.5 * (2 * math.log(1.5) ** 2 + math.log(1.2) ** 2) / 3
K2_ROW1 = 0.5 * (math.log(0.8) ** 2 + math.log(3.0) ** 2) / 2

HAND = [
    # truncate: clamp(rho, lower, upper)
    ("token", "truncate", "ratio", None, 2.0, [[1.5, 1.5, 1.2], [0.8, 2.0]]),
    ("token", "truncate", "ratio", 1.0, 2.0, [[1.5, 1.5, 1.2], [1.0, 2.0]]),
    ("sequence", "truncate", "ratio", None, 2.5, [[2.5] * 3, [2.4] * 2]),
    ("geometric", "truncate", "ratio", 1.4, 1.45, [[1.4] * 3, [1.45] * 2]),
    # mask by the level's ratio
    ("token", "mask", "ratio", 0.5, 2.0, [[1.5, 1.5, 1.2], [0.8, 0.0]]),
    ("sequence", "mask", "ratio", 0.5, 2.5, [[0.0] * 3, [2.4] * 2]),
    ("geometric", "mask", "ratio", 0.5, 1.45, [[GEO0] * 3, [0.0] * 2]),
    # mask by the sequence product (sum of log rho): token weights rho_t, rejected by row
    ("token", "mask", "sum", 0.5, 2.5, [[0.0] * 3, [0.8, 3.0]]),
    ("sequence", "mask", "sum", 0.5, 2.5, [[0.0] * 3, [2.4] * 2]),
    ("geometric", "mask", "sum", 0.5, 2.5, [[0.0] * 3, [GEO1] * 2]),
    ("token", "mask", "sum", 2.45, None, [[1.5, 1.5, 1.2], [0.0, 0.0]]),
    # mask by max: row 1 has the token 3.0 outside [0.5, 2]: the whole row goes
    ("token", "mask", "max", 0.5, 2.0, [[1.5, 1.5, 1.2], [0.0, 0.0]]),
    ("sequence", "mask", "max", 0.5, 2.0, [[2.7] * 3, [0.0] * 2]),
    ("geometric", "mask", "max", 0.5, 2.0, [[GEO0] * 3, [0.0] * 2]),
    ("token", "mask", "max", 0.85, None, [[1.5, 1.5, 1.2], [0.0, 0.0]]),  # lower only: verl's former veto
    # mask by k2 (threshold 0.1 between the rows' 0.0603 and 0.3142)
    ("token", "mask", "k2", None, 0.1, [[1.5, 1.5, 1.2], [0.0, 0.0]]),
    ("sequence", "mask", "k2", None, 0.1, [[2.7] * 3, [0.0] * 2]),
    ("geometric", "mask", "k2", None, 0.1, [[GEO0] * 3, [0.0] * 2]),
    ("token", "mask", "k2", None, 0.05, [[0.0] * 3, [0.0] * 2]),
    # reject: weight 1 where the statistic accepts (pure rejection sampling)
    ("token", "reject", "ratio", 0.5, 2.0, [[1.0, 1.0, 1.0], [1.0, 0.0]]),
    ("sequence", "reject", "sum", 0.5, 2.5, [[0.0] * 3, [1.0] * 2]),
    ("geometric", "reject", "ratio", 0.5, 1.45, [[1.0] * 3, [0.0] * 2]),
    ("token", "reject", "max", 0.5, 2.0, [[1.0] * 3, [0.0] * 2]),
    ("geometric", "reject", "k2", None, 0.1, [[1.0] * 3, [0.0] * 2]),
    ("sequence", "reject", "ratio", 0.5, 2.5, [[0.0] * 3, [1.0] * 2]),
    ("token", "reject", "sum", 0.5, 2.5, [[0.0] * 3, [1.0] * 2]),
    ("geometric", "reject", "sum", 2.45, None, [[1.0] * 3, [0.0] * 2]),
    ("sequence", "reject", "max", 0.5, 2.0, [[1.0] * 3, [0.0] * 2]),
    ("geometric", "reject", "max", 0.85, None, [[1.0] * 3, [0.0] * 2]),
    ("token", "reject", "k2", None, 0.05, [[0.0] * 3, [0.0] * 2]),
    ("sequence", "reject", "k2", None, 0.1, [[1.0] * 3, [0.0] * 2]),
]


@pytest.mark.parametrize("level, mode, statistic, lower, upper, expected", HAND)
def test_grid_point_by_hand(level, mode, statistic, lower, upper, expected):
    assert 0.05 < K2_ROW0 < 0.1 < K2_ROW1  # the thresholds above sit between the rows
    plugin = rc(level=level, mode=mode, statistic=statistic, lower=lower, upper=upper)
    got, metrics = valid_weights(plugin, ROWS)
    assert got == [pytest.approx(row, rel=1e-12) for row in expected]
    if level == "token" and mode != "reject":  # changed tokens: those whose weight is not their own rho
        changed = sum(w != pytest.approx(r) for gw, rw in zip(expected, ROWS) for w, r in zip(gw, rw))
        assert metrics["rollout_correction/changed_fraction"] == pytest.approx(changed / 5)


def test_hand_cases_cover_every_legal_grid_point():
    levels, statistics = ("token", "sequence", "geometric"), ("ratio", "sum", "max", "k2")
    legal = {(level, "truncate", "ratio") for level in levels} | {
        (level, mode, statistic) for level in levels for mode in ("mask", "reject") for statistic in statistics}
    assert {case[:3] for case in HAND} == legal
    for level in levels:  # the other truncate points are refused (truncate clamps the ratio itself)
        for statistic in statistics[1:]:
            with pytest.raises(ValueError, match="takes statistic 'ratio'"):
                RolloutCorrectionParams(level=level, mode="truncate", statistic=statistic, lower=None, upper=2.0)


def test_k2_rejects_a_sequence_a_token_band_keeps():
    rows = [[1.8, 0.6, 1.9], [1.1, 0.95, 1.05]]
    k2 = [0.5 * sum(math.log(x) ** 2 for x in row) / 3 for row in rows]
    assert k2[0] == pytest.approx(0.169735, abs=1e-6) and k2[1] < 0.01
    token_band, _ = valid_weights(rc(level="token", mode="mask", statistic="ratio", lower=0.5, upper=2.0), rows)
    assert token_band == [pytest.approx(rows[0]), pytest.approx(rows[1])]  # every token inside [0.5, 2]
    by_k2, metrics = valid_weights(rc(level="token", mode="mask", statistic="k2", upper=0.1), rows)
    assert by_k2 == [[0.0, 0.0, 0.0], pytest.approx(rows[1])]
    assert metrics["rollout_correction/changed_sequence_fraction"] == 0.5
    assert metrics["rollout_correction/changed_fraction"] == 0.5


@pytest.mark.parametrize("statistic", ["k2_sum", "k2_max", "k3", "k3_sum", "k3_max"])
def test_verls_sum_max_and_k3_divergence_statistics(statistic):
    """verl's rollout_rs seq_sum_k2, seq_max_k2, seq_mean_k3, seq_sum_k3 and seq_max_k3 (k3 = e^l - 1 - l, k2 =
    l^2 / 2, l = log rho_t), by hand on ROWS: a threshold between the two rows' values rejects exactly the larger."""
    estimator, reduce = statistic.split("_") if "_" in statistic else (statistic, "mean")
    per_token = {"k2": lambda l: 0.5 * l * l, "k3": lambda l: math.exp(l) - 1 - l}[estimator]
    values = []
    for row in ROWS:
        terms = [per_token(math.log(x)) for x in row]
        values.append({"sum": sum(terms), "max": max(terms), "mean": sum(terms) / len(terms)}[reduce])
    high = max(range(2), key=lambda i: values[i])
    threshold = (values[0] + values[1]) / 2
    got, metrics = valid_weights(rc(level="token", mode="mask", statistic=statistic, upper=threshold), ROWS)
    for i, row in enumerate(ROWS):
        assert got[i] == ([0.0] * len(row) if i == high else pytest.approx(row, rel=1e-12))
    assert metrics["rollout_correction/changed_sequence_fraction"] == 0.5
    from trl_ext_plugins.corrections.rollout_correction import sequence_divergence

    li = rho_inputs(ROWS)
    log_rho = torch.where(li.mask.bool(), li.old_per_token_logps - li.sampling_per_token_logps, 0.0)
    assert sequence_divergence(log_rho, li.mask, estimator, reduce).flatten().tolist() == pytest.approx(values,
                                                                                                       rel=1e-12)
    with pytest.raises(ValueError, match="only an upper threshold"):
        RolloutCorrectionParams(statistic=statistic, upper=1.0, lower=0.1)


def test_max_rejects_the_sequence_of_one_outlier_token():
    rows = [[1.0, 1.0, 4.0], [1.2, 0.9, 1.1]]
    token_band, _ = valid_weights(rc(), rows)
    assert token_band == [[1.0, 1.0, 0.0], pytest.approx(rows[1])]  # only the outlier goes
    by_max, metrics = valid_weights(rc(statistic="max"), rows)
    assert by_max == [[0.0, 0.0, 0.0], pytest.approx(rows[1])]  # the whole sequence goes
    assert metrics["rollout_correction/changed_fraction"] == 0.5
    # symmetric band [1/C, C]: the same as max_t |log rho_t| > log C (verl seq_max_k2 at 0.5 (log C)^2)
    assert max(abs(math.log(x)) for x in rows[0]) > math.log(2.0) > max(abs(math.log(x)) for x in rows[1])


def test_sum_equals_the_sequence_level_ratio():
    rows = [[1.5, 1.5, 1.2], [0.8, 3.0], [0.3, 1.1, 1.2]]  # products 2.7, 2.4, 0.396
    by_sum, _ = valid_weights(rc(level="sequence", statistic="sum", upper=2.5), rows)
    assert by_sum == [[0.0] * 3, pytest.approx([2.4] * 2), [0.0] * 3]  # 0.396 < 0.5
    for seed in range(3):
        _, old, rollout, mask, _ = random_batch(seed)
        log_rho = torch.nan_to_num((old - rollout) * mask, nan=0.0)
        a = rc(level="sequence", statistic="sum").weights(log_rho, mask)
        b = rc(level="sequence", statistic="ratio").weights(log_rho, mask)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_geometric_mean_weight():
    rows = [[2.0, 0.5, 4.0], [1.21, 1.0]]  # geometric means 4^(1/3) = 1.5874 and 1.1
    got, _ = valid_weights(rc(level="geometric", upper=4.0), rows)
    assert got == [pytest.approx([4 ** (1 / 3)] * 3), pytest.approx([1.1, 1.1])]
    got, _ = valid_weights(rc(level="geometric", mode="truncate", lower=None, upper=1.5), rows)
    assert got == [pytest.approx([1.5] * 3), pytest.approx([1.1, 1.1])]


def test_drop_from_denominator_removes_rejected_sequences_from_the_token_mean():
    # k2 rejects row 1; with drop its 2 tokens leave the bnpo token mean: loss = sum over row 0 / 3, not / 5
    li = rho_inputs(ROWS, advantages=[[1.0], [1.0]])
    tw = rc(statistic="k2", upper=0.1, drop_from_denominator=True).trl_ext_token_weights(inputs=li)
    assert tw.mask.tolist() == [[True, True, True], [False, False, False]]  # the whole row (padding is off anyway)
    for drop, denominator in ((True, 3.0), (False, 5.0)):
        li = rho_inputs(ROWS, advantages=[[1.0], [1.0]])
        loss, _, _ = compose_loss(PluginHost([rc(statistic="k2", upper=0.1, drop_from_denominator=drop)]), li,
                                  loss_type="bnpo", kl=ops.KLTerm("k3"))
        # pi_theta = pi_old: PPO term -A r = -1 per token, weighted by rho_t
        assert loss.item() == pytest.approx(-(1.5 + 1.5 + 1.2) / denominator, rel=1e-12)


def test_weights_are_detached_and_finite_under_extremes():
    # log rho +-100 (clamped to +-20), all tokens masked, single-token completions; every legal grid point
    theta = torch.full((3, 3), -1.0, dtype=D)
    log_rho = torch.tensor([[100.0, -100.0, 0.0], [100.0, 0.0, 0.0], [0.0, 0.0, 0.0]], dtype=D)
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0]], dtype=D)
    for level, mode, statistic, lower, upper, _ in HAND:
        plugin = rc(level=level, mode=mode, statistic=statistic, lower=lower, upper=upper)
        old = theta.clone().requires_grad_(True)
        li = make_inputs(theta, old=old, rollout=theta - log_rho, mask=mask)
        li.old_per_token_logps = old
        weight = plugin.trl_ext_token_weights(inputs=li).weight
        assert not weight.requires_grad and torch.isfinite(weight).all(), (level, mode, statistic)
        li = make_inputs(theta, rollout=theta - log_rho, mask=mask)
        loss, _, _ = compose_loss(PluginHost([plugin]), li, loss_type="dapo", kl=ops.KLTerm("k3"))
        (grad,) = torch.autograd.grad(loss, li.per_token_logps)
        assert torch.isfinite(loss) and torch.isfinite(grad).all() and (grad[~mask.bool()] == 0).all()


GRID = [{"level": level, "mode": mode, "statistic": statistic, "lower": lower, "upper": upper, **drop}
        for level, mode, statistic, lower, upper, _ in HAND
        for drop in ([{}] if mode == "truncate" else [{}, {"drop_from_denominator": True}])]


@SETTINGS
@given(batch=micro_batch(), point=st.sampled_from(GRID), objective=st.sampled_from([None, GRPO(), CISPO()]),
       loss_type=st.sampled_from(["bnpo", "dapo", "grpo", "dr_grpo"]), training=st.booleans())
def test_every_grid_point_is_finite_under_legal_extremes(batch, point, objective, loss_type, training):
    # the property suite's float32 batches: -inf at padding, log-probs down to -1e4, NaN rollout log-probs, all masked
    mask, theta, old, rollout, ref, advantages = batch
    li, leaf = loss_inputs(mask, theta, old, rollout, ref, advantages, 0.0, loss_type, training, 2)
    plugins = [p for p in (objective, rc(**point)) if p is not None]
    loss, _, _ = compose_loss(PluginHost(plugins), li, loss_type=loss_type, kl=ops.KLTerm("k3"))
    assert torch.isfinite(loss), (point, loss)
    (grad,) = torch.autograd.grad(loss, leaf, allow_unused=True)
    if grad is not None:
        assert torch.isfinite(grad).all() and torch.all(grad[~mask.bool()] == 0), (point, grad)


def test_plugin_is_registered_documented_and_logs_diagnostics():
    assert UnifiedCorrection in PLUGINS and Catalog.discover().resolve("rollout_correction").cls is UnifiedCorrection
    check_plugin_conformance(UnifiedCorrection)
    _, metrics = valid_weights(rc(statistic="max"), ROWS)
    for key in ("ess", "rho/mean", "rho/std", "rho/max", "changed_fraction", "changed_sequence_fraction",
                "mismatch_kl/k1", "mismatch_kl/k3", "weight/mean", "logp_diff/max"):
        assert f"rollout_correction/{key}" in metrics
    assert metrics["rollout_correction/changed_sequence_fraction"] == 0.5
    assert metrics["rollout_correction/rho/max"] == pytest.approx(3.0)


# -- conformance against references written from the formula ----------------------------------------------------------

CONFORMANCE_BASE = {"theta": [[-0.5, -1.2, -0.1], [-2.0, -0.3, -0.7]], "old": [[-0.7, -1.0, -0.1], [-1.5, -0.31, -0.2]],
                    "rollout": [[-0.6, -1.9, -0.1], [-1.4, -0.3, -0.7]], "mask": [[1, 1, 1], [1, 1, 0]],
                    "advantages": [[1.5], [-0.8]]}
CONFORMANCE_CASES = [CONFORMANCE_BASE, {**CONFORMANCE_BASE, "advantages": [[1.0, -2.0, 0.5], [0.3, -1.0, 2.0]]},
                     {**CONFORMANCE_BASE, "mask": [[1, 0, 0], [0, 0, 0]]}]


def conformance_reference(weight_and_keep):
    """bnpo token mean of the default PPO-clip term (eps 0.2) times the correction weight, over kept loss tokens."""
    def ref(case, theta):
        old = torch.tensor(case["old"], dtype=D)
        mask = torch.tensor(case["mask"], dtype=D)
        adv = torch.tensor(case["advantages"], dtype=D)
        log_rho = (old - torch.tensor(case["rollout"], dtype=D)) * mask
        weight, keep = weight_and_keep(log_rho, mask)
        r = torch.exp(theta - old)
        loss = -torch.minimum(r * adv, torch.clamp(r, 0.8, 1.2) * adv) * weight
        kept = mask * keep
        return (loss * kept).sum() / max(kept.sum().item(), 1.0)
    return ref


def per_row(values, mask):
    return values.expand_as(mask)


@pytest.mark.parametrize("params, weight_and_keep", [
    # k2 upper 0.05: row 0 mean 0.5 (0.1^2 + 0.9^2 + 0) / 3 = 0.1367 is rejected; row 1 0.5 (0.1^2 + 0.01^2) / 2
    ({"statistic": "k2", "upper": 0.05},
     lambda lr, m: (torch.where(((0.5 * lr ** 2).sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp(min=1)) > 0.05,
                                0.0, torch.exp(lr)), torch.ones_like(m))),
    # max with [0.5, 2]: row 0 has rho = e^0.9 = 2.46 -> rejected (kept in the denominator)
    ({"statistic": "max"},
     lambda lr, m: (torch.where(((torch.exp(lr) > 2) | (torch.exp(lr) < 0.5)).any(-1, keepdim=True), 0.0,
                                torch.exp(lr)), torch.ones_like(m))),
    # geometric level, sum statistic with [0.5, 2], dropping the rejected rows from the denominator
    ({"level": "geometric", "statistic": "sum", "drop_from_denominator": True},
     lambda lr, m: ((lambda bad: (per_row(torch.where(bad, 0.0, torch.exp(lr.sum(-1, keepdim=True)
                                                                       / m.sum(-1, keepdim=True).clamp(min=1))), m),
                                  per_row((~bad).to(D), m)))(
         (torch.exp(lr.sum(-1, keepdim=True)) > 2) | (torch.exp(lr.sum(-1, keepdim=True)) < 0.5)))),
    # sequence truncate: min(prod rho, 1.5)
    ({"level": "sequence", "mode": "truncate", "lower": None, "upper": 1.5},
     lambda lr, m: (per_row(torch.clamp(torch.exp(lr.sum(-1, keepdim=True)), max=1.5), m), torch.ones_like(m))),
    # pure rejection by the geometric mean in [0.8, 1.25], dropping the rejected rows (row 0: e^(0.8/3) = 1.31)
    ({"level": "geometric", "mode": "reject", "lower": 0.8, "upper": 1.25, "drop_from_denominator": True},
     lambda lr, m: (lambda keep: (per_row(keep, m), per_row(keep, m)))(
         ((lambda g: (g >= 0.8) & (g <= 1.25))(torch.exp(lr.sum(-1, keepdim=True) / m.sum(-1, keepdim=True)
                                                         .clamp(min=1)))).to(D))),
], ids=["k2", "max", "geometric-sum-drop", "sequence-truncate", "geometric-reject-drop"])
def test_conforms_to_the_formula(params, weight_and_keep):
    assert_conforms(rc(**params), conformance_reference(weight_and_keep), CONFORMANCE_CASES)


def test_verl_geometric_rs_with_token_tis_is_tis_plus_reject_mode():
    # verl decoupled_geo_rs_token_tis: w_t = min(rho_t, 2) on sequences whose geometric-mean pi_rollout/pi_old lies in
    # [0.999, 1.001] (its seq_mean_k1 bounds); rejected sequences leave the denominator. Ours: tis + reject mode with
    # the bounds inverted to rho = pi_old/pi_rollout: [1/1.001, 1/0.999].
    rows = {**CONFORMANCE_BASE, "rollout": [[-0.7005, -0.9995, -0.1], [-1.4, -0.3, -0.7]]}  # row 0 geo 1.0, row 1 not
    rows["mask"] = [[1, 1, 1], [1, 1, 0]]

    def weight_and_keep(lr, m):
        k1_mean = (-lr).sum(-1, keepdim=True) / m.sum(-1, keepdim=True)
        keep = ((k1_mean >= math.log(0.999)) & (k1_mean <= math.log(1.001))).to(D).expand_as(m)
        return torch.clamp(torch.exp(lr), max=2.0), keep
    assert_conforms(TIS(), conformance_reference(weight_and_keep), [rows], others=[rc(
        level="geometric", mode="reject", lower=1 / 1.001, upper=1 / 0.999, drop_from_denominator=True)])
    keep = weight_and_keep((torch.tensor(rows["old"], dtype=D) - torch.tensor(rows["rollout"], dtype=D))
                           * torch.tensor(rows["mask"], dtype=D), torch.tensor(rows["mask"], dtype=D))[1]
    assert keep[:, 0].tolist() == [1.0, 0.0]  # the case keeps one sequence and rejects the other


# -- validation -------------------------------------------------------------------------------------------------------


def stage(params):
    return StageSpec(trainer="grpo", model="embedded:tiny-qwen2", dataset="embedded:arithmetic",
                     plugins=["grpo", {"rollout_correction": params}, "rollout_logprobs", "exact_match"])


@pytest.mark.parametrize("params, field, words", [
    ({"lower": 3.0, "upper": 2.0}, "upper", "must not exceed"),
    ({"statistic": "k2", "upper": 0.1, "lower": 0.5}, "lower", "only an upper threshold"),
    ({"statistic": "k2"}, "upper", "needs an upper threshold"),
    ({"lower": -0.1}, "lower", "greater than or equal to 0"),
    ({"upper": -2.0}, "upper", "greater than 0"),
    ({"preset": "ppo"}, "preset", "'tis', 'mis' or 'icepop'"),
    ({"mode": "truncate", "statistic": "k2", "upper": 0.1}, "statistic", "takes statistic 'ratio'"),
    ({"preset": "tis", "statistic": "max"}, "statistic", "takes statistic 'ratio'"),
    ({"preset": "tis", "drop_from_denominator": True}, "drop_from_denominator", "nothing to drop"),
    ({"lower": None, "upper": None}, "upper", "at least one of lower and upper"),
    ({"level": "geometric_mean"}, "level", "'token', 'sequence' or 'geometric'"),
    ({"mode": "reject", "statistic": "k2", "upper": 0.1, "lower": 0.01}, "lower", "only an upper threshold"),
    ({"threshold": 2.0}, "threshold", "not a parameter"),
], ids=["lower>upper", "k2-lower", "k2-no-upper", "negative-lower", "negative-upper", "unknown-preset",
        "truncate-k2", "tis-max", "truncate-drop", "no-bound", "unknown-level", "reject-k2-lower", "unknown-field"])
def test_illegal_combinations_refused_naming_the_field(params, field, words):
    with pytest.raises(RecipeError) as info:
        resolve_stage(stage(params), 0, Catalog.discover())
    lines = [line for line in str(info.value).splitlines() if "rollout_correction" in line]
    assert len(lines) == 1, str(info.value)
    assert f"stages[0].plugins[1].params.{field}:" in lines[0] and "(plugin 'rollout_correction')" in lines[0]
    assert words in lines[0], lines[0]


def test_presets_fill_and_explicit_fields_override():
    assert RolloutCorrectionParams(preset="tis").model_dump(exclude={"preset", "support"}) == {
        "level": "token", "mode": "truncate", "statistic": "ratio", "lower": None, "upper": 2.0,
        "drop_from_denominator": False}
    assert RolloutCorrectionParams(preset="icepop", upper=4.0).lower == 0.25  # IcePop's [1/beta, beta]
    assert RolloutCorrectionParams(preset="mis", upper=4.0).lower == 0.25  # mis: [1/C, C] too, as the mis plugin
    k2 = RolloutCorrectionParams(preset="mis", statistic="k2", upper=0.02)  # ratio bounds do not carry to k2
    assert (k2.lower, k2.upper, k2.mode) == (None, 0.02, "mask")
    resolved = resolve_stage(stage({"preset": "icepop", "level": "sequence"}), 0, Catalog.discover())
    assert resolved.args["vllm_importance_sampling_correction"] is False
