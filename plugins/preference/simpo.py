"""``simpo``: Simple Preference Optimization, length-normalised reference-free reward with a target margin."""

from __future__ import annotations

from pydantic import Field

from trl_ext import PluginParams, hookimpl
from trl_ext_plugins.preference.common import PreferenceLoss
from trl_ext_plugins.preference.math import simpo_loss


class SimPOParams(PluginParams):
    gamma: float = Field(0.5, description="Target reward margin gamma (TRL CPOConfig.simpo_gamma default 0.5; the "
                                          "paper's Llama-3-8B-Base setting is gamma=1.0 with beta=2.0).")
    label_smoothing: float = Field(0.0, ge=0.0, le=1.0, description="eps of noisy labels: -(1 - eps) log sigma(z) - "
                                   "eps log sigma(-z) (TRL CPOConfig.label_smoothing with loss_type simpo); 0: the "
                                   "paper's loss.")


class SimPO(PreferenceLoss):
    """SimPO (Meng, Xia, Chen, NeurIPS 2024, arXiv 2405.14734).

    ``L = -log sigma(beta/|y_w| log pi(y_w|x) - beta/|y_l| log pi(y_l|x) - gamma)``: the implicit reward is the
    policy's *mean* token log-prob over the completion, so no reference model is loaded or run (the DPO trainer is
    told so; see ``ExtDPOTrainer``). ``beta`` is TRL's ``args.beta``; defaults follow TRL's
    ``CPOConfig(loss_type="simpo", cpo_alpha=0)`` (beta 0.1, gamma 0.5), not the paper (beta 2.0-2.5,
    gamma/beta 0.5-0.55); set ``args.beta: 2.0`` and ``gamma: 1.0`` for the paper's Base setting. Parity with TRL's
    CPO ``simpo`` loss is tested, with TRL's ``label_smoothing`` too (``label_smoothing``, default 0, as TRL).
    """

    name = "simpo"
    needs = frozenset()
    reference_free = True
    Params = SimPOParams

    @hookimpl
    def trl_ext_preference_loss(self, inputs):
        return simpo_loss(inputs.chosen_mean_logps, inputs.rejected_mean_logps, inputs.beta, self.params.gamma,
                          self.params.label_smoothing)
