"""Record TRL's own loss values and gradients for every trl-ext/TRL overlap into tests/trl_fixtures/<family>.json.

Run from the repository root: ``python tests/trl_fixtures/record.py``. The cases are defined in ``cases.py``; each
file holds the TRL version it was recorded with, the inputs (as float64 lists, so the file does not depend on torch's
random generator), and per case the TRL config fields, TRL's loss and its gradient. Re-running with the same TRL
writes byte-identical files (sorted keys; Python's float repr round-trips exactly).
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

COMMAND = "python tests/trl_fixtures/record.py"


def _finite_floats(value, where):
    """Nested lists of floats, each finite (JSON has no NaN/inf)."""
    flat = value if isinstance(value, list) else [value]
    for v in flat:
        if isinstance(v, list):
            _finite_floats(v, where)
        elif isinstance(v, float) and not math.isfinite(v):
            raise ValueError(f"{where}: non-finite value {v}")
    return value


def record_case(case, inputs: dict) -> dict:
    loss, grads = case.run_trl(case.trl, inputs)
    if not all(g.abs().sum() > 0 for g in grads.values()):
        raise ValueError(f"{case.id}: a zero gradient would make the parity check vacuous")
    return {"id": case.id, "trl": case.trl, "inputs": case.make_inputs.__name__,
            "loss": _finite_floats(loss.tolist(), case.id),
            "grad": {name: _finite_floats(g.tolist(), case.id) for name, g in grads.items()},
            "parity_rtol": case.parity_rtol, "note": case.note}


def build_docs() -> dict[str, dict]:
    """``{family: document}`` with TRL's numbers for every case."""
    import torch
    import trl

    from tests.trl_fixtures.cases import all_cases

    torch.set_num_threads(1)  # one summation order
    families: dict[str, dict] = {}
    for case in all_cases():
        doc = families.setdefault(case.family, {
            "trl_version": trl.__version__, "torch_version": torch.__version__.split("+")[0],
            "recorded_with": COMMAND, "inputs": {}, "cases": []})
        name = case.make_inputs.__name__
        if name not in doc["inputs"]:
            doc["inputs"][name] = case.make_inputs()
        doc["cases"].append(record_case(case, doc["inputs"][name]))
    return families


def dumps(doc: dict) -> str:
    return json.dumps(doc, indent=1, sort_keys=True) + "\n"


def main() -> None:
    for family, doc in build_docs().items():
        (HERE / f"{family}.json").write_text(dumps(doc))
        print(f"wrote tests/trl_fixtures/{family}.json: {len(doc['cases'])} cases, TRL {doc['trl_version']}")


if __name__ == "__main__":
    main()
