"""Merging math (ALGORITHMS.md items 52 WARP and 53 checkpoint averaging): numbers computed by hand from the formulas."""

import math

import pytest
import torch

from trl_ext_plugins.merge.math import (
    ArchitectureMismatchError,
    NonFiniteWeightsError,
    ZeroTaskVectorError,
    average_state_dicts,
    check_same_tensors,
    ema_weights,
    liti,
    normalized_weights,
    slerp,
    slerp_coefficients,
    slerp_fold_coefficients,
    slerp_many,
)

R2 = math.sqrt(0.5)  # sin(pi/4) = 0.707107


def test_orthogonal_equal_norm_slerp_keeps_the_norm():
    d1, d2 = torch.tensor([3.0, 0.0]), torch.tensor([0.0, 3.0])
    c1, c2, linear = slerp_coefficients(d1, d2, 0.5)
    assert (c1, c2) == pytest.approx((0.707107, 0.707107), abs=1e-6) and not linear
    merged = slerp(d1, d2, 0.5)
    assert merged.tolist() == pytest.approx([2.121320, 2.121320], abs=1e-6)
    assert float(merged.norm()) == pytest.approx(3.0, abs=1e-9)  # = ||delta||
    assert float((0.5 * d1 + 0.5 * d2).norm()) == pytest.approx(0.707107 * 3, abs=1e-5)  # linear averaging shrinks


def test_slerp_other_angles_and_norms():
    # 60 degrees, t = 0.5: sin(pi/6) / sin(pi/3) = 0.577350 each; unit vectors -> the unit vector at 30 degrees
    d1, d2 = torch.tensor([1.0, 0.0]), torch.tensor([0.5, math.sqrt(3) / 2])
    assert slerp_coefficients(d1, d2, 0.5)[:2] == pytest.approx((0.577350, 0.577350), abs=1e-6)
    assert slerp(d1, d2, 0.5).tolist() == pytest.approx([math.sqrt(3) / 2, 0.5], abs=1e-6)
    # orthogonal, unequal norms: the coefficients depend on the angle only
    assert slerp(torch.tensor([2.0, 0.0]), torch.tensor([0.0, 1.0]), 0.5).tolist() == pytest.approx(
        [1.414214, 0.707107], abs=1e-6)
    # t = 0.25 at 90 degrees: sin(3pi/8) = 0.923880, sin(pi/8) = 0.382683
    assert slerp_coefficients(torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0]), 0.25)[:2] == pytest.approx(
        (0.923880, 0.382683), abs=1e-6)


@pytest.mark.parametrize("t", [0.0, 1.0])
def test_slerp_endpoints(t):
    d1, d2 = torch.tensor([1.0, 2.0, -1.0]), torch.tensor([0.5, -1.0, 3.0])
    expected = d1 if t == 0.0 else d2
    assert torch.allclose(slerp(d1, d2, t), expected.double(), atol=1e-12)


def test_parallel_vectors_interpolate_linearly():
    d1, d2 = torch.tensor([1.0, 2.0]), torch.tensor([2.0, 4.0])
    c1, c2, linear = slerp_coefficients(d1, d2, 0.25)
    assert linear and (c1, c2) == (0.75, 0.25)
    assert slerp(d1, d2, 0.25).tolist() == pytest.approx([1.25, 2.5])
    # just under the threshold SLERP's coefficients are already within 1e-3 of the linear ones (its limit)
    angle = math.acos(0.999)
    near = torch.tensor([math.cos(angle), math.sin(angle)])
    c1, c2, linear = slerp_coefficients(torch.tensor([1.0, 0.0]), near, 0.25)
    assert not linear and (c1, c2) == pytest.approx((0.75, 0.25), abs=1e-3)


def test_antiparallel_vectors_cancel_linearly():
    d1, d2 = torch.tensor([1.0, 0.0]), torch.tensor([-1.0, 0.0])
    c1, c2, linear = slerp_coefficients(d1, d2, 0.5)
    assert linear and (c1, c2) == (0.5, 0.5)
    assert slerp(d1, d2, 0.5).tolist() == [0.0, 0.0]
    assert slerp(d1, d2, 0.25).tolist() == pytest.approx([0.5, 0.0])
    assert torch.isfinite(slerp(d1, d2 * 1e-30, 0.5)).all()


def test_zero_task_vector_is_refused():
    with pytest.raises(ZeroTaskVectorError, match="zero"):
        slerp(torch.zeros(3), torch.ones(3), 0.5)
    with pytest.raises(ZeroTaskVectorError):
        slerp(torch.ones(3), torch.zeros(3), 0.5)


def test_slerp_many():
    e = torch.eye(3)
    two, fallbacks = slerp_many([e[0], e[1]])
    assert two.tolist() == pytest.approx([R2, R2, 0.0], abs=1e-6) and fallbacks == 0
    # M = 3: acc = slerp(e1, e2; 1/2) = 0.707107 (e1 + e2); then slerp(acc, e3; 1/3) at 90 degrees:
    # sin(pi/3) = 0.866025 on acc, sin(pi/6) = 0.5 on e3 -> 0.612372 (e1 + e2) + 0.5 e3, norm 1
    three, _ = slerp_many([e[0], e[1], e[2]])
    assert three.tolist() == pytest.approx([0.612372, 0.612372, 0.5], abs=1e-6)
    assert float(three.norm()) == pytest.approx(1.0)
    one, _ = slerp_many([e[0]])
    assert one.tolist() == e[0].tolist()
    with pytest.raises(ValueError, match="exactly 2"):
        slerp_many([e[0], e[1], e[2]], t=0.3)


def test_liti():
    init, merged = torch.tensor([1.0, -2.0]), torch.tensor([3.0, 2.0])
    assert liti(init, merged, 0.0).tolist() == init.tolist()
    assert liti(init, merged, 1.0).tolist() == merged.tolist()
    assert liti(init, merged, 0.3).tolist() == pytest.approx([1.6, -0.8])  # 0.7 * init + 0.3 * merged


def test_average_weights():
    assert normalized_weights(4) == [0.25] * 4
    assert normalized_weights(2, [3.0, 1.0]) == [0.75, 0.25]
    assert ema_weights(3, 0.5) == pytest.approx([0.25, 0.25, 0.5])  # e3 = .25 t1 + .25 t2 + .5 t3
    assert ema_weights(3, 0.9) == pytest.approx([0.81, 0.09, 0.1])
    assert ema_weights(3, 0.0) == [0.0, 0.0, 1.0]
    assert ema_weights(1, 0.7) == [1.0]
    for bad in ([1.0, -1.0], [0.0, 0.0], [float("nan"), 1.0]):
        with pytest.raises(ValueError):
            normalized_weights(2, bad)
    with pytest.raises(ValueError, match="3 weights for 2"):
        normalized_weights(2, [1, 1, 1])


def test_average_state_dicts_numbers_and_buffers():
    a = {"w": torch.tensor([1.0, 3.0]), "steps": torch.tensor([7]), "mask": torch.tensor([True, False])}
    b = {"w": torch.tensor([3.0, 5.0]), "steps": torch.tensor([9]), "mask": torch.tensor([False, False])}
    out = average_state_dicts([a, b])
    assert out["w"].tolist() == [2.0, 4.0]
    assert out["steps"].tolist() == [7] and out["mask"].tolist() == [True, False]  # copied from the base, not averaged
    assert average_state_dicts([a, b], base=1)["steps"].tolist() == [9]
    assert average_state_dicts([a, b], [3.0, 1.0])["w"].tolist() == [1.5, 3.5]
    same = average_state_dicts([a, a, a])
    assert torch.equal(same["w"], a["w"])
    half = {"w": torch.tensor([1.0, 3.0], dtype=torch.bfloat16)}
    assert average_state_dicts([half, half])["w"].dtype == torch.bfloat16


def test_average_state_dicts_refuses_what_it_cannot_average_naming_the_tensor():
    """Shapes that would broadcast ((3, 4) with (4,)), a tensor only one model has, a float tensor that is an integer
    one elsewhere, and NaN or Inf weights: each is refused, never averaged into a model that loads."""
    a = {"w": torch.ones(3, 4), "b": torch.zeros(2)}
    with pytest.raises(ArchitectureMismatchError, match=r"'w' has shape \[4\] in 'model 1' but \[3, 4\] in 'model 0'"):
        average_state_dicts([a, {"w": torch.ones(4), "b": torch.zeros(2)}])
    with pytest.raises(ArchitectureMismatchError, match="tensor 'extra' is in 'model 1' but not in 'model 0'"):
        average_state_dicts([a, {**a, "extra": torch.ones(1)}])
    with pytest.raises(ArchitectureMismatchError, match="'b' is torch.int64 in 'model 1'"):
        average_state_dicts([a, {**a, "b": torch.zeros(2, dtype=torch.int64)}])
    for bad in (math.nan, math.inf):
        with pytest.raises(NonFiniteWeightsError, match="'b' holds NaN or Inf in 'model 1'"):
            average_state_dicts([a, {**a, "b": torch.tensor([0.0, bad])}])


def test_non_finite_task_vectors_are_refused_in_both_slerp_forms():
    """max(-1, min(1, nan)) is 1, so the Gram form took a NaN tensor for parallel vectors and interpolated it
    linearly into the output, while the vector form returned NaN coefficients: both now refuse it."""
    with pytest.raises(NonFiniteWeightsError):
        slerp_fold_coefficients(torch.tensor([[1.0, math.nan], [math.nan, 1.0]]))
    with pytest.raises(NonFiniteWeightsError):
        slerp_coefficients(torch.tensor([1.0, 0.0]), torch.tensor([math.nan, 1.0]), 0.5)


def test_check_same_tensors_names_the_tensor():
    check_same_tensors([{"a": (2, 3)}, {"a": (2, 3)}], ["x", "y"], "merge")
    with pytest.raises(ArchitectureMismatchError, match=r"parameter 'a' has shape \[2, 4\] in 'y' but \[2, 3\] in 'x'"):
        check_same_tensors([{"a": (2, 3)}, {"a": (2, 4)}], ["x", "y"], "merge")
    with pytest.raises(ArchitectureMismatchError, match="tensor 'b' is in 'y' but not in 'x'"):
        check_same_tensors([{"a": (2,)}, {"a": (2,), "b": (1,)}], ["x", "y"], "merge")
    with pytest.raises(ArchitectureMismatchError, match="tensor 'b' is in 'x' but not in 'y'"):
        check_same_tensors([{"a": (2,), "b": (1,)}, {"a": (2,)}], ["x", "y"], "merge")


def test_gram_fold_equals_vector_slerp():
    """The streamed merge computes SLERP from the task vectors' Gram matrix; it equals SLERP on the vectors."""
    gen = torch.Generator().manual_seed(0)
    for m, t in ((2, None), (2, 0.3), (3, None), (4, None)):
        deltas = [torch.randn(50, generator=gen, dtype=torch.float64) for _ in range(m)]
        stacked = torch.stack(deltas)
        coefficients, fallbacks = slerp_fold_coefficients(stacked @ stacked.T, t)
        merged, expected_fallbacks = slerp_many(deltas, t)
        assert torch.allclose(torch.tensor(coefficients, dtype=torch.float64) @ stacked, merged, atol=1e-12)
        assert fallbacks == expected_fallbacks == 0
    e = torch.eye(3, dtype=torch.float64)
    assert slerp_fold_coefficients(e)[0] == pytest.approx([0.612372, 0.612372, 0.5], abs=1e-6)
    parallel = torch.stack([torch.tensor([1.0, 2.0]), torch.tensor([2.0, 4.0])]).double()
    assert slerp_fold_coefficients(parallel @ parallel.T, 0.25) == ([0.75, 0.25], 1)
    with pytest.raises(ZeroTaskVectorError):
        slerp_fold_coefficients(torch.tensor([[1.0, 0.0], [0.0, 0.0]]))


def test_a_running_merge_that_cancelled_folds_the_next_run_in_linearly():
    """M = 3 with d_2 = -d_1: the first fold is linear (anti-parallel) and leaves exactly zero, which has no angle, so
    the third run is folded linearly: 2/3 * 0 + 1/3 * d_3 (before, this raised 'a task vector is exactly zero' although
    no run's task vector was zero)."""
    d1, d3 = torch.tensor([1.0, 2.0, 0.0]), torch.tensor([0.0, 0.0, 3.0])
    merged, fallbacks = slerp_many([d1, -d1, d3])
    assert merged.tolist() == pytest.approx([0.0, 0.0, 1.0]) and fallbacks == 2
    stacked = torch.stack([d1, -d1, d3]).double()
    coefficients, gram_fallbacks = slerp_fold_coefficients(stacked @ stacked.T)
    assert coefficients == pytest.approx([1 / 3, 1 / 3, 1 / 3]) and gram_fallbacks == 2
    # a zero task vector is still refused, naming which one, in both forms
    with pytest.raises(ZeroTaskVectorError, match="task vector 2 is exactly zero"):
        slerp_many([d1, torch.zeros(3), d3])
    with pytest.raises(ZeroTaskVectorError, match="task vector 1 is exactly zero"):
        slerp_many([torch.zeros(3), d1, d3])
    zero_second = torch.stack([d1, torch.zeros(3), d3]).double()
    with pytest.raises(ZeroTaskVectorError, match="task vector 2 is exactly zero"):
        slerp_fold_coefficients(zero_second @ zero_second.T)
