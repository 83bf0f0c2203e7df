"""``grpo``: Group Relative Policy Optimization's clipped per-token objective and sequence-mean aggregation."""

from __future__ import annotations

from trl_ext import NoParams, hookimpl, ops
from trl_ext_plugins.losses.base import ObjectivePlugin


class GRPO(ObjectivePlugin):
    """GRPO (DeepSeekMath, Shao et al. 2024, arXiv 2402.03300).

    Objective per token: ``clipobj(r, A) = min(r*A, clip(r, 1-eps_low, 1+eps_high)*A)`` with
    ``r = pi_theta/pi_old`` computed in log space (clamped to +-20), ``A`` TRL's group-normalised advantage
    ``(R - mean_G)/(std_G + 1e-4)`` with the *unbiased* group std (torch.std, as TRL and verl do), and aggregation
    ``seq-mean-token-mean`` (mean over each sequence's tokens, then over sequences). KL: TRL's k3 estimator added per
    token with weight ``args.beta``.

    Defaults: the clip range and KL weight are TRL's fields (``args.epsilon`` 0.2, ``args.beta``). The paper used
    beta=0.04 and G=64; TRL defaults to beta=0.0 (no reference model loaded) and G=8: set ``args.beta: 0.04`` for the
    paper's KL. Sets ``args.loss_type: grpo``, whose aggregation (seq-mean-token-mean) the trainer then applies; the
    aggregation can be swapped with the ``aggregation`` plugin. Parity with TRL's ``loss_type="grpo"`` is tested
    (tests/test_losses_parity.py).
    """

    name = "grpo"
    Params = NoParams
    trl_args = {"loss_type": "grpo"}

    @hookimpl
    def trl_ext_policy_loss(self, inputs):
        ratio = ops.safe_ratio(inputs.log_ratio)
        return ops.ppo_clip_objective(ratio, inputs.advantages, inputs.epsilon_low, inputs.epsilon_high)
