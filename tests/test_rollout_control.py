"""The rollout-control plugins (issue 16) meet the host's plugin rules and are registered by their family, with the
embedded datasets they use."""

from __future__ import annotations

import pytest

from trl_ext.catalog import Catalog
from trl_ext.testing import check_plugin_conformance
from trl_ext_plugins.rollout.multi_env import MultiEnv
from trl_ext_plugins.rollout.partial_rollout import PartialRollout
from trl_ext_plugins.rollout.pass_rate_filter import PassRateFilter
from trl_ext_plugins.rollout.pivot_rl import PivotRL
from trl_ext_plugins.rollout.self_play import SelfPlay

PLUGINS = [PassRateFilter, PartialRollout, MultiEnv, SelfPlay, PivotRL]


@pytest.mark.parametrize("plugin", PLUGINS, ids=[p.name for p in PLUGINS])
def test_conformance(plugin):
    check_plugin_conformance(plugin)
    assert "arXiv" in plugin.__doc__


def test_registered_with_their_datasets():
    catalog = Catalog.discover()
    assert {p.name for p in PLUGINS} <= set(catalog.plugins)
    assert {"arithmetic_proposals", "calc_tool"} <= set(catalog.datasets)
