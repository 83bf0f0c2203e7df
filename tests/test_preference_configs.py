"""Every preference recipe under configs/ validates against the installed plugins (no model is loaded)."""

import pytest

from trl_ext.catalog import Catalog
from trl_ext.recipe import load_raw, parse_recipe
from trl_ext.runner import resolve_recipe

NAMES = ["dpo", "ipo", "apo", "simpo", "orpo", "rpo", "qrpo", "kto", "delta_pairs", "iterative_dpo"]


@pytest.mark.parametrize("name", NAMES)
def test_recipe_resolves(name):
    resolved = resolve_recipe(parse_recipe(load_raw(f"configs/{name}.yaml")), Catalog.discover())
    last = resolved[-1]
    assert name in last.host.names()
    if name in ("rpo", "qrpo"):  # reward columns must survive TRL's column pruning
        assert last.args["remove_unused_columns"] is False


def test_embedded_reward_pairs_dataset():
    build, _ = Catalog.discover().datasets["arithmetic_rewards"]
    data = build(split="train", size=8, n_ref=3)
    assert all(r == 1.0 for r in data["chosen_reward"])
    assert all(0 < r < 1 for r in data["rejected_reward"])
    assert all(len(refs) == 3 for refs in data["ref_rewards"])
