"""TRL parity fixtures: TRL 1.16's own loss values and gradients, recorded in tests/trl_fixtures/*.json.

Two checks per case (cases defined in tests/trl_fixtures/cases.py, recorded by tests/trl_fixtures/record.py):

* drift: the installed TRL recomputes the case from the recorded inputs and must give the recorded loss and gradient
  (float64, relative 1e-9; relative 1e-6 for a case whose TRL kernel computes in float32, ``Case.drift_rtol``, since
  float32 matmuls round differently on another CPU with the same TRL and torch). A TRL upgrade that changes a number,
  or drops the method or loss type, fails here on purpose, naming the case, both numbers and both TRL versions;
* parity: trl-ext's path for the same case (the plugins and the args they set, as the live parity tests run them) must
  give the *recorded* numbers (relative 1e-9 unless the case records a looser ``parity_rtol`` with its reason), so
  trl-ext stays pinned to TRL 1.16's numbers even after TRL changes.

Relative error: ``|now - recorded| <= rtol * |recorded|`` for the loss, and the largest elementwise difference of a
gradient relative to its largest recorded magnitude.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import trl

from tests.trl_fixtures.cases import all_cases

FIXTURES = Path(__file__).parent / "trl_fixtures"
DRIFT_RTOL = 1e-9
RERECORD = "python tests/trl_fixtures/record.py"


def _load():
    docs = {path.stem: json.loads(path.read_text()) for path in sorted(FIXTURES.glob("*.json"))}
    records = {}
    for family, doc in docs.items():
        for case in doc["cases"]:
            records[case["id"]] = (family, doc, case)
    return records


RECORDS = _load()
CASES = {case.id: case for case in all_cases()}


def test_every_case_is_recorded_and_every_record_is_a_case():
    missing = sorted(set(CASES) - set(RECORDS))
    stale = sorted(set(RECORDS) - set(CASES))
    assert not missing and not stale, (f"cases without a recording: {missing}; recordings without a case: {stale}; "
                                       f"run {RERECORD}")
    for case_id, case in CASES.items():
        family, _, record = RECORDS[case_id]
        assert family == case.family, f"{case_id} is recorded in {family}.json, defined for {case.family}.json"
        assert record["trl"] == case.trl, (f"{case_id}: the case's TRL fields {case.trl} differ from the recorded "
                                           f"{record['trl']}; run {RERECORD}")


def _mismatch(now, recorded, rtol, said="now") -> str | None:
    """None when ``now`` matches ``recorded`` to ``rtol``, else a description of the largest difference (``said``
    names the side that computed ``now``)."""
    recorded_t = torch.as_tensor(recorded, dtype=torch.float64)
    now_t = now.detach().to(torch.float64)
    if now_t.shape != recorded_t.shape:
        return f"shape {tuple(recorded_t.shape)} recorded, now {tuple(now_t.shape)}"
    diff = (now_t - recorded_t).abs()
    scale = recorded_t.abs().max() if recorded_t.numel() else torch.tensor(0.0, dtype=torch.float64)
    if torch.isfinite(now_t).all() and diff.max() <= rtol * scale:
        return None
    if recorded_t.dim() == 0:
        return f"{recorded_t.item()!r}, {said} {now_t.item()!r}"
    index = tuple(int(i) for i in torch.unravel_index(diff.argmax(), diff.shape))
    return (f"at {list(index)} {recorded_t[index].item()!r}, {said} {now_t[index].item()!r} (largest difference "
            f"{diff.max().item():.3e}, tolerance {rtol} x {scale.item():.3e})")


def _compare(loss, grads, record, rtol, said="now"):
    """[(what, description)] for every quantity that does not match the record."""
    out = []
    problem = _mismatch(loss, record["loss"], rtol, said)
    if problem:
        out.append(("loss", problem))
    for name, recorded in record["grad"].items():
        if name not in grads:
            out.append((f"d loss/d {name}", "recorded, not computed now"))
            continue
        problem = _mismatch(grads[name], recorded, rtol, said)
        if problem:
            out.append((f"d loss/d {name}", problem))
    return out


def _inputs(case_id):
    _, doc, record = RECORDS[case_id]
    return doc["inputs"][record["inputs"]]


@pytest.mark.parametrize("case_id", sorted(CASES))
def test_trl_has_not_drifted(case_id):
    family, doc, record = RECORDS[case_id]
    recorded, installed = doc["trl_version"], trl.__version__
    case = CASES[case_id]
    try:
        loss, grads = case.run_trl(record["trl"], _inputs(case_id))
    except Exception as exc:  # a renamed method, a dropped loss type: fail naming it, never skip
        pytest.fail(f"TRL {installed} can no longer compute {case_id} (recorded with TRL {recorded}, fields "
                    f"{record['trl']}): {type(exc).__name__}: {exc}; {case.note}".rstrip("; "), pytrace=False)
    problems = _compare(loss, grads, record, case.drift_rtol)
    if problems:
        lines = "; ".join(f"recorded {what} {desc}" for what, desc in problems)
        pytest.fail(f"TRL {installed} changed {case_id}: {lines} (recorded with TRL {recorded} in "
                    f"tests/trl_fixtures/{family}.json); re-record with {RERECORD} after checking the change",
                    pytrace=False)


@pytest.mark.parametrize("case_id", sorted(CASES))
def test_trl_ext_matches_recorded_trl(case_id):
    family, doc, record = RECORDS[case_id]
    loss, grads = CASES[case_id].run_ext(_inputs(case_id))
    problems = _compare(loss, grads, record, record["parity_rtol"], said="trl-ext")
    if problems:
        lines = "; ".join(f"{what}: TRL recorded {desc}" for what, desc in problems)
        pytest.fail(f"trl-ext's path for {case_id} differs from TRL {doc['trl_version']}'s recorded numbers "
                    f"(tests/trl_fixtures/{family}.json, rtol {record['parity_rtol']}): {lines}", pytrace=False)


def test_a_changed_number_is_caught_and_located():
    """The comparison itself: a 1e-7 relative change of the loss or one gradient entry fails, naming where."""
    case_id = "grpo/loss_type=dapo/epsilon_high=0.28/ext=dapo"
    _, _, record = RECORDS[case_id]
    loss, grads = CASES[case_id].run_trl(record["trl"], _inputs(case_id))
    assert _compare(loss, grads, record, DRIFT_RTOL) == []
    assert [what for what, _ in _compare(loss * (1 + 1e-7), grads, record, DRIFT_RTOL)] == ["loss"]
    grad = grads["per_token_logps"].clone()
    index = tuple(int(i) for i in torch.unravel_index(grad.abs().argmax(), grad.shape))
    grad[index] *= 1 + 1e-7
    (what, description), = _compare(loss, {"per_token_logps": grad}, record, DRIFT_RTOL)
    assert what == "d loss/d per_token_logps" and description.startswith(f"at {list(index)} ")
