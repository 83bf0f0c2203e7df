"""The preference-loss plugin path on a Mixture-of-Experts policy keeps TRL's router load-balancing loss: the ``dpo``
plugin's loss equals TRL's own DPO loss (sigmoid + ``router_aux_loss_coef * aux_loss``) on the same batch."""

from __future__ import annotations

import pytest

from trl_ext.host import PluginHost
from trl_ext_plugins.preference import DPO


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):  # this module's policy: the embedded MoE model
    from trl_ext.embedded.models import materialize_model

    return str(materialize_model("tiny-qwen3-moe", tmp_path_factory.mktemp("moe") / "tiny-qwen3-moe", seed=0))


def test_dpo_plugin_loss_equals_trls_with_the_router_aux_loss(tiny_trainer):
    trainer = tiny_trainer("dpo", [DPO()], args={"router_aux_loss_coef": 0.01})
    assert trainer.aux_loss_enabled
    batch = trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))
    ours = trainer.compute_loss(trainer.model, batch)
    trainer.plugin_host = PluginHost([])  # TRL's own DPO loss on the same batch
    theirs = trainer.compute_loss(trainer.model, batch)
    trainer.router_aux_loss_coef = 0.0
    sigmoid_only = trainer.compute_loss(trainer.model, batch)
    assert ours.item() == pytest.approx(theirs.item(), abs=1e-6)
    assert abs(theirs.item() - sigmoid_only.item()) > 1e-4  # the aux term is really there
