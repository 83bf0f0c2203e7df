"""``grpo``: Group Relative Policy Optimization's clipped per-token objective and sequence-mean aggregation."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from trl_ext import PluginParams, hookimpl, ops
from trl_ext_plugins.losses import math
from trl_ext_plugins.losses.base import ObjectivePlugin


class GRPOParams(PluginParams):
    kl_estimator: Literal["k1", "k2", "k3", "k3+"] = Field(
        "k3", description="Per-token estimator of KL(pi || pi_ref) in the beta-weighted loss term, d = log pi - log "
        "pi_ref: k1 = d; k2 = d^2/2; k3 = e^-d - 1 + d (paper, TRL); k3+ = k3's value with k2's gradient (verl "
        "'low_var_kl+'). Used only when args.beta != 0.")
    kl_bias_correction: bool | Literal["score"] | None = Field(
        None, description="Multiply the KL estimate by the ratio pi_theta/pi_old (TRL's use_bias_correction_kl). "
        "None: TRL's field decides (default true in TRL 1.16); false: the paper's plain estimate; true/false set "
        "args.use_bias_correction_kl. score: NeMo-RL's default, the weight exp(log pi - sg(log pi)) (value 1, adds "
        "the score-function term KL_t * grad log pi to the gradient).")
    kl_clamp: float | None = Field(None, gt=0, description="Clamp the KL estimate to [-c, c] (verl: 10 for k3); None: "
                                                           "no clamp (paper, TRL).")
    kl_clamp_order: Literal["estimate", "weighted"] = Field(
        "estimate", description="What kl_clamp bounds when the KL carries a weight (kl_bias_correction true or score): "
        "estimate, the estimate before the weight (w * clamp(KL), as verl clamps its unweighted KL); weighted, the "
        "weighted value (clamp(w * KL), zero gradient where it binds: NeMo-RL, slime).")
    dual_clip: float | None = Field(None, gt=1, description="Dual-clip constant c (arXiv 1912.09729; verl clip_ratio_c "
                                                            "3.0): for A<0 the token loss is capped at -c*A. None: "
                                                            "plain PPO clip (paper, TRL).")


class GRPO(ObjectivePlugin):
    """GRPO (DeepSeekMath, Shao et al. 2024, arXiv 2402.03300).

    Objective per token: ``clipobj(r, A) = min(r*A, clip(r, 1-eps_low, 1+eps_high)*A)`` with
    ``r = pi_theta/pi_old`` computed in log space (clamped to +-20), ``A`` TRL's group-normalised advantage
    ``(R - mean_G)/(std_G + 1e-4)`` with the *unbiased* group std (torch.std, as TRL and verl do), and aggregation
    ``seq-mean-token-mean`` (mean over each sequence's tokens, then over sequences).

    KL (when ``args.beta != 0``): ``+ beta * KL_t`` per token with ``KL_t`` the ``kl_estimator`` (default ``k3``,
    ``e^(ref - logp) - (ref - logp) - 1``, the paper's and TRL's; its exponent is clamped to +-20). Convention: TRL
    1.16 multiplies it by the importance ratio ``r`` (``use_bias_correction_kl``, default true), which the paper does
    not; this plugin follows TRL's field by default and ``kl_bias_correction: false`` gives the paper's plain k3
    (``true``/``false`` set the TRL field, so TRL's own path agrees); ``score`` is NeMo-RL's weight
    ``exp(log pi - sg(log pi))``, whose gradient adds ``KL_t * grad log pi`` (the two agree on-policy, where
    pi_old = sg(pi_theta); off-policy TRL's ratio weights the value too, NeMo-RL's does not). ``kl_clamp_order``
    says what ``kl_clamp`` bounds under a weight: the estimate (default) or the weighted value (NeMo-RL and slime;
    NeMo-RL's default KL is k3, ``score``, ``weighted``, clamp 10). ``k3+`` keeps k3's value with k2's gradient.
    ``dual_clip: c`` adds dual-clip PPO (Ye et al. 2020, arXiv 1912.09729; verl's ``clip_ratio_c``), off by default.

    Defaults: the clip range and KL weight are TRL's fields (``args.epsilon`` 0.2, ``args.beta``). The paper used
    beta=0.04 and G=64; TRL defaults to beta=0.0 (no reference model loaded) and G=8: set ``args.beta: 0.04`` for the
    paper's KL. Sets ``args.loss_type: grpo``, whose aggregation (seq-mean-token-mean) the trainer then applies; the
    aggregation can be swapped with the ``aggregation`` plugin. Parity with TRL's ``loss_type="grpo"`` is tested
    (tests/test_losses_parity.py).
    """

    name = "grpo"
    token_ppo_clip = True
    Params = GRPOParams
    trl_args = {"loss_type": "grpo"}

    def extra_trl_args(self):
        bias = self.params.kl_bias_correction
        return {"use_bias_correction_kl": bias} if isinstance(bias, bool) else {}

    def kl_term(self, trl_bias_correction: bool) -> ops.KLTerm:
        """The KL term this plugin's options select, given TRL's ``use_bias_correction_kl``."""
        p = self.params
        bias = trl_bias_correction if p.kl_bias_correction is None else p.kl_bias_correction
        return ops.KLTerm(p.kl_estimator, bias_correction=bias, clamp=p.kl_clamp,
                          clamp_weighted=p.kl_clamp_order == "weighted")

    @hookimpl
    def trl_ext_trainer_created(self, trainer):
        term = self.kl_term(bool(trainer.args.use_bias_correction_kl))
        # A coefficient set by an earlier hook stays: a plugin that folds the KL into the reward (reinforce_pp, ppo,
        # rloo, remax, vapo) sets args.beta = 1.0 only to get reference log-probs and drops the loss term with
        # coef 0; rebuilt without it, [reinforce_pp, grpo] trained a loss KL at weight 1.0 ([grpo, reinforce_pp] 0).
        previous = getattr(trainer, "kl_term", None)
        if previous is not None and previous.coef is not None:
            term.coef = previous.coef
        trainer.kl_term = term

    @hookimpl
    def trl_ext_policy_loss(self, inputs):
        _, log_ratio, advantages = math.masked_inputs(inputs)
        return ops.ppo_clip_objective(ops.safe_ratio(log_ratio), advantages, inputs.epsilon_low, inputs.epsilon_high,
                                      self.params.dual_clip)
