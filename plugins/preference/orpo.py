"""``orpo``: Odds-Ratio Preference Optimization, SFT loss plus an odds-ratio penalty, without a reference model."""

from __future__ import annotations

from trl_ext import NoParams, hookimpl
from trl_ext import metrics as figures
from trl_ext_plugins.preference.common import PreferenceLoss
from trl_ext_plugins.preference.math import log_odds, orpo_odds_ratio_loss


class ORPO(PreferenceLoss):
    """ORPO (Hong et al., EMNLP 2024, arXiv 2403.07691).

    ``L = L_SFT(y_w) + lambda * L_OR`` with ``L_OR = -log sigma(log odds(y_w) - log odds(y_l))``,
    ``odds(y) = P/(1-P)``, ``P = exp(mean token log-prob of y)``. ``lambda`` is TRL's ``args.beta`` (default 0.1, the
    paper's main setting; TRL's ``ORPOConfig.beta`` plays the same role). Reference-free: no reference model is
    loaded or run. Conventions: ``L_SFT`` is the token-mean NLL of the chosen *completion* tokens over the
    micro-batch (the paper's causal-LM loss on responses). TRL's experimental ORPO trainer also counts the prompt
    tokens in its NLL; the odds-ratio term is identical (parity with ``ORPOTrainer.odds_ratio_loss`` tested).
    The per-example value returned is ``-B * logp_w,i / sum_j |y_w,j| + lambda * L_OR,i`` so that the host's batch
    mean gives exactly the token-mean NLL.
    """

    name = "orpo"
    needs = frozenset()
    reference_free = True
    beta_may_be_zero = True  # lambda 0: the NLL term alone (SFT)
    Params = NoParams

    @hookimpl
    def trl_ext_preference_loss(self, inputs):
        batch_size = inputs.chosen_logps.shape[0]
        nll = -inputs.chosen_logps * batch_size / inputs.chosen_lengths.sum().clamp(min=1)
        odds_ratio = orpo_odds_ratio_loss(inputs.chosen_mean_logps, inputs.rejected_mean_logps)
        ratio = (log_odds(inputs.chosen_mean_logps) - log_odds(inputs.rejected_mean_logps)).detach()
        # over every rank's pairs (figure parts the trainer reduces): the NLL is a token mean of the chosen tokens
        inputs.metrics["orpo/nll_loss"] = figures.mean(-inputs.chosen_logps.detach().sum(), inputs.chosen_lengths.sum())
        inputs.metrics["orpo/log_odds_ratio"] = figures.mean(ratio.sum(), ratio.numel())
        return nll + inputs.beta * odds_ratio
