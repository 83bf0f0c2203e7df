"""Preference trainers: TRL's ``DPOTrainer`` and ``KTOTrainer`` with the preference-loss seam.

DPO: when a plugin fills the ``preference_loss`` slot, trl-ext computes the policy's summed completion log-probs with
TRL's fused LM head (the same call TRL makes), the reference's through TRL's ``compute_ref_log_probs`` (only when a
selected plugin needs the reference), and asks the plugin for the per-example loss. Otherwise TRL's own
``_compute_loss`` runs untouched.

TRL 1.16 internals relied on: ``DPOTrainer._compute_loss(model, inputs, return_outputs)``, the collated keys
``input_ids``/``attention_mask``/``completion_mask`` with chosen rows first then rejected rows, the fused-head output
``log_probs``, ``compute_ref_log_probs(model, inputs)`` and the optional ``ref_chosen_logps``/``ref_rejected_logps``.
"""

from __future__ import annotations

import contextlib

import torch
from trl import DPOTrainer, KTOTrainer

from trl_ext import metrics as figures
from trl_ext.batches import PreferenceInputs
from trl_ext.plugin import Need, Slot
from trl_ext.trainers.base import HostMixin

_NON_MODEL_KEYS = {"completion_mask", "ref_chosen_logps", "ref_rejected_logps"}

# DPOConfig options that change TRL's own preference loss; the plugin path computes summed log-probs and leaves the
# loss to the plugin, so these would be silently ignored there.
DPO_OPTIONS_NOT_IN_PLUGIN_PATH = {"ld_alpha": None, "f_divergence_type": "reverse_kl", "use_weighting": False,
                                  "label_smoothing": 0.0, "loss_type": ["sigmoid"], "loss_weights": None}


def _is_neutral(key: str, value) -> bool:
    """Whether an option's value leaves TRL's loss as the plugin path computes it (plain sigmoid DPO, one term)."""
    if key == "loss_type":  # a string or a list of TRL loss names
        return ([value] if isinstance(value, str) else list(value)) == ["sigmoid"]
    if key == "loss_weights":  # one weight per loss_type term
        return value is None or [float(w) for w in value] == [1.0]
    return value == DPO_OPTIONS_NOT_IN_PLUGIN_PATH[key]


def check_dpo_stage(host, stage, args: dict, where: str) -> list[str]:
    """DPO's own validation (TrainerKind.check): ``beta`` the loss can use, and TRL loss options a preference-loss
    plugin would silently ignore."""
    owner = host.filling(Slot.PREFERENCE_LOSS)
    errors = beta_errors(args, where, owner)
    if owner is None:
        return errors
    return errors + [f"{where}.args.{key}: TRL's DPO option has no effect with the preference-loss plugin "
                     f"{owner.name!r}; remove it" for key in DPO_OPTIONS_NOT_IN_PLUGIN_PATH
                     if key in args and not _is_neutral(key, args[key])]


def beta_errors(args: dict, where: str, owner) -> list[str]:
    """``args.beta`` scales the implicit reward of every DPO-family loss: a negative one reverses the preference and 0
    makes it constant (IPO and QRPO divide by it, so they fail at the first step, after the models load). Refused
    before anything loads; 0 is allowed where it means something: a plugin declaring ``beta_may_be_zero`` (ORPO's
    lambda 0 is plain SFT) or TRL's own loss with only the ``sft`` term."""
    beta = args.get("beta")
    if beta is None or beta > 0:
        return []
    if beta < 0:
        return [f"{where}.args.beta: {beta} must be > 0 (a negative beta reverses the preference)"]
    loss_types = args.get("loss_type", "sigmoid")
    sft_only = owner is None and ([loss_types] if isinstance(loss_types, str) else list(loss_types)) == ["sft"]
    if sft_only or getattr(owner, "beta_may_be_zero", False):
        return []
    name = f"plugin {owner.name!r}" if owner is not None else "TRL's DPO loss"
    return [f"{where}.args.beta: 0 leaves {name} without a preference signal (the implicit reward is beta times the "
            "log-ratio); use a value > 0 (TRL's default 0.1)"]


class ExtDPOTrainer(HostMixin, DPOTrainer):
    # Extra collated dataset columns (e.g. reward columns) that reach plugins in ``PreferenceInputs.batch`` and never
    # the model; a plugin adds names here and wraps ``data_collator`` (see trl_ext_plugins.preference.common).
    preference_columns: frozenset[str] = frozenset()

    def __init__(self, *args, plugin_host, **kwargs):
        self._init_host(plugin_host)
        # A preference-loss plugin that does not need the reference (SimPO, ORPO): keep TRL from loading one.
        reference_free = (self.plugin_host.implements("trl_ext_preference_loss")
                          and Need.REFERENCE not in self.plugin_host.needs() and kwargs.get("ref_model") is None)
        with _skip_reference_model(policy_is_path=isinstance(kwargs.get("model"), str), active=reference_free):
            super().__init__(*args, **kwargs)

    def _compute_loss(self, model, inputs, return_outputs):
        columns = {k: inputs[k] for k in self.preference_columns if k in inputs}
        if return_outputs and self.plugin_host.implements("trl_ext_preference_loss"):
            # Evaluation with compute_metrics asks for outputs too: the loss is still the plugin's (TRL's own
            # loss_type was returned here, so eval_loss ignored IPO, SimPO, ...), the outputs TRL's extra forward.
            loss = self._compute_loss(model, inputs, False)
            model_kwargs = {k: v for k, v in inputs.items() if k not in _NON_MODEL_KEYS and k not in columns}
            with torch.no_grad():
                outputs = model(**model_kwargs, use_cache=False)
            return loss, outputs
        inputs = {k: v for k, v in inputs.items() if k not in columns}
        if return_outputs or not self.plugin_host.implements("trl_ext_preference_loss"):
            return super()._compute_loss(model, inputs, return_outputs)
        model_kwargs = {k: v for k, v in inputs.items() if k not in _NON_MODEL_KEYS}
        model_kwargs["use_cache"] = False
        if self.aux_loss_enabled:  # MoE: as TRL, ask for router logits so the model returns its load-balancing loss
            model_kwargs["output_router_logits"] = True
        completion_mask = inputs["completion_mask"]
        labels = inputs["input_ids"].masked_fill(completion_mask == 0, -100)
        outputs = model(**model_kwargs, labels=labels, fused_lm_head=True)
        shift_mask = completion_mask[..., 1:]
        per_token_logps = outputs.log_probs[:, -shift_mask.size(1):]
        chosen_logps, rejected_logps = per_token_logps.sum(dim=1).chunk(2, dim=0)
        chosen_lengths, rejected_lengths = shift_mask.sum(dim=1).chunk(2, dim=0)

        ref_chosen = ref_rejected = None
        if Need.REFERENCE in self.plugin_host.needs():
            if "ref_chosen_logps" in inputs:
                ref_chosen, ref_rejected = inputs["ref_chosen_logps"], inputs["ref_rejected_logps"]
            else:
                ref_model = self.ref_model if self.ref_model is not None else self.model
                ref_chosen, ref_rejected = self.compute_ref_log_probs(ref_model, inputs)
        pref = PreferenceInputs(
            chosen_logps=chosen_logps,
            rejected_logps=rejected_logps,
            chosen_lengths=chosen_lengths,
            rejected_lengths=rejected_lengths,
            ref_chosen_logps=ref_chosen,
            ref_rejected_logps=ref_rejected,
            beta=self.beta,
            batch={**{k: v for k, v in inputs.items() if k not in model_kwargs}, **columns},
        )
        per_example = self.plugin_host.hook.trl_ext_preference_loss(inputs=pref)
        loss = per_example.mean()
        if self.aux_loss_enabled:  # TRL's DPO adds router_aux_loss_coef * aux_loss; keep it on the plugin path
            loss = loss + self.router_aux_loss_coef * outputs.aux_loss
            pref.metrics["aux_loss"] = figures.mean(outputs.aux_loss.detach(), 1.0)  # mean over ranks, as TRL
        self._log_preference_metrics(pref)
        return loss

    def _log_preference_metrics(self, pref: PreferenceInputs) -> None:
        gather = self.accelerator.gather
        metrics = {
            "logps/chosen": gather(pref.chosen_logps.detach()).mean().item(),
            "logps/rejected": gather(pref.rejected_logps.detach()).mean().item(),
        }
        if pref.ref_chosen_logps is not None:
            chosen = self.beta * (pref.chosen_logps - pref.ref_chosen_logps).detach()
            rejected = self.beta * (pref.rejected_logps - pref.ref_rejected_logps).detach()
            metrics["rewards/chosen"] = gather(chosen).mean().item()
            metrics["rewards/rejected"] = gather(rejected).mean().item()
            metrics["rewards/margins"] = gather(chosen - rejected).mean().item()
            metrics["rewards/accuracies"] = gather((chosen > rejected).float()).mean().item()
        metrics.update(pref.metrics)
        self._log_plugin_metrics(metrics)


@contextlib.contextmanager
def _skip_reference_model(policy_is_path: bool, active: bool):
    """Make ``DPOTrainer.__init__`` leave ``self.ref_model = None`` instead of loading a copy of the policy.

    TRL 1.16 has no reference-free switch; its ``__init__`` calls ``create_model_from_path`` (imported into
    ``trl.trainer.dpo_trainer``) once for the policy when ``model`` is a path, then once for the reference. The second
    call is answered with ``None``; every later use of ``self.ref_model`` in TRL checks for ``None``.
    """
    if not active:
        yield
        return
    import trl.trainer.dpo_trainer as dpo_module

    real = dpo_module.create_model_from_path
    calls = {"n": 0}

    def create(path, **kwargs):
        calls["n"] += 1
        return real(path, **kwargs) if policy_is_path and calls["n"] == 1 else None

    dpo_module.create_model_from_path = create
    try:
        yield
    finally:
        dpo_module.create_model_from_path = real


class ExtKTOTrainer(HostMixin, KTOTrainer):
    """TRL's KTOTrainer; plugins act through the generic seams (dataset, trainer-created, after-stage)."""

    def __init__(self, *args, plugin_host, **kwargs):
        self._init_host(plugin_host)
        super().__init__(*args, **kwargs)
