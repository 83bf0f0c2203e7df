"""``kto``: Kahneman-Tversky Optimization on unpaired desirable/undesirable completions (TRL's KTOTrainer)."""

from __future__ import annotations

from trl_ext import NoParams, Plugin, hookimpl
from trl_ext_plugins.preference.common import check_preference_dataset


class KTO(Plugin):
    """KTO (Ethayarajh et al., ICML 2024, arXiv 2402.01306), on TRL's stable ``KTOTrainer``.

    Per example ``lambda_y - v(x, y)`` with ``v = lambda_D sigma(beta (r - z_0))`` for desirable and
    ``lambda_U sigma(beta (z_0 - r))`` for undesirable completions, ``r = log pi/pi_ref`` (summed) and
    ``z_0 = max(0, KL estimate)`` from mismatched (prompt, completion) pairs, detached. TRL implements it exactly
    (``KTOConfig(loss_type="kto")``), so this plugin selects TRL's loss and validates the unpaired data
    (``prompt``/``completion``/``label``); ``beta`` (0.1), ``desirable_weight`` and ``undesirable_weight`` (1.0) stay
    TRL config fields. The formula is also in ``trl_ext_plugins.preference.math.kto_loss``, tested against TRL's
    trainer on the same batch. For unpaired APO-zero select ``apo`` on the kto trainer instead.
    """

    name = "kto"
    family = "preference"
    trainers = frozenset({"kto"})
    Params = NoParams

    @hookimpl
    def trl_ext_configure_args(self, trainer, args):
        return {"loss_type": "kto"}

    @hookimpl
    def trl_ext_prepare_dataset(self, dataset, split, stage):
        check_preference_dataset(dataset, self.name, split, "kto")
        return None
