"""The example plugin's own tests, using trl-ext's pytest plugin fixtures (trl_ext.testing)."""

import pytest

from trl_ext.testing import check_plugin_conformance
from trl_ext_length_bonus import LengthBonus, LengthBonusParams, length_bonus


def test_conforms():
    check_plugin_conformance(LengthBonus)


def test_formula():
    assert length_bonus([2, 0, 4, 10], target=2, scale=4.0) == [1.0, 0.5, 0.5, 0.0]


def test_reward_function_from_hook():
    (fn,) = LengthBonus(LengthBonusParams(target=3)).trl_ext_reward_functions(stage=None)
    assert fn.weight == 0.1
    assert fn.fn(completions=["abc", "a"]) == [1.0, 0.5]


def test_selected_in_a_catalog(trl_ext_catalog, register_plugin):
    register_plugin(LengthBonus)
    assert trl_ext_catalog.resolve("length_bonus").cls is LengthBonus


def test_bad_params_rejected():
    with pytest.raises(Exception, match="greater than 0"):
        LengthBonusParams(scale=0)
